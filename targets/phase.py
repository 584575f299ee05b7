"""A session's phases on the target side: the one state machine of every front end, drawn
in ``docs/architecture.md``.

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


class PhaseLog:
    """Each session's phase as last seen, and a DEBUG line on ``log`` for each change
    (``name: session N: BEFORE -> AFTER``); a session that reaches ``DONE`` is forgotten.
    Costs one level check where DEBUG is off."""

    def __init__(self, log: logging.Logger, name: str, noun: str = "session"):
        self.log = log
        self.prefix = f"{name}: {noun}"
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
