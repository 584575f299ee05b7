"""What a server's STATS tells whom.

Per-peer detail (each target's name, totals and timings; each edge session's numbers) goes
only to peers that introduced themselves: a target's or a drafter's card, or an
observer's card (``ObserverCard``: ``starhub status`` and the benchmark, which hold no
admission slot and no session). A peer that only knocks gets aggregates. This keeps
casual probes from listing who uses a server; keeping strangers out altogether is CURVE's
job (``starhub.wire.security``).

Every report also fits the one header frame a message has (``MAX_HEADER_BYTES``, which
every reader enforces): where a server has more targets or sessions than that holds, its
report lists the latest of them only (``fitted``); the counts stay whole.
"""

from __future__ import annotations

from collections import OrderedDict

from msgspec.structs import replace

from starhub.wire.codec import MAX_HEADER_BYTES, encode
from starhub.wire.messages import StatsReport
from starhub.wire.reports import HubReport, Report, VerifierReport

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
        return fitted(report, _cut_hub)
    counters = report.counters and replace(report.counters, peers=None)
    return replace(report, aggregates_only=True, counters=counters,
                   control=replace(report.control, targets=None))


def verifier_view(report: VerifierReport, detail: bool) -> VerifierReport:
    """A verifier's STATS, without its scheduler's per-session entries unless ``detail``."""
    if detail:
        return fitted(report, _cut_verifier)
    return replace(report, aggregates_only=True,
                   scheduler=replace(report.scheduler, sessions=None))


def fitted(report: Report, cut, limit: int = MAX_HEADER_BYTES) -> Report:
    """``report``, its per-peer lists cut (``cut(report, share)`` keeps that share of each,
    and None when nothing is left to cut) until its STATS_REPORT's header fits ``limit``
    bytes: a report its reader refuses would tell nobody anything."""
    while (size := len(encode(StatsReport(body=report))[0])) > limit:
        smaller = cut(report, 0.9 * limit / size)
        if smaller is None:
            break
        report = smaller
    return report


def _keep(items, share: float):
    """The last ``share`` of ``items`` (the latest peers; None stays None)."""
    return items if items is None else items[len(items) - int(len(items) * share):]


def _cut_hub(report: HubReport, share: float) -> HubReport | None:
    targets = report.control.targets
    peers = report.counters.peers if report.counters else None
    if not targets and not peers:
        return None
    return replace(report, control=replace(report.control, targets=_keep(targets, share)),
                   counters=report.counters and replace(report.counters,
                                                        peers=_keep(peers, share)))


def _cut_verifier(report: VerifierReport, share: float) -> VerifierReport | None:
    sessions = report.scheduler.sessions
    if not sessions:
        return None
    kept = dict(_keep(list(sessions.items()), share))
    return replace(report, scheduler=replace(report.scheduler, sessions=kept))
