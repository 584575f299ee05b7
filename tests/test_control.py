"""The control plane on synthetic measurements: the load model's N_full and N_max, the
admission rule, and the tree-shape choice."""

from __future__ import annotations

import math
import random

import pytest

from bench.model import expected_accepted
from starhub.control.plane import (
    AUTO,
    MAX_FLOOR,
    Acceptance,
    ControlConfig,
    Controller,
    LinearFit,
    session_rate,
)

STEP, T_S, T_V, T_C = 25e-3, 1.4e-3, 25e-3, 1e-3


def controller(depth=6, max_targets=AUTO, topk=1, max_nodes=6) -> Controller:
    ctl = Controller(ControlConfig(depth=depth, topk=topk, max_nodes=max_nodes,
                                   max_targets=max_targets))
    for d in range(1, 9):
        for _ in range(3):
            ctl.observe_draft(d, min(max_nodes, topk * d), d * T_S)
    return ctl


def run_rounds(ctl: Controller, tag: int, beta: float, rounds: int, seed: int = 0) -> None:
    """A session's rounds as the hub sees them: choose, then the target's COMMIT."""
    rng = random.Random(seed)
    for _ in range(rounds):
        choice = ctl.choose(tag)
        if choice.plain:
            ctl.observe_commit(tag, 0, 0, 0, choice.plain * STEP, choice.plain * STEP + T_C,
                               STEP)
            continue
        accepted = 0
        while accepted < choice.depth and rng.random() < beta:
            accepted += 1
        ctl.observe_commit(tag, accepted, choice.depth, choice.nodes, T_V, T_V + T_C, STEP)


def test_linear_fit_recovers_a_cost_curve_and_keeps_the_prior_where_data_is_silent():
    fit = LinearFit([0.0, 0.0])
    for nodes in (1, 4, 8, 16) * 20:
        fit.update([1.0, nodes], 0.040 + 0.0017 * nodes)
    assert fit.predict([1.0, 10]) == pytest.approx(0.057, rel=0.02)
    flat = LinearFit([0.02, 0.001])
    for _ in range(50):
        flat.update([1.0, 10], 0.03)
    assert flat.predict([1.0, 10]) == pytest.approx(0.03, rel=0.02)


def test_linear_fit_of_features_the_data_never_tells_apart_still_predicts():
    """Plain passes feed one token a row, so two features are always equal; at long caches
    the ridge is lost in rounding and elimination meets an exact zero pivot."""
    fit = LinearFit([0.0, 0.0, 0.0, 0.02], forget=1 - 2 / 256, strength=1e-9)
    for cached in range(3000, 3040):
        fit.update([2.0, cached, cached, 1.0], 0.04 + 1e-5 * cached)
    assert fit.predict([2.0, 3020, 3020, 1.0]) == pytest.approx(0.0702, rel=0.02)


def test_acceptance_by_depth_learns_beta_and_starts_new_sessions_from_the_hub_curve():
    hub = Acceptance()
    session = Acceptance(parent=hub)
    rng = random.Random(3)
    for _ in range(3000):
        accepted = 0
        while accepted < 6 and rng.random() < 0.8:
            accepted += 1
        session.observe(6, accepted)
    assert session.betas()[1:4] == pytest.approx([0.8] * 3, abs=0.07)
    fresh = Acceptance(parent=hub)
    assert fresh.expected_tokens()[6] == pytest.approx(1 + expected_accepted(0.8, 6), rel=0.1)


def test_a_round_counts_once_in_a_session_curve_whatever_the_depth_of_its_priors():
    """A session's round also reaches its target's and the hub's counts; the curves a
    session shrinks toward leave it out, so one round that kept nothing moves a fresh
    hub's session as far as one observation against the prior's weight, not three."""
    hub = Acceptance()
    target = Acceptance(parent=hub)
    session = Acceptance(parent=target)
    session.observe(4, 0)
    once = hub.pseudo * hub.prior / (1 + hub.pseudo)
    assert session.betas()[1] == pytest.approx(once)
    assert target.betas()[1] == pytest.approx(once)
    # the target's next session starts from that round, counted once
    assert Acceptance(parent=target).betas()[1] == pytest.approx(once)
    # another target's sessions do learn from it, through the hub
    assert Acceptance(parent=Acceptance(parent=hub)).betas()[1] == pytest.approx(once)


def test_a_curve_shrinks_toward_the_other_targets_rounds_at_a_busy_hub():
    """Twelve targets' rounds interleave at the hub, which forgets per round it sees:
    what a target leaves out of the hub's counts is its own share as the hub decayed it,
    so the hub still holds the other eleven's rounds for it."""
    hub = Acceptance()
    targets = [Acceptance(parent=hub) for _ in range(12)]
    rng = random.Random(5)
    for r in range(2400):
        beta = 0.5 if r % 12 == 0 else 0.9
        accepted = 0
        while accepted < 6 and rng.random() < beta:
            accepted += 1
        targets[r % 12].observe(6, accepted)
    others = hub.betas(without=targets[0])[1]
    assert others == pytest.approx(0.9, abs=0.03)
    assert hub.betas()[1] < others
    assert targets[0].betas()[1] == pytest.approx(0.5, abs=0.06)


