"""A pool of hubs, seen from one target: which hub its sessions should open on.

Placement is each target's own choice from what the hubs say about themselves; there is no
coordinator. Before it greets, a target asks every hub of its pool for its STATS (no card:
asking takes no admission slot) and reads from each answer how fast one more target would
decode there (``offer``): StarSD's model with the hub's own figures, a round of ``S``
drafting and ``Z`` returning for ``τ`` tokens, ``τ / max(S + Z, (N + 1)·S)`` with ``N``
targets admitted already, or nothing where the hub's admission rule would turn it away.
It greets the hubs in that order (``rank``), the one with fewer targets first where the
offers are equal, and stays with the first that admits it.

Every hub is asked, not two at random (the "power of two choices"): a pool is a handful of
hubs, and asking each costs one small message, so the best answer is as cheap as a sampled
one. Answers are as old as the survey, and targets that start together see the same ones;
so hubs whose offers and target counts are equal are tried in a random order, and a crowd
of newcomers spreads over them instead of herding onto one. A hub
that does not answer within the survey's timeout (down, hung, restarting) is not greeted;
the link asks again after its backoff.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from starhub.wire.messages import StatsQuery, StatsReport
from starhub.wire.reports import HubReport

TIE = 0.05
"""Offers within this share of each other are equal (``rank``)."""
MOVE_MARGIN = 0.25
"""How much worse another hub's offer may be for a target to move there to even out the
targets' counts (``move_chance``)."""
DAMPING = 0.25
"""The chance of a move at one look, before the gap in targets scales it (``move_chance``)."""
SURVEY_S = 0.5
"""How long a survey waits for the hubs' answers: a hub on the same network answers a STATS
in milliseconds."""


def pool_addresses(hub: str | Sequence[str]) -> list[str]:
    """The addresses in ``hub``: one, a comma-separated list, or a list; each once."""
    parts = hub.split(",") if isinstance(hub, str) else list(hub)
    found = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not found:
        raise ValueError(f"no hub address in {hub!r}")
    return found


@dataclass(frozen=True)
class Offer:
    """What one hub's STATS promise a newcomer: ``tok_s``, the tokens per second one more
    target would decode at (0: the hub would turn it away), beside the hub's load and the
    targets it has admitted."""

    address: str
    tok_s: float
    admitted: int
    load: float


def offer(address: str, report: HubReport, joining: bool = True, step_s: float = 0.0
          ) -> Offer:
    """``report``'s promise to one more target (see the module's docstring), or with
    ``joining`` false to one of the targets it admitted already (it has room for them).
    ``step_s``: the target's own plain step, which its round trip ``Z`` cannot be shorter
    than. A hub with no targets yet knows no step, and its ``Z`` is its link alone: judged by
    that, hubs that differ by a millisecond in ``S`` (their drafting timed on a busy CPU)
    differ by far more than ``TIE``, and a crowd of newcomers all greets the faster one."""
    control = report.control
    n = control.admitted
    after = n + 1 if joining else n
    limit = control.max_targets
    full = joining and (
        (limit == "auto" and control.n_max is not None and after > control.n_max)
        or (isinstance(limit, int) and limit > 0 and after > limit))
    typical = control.typical
    s, z = typical.S_ms / 1e3, max(typical.Z_ms / 1e3, step_s)
    cycle = max(s + z, after * s)
    tok_s = 0.0 if full else typical.tau / cycle if cycle > 0 else math.inf
    return Offer(address, tok_s, n, report.load)


def move_chance(here: HubReport, there: Offer, step_s: float = 0.0) -> float:
    """How likely a target admitted by the hub that reported ``here`` should move to the hub
    of ``there`` at one look (``step_s``: as ``offer``'s): where the other hub has room,
    at least two targets fewer, and an offer not worse by more than ``MOVE_MARGIN``,
    ``DAMPING`` times ``(n_here - n_there) / n_here``, so that a crowd that arrived
    together sends about a quarter of the gap each look instead of moving together (every
    target looks at counts that lag the moves others just made); else 0. An empty hub's
    offer is not weighed: with no rounds of its own it promises what its cautious priors
    say, and a restarted hub would never win its targets back.

    Only counts move a target, not a better offer alone: on a shared CPU two like hubs'
    estimates of their rounds (and so their offers) differed by more than 25% from one look
    to the next, and targets that followed them swung from hub to hub. A newcomer still
    goes to the best offer (``rank``)."""
    stay = offer("", here, joining=False, step_s=step_s)
    n = stay.admitted
    if there.tok_s <= 0 or n - there.admitted < 2:
        return 0.0
    if there.admitted and there.tok_s * (1 + MOVE_MARGIN) < stay.tok_s:
        return 0.0  # (an empty hub's offer rests on its priors: its acceptance deliberately
        # low until it has rounds to learn from, so counts alone judge a move there)
    return DAMPING * (n - there.admitted) / n


def rank(offers: Sequence[Offer], rng: random.Random | None = None) -> list[Offer]:
    """The order to greet: the offers within ``TIE`` of the best (below saturation every
    hub promises the same) by fewest targets, equal ones in a random order; then the rest,
    best first; full hubs last (their admission may still say yes)."""
    rng = rng or random.Random()
    shuffled = list(offers)
    rng.shuffle(shuffled)
    best = max((o.tok_s for o in shuffled), default=0.0)

    def key(o: Offer) -> tuple[int, float]:
        if o.tok_s <= 0:
            return 2, 0.0
        if o.tok_s * (1 + TIE) >= best:
            return 0, o.admitted
        return 1, -o.tok_s

    return sorted(shuffled, key=key)  # stable: equal keys keep the shuffled order


def survey(addresses: Sequence[str], timeout_s: float = SURVEY_S, patience_s: float = 0.0,
           client_options: dict | None = None) -> dict[str, HubReport]:
    """Every hub's STATS, asked of all at once, that came within ``timeout_s`` of the first
    answer (a busy host answers late, but all its hubs alike); a hub that refused us, said
    something else or stayed silent is left out. The first answer is waited for up to
    ``timeout_s``, or ``patience_s`` where that is longer."""
    # deferred: the connection's codec loads torch; ranking offers needs none
    from starhub.client.connection import HubClient, HubUnavailable

    clients: dict[zmq.Socket, tuple[str, object]] = {}
    poller = zmq.Poller()
    try:
        for address in addresses:
            client = HubClient(address, timeout_s=timeout_s, **(client_options or {}))
            clients[client.sock] = address, client
            try:
                client.send(StatsQuery())
            except HubUnavailable:
                continue
            poller.register(client.sock, zmq.POLLIN)
        found: dict[str, HubReport] = {}
        start = first = time.monotonic()

        def left() -> float:
            return (first + timeout_s if found else start + max(timeout_s, patience_s)) \
                - time.monotonic()

        while poller.sockets and left() > 0:
            for sock, _ in poller.poll(int(1000 * left()) + 1):
                address, client = clients[sock]
                poller.unregister(sock)
                try:
                    reply = client.recv(0)
                except HubUnavailable:
                    continue
                if isinstance(reply, StatsReport) and isinstance(reply.body, HubReport):
                    if not found:
                        first = time.monotonic()
                    found[address] = reply.body
        return found
    finally:
        for _, client in clients.values():
            client.close()
