"""How the edge verifier shares its forward passes among drafters.

Two decisions, both made by ``Scheduler``: which waiting proposals ride in the next
batched pass (at most ``budget`` fed tokens and ``max_batch`` rows), and how many tree
nodes ``S_i`` each drafter may send next. The policies:

- ``fifo``: arrival order, every drafter the same fixed ``S_i``.
- ``random``: arrival order, ``S_i`` a random split of the budget (a bench baseline).
- ``goodspeed``: GoodSpeed's gradient scheduling. Split the budget into integer ``S_i``
  maximising ``sum_i (1/X_i) (1 - a_i^(S_i+1)) / (1 - a_i)`` by a greedy max-heap over
  marginal gains, where ``a_i`` is drafter i's acceptance per drafted position and ``X_i``
  its committed tokens per round: proportional fairness (it maximises ``sum log goodput``).
- ``slo``: WISP-style. A session may ask for a speed v; a round that commits X tokens
  must then take at most X/v, so a proposal is due X/v after the drafter's last COMMIT
  (its drafting time comes out of that). Proposals
  that would miss their deadline unless served now go first (earliest deadline first),
  the rest by expected tokens per unit of estimated cost. Anything that has waited
  ``starve_steps`` passes is served next, so nothing starves.

Nothing here touches sockets or models: the verifier feeds it observations and asks it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from starhub.control.estimators import Ema
from starhub.wire.reports import MAX_ENTRIES, SchedulerReport, SessionEntry
from targets.cost import BatchStats, PassCost

POLICIES = ("fifo", "random", "goodspeed", "slo")


@dataclass
class Waiting:
    """A PROPOSE waiting for verification."""

    sid: int
    nodes: int
    cached: int
    arrived: float
    deadline: float = math.inf
    steps_waited: int = 0

    @property
    def fed(self) -> int:
        """Tokens this proposal adds to a forward pass: the root plus its nodes."""
        return self.nodes + 1


SMOOTHING = 0.1
"""How fast a session's estimates follow its rounds."""


def _estimate(prior: float) -> Ema:
    return Ema(prior, alpha=SMOOTHING)


@dataclass
class DrafterState:
    """One session's running estimates."""

    opened_at: float
    speed: float = 0.0
    """Requested tokens/s (0: no SLO)."""
    accepted: Ema = field(default_factory=lambda: _estimate(2.0))
    trials: Ema = field(default_factory=lambda: _estimate(3.0))
    """Accepted positions and positions tried (accepted plus one rejection) a round."""
    goodput: Ema = field(default_factory=lambda: _estimate(2.0))
    """X_i: committed tokens a round."""
    committed: int = 0
    rounds: int = 0
    late: int = 0
    last_commit: float | None = None

    @property
    def alpha(self) -> float:
        accepted, trials = self.accepted.get(2.0), self.trials.get(3.0)
        return min(max(accepted / max(trials, 1e-9), 0.01), 0.99)

    @property
    def per_round(self) -> float:
        return self.goodput.get(2.0)


def goodspeed_split(alphas: list[float], goodputs: list[float], total: int,
                    floor: int = 1, cap: int = 64, min_gain: float = 0.01) -> list[int]:
    """Integer ``S_i`` (each in [floor, cap], summing to at most ``total``) maximising
    ``sum_i (1/X_i) (1 - a_i^(S_i+1)) / (1 - a_i)``: each step grants one more node to the
    drafter whose marginal gain ``a_i^(S_i+1) / X_i`` is largest. A node whose chance of
    being accepted, ``a_i^(S_i+1)``, is under ``min_gain`` is not worth its verification
    and is never granted, so budget can be left over."""
    sizes = [floor] * len(alphas)
    left = total - floor * len(alphas)

    def entry(i: int) -> tuple[float, int] | None:
        chance = alphas[i] ** (sizes[i] + 1)
        if sizes[i] >= cap or chance < min_gain:
            return None
        return -chance / max(goodputs[i], 1e-9), i

    heap = [e for e in map(entry, range(len(alphas))) if e]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        left -= 1
        if (e := entry(i)) is not None:
            heapq.heappush(heap, e)
    return sizes


