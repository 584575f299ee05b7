"""The verifier's schedules on synthetic observations: GoodSpeed's split, the batch each
policy picks, the SLO order, starvation, and the verify-time estimator."""

from __future__ import annotations

import math
import random

import pytest

from targets.cost import BatchStats, PassCost
from targets.schedule import Scheduler, Waiting, goodspeed_split


def _objective(alphas, goodputs, sizes):
    return sum((1 - a ** (s + 1)) / (1 - a) / x
               for a, x, s in zip(alphas, goodputs, sizes, strict=True))


def test_goodspeed_split_is_the_best_integer_split():
    alphas, goodputs = [0.5, 0.7, 0.9], [2.0, 3.0, 5.0]
    sizes = goodspeed_split(alphas, goodputs, total=12, cap=12)
    assert sum(sizes) == 12 and min(sizes) >= 1
    best = max((_objective(alphas, goodputs, (a, b, 12 - a - b)), (a, b, 12 - a - b))
               for a in range(1, 11) for b in range(1, 12 - a))
    assert _objective(alphas, goodputs, sizes) == pytest.approx(best[0])


def test_goodspeed_gives_more_nodes_to_better_drafters_and_respects_the_cap():
    sizes = goodspeed_split([0.4, 0.9], [2.0, 2.0], total=40, cap=16)
    assert sizes[1] == 16 and sizes[0] < sizes[1]
    assert goodspeed_split([0.7, 0.7], [3.0, 3.0], total=10) == [5, 5]


def test_fifo_picks_in_arrival_order_within_the_token_budget():
    sched = Scheduler("fifo", budget=25, nodes=10)
    waiting = [Waiting(sid, nodes=10, cached=50, arrived=t) for sid, t in ((1, 3.0), (2, 1.0),
                                                                          (3, 2.0))]
    picked = sched.pick(waiting, now=4.0)
    assert [w.sid for w in picked] == [2, 3]
    assert waiting[0].steps_waited == 1
    assert [w.sid for w in Scheduler("fifo", budget=25, max_batch=1).pick(waiting, 4.0)] == [2]
    big = Waiting(9, nodes=60, cached=0, arrived=0.0)
    assert sched.pick([big], 1.0) == [big], "an oversized tree is verified alone, not stuck"


def test_slo_serves_what_must_go_now_first_and_hopeless_last():
    sched = Scheduler("slo", budget=12, nodes=10)
    sched.cost.mean.update(0.05)
    now = 10.0
    relaxed = Waiting(1, 10, 10, arrived=9.0, deadline=now + 1.0)
    urgent = Waiting(2, 10, 10, arrived=9.5, deadline=now + 0.08)
    hopeless = Waiting(3, 10, 10, arrived=8.0, deadline=now + 0.01)
    assert sched.pick([relaxed, hopeless, urgent], now) == [urgent]
    starved = Waiting(4, 10, 10, arrived=9.9, deadline=math.inf, steps_waited=4)
    assert sched.pick([urgent, starved], now) == [starved]


def test_slo_deadlines_follow_the_requested_speed():
    sched = Scheduler("slo")
    sched.open(7, now=0.0, speed=10.0)
    sched.open(8, now=0.0)
    assert sched.deadline(8, 1.0) == math.inf
    sched.observe(7, drafted_depth=5, accepted=2, committed=3, finished_at=1.0)
    goodput = sched.sessions[7].per_round
    assert sched.deadline(7, now=1.01) == pytest.approx(1.0 + goodput / 10.0)
    assert sched.deadline(7, now=5.0) == 5.0


def test_observations_move_acceptance_and_goodspeed_budgets():
    sched = Scheduler("goodspeed", budget=44, cap=32)
    for sid in (1, 2):
        sched.open(sid, now=0.0)
    for _ in range(40):
        sched.observe(1, drafted_depth=10, accepted=9, committed=10, finished_at=1.0)
        sched.observe(2, drafted_depth=10, accepted=0, committed=1, finished_at=1.0)
    assert sched.sessions[1].alpha > 0.8 > 0.2 > sched.sessions[2].alpha
    assert sched.nodes_for(1) > sched.nodes_for(2)
    assert sched.nodes_for(1) + sched.nodes_for(2) <= 44 - 2
    sched.close(1)
    assert "1" not in sched.snapshot().sessions


def test_the_pass_cost_recovers_a_tree_pass_and_reports_its_error_on_unseen_passes():
    cost = PassCost(0.01)
    rng = random.Random(0)

    def seconds(rows: int, fed: int, cached_x_new: int) -> float:
        return 0.01 + 2e-4 * fed + 1e-8 * cached_x_new + 1e-3 * rows

    for _ in range(200):
        rows, cached = rng.randint(1, 4), rng.randint(50, 2000)
        fed = rows * rng.randint(2, 25)
        took = seconds(rows, fed, cached * fed) * (1 + rng.gauss(0, 0.01))
        cost.observe(BatchStats(rows, fed, cached * rows, cached * fed), took, trees=rows)
    assert cost.predict(BatchStats(2, 50, 2000, 50_000), trees=2) == pytest.approx(
        seconds(2, 50, 50_000), rel=0.03)
    assert cost.node_s(1000) == pytest.approx(2e-4 + 1e-8 * 1000, rel=0.05)
    assert cost.mape is not None and cost.mape < 0.05
    assert cost.plain.samples == 0, "tree passes teach only the tree fit"


def test_the_scheduler_reads_the_cost_model_it_shares_with_the_core():
    cost = PassCost()
    sched = Scheduler("slo", budget=40, cost=cost)
    for _ in range(20):  # as ``EngineCore.learn`` teaches it
        cost.observe(BatchStats(2, 22, 600, 6600), 0.05, trees=2)
    assert sched.pass_s == pytest.approx(0.05)
    assert sched.cost.trees.samples == 20 and sched.snapshot().time_model_ms


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        Scheduler("lottery")
