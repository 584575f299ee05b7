"""Whether the hub's trees raise a serving target's throughput at its current batch.

A serving target decodes its B requests in batched passes. Plain, a pass feeds B tokens
and yields B. With the hub, a pass feeds B trees and yields about B·τ, then the requests
wait for their next trees (the round trip: the hub's drafting plus the link). A CPU pays
for every token a pass feeds, so as B grows plain batching catches up with trees and then
passes them; on a host where the hub drafts on the target's own cores it does so sooner,
since both the round trip and our passes then carry the hub's compute.

``SpeculationGate`` prices both from what passes cost here (the core's ``PassCost``), τ
and the tree size of the rounds verified here, and the round trip. A request about to
open its hub session asks it ``pays``; where plain batching would serve the batch faster,
the request and every other in the batch decode on their own, still batched, and the hub
drafts nothing for them. Rows decoding plain take up trees again with the next newcomer
whose verdict says trees, or when a request leaves and the verdict on the rows left (at
their number, not the recent average) says trees (``Batcher._take_up_trees``), each with
tokens enough to go for trees once its first comes (``rejoin_pays``): a request that opens
its hub session decodes plain until then (``Batcher._catch_up``). Rows that cannot use the
hub (it was lost meanwhile) are priced as plain rows beside the trees: a tree slows their
pass and gives them nothing. Until rounds have been measured it assumes trees pay, so that
they get measured.

A request that would decode alone always opens its hub session: alone it slows no other
row of ours, and the hub's control plane judges its rounds one by one from the session's
own acceptance, sending plain rounds where no tree pays. The gate cannot know a new
prompt's acceptance, and its averages move only while trees run. (The serving runs behind
these choices are in ``docs/benchmarks.md``, "Serving".)
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

from starhub.control.estimators import Ema, TimeAverage
from targets.cost import PassCost

BATCH_MARGIN = 0.95
"""Trees must beat plain batching by this factor: below 1, trees also where the estimates
put them a little behind. A request that opens its hub session decodes plain until its
first tree comes, and rows decoding plain take trees up again whenever a verdict says
they pay, so a wrong "plain" costs a spell without trees and a wrong "trees" the hub's
prefill and a spell of tree passes, neither a stall. Below capacity trees also shrink the
batch they are judged at (requests leave sooner), which a verdict at today's batch does
not credit them with. ``docs/benchmarks.md`` has the serving runs that chose 0.95. (The
hub's control plane, which prices one session's rounds against a plain step it knows
exactly, asks more of a tree: ``TREE_MARGIN`` 1.02.)"""
BATCH_WINDOW_S = 5.0
"""The recent batch size averages the rows decoding over about this long: long enough
to see the load that arrivals build, short enough that a lull after a burst lets a lone
request use the hub again."""
COALESCE = 0.3
"""The engine holds a pass at most this fraction of a pass for trees still on their way
(``Batcher._coalesce``)."""
PRIOR_TAU = 2.0
PRIOR_NODES = 10.0
PRIOR_ROUNDS = 4
"""The priors of τ and of the tree size weigh as this many rounds: the first rounds a
server verifies move them as far as their mean says (two rounds of τ 4 read 2.67), not
5% a round."""


class Decision(NamedTuple):
    """The gate's verdict on a request's batch, and the rates it was judged by."""
    trees: bool
    """The request opens its hub session (else it and its batch decode plain)."""
    lone: bool
    """It would decode alone: it opens its hub session whatever the rates say, and the
    hub judges its rounds."""
    rows: int
    tree_tok_s: float
    plain_tok_s: float


class SpeculationGate:
    def __init__(self, cost: PassCost, margin: float = BATCH_MARGIN):
        self.cost = cost
        """What passes cost here: the core's one model, which its engine's passes teach."""
        self.tau = Ema(PRIOR_TAU, alpha=0.05, prior=PRIOR_ROUNDS)
        self.nodes = Ema(PRIOR_NODES, alpha=0.05, prior=PRIOR_ROUNDS)
        self.round_trip = Ema(0.0, alpha=0.1, prior=0)
        """Zero until measured (trees pay until they are measured); the first measurement
        replaces it."""
        self.open_wait = Ema(0.0, alpha=0.2, prior=0)
        """From a mid-stream OPEN sent to its first tree: the hub's prefill of the whole
        context and its first draft. Zero until measured."""
        self.batch = TimeAverage(BATCH_WINDOW_S)
        """Requests decoding, averaged over the last few seconds; a spell with none
        counts as one, the request that will end it."""
        self.margin = margin

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

    def observe_open_wait(self, seconds: float) -> None:
        """A mid-stream OPEN's wait for its first tree (``open_wait``)."""
        self.open_wait.update(seconds)

    def rejoin_pays(self, cached: int, left: int) -> bool:
        """Whether a request decoding plain, with at most ``left`` tokens to go and
        ``cached`` in its cache, should open a hub session now that trees pay. It goes on decoding
        plain until its first tree comes (``Batcher._catch_up``), so the wait costs it
        nothing; it opens where tokens would be left for trees by then: more than the wait
        (``open_wait``) holds plain steps, as ``rates`` prices one row. Where these rates
        say trees do not pay alone, the gate cannot price the gain and leaves the request
        to the hub's judgment, as it does a lone newcomer (``verdict``)."""
        tree, plain = self.rates([cached])
        if tree <= plain:
            return True
        return left > self.open_wait.get(0.0) * plain + 1

    def plain_pass_s(self, cached: Sequence[int]) -> float:
        """A plain pass over sessions of these cache lengths (``PassCost.plain_s``)."""
        return self.cost.plain_s(cached)

    def tree_pass_s(self, cached: list[int], plain: Sequence[int] = ()) -> float:
        """A pass that verifies a tree for each session of ``cached`` and one token for
        each of ``plain``: the plain pass of all those rows, plus what the trees add, by
        the tree fit (each node's fed token and its attention, and each tree row's mask).
        Pricing the rows as plain passes run keeps what no fit term describes (rows of
        unlike cache lengths padded to the longest) the same on both sides of a verdict:
        priced by one fit and not the other, it made a tree among many plain rows look
        like a gain (a newcomer beside nine plain rows judged 57.5 tok/s against 43.2)."""
        added = sum(self._tree_added_s(c) for c in cached)
        return self.plain_pass_s([*cached, *plain]) + added

    def _tree_added_s(self, cached: int) -> float:
        """What a tree adds to a pass, for a session holding ``cached`` tokens, with the
        cores to itself: its nodes' fed tokens and their attention, and its row."""
        return self.nodes.get(PRIOR_NODES) * self.cost.node_s(cached) + self.cost.row_s()

    def steps_beside(self, cached: list[int], plain: Sequence[int]) -> list[float]:
        """For each session of ``cached``, verifying trees beside the ``plain`` rows: what
        it waits per token if it decodes plain while the others keep their trees, a pass
        as it runs with their trees (slowed by the hub beside us), or the plain pass
        where it would be the only tree. A plain round the hub sends one row of a batch
        that keeps its trees steps at this pace, not at the batch's plain pass."""
        if len(cached) < 2:
            return [self.plain_pass_s([*cached, *plain])] * len(cached)
        full, slowdown = self.tree_pass_s(cached, plain), self.cost.slowdown.get(1.0)
        return [(full - self._tree_added_s(c)) * slowdown for c in cached]

    def rates(self, cached: list[int], plain: Sequence[int] = ()) -> tuple[float, float]:
        """(tokens/s with trees for the sessions of ``cached`` beside the ``plain`` rows,
        tokens/s with every row plain), for sessions of these cache lengths.

        A round with trees is the batch's tree pass, slowed by the hub beside us, then the
        wait for the next trees. With no plain rows the wait is the round trip. Plain
        rows do not wait: the engine holds their pass for the trees only COALESCE of a
        pass, then runs it without them, so a tree row waits for whole plain passes (the
        round trip rounded up to them), in which the plain rows step. Plain rows gain
        nothing from the trees beside them and pay the tree pass."""
        tokens = len(cached) * self.tau.get(PRIOR_TAU)
        wait = self.round_trip.get(0.0)
        if plain:
            alone = max(self.plain_pass_s(plain), 1e-6)
            steps = math.ceil(wait / alone) if wait > COALESCE * alone else 0
            wait = steps * alone if steps else wait
            tokens += len(plain) * (1 + steps)
        cycle = self.tree_pass_s(cached, plain) * self.cost.slowdown.get(1.0) + wait
        everyone = [*cached, *plain]
        return (tokens / max(cycle, 1e-6),
                len(everyone) / max(self.plain_pass_s(everyone), 1e-6))

    def node_s(self, cached: int) -> float:
        """What one more tree node of a session holding ``cached`` tokens adds to a pass
        as passes run here (beside the hub where it shares our cores): the fit's cost of
        a fed token and of its attention; 0 until passes have told it."""
        return self.cost.node_s(cached) * self.cost.slowdown.get(1.0)

    def floor(self, cached: int, tok_s: float) -> float:
        """The least draft path probability worth a node in the next tree of a session
        holding ``cached`` tokens, in a batch committing ``tok_s`` tokens a second
        (``rates``' first). A node adds about its path probability in accepted tokens
        and holds the whole batch for ``node_s``: it raises the batch's throughput where
        ``p >= node_s · tok_s``. A session the head reads poorly in a busy batch so keeps
        only its likeliest guesses, or none but the first."""
        return min(self.node_s(cached) * tok_s, 1.0)

    def pays(self, cached: list[int], queued: int = 0, now: float | None = None,
             plain: Sequence[int] = ()) -> bool:
        """Whether the request about to open its hub session should: always when it would
        decode alone; otherwise when trees for the sessions of ``cached`` (beside the
        ``plain`` rows, which cannot use the hub) beat plain batching by the margin, in
        the batch it will decode in: this one with the ``queued`` requests still
        prefilling, or the recent average where that is larger (arrivals go on at the rate
        that built it, and a request that opened its hub session in a lull would then hold
        trees in a full batch); the rows the average adds would use trees."""
        return self.verdict(cached, queued, now, plain).trees

    def verdict(self, cached: list[int], queued: int = 0, now: float | None = None,
                plain: Sequence[int] = (), current: bool = False) -> Decision:
        """``pays``, with the rows, tree and plain tokens/s it was judged at; ``current``:
        at today's batch alone, not the recent average."""
        recent = 1.0 if current else self.batch.get(1.0, time.monotonic() if now is None
                                                     else now)
        rows = max(len(cached) + len(plain) + queued, round(recent))
        known = [*cached, *plain]
        mean = sum(known) / len(known) if known else 0.0
        tree, plain_rate = self.rates(cached + [round(mean)] * (rows - len(known)), plain)
        lone = rows == 1
        return Decision(lone or tree >= self.margin * plain_rate, lone, rows, tree, plain_rate)
