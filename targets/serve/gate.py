"""Whether the hub's trees raise a serving target's throughput at its current batch.

A serving target decodes its B requests in batched passes. Plain, a pass feeds B tokens
and yields B. With the hub, a pass feeds B trees and yields about B·τ, then the requests
wait for their next trees (the round trip ``w``: the hub's drafting plus the link). A CPU
pays for every token a pass feeds, so as B grows plain batching catches up with trees and
then passes them; on a host where the hub drafts on the target's own cores it does so
sooner, since both the round trip and our passes then carry the hub's compute.

``SpeculationGate`` learns the three things that decide it from this target's own passes:
a pass's time as ``c0 + c1·fed + c2·sum(cached·fed) + c3·trees`` (fed tokens, the
attention they pay against the caches, and what a tree row costs beyond its tokens: its
mask and the scattered attention), τ and the tree size of the rounds verified here, and the round
trip. Where the hub shares our cores, the fit is of each pass's time alone (its CPU time,
``starhub.cores``) and tree passes carry the slowdown measured on them (wall over alone):
the hub's compute is charged to the trees, not to plain batching. A request that is
about to open its hub session asks it ``pays``; where plain batching would serve the
batch faster, the request and every other in the batch decode on their own, still
batched, and the hub drafts nothing for them (a batch of trees and plain rows would be
the worst of both: each tree slows every row's pass). Until rounds have been measured
it assumes trees pay, so that they get measured.
"""

from __future__ import annotations

import time

from starhub.control.estimators import Ema, TimeAverage
from starhub.fit import LinearFit
from targets.engine import BatchStats

MARGIN = 1.10
"""Trees must beat plain batching by this factor. On a shared CPU the gate's estimates of
one batch's rates move by about ±10% from one request to the next, and a wrong "trees"
costs more than a wrong "plain": the hub's prefill, tree passes for the whole batch, and
the hub's compute on our cores; a wrong "plain" forgoes a gain smaller than the noise."""
BATCH_WINDOW_S = 5.0
"""The recent batch size averages the rows decoding over about this long: long enough
to see the load that arrivals build, short enough that a lull after a burst lets a lone
request use the hub again."""
PRIOR_TAU = 2.0
PRIOR_NODES = 10.0


class SpeculationGate:
    def __init__(self, step_s: float, margin: float = MARGIN):
        self.passes = LinearFit([step_s if step_s > 0 else 0.02, 0.0, 0.0, 0.0], forget=0.99)
        self.tau = Ema(PRIOR_TAU, alpha=0.05)
        self.nodes = Ema(PRIOR_NODES, alpha=0.05)
        self.round_trip = Ema(0.0, alpha=0.1)
        self.batch = TimeAverage(BATCH_WINDOW_S)
        """Requests decoding, averaged over the last few seconds; a spell with none
        counts as one, the request that will end it."""
        self.slowdown = Ema(1.0, alpha=0.1)
        """Wall over alone time of the passes that verified trees: what the hub's compute
        next to ours adds to them (1 where it runs elsewhere)."""
        self.margin = margin

    def observe_pass(self, cost: BatchStats, alone_s: float, wall_s: float | None = None,
                     trees: int = 0) -> None:
        """A pass's time with the cores to itself, and as it ran (default: the same);
        ``trees``: the rows that verified a tree."""
        self.passes.update([1.0, cost.new_tokens, cost.cached_x_new, trees], alone_s)
        if trees and wall_s is not None and alone_s > 0:
            self.slowdown.update(max(wall_s / alone_s, 1.0))

    def observe_batch(self, rows: int, now: float | None = None) -> None:
        """Requests decoding from ``now`` (``time.monotonic()``) on."""
        self.batch.update(max(rows, 1), time.monotonic() if now is None else now)

    def observe_round(self, nodes: int, committed: int) -> None:
        """A hub tree of ``nodes`` verified here, ``committed`` tokens kept (bonus included)."""
        self.tau.update(committed)
        self.nodes.update(nodes)

    def observe_round_trip(self, seconds: float) -> None:
        """From a COMMIT (or OPEN) sent to the next tree received, less the passes the
        engine ran for other requests meanwhile: the time the round trip cost."""
        self.round_trip.update(seconds)

    def tree_cycle_s(self, cached: list[int]) -> float:
        """A request's time per round with trees: its batch's tree pass, slowed by the hub
        beside us, plus the round trip."""
        return self.tree_pass_s(cached) * self.slowdown.get(1.0) + self.round_trip.get(0.0)

    def plain_pass_s(self, cached: list[int]) -> float:
        """A plain pass over sessions of these cache lengths: one token fed each."""
        return max(self.passes.predict([1.0, len(cached), sum(cached), 0.0]), 0.0)

    def tree_pass_s(self, cached: list[int]) -> float:
        fed = 1.0 + self.nodes.get(PRIOR_NODES)
        return max(self.passes.predict([1.0, len(cached) * fed, sum(cached) * fed,
                                        len(cached)]), 0.0)

    def rates(self, cached: list[int]) -> tuple[float, float]:
        """(tokens/s with trees, tokens/s plain) for a batch of these cache lengths."""
        b = len(cached)
        plain = b / max(self.plain_pass_s(cached), 1e-6)
        return b * self.tau.get(PRIOR_TAU) / max(self.tree_cycle_s(cached), 1e-6), plain

    def pays(self, cached: list[int], queued: int = 0, now: float | None = None) -> bool:
        """Whether trees for every session of this batch beat plain batching by the margin,
        in the batch a new request will decode in: this one with the ``queued`` requests
        still prefilling, or the recent average where that is larger (arrivals go on at
        the rate that built it, and a request that opened its hub session in a lull would
        then hold trees in a full batch)."""
        return self.verdict(cached, queued, now)[0]

    def verdict(self, cached: list[int], queued: int = 0, now: float | None = None
                ) -> tuple[bool, int, float, float]:
        """``pays``, with the rows, tree and plain tokens/s it was judged at."""
        recent = self.batch.get(1.0, time.monotonic() if now is None else now)
        rows = max(len(cached) + queued, round(recent))
        mean = sum(cached) / len(cached) if cached else 0.0
        tree, plain = self.rates(cached + [round(mean)] * (rows - len(cached)))
        return tree >= self.margin * plain, rows, tree, plain