def test_n_full_and_n_max_follow_the_star_model():
    """t_s=1.4ms, depth 6, Z=26ms, beta 0.8, t_step 25ms: N_full = 5; every target keeps
    its standalone speed while N·S <= tau·t_step, so N_max = 11."""
    ctl = controller()
    assert ctl.join(b"a", "a", STEP, 0.0) is None
    ctl.open(1, b"a", STEP)
    run_rounds(ctl, 1, 0.8, 3000)
    assert ctl.n_full() == 5
    tau = 1 + expected_accepted(0.8, 6)
    assert abs(ctl.n_max() - math.floor(tau * STEP / (6 * T_S))) <= 1


def test_auto_admission_stops_at_n_max_and_a_freed_slot_is_reused():
    ctl = controller()
    admitted = []
    for i in range(16):
        who = f"t{i}".encode()
        if ctl.join(who, who.decode(), STEP, 0.0) is not None:
            break
        ctl.open(i + 1, who, STEP)
        run_rounds(ctl, i + 1, 0.8, 400, seed=i)
        admitted.append(who)
    assert abs(len(admitted) - ctl.n_max()) <= 1
    assert ctl.join(b"late", "late", STEP, 0.0) == "saturated"
    assert ctl.rejections >= 1
    ctl.leave(admitted[0])
    assert ctl.join(b"late", "late", STEP, 0.0) is None


def greet_and_serve(ctl: Controller, betas: list[float], seconds: int, seed: int,
                    rounds_a_second: int = 12) -> list[bytes]:
    """Targets greeting a hub at once, as the emulated bench's do: admitted ones open a
    session and take rounds in turn (``rounds_a_second`` each, about what a saturated hub
    gives them), turned-away ones greet again each second. Returns those admitted."""
    names = [f"t{i}".encode() for i in range(len(betas))]
    rngs: dict[int, tuple[random.Random, float]] = {}
    for second in range(seconds):
        for i, who in enumerate(names):
            if who not in ctl.targets and ctl.join(who, who.decode(), STEP, second) is None:
                ctl.open(i + 1, who, STEP)
                ctl.choose(i + 1)
                rngs[i + 1] = (random.Random(seed * 1000 + i), betas[i])
        for _ in range(rounds_a_second):
            for tag, (rng, beta) in rngs.items():
                choice = ctl.sessions[tag].choice
                accepted = 0
                while accepted < choice.depth and rng.random() < beta:
                    accepted += 1
                ctl.observe_commit(tag, accepted, choice.depth, choice.nodes, T_V, T_V + T_C,
                                   STEP)
                ctl.choose(tag)
    return [who for who in names if who in ctl.targets]


def test_alike_targets_are_admitted_to_n_max_while_their_estimates_are_young():
    """Sixteen targets with one acceptance, for five seconds: each target's own estimate
    rests on a few dozen rounds, and judging each by it stopped admission at the
    unluckiest, two or three below the N_max the hub reported."""
    for seed in range(8):
        ctl = controller()
        admitted = greet_and_serve(ctl, [0.8] * 16, seconds=5, seed=seed)
        assert abs(len(admitted) - ctl.n_max()) <= 1, (seed, len(admitted), ctl.n_max())


def test_admission_counts_on_acceptance_two_standard_errors_below_its_estimate():
    """An admitted target keeps its slot: the hub admits, and N_max counts, only as many
    targets as keep standalone speed when acceptance is two standard errors worse than
    measured, here one fewer than the estimate alone would."""
    ctl = controller()
    assert ctl.join(b"first", "first", STEP, 0.0) is None
    ctl.open(1, b"first", STEP)
    run_rounds(ctl, 1, 0.8, 3000)
    s, _, tau, _, depth = ctl.typical()
    admitted = 1
    while ctl.join(f"t{admitted}".encode(), "t", STEP, 0.0) is None:
        admitted += 1
        ctl.open(admitted, f"t{admitted - 1}".encode(), STEP)
        ctl.choose(admitted)
    assert admitted == ctl.n_max()
    assert admitted < math.floor(tau * STEP / s)
    assert ctl.snapshot(0.0).n_max == admitted


