"""What a server's STATS tells whom.

Per-peer detail (each target's name, totals and timings; each edge session's numbers) goes
only to peers that introduced themselves: a target's or a drafter's card, or an
observer's card (``ObserverCard``: ``starhub status`` and the benchmark, which hold no
admission slot and no session). A peer that only knocks gets aggregates. This keeps
casual probes from listing who uses a server; keeping strangers out altogether is CURVE's
job (``starhub.wire.security``).
"""

from __future__ import annotations

from collections import OrderedDict

OBSERVER_LIMIT = 256
AGGREGATES_ONLY = "aggregates_only"
"""Set in a body that had its per-peer parts removed."""


class Observers:
    """Identities that sent an OBSERVER_CARD; the most recent ``limit`` are kept, so that
    a peer that says it again and again costs nothing."""

    def __init__(self, limit: int = OBSERVER_LIMIT):
        self.limit = limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def add(self, identity: bytes) -> None:
        self._seen[identity] = None
        self._seen.move_to_end(identity)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._seen

    def __len__(self) -> int:
        return len(self._seen)


def _without(table: object, key: str) -> object:
    return {k: v for k, v in table.items() if k != key} if isinstance(table, dict) else table


def hub_view(body: dict, detail: bool) -> dict:
    """A hub's STATS body, without its per-target parts unless ``detail``: the control
    plane's ``targets`` and the raw counters' ``peers``."""
    if detail:
        return body
    out = {**body, AGGREGATES_ONLY: True}
    for key, inner in (("control", "targets"), ("counters", "peers")):
        if key in out:
            out[key] = _without(out[key], inner)
    return out


def verifier_view(body: dict, detail: bool) -> dict:
    """A verifier's STATS body, without its scheduler's per-session entries unless
    ``detail``."""
    if detail:
        return body
    out = {**body, AGGREGATES_ONLY: True}
    if "scheduler" in out:
        out["scheduler"] = _without(out["scheduler"], "sessions")
    return out
