"""A session's phases on the target side and the arrows between them (``ARROWS``): the one
state machine of every front end, drawn in ``docs/architecture.md`` (``diagram()``).

A request of the core (``starhub target``, ``attach()``, ``starhub serve``: a
``targets.batcher.Slot``, whose ``phase`` reads it from its fields) may pass through every
phase. An edge verifier's session (``targets.verifier``) passes through four of them:
``PREFILLING`` from its drafter's OPEN, ``WAITING`` for the drafter's PROPOSE once OPENED
is sent, ``TREE`` from that PROPOSE until the pass that verifies it has COMMITted, and
``DONE``; its drafter always sends trees, so it never decodes plain.
"""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple


class Phase(enum.Enum):
    """Where a session is. Each pass verifies every session with something to verify:
    ``TREE``, ``PLAIN_ROUND``, ``AHEAD`` and ``ALONE`` (an edge verifier's scheduler picks
    among its ``TREE`` sessions)."""

    PREFILLING = "its prompt is prefilled, a slice a turn"
    ALONE = "decodes plain with no hub session (it may open one later if it kept features)"
    AHEAD = "decodes plain while its hub session catches up (from its OPEN on)"
    WAITING = "waits for the hub's PROPOSE to its OPEN or COMMIT (edge: its drafter's)"
    TREE = "has a tree to verify in a pass"
    PLAIN_ROUND = "steps the plain round the hub asked for"
    DONE = "ended: its sessions here and at its peer closed"


class Arrow(NamedTuple):
    """A change of phase, and what makes it."""

    before: Phase | None
    """None: the session is new."""
    after: Phase | None
    """None: the session is forgotten."""
    event: str = ""


P = Phase
ARROWS = (
    Arrow(None, P.PREFILLING, "request taken in, or OPEN (edge)"),
    Arrow(P.PREFILLING, P.AHEAD, "prefill done, OPEN sent"),
    Arrow(P.PREFILLING, P.ALONE, "prefill done with no hub, or the gate sends the batch plain"),
    Arrow(P.PREFILLING, P.WAITING,
          "prefill done, OPEN sent (the star target) or OPENED (edge)"),
    Arrow(P.ALONE, P.AHEAD,
          "the gate says trees, OPEN mid-stream with every token and feature row"),
    Arrow(P.AHEAD, P.TREE, "a PROPOSE whose path holds what it decoded since: the nodes below"),
    Arrow(P.AHEAD, P.PLAIN_ROUND, "a PROPOSE of more plain steps than it decoded since"),
    Arrow(P.AHEAD, P.WAITING, "the PROPOSE settled by what it decoded since, COMMIT sent"),
    Arrow(P.WAITING, P.TREE, "PROPOSE with a tree"),
    Arrow(P.WAITING, P.PLAIN_ROUND, "PROPOSE of plain steps"),
    Arrow(P.TREE, P.WAITING, "verified, COMMIT sent"),
    Arrow(P.PLAIN_ROUND, P.WAITING, "last plain step, COMMIT sent"),
    Arrow(P.AHEAD, P.ALONE, "hub error, hub lost or late, or the gate says plain"),
    Arrow(P.WAITING, P.ALONE, "hub error, hub lost or late, or the gate says plain"),
    Arrow(P.TREE, P.ALONE, "hub lost or late"),
    Arrow(P.PLAIN_ROUND, P.ALONE, "hub lost or late"),
    Arrow(P.PREFILLING, P.DONE, "cancelled, closed, or its prefill failed (edge)"),
    Arrow(P.ALONE, P.DONE, "end of sequence, max_tokens, cancelled"),
    Arrow(P.AHEAD, P.DONE, "end of sequence, max_tokens, cancelled"),
    Arrow(P.WAITING, P.DONE, "cancelled, closed or expired (edge)"),
    Arrow(P.TREE, P.DONE,
          "end of sequence, max_tokens, cancelled; closed, or its pass failed (edge)"),
    Arrow(P.PLAIN_ROUND, P.DONE, "end of sequence, max_tokens, cancelled"),
    Arrow(P.DONE, None),
)
"""Every change of phase a session can make: the diagram in ``docs/architecture.md`` is
``diagram()``."""
del P

NEXT: dict[Phase | None, frozenset[Phase]] = {
    before: frozenset(a.after for a in ARROWS if a.before is before and a.after is not None)
    for before in (None, *Phase)}
"""The phases each phase leads to in one arrow (None: a new session's)."""


def reachable(before: Phase | None, arrows: int) -> frozenset[Phase]:
    """The phases ``before`` leads to in at most ``arrows`` arrows."""
    seen: set[Phase] = set()
    frontier = {before}
    for _ in range(arrows):
        frontier = {after for phase in frontier for after in NEXT[phase]} - seen
        seen |= frontier
    return frozenset(seen)


def diagram() -> str:
    """The arrows as a Mermaid state diagram."""
    lines = ["stateDiagram-v2"]
    for arrow in ARROWS:
        before = arrow.before.name if arrow.before else "[*]"
        after = arrow.after.name if arrow.after else "[*]"
        lines.append(f"    {before} --> {after}" + (f": {arrow.event}" if arrow.event else ""))
    return "\n".join(lines) + "\n"


class PhaseLog:
    """Each session's phase as last seen, and a DEBUG line on ``log`` for each change
    (``name: session N: BEFORE -> AFTER``); a session that reaches ``DONE`` is forgotten.
    A change that no ``arrows`` arrows make (``ARROWS``) is a bug, logged as a warning.
    Costs one level check where DEBUG is off."""

    def __init__(self, log: logging.Logger, name: str, noun: str = "session",
                 arrows: int = 1):
        self.log = log
        self.prefix = f"{name}: {noun}"
        self.arrows = arrows
        """The most arrows a session may follow between two notes (a front end that notes
        once a turn, where a turn may take a reply and verify it, follows two)."""
        self.seen: dict[int, Phase] = {}

    def note(self, sid: int, phase: Phase) -> None:
        """``sid`` is in ``phase`` now (a new session: it was nowhere before)."""
        if not self.log.isEnabledFor(logging.DEBUG):
            return
        before = self.seen.pop(sid, None) if phase is Phase.DONE else self.seen.get(sid)
        if phase is before or (phase is Phase.DONE and before is None):
            return  # unchanged, or ended before DEBUG was turned on
        if phase is not Phase.DONE:
            self.seen[sid] = phase
        self.log.debug("%s %d: %s -> %s", self.prefix, sid,
                       before.name if before else "NEW", phase.name)
        if before is not None and phase not in reachable(before, self.arrows):
            self.log.warning("%s %d went from %s to %s, which the state diagram has no "
                             "path for in %d arrows (targets.phase.ARROWS)", self.prefix,
                             sid, before.name, phase.name, self.arrows)