@dataclass
class Scheduler:
    policy: str = "fifo"
    budget: int = 64
    """Tokens one forward pass may feed, summed over its rows (C)."""
    max_batch: int = 0
    """Rows per pass; 0 means as many as the budget allows."""
    nodes: int = 10
    """``fifo``'s fixed S_i and every new session's first one."""
    cap: int = 32
    starve_steps: int = 4
    seed: int = 0
    sessions: dict[int, DrafterState] = field(default_factory=dict)
    cost: PassCost = field(default_factory=PassCost)
    """What a pass costs: the target side's one model, taught by the passes the core runs
    (``targets.core``)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown schedule '{self.policy}' ({', '.join(POLICIES)})")
        if self.budget < 2:
            raise ValueError("the budget must allow at least one root and one node")
        self.rng = random.Random(self.seed)
        self.sizes: dict[int, int] = {}

    # -- sessions ---------------------------------------------------------------------
    def open(self, sid: int, now: float, speed: float = 0.0) -> None:
        self.sessions[sid] = DrafterState(opened_at=now, speed=speed)
        self._resplit()

    def close(self, sid: int) -> None:
        self.sessions.pop(sid, None)
        self.sizes.pop(sid, None)
        self._resplit()

    @property
    def pass_s(self) -> float:
        """A pass's seconds, on average (0 before the first)."""
        return self.cost.pass_s

    def observe(self, sid: int, drafted_depth: int, accepted: int, committed: int,
                finished_at: float, deadline: float = math.inf) -> None:
        """One verified round: how deep the tree went, how much of it was accepted."""
        state = self.sessions.get(sid)
        if state is None:
            return
        missed = 1 if accepted < drafted_depth else 0
        state.accepted.update(accepted)
        state.trials.update(accepted + missed)
        state.goodput.update(committed)
        state.committed += committed
        state.rounds += 1
        state.late += finished_at > deadline
        state.last_commit = finished_at
        self._resplit()

    def nodes_for(self, sid: int) -> int:
        """The draft budget S_i to send with this session's next COMMIT."""
        return self.sizes.get(sid, self.nodes)

    def deadline(self, sid: int, now: float) -> float:
        """When the proposal arriving ``now`` must be committed for its session to keep
        its speed: a round of X tokens may take X/v from the previous COMMIT."""
        state = self.sessions.get(sid)
        if state is None or state.speed <= 0:
            return math.inf
        start = state.opened_at if state.last_commit is None else state.last_commit
        return max(now, start + state.per_round / state.speed)

    # -- the next pass ----------------------------------------------------------------
    def pick(self, waiting: list[Waiting], now: float) -> list[Waiting]:
        """The proposals for the next forward pass (never empty if any wait)."""
        if not waiting:
            return []
        if self.policy == "slo":
            order = self._slo_order(waiting, now)
        else:
            order = sorted(waiting, key=lambda w: w.arrived)
        rows = self.max_batch or len(order)
        batch: list[Waiting] = []
        fed = 0
        for w in order:
            if len(batch) >= rows:
                break
            if batch and fed + w.fed > self.budget:
                continue
            batch.append(w)
            fed += w.fed
        for w in waiting:
            if w not in batch:
                w.steps_waited += 1
        return batch

    def full(self, waiting: list[Waiting]) -> bool:
        """Whether the waiting proposals already fill a pass (rows or budget)."""
        return (bool(self.max_batch) and len(waiting) >= self.max_batch) \
            or sum(w.fed for w in waiting) >= self.budget

    def _slo_order(self, waiting: list[Waiting], now: float) -> list[Waiting]:
        """Starved proposals first; then those that make their deadline only if served in
        this pass, earliest deadline first; then the rest by expected tokens per unit of
        cost; last, those that will be late whatever happens (serving them first would
        only make others late too)."""
        pass_s = self.pass_s or self.cost.predict(BatchStats(1, self.budget, 0, 0), trees=1)

        def rank(w: Waiting) -> int:
            if w.steps_waited >= self.starve_steps:
                return 0
            if w.deadline < now + pass_s:
                return 3
            return 1 if w.deadline < now + 2 * pass_s else 2

        def utility(w: Waiting) -> float:
            state = self.sessions.get(w.sid)
            tokens = state.per_round if state else 1.0
            return tokens / max(self.cost.node_s(w.cached) * w.fed, 1e-6)

        return sorted(waiting, key=lambda w: (r := rank(w), w.arrived if r == 0 else
                                              w.deadline if r == 1 else -utility(w)))

    def _resplit(self) -> None:
        sids = list(self.sessions)
        if not sids or self.policy in ("fifo", "slo"):
            self.sizes = {}
            return
        total = max(self.budget - len(sids), len(sids))
        if self.policy == "random":
            cuts = sorted(self.rng.randint(0, total - len(sids)) for _ in sids[1:])
            bounds = [0, *cuts, total - len(sids)]
            sizes = [1 + min(bounds[i + 1] - bounds[i], self.cap - 1) for i in range(len(sids))]
        else:
            sizes = goodspeed_split([self.sessions[s].alpha for s in sids],
                                    [self.sessions[s].per_round for s in sids], total,
                                    cap=self.cap)
        self.sizes = dict(zip(sids, sizes, strict=True))

    def snapshot(self) -> SchedulerReport:
        sessions = itertools.islice(self.sessions.items(), MAX_ENTRIES)
        return SchedulerReport(
            policy=self.policy, budget=self.budget, max_batch=self.max_batch,
            time_model_ms=self.cost.report_ms(), time_model_mape=self.cost.mape,
            sessions={str(sid): SessionEntry(alpha=round(s.alpha, 3),
                                             goodput=round(s.per_round, 3),
                                             nodes=self.nodes_for(sid), rounds=s.rounds,
                                             late=s.late)
                      for sid, s in sessions})