def test_targets_that_truly_differ_are_judged_by_their_own_acceptance():
    """Alike or not is the data's call: poor drafts for half the targets are no noise,
    and admission stops where those would fall below standalone speed (at depth 6,
    beta 0.5 gives 2 tokens a round: five targets' drafts fit in 50 ms), well short of
    the typical target's N_max."""
    ctl = controller()
    betas = [0.85, 0.5] * 8
    admitted = greet_and_serve(ctl, betas, seconds=8, seed=0)
    poor = 1 + expected_accepted(0.5, 6)
    assert len(admitted) * 6 * T_S <= poor * STEP
    assert len(admitted) < ctl.n_max()
    assert any(betas[int(who[1:])] == 0.5 for who in admitted)


def test_a_fixed_limit_counts_admitted_targets_only():
    ctl = controller(max_targets=2)
    assert ctl.join(b"a", "a", STEP, 0.0) is None
    assert ctl.join(b"b", "b", STEP, 0.0) is None
    assert "admission limit of 2" in ctl.join(b"c", "c", STEP, 0.0)
    assert ctl.join(b"a", "a", STEP, 0.0) is None, "a known target is never turned away"
    ctl.leave(b"b")
    assert ctl.join(b"c", "c", STEP, 0.0) is None


def crowd(betas: list[float], iterations: int) -> Controller:
    """One session per target, of these acceptances, their rounds taken in turn."""
    ctl = controller(depth=AUTO, max_targets=0, max_nodes=8)
    for i in range(len(betas)):
        ctl.join(bytes([i]), str(i), STEP, 0.0)
        ctl.open(i + 1, bytes([i]), STEP)
    for _ in range(iterations):
        for i, beta in enumerate(betas):
            run_rounds(ctl, i + 1, beta, 1, seed=i)
    return ctl


def test_adaptive_depth_goes_deep_for_a_good_drafter_and_plain_for_a_bad_one():
    ctl = controller(depth=AUTO, max_targets=0, max_nodes=8)
    ctl.join(b"good", "good", STEP, 0.0)
    ctl.join(b"bad", "bad", STEP, 0.0)
    ctl.open(1, b"good", STEP)
    ctl.open(2, b"bad", STEP)
    run_rounds(ctl, 1, 0.9, 300)
    run_rounds(ctl, 2, 0.05, 300)
    assert ctl.choose(1).depth >= 5
    choices = [ctl.choose(2) for _ in range(40)]
    plain = [c for c in choices if c.plain]
    assert len(plain) >= 30, "a session no tree speeds up decodes plainly"
    assert any(c.probe for c in choices), "and is re-probed now and then"


def test_adaptive_depth_shortens_trees_when_the_hub_saturates():
    """At saturation every layer one session drafts delays all the others."""
    alone = controller(depth=AUTO, max_targets=0, max_nodes=8)
    alone.join(b"t", "t", STEP, 0.0)
    alone.open(1, b"t", STEP)
    run_rounds(alone, 1, 0.75, 400)
    crowded = crowd([0.75] * 24, 40)
    deep_alone = alone.choose(1).depth
    crowd_depths = [crowded.sessions[i + 1].choice.depth for i in range(24)]
    assert max(crowd_depths) < deep_alone


def test_a_round_goes_at_its_own_pace_on_a_light_hub_and_at_the_slowest_at_the_knee():
    """Round trips that differ queue behind the slowest once the hub's load nears it."""
    e, cycle, slowest = 3.0, 28e-3, 36e-3
    assert session_rate(e, cycle, slowest, 4e-3) == pytest.approx(e / cycle, rel=0.01)
    assert session_rate(e, cycle, slowest, slowest) == pytest.approx(e / slowest)
    assert e / slowest < session_rate(e, cycle, slowest, 27e-3) < e / cycle
    assert session_rate(e, cycle, slowest, 50e-3) == pytest.approx(e / 50e-3)


def test_a_good_drafter_near_the_knee_drafts_no_longer_than_the_others_round_trips():
    """Its deeper tree would stretch every other session's round toward its own; at a
    hub loaded near the round trips it pays less than that costs them."""
    ctl = crowd([0.95] + [0.7] * 5, 80)
    good = ctl.sessions[1]
    others = [sm.s + sm.z for tag, sm in ctl.sessions.items() if tag != 1 and sm.s]
    assert good.choice.depth >= 4
    assert good.s + good.z <= max(others) + 1e-4


def test_a_target_without_a_known_step_time_is_admitted():
    ctl = controller()
    assert ctl.join(b"old", "old", 0.0, 0.0) is None


def test_an_average_without_a_prior_weight_moves_by_its_alpha_from_the_start():
    from starhub.control.estimators import Ema

    ema = Ema(2.0, alpha=0.05)
    ema.update(4.0)
    assert abs(ema.get(0.0) - 2.1) < 1e-9
    assert Ema(alpha=0.05).update(4.0) == 4.0, "with no starting value the first one is it"


