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

from msgspec.structs import replace

from starhub.wire.reports import HubReport, VerifierReport

OBSERVER_LIMIT = 256
AGGREGATES_ONLY = "aggregates_only"
"""Set (``Report.aggregates_only``) in a report that had its per-peer parts removed."""


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


def hub_view(report: HubReport, detail: bool) -> HubReport:
    """A hub's STATS, without its per-target parts unless ``detail``: the control plane's
    ``targets`` and the raw counters' ``peers``."""
    if detail:
        return report
    counters = report.counters and replace(report.counters, peers=None)
    return replace(report, aggregates_only=True, counters=counters,
                   control=replace(report.control, targets=None))


def verifier_view(report: VerifierReport, detail: bool) -> VerifierReport:
    """A verifier's STATS, without its scheduler's per-session entries unless ``detail``."""
    if detail:
        return report
    return replace(report, aggregates_only=True,
                   scheduler=replace(report.scheduler, sessions=None))