def verified(ctl: Controller, tag: int, per_node: float, rounds: int = 40) -> None:
    """Rounds whose verify takes ``T_V + per_node`` a tree node, over trees of 2 to 8."""
    for i in range(rounds):
        nodes = 2 + i % 7
        ctl.choose(tag)
        ctl.observe_commit(tag, 1, 3, nodes, T_V + per_node * nodes, None, STEP)


def test_a_tree_leaves_out_nodes_worth_less_than_the_verify_time_they_cost():
    ctl = controller(depth=4, max_targets=0, topk=4, max_nodes=10)
    ctl.join(b"cpu", "cpu", STEP, 0.0)
    ctl.open(1, b"cpu", STEP)
    verified(ctl, 1, per_node=1.2e-3)
    choice = ctl.choose(1)
    sm = ctl.sessions[1]
    slope = ctl.targets[b"cpu"].verify_line()[1]
    assert slope == pytest.approx(1.2e-3, rel=0.1)
    assert choice.floor == pytest.approx(sm.e * slope / (sm.s + sm.z))
    assert 0.02 < choice.floor < 0.2, "a CPU target's node is worth keeping above a few %"


def test_nodes_that_cost_nothing_are_all_kept_and_pruning_can_be_turned_off():
    free = controller(depth=4, max_targets=0, topk=4, max_nodes=10)
    free.join(b"gpu", "gpu", STEP, 0.0)
    free.open(1, b"gpu", STEP)
    verified(free, 1, per_node=0.0)
    assert free.choose(1).floor < 1e-3
    off = Controller(ControlConfig(depth=4, topk=4, max_nodes=10, prune=False))
    off.join(b"cpu", "cpu", STEP, 0.0)
    off.open(1, b"cpu", STEP)
    verified(off, 1, per_node=1.2e-3)
    assert off.choose(1).floor == 0.0


def test_a_session_whose_trees_keep_few_nodes_is_priced_at_the_nodes_it_keeps():
    """Verify costs 5 ms a node and the floor leaves a quarter of each tree: priced at the
    full trees, no tree would pay, yet the trees it sends do."""
    ctl = controller(depth=AUTO, max_targets=0, topk=4, max_nodes=10)
    ctl.join(b"cpu", "cpu", STEP, 0.0)
    ctl.open(1, b"cpu", STEP)
    rng = random.Random(0)
    choices = []
    for _ in range(300):
        choice = ctl.choose(1)
        choices.append(choice)
        if choice.plain:
            ctl.observe_commit(1, 0, 0, 0, choice.plain * STEP, choice.plain * STEP + T_C,
                               STEP)
            continue
        kept = max(1, choice.nodes // 4)
        accepted = 0
        while accepted < min(choice.depth, kept) and rng.random() < 0.7:
            accepted += 1
        ctl.observe_commit(1, accepted, choice.depth, kept, STEP + 5e-3 * kept, None, STEP)
    assert sum(not c.plain for c in choices[-100:]) >= 90
    assert ctl.sessions[1].kept.get(1.0) < 0.4
    assert ctl.snapshot(0.0).targets[0].kept_share < 0.4, "STATS reports the share"


def test_a_serving_targets_sessions_take_the_floor_their_target_advises():
    """A serving target's COMMIT times a whole batched pass, not one tree's nodes: the hub's
    own floor would price a node at the whole batch, so its sessions take the floor the
    target works out from its own passes, and none until it advises one."""
    ctl = controller(depth=4, max_targets=0, topk=4, max_nodes=10)
    ctl.join(b"srv", "srv", STEP, 0.0)
    ctl.open(1, b"srv", STEP, batched=True)
    verified(ctl, 1, per_node=1.2e-3)
    assert ctl.choose(1).floor == 0.0
    ctl.observe_commit(1, 1, 3, 4, T_V, None, STEP, floor=0.08)
    assert ctl.choose(1).floor == pytest.approx(0.08)
    ctl.observe_commit(1, 1, 3, 4, T_V, None, STEP, floor=0.9)
    assert ctl.choose(1).floor == MAX_FLOOR, \
        "however high the advice, no floor leaves out a node at even odds"
    own = controller(depth=4, max_targets=0, topk=4, max_nodes=10)
    own.join(b"cpu", "cpu", STEP, 0.0)
    own.open(1, b"cpu", STEP)
    verified(own, 1, per_node=1.2e-3)
    own.observe_commit(1, 1, 3, 4, T_V + 4 * 1.2e-3, None, STEP, floor=0.4)
    assert 0.02 < own.choose(1).floor < 0.2, "a session of its own takes the hub's floor"
    off = Controller(ControlConfig(depth=4, topk=4, max_nodes=10, max_targets=0, prune=False))
    off.join(b"srv", "srv", STEP, 0.0)
    off.open(1, b"srv", STEP, batched=True)
    off.observe_commit(1, 1, 3, 4, T_V, None, STEP, floor=0.08)
    assert off.choose(1).floor == 0.0, "--prune off ignores the advice"
