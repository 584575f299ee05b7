"""``SpeculationGate``: a serving target sends a request to the hub only while trees would
serve its batch faster than plain batching, judged from the passes it measured."""

from __future__ import annotations

import contextlib

import pytest

from targets.cost import BatchStats, PassCost
from targets.gate import BATCH_MARGIN, COALESCE, PRIOR_TAU, SpeculationGate


def feed(gate: SpeculationGate, per_token_s: float, base_s: float = 0.04,
         tau: float = 2.5, nodes: int = 10, round_trip_s: float = 0.01) -> None:
    """Passes of a machine whose pass costs ``base_s`` plus ``per_token_s`` a fed token,
    plain and with trees, at batches of 1 to 6, cached lengths 100 to 400."""
    for rows in range(1, 7):
        for cached in (100, 250, 400):
            for fed_each in (1, nodes + 1):
                fed = rows * fed_each
                cost = BatchStats(rows, fed, rows * cached, rows * cached * fed_each)
                gate.cost.observe(cost, base_s + per_token_s * fed,
                                  trees=rows if fed_each > 1 else 0)
    for i in range(200):  # 2.5 as 2, 3, 2, 3, ...
        gate.observe_round(nodes, int(tau) + (i % 2 if tau % 1 else 0))
        gate.observe_round_trip(round_trip_s)


def rounds(gate: SpeculationGate, round_trip_s: float, count: int = 50) -> None:
    """Rounds of 10-node trees that keep 3 tokens each."""
    for _ in range(count):
        gate.observe_round(10, 3)
        gate.observe_round_trip(round_trip_s)


def stats_of(sink):
    """A request's tokens, read from its events until the last, and that event's
    ``GenerationStats``."""
    tokens, event = [], sink.get(timeout=60)
    while not event.done:
        tokens += event.tokens
        event = sink.get(timeout=60)
    return tokens + event.tokens, event.stats


def tokens_of(sink) -> list[int]:
    return stats_of(sink)[0]


@contextlib.contextmanager
def eagle3_hub(tiny_dir):
    """A hub in this process whose drafter, a random EAGLE-3 head over the tiny model,
    checks the width and the rows of every feature it is sent."""
    from starhub.drafters.eagle import EagleDrafter
    from starhub.drafters.eagle_head import EAGLE3
    from tests.conftest import HubThread
    from tests.test_eagle_drafter import random_head

    hub = HubThread(EagleDrafter(random_head(tiny_dir, EAGLE3, None).eval()))
    try:
        yield hub
    finally:
        hub.stop()


def test_before_any_round_is_measured_trees_are_tried():
    gate = SpeculationGate(PassCost(0.04))
    assert gate.pays([200]) and gate.pays([200] * 8)


def test_where_fed_tokens_cost_a_lot_trees_pay_alone_but_not_in_a_wide_batch():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.003)
    tree, plain = gate.rates([300])
    assert tree > 1.2 * plain
    assert not gate.pays([300] * 6)
    tree, plain = gate.rates([300] * 6)
    assert plain > tree


def test_where_fed_tokens_are_nearly_free_trees_pay_at_every_batch():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.0001)
    assert all(gate.pays([300] * b) for b in range(1, 9))


def test_a_slow_hub_round_trip_makes_plain_batching_win():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.0001, round_trip_s=0.2)
    assert not gate.pays([300, 300])


def test_trees_that_keep_nothing_never_pay():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.0001, tau=1)
    assert not gate.pays([300, 300])
    tree, plain = gate.rates([300])
    assert tree < plain


def test_the_floor_advised_prices_a_node_at_what_it_holds_the_whole_batch_back():
    """A node pays where its path probability beats its share of a pass times the tokens a
    second the batch commits: no advice before passes are measured, a higher floor where
    fed tokens cost more and where the batch commits more."""
    gate = SpeculationGate(PassCost(0.04))
    assert gate.floor(300, gate.rates([300])[0]) == 0.0
    cheap, dear = SpeculationGate(PassCost(0.04)), SpeculationGate(PassCost(0.04))
    feed(cheap, per_token_s=0.0005)
    feed(dear, per_token_s=0.002)
    assert cheap.node_s(300) == pytest.approx(0.0005, rel=0.05)
    for gate in (cheap, dear):
        lone, batch = gate.rates([300])[0], gate.rates([300] * 4)[0]
        assert batch > lone
        assert gate.floor(300, lone) == pytest.approx(gate.node_s(300) * lone)
        assert gate.floor(300, batch) > gate.floor(300, lone)
    assert dear.floor(300, 100.0) == pytest.approx(4 * cheap.floor(300, 100.0), rel=0.1)
    assert dear.floor(300, 1e4) == 1.0


def plain_pair_then_alone(model, tokenizer, hub: str):
    """A request of 40 tokens and one of 4, queued together, on a server whose gate finds
    the hub far too slow for a batch of two: both begin plain, and once the short one ends
    the long one may take up the hub. The long one's tokens and stats, and the server's
    totals, once both have ended."""
    import queue

    from targets.batcher import Batcher, Request

    batcher = Batcher(model, tokenizer, hub)
    feed(batcher.gate, per_token_s=0.01, round_trip_s=0.5)
    long, short = queue.SimpleQueue(), queue.SimpleQueue()
    batcher.submit(Request(prompt=[5, 6, 7, 8, 9], max_tokens=40, sink=long.put))
    batcher.submit(Request(prompt=[11, 12, 13], max_tokens=4, sink=short.put))
    batcher.start()
    try:
        stats_of(short)
        got, stats = stats_of(long)
    finally:
        batcher.stop()
    return got, stats, batcher.stats


def test_a_batch_where_plain_pays_decodes_without_the_hub_and_equal_to_generate(tiny_model):
    import queue

    import torch

    from starhub.launch.spawn import spawn_hub
    from targets.batcher import Batcher, Request

    model, tokenizer = tiny_model
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    with spawn_hub(["--drafter", "ngram", "--depth", "4"]) as hub:
        batcher = Batcher(model, tokenizer, hub.address)
        feed(batcher.gate, per_token_s=0.01, round_trip_s=0.5)  # the hub is far too slow
        sinks = [queue.SimpleQueue() for _ in prompts]
        for ids, sink in zip(prompts, sinks, strict=True):  # queued together: a batch of 2
            batcher.submit(Request(prompt=ids, max_tokens=12, sink=sink.put))
        batcher.start()
        try:
            (first, first_stats), (second, _) = [stats_of(sink) for sink in sinks]
            assert batcher.stats.gated == len(prompts)
            assert first_stats.rounds == 0, "the first request never decoded alone"
        finally:
            batcher.stop()
    for ids, got in zip(prompts, (first, second), strict=True):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert got == ref[0, len(ids):].tolist()


def test_a_request_sent_plain_takes_up_trees_once_left_alone(tiny_model, tiny_dir):
    """Plain batching wins for two requests; once the short one ends, the long one opens a
    hub session mid-stream, carrying every token and feature row it decoded plain (an
    EAGLE-3 head checks both), and its output is still the target's own."""

    import torch

    model, tokenizer = tiny_model
    with eagle3_hub(tiny_dir) as hub:
        got, stats, totals = plain_pair_then_alone(model, tokenizer, hub.address)
        assert totals.gated == 2, "both began plain"
        assert stats.rounds > 0 and stats.note == "", "then it verified hub trees"
        assert hub.hub.metrics.sessions_opened == 1
    ref = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=40, do_sample=False)
    assert got == ref[0, 5:].tolist()


def test_a_request_decodes_on_while_the_hub_drafts_its_first_tree_and_commits_what_it_decoded(
        tiny_model, tiny_dir):
    """A request that opens its hub session does not wait for the hub's first tree: it
    goes on decoding plain, and the tree, drafted for where it was, is settled by the
    tokens it decoded since (or its nodes below them verified). The hub accepts every such
    COMMIT (an EAGLE-3 head checks each feature row), and the output is the target's own."""
    import queue

    import torch

    from targets.batcher import Batcher, Request

    model, tokenizer = tiny_model
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [3, 1, 4, 1, 5, 9]]
    with eagle3_hub(tiny_dir) as hub:
        batcher = Batcher(model, tokenizer, hub.address)
        batcher.start()
        try:
            got = []
            for ids in prompts:  # one at a time: each OPEN's first pass runs at once
                sink: queue.SimpleQueue = queue.SimpleQueue()
                batcher.submit(Request(prompt=ids, max_tokens=24, sink=sink.put))
                tokens, stats = stats_of(sink)
                assert stats.rounds > 0 and stats.note == "", "it verified hub trees"
                got.append(tokens)
            assert batcher.stats.caught_up >= len(prompts)
            assert not hub.hub.metrics.errors, "the hub refused a COMMIT"
        finally:
            batcher.stop()
    for ids, tokens in zip(prompts, got, strict=True):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        assert tokens == ref[0, len(ids):].tolist()


def test_a_lone_request_uses_the_hub_where_the_rates_say_plain(tiny_model):
    """Alone, a request slows no other row, and the hub judges its rounds from its own
    acceptance: it opens its hub session even where the gate's averages (a slow hub
    round trip) say plain, and its output is still the target's own."""
    import queue

    import torch

    from starhub.launch.spawn import spawn_hub
    from targets.batcher import Batcher, Request

    model, tokenizer = tiny_model
    ids = [5, 6, 7, 8, 9]
    with spawn_hub(["--drafter", "ngram", "--depth", "4"]) as hub:
        batcher = Batcher(model, tokenizer, hub.address)
        feed(batcher.gate, per_token_s=0.01, round_trip_s=0.5)
        tree, plain = batcher.gate.rates([len(ids) + 1])
        assert tree < plain, "the gate's averages say plain"
        sink: queue.SimpleQueue = queue.SimpleQueue()
        batcher.start()
        try:
            batcher.submit(Request(prompt=ids, max_tokens=12, sink=sink.put))
            got = tokens_of(sink)
            assert batcher.stats.gated == 0 and batcher.stats.rounds > 0
        finally:
            batcher.stop()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert got == ref[0, len(ids):].tolist()


def test_a_request_sent_plain_after_hub_rounds_takes_them_up_again_once_left_alone(
        tiny_model, tiny_dir):
    """A request using the hub is sent plain by a newcomer's verdict, then, left alone,
    opens a second hub session, whose rounds count from their own start."""
    import queue

    import torch

    from targets.batcher import Batcher, Request

    model, tokenizer = tiny_model
    with eagle3_hub(tiny_dir) as hub:
        batcher = Batcher(model, tokenizer, hub.address)
        feed(batcher.gate, per_token_s=0.05, round_trip_s=0.5)  # two rows: plain
        long, short = queue.SimpleQueue(), queue.SimpleQueue()
        batcher.start()
        try:
            batcher.submit(Request(prompt=[5, 6, 7, 8, 9], max_tokens=60, sink=long.put))
            got = long.get(timeout=60).tokens + long.get(timeout=60).tokens  # a hub round
            batcher.submit(Request(prompt=[11, 12, 13], max_tokens=4, sink=short.put))
            stats_of(short)
            rounds = batcher.stats.rounds
            rest, _ = stats_of(long)
            assert batcher.stats.gated == 2, "the newcomer sent both plain"
            assert hub.hub.metrics.sessions_opened == 2
            assert batcher.stats.rounds > rounds, "no tree verified after it was left alone"
        finally:
            batcher.stop()
    ref = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=60, do_sample=False)
    assert got + rest == ref[0, 5:].tolist()


def test_a_request_arriving_in_a_lull_is_judged_by_the_batch_recent_load_builds():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.003)
    assert gate.pays([300], now=0.0), "alone, trees pay on this machine"
    for i in range(100):  # six requests decoding for 10 s, then one for half a second
        gate.observe_batch(6, now=0.1 * i)
    gate.observe_batch(1, now=10.0)
    assert not gate.pays([300], now=10.5), "but requests have been decoding six at a time"


def test_a_lone_request_after_a_quiet_spell_uses_the_hub_again():
    """The recent batch is averaged over time, not passes: a spell with nothing decoding
    (and so no passes) brings it down."""
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.003)
    for i in range(100):
        gate.observe_batch(6, now=0.1 * i)
    gate.observe_batch(0, now=10.0)
    assert gate.pays([300], now=25.0)



def test_what_a_tree_row_costs_beyond_its_tokens_counts_against_trees():
    """Tree passes that cost more than their fed tokens explain (masks, scattered
    attention) are not read off the plain passes' per-token cost."""
    def gate_with(tree_row_s: float) -> SpeculationGate:
        gate = SpeculationGate(PassCost(0.04))
        for _ in range(3):
            for rows in range(1, 6):
                for cached in (100, 300):
                    plain = BatchStats(rows, rows, rows * cached, rows * cached)
                    gate.cost.observe(plain, 0.04 + 0.002 * rows)
                    tree = BatchStats(rows, 11 * rows, rows * cached, 11 * rows * cached)
                    gate.cost.observe(tree, 0.04 + 0.022 * rows + tree_row_s * rows, trees=rows)
        rounds(gate, round_trip_s=0.01)
        return gate

    assert gate_with(0.0).pays([200, 200])
    assert not gate_with(0.05).pays([200, 200])


def test_a_tree_among_rows_already_decoding_plain_is_judged_as_that_mix():
    """Rows that cannot use the hub (it was lost while they decoded) stay plain: a
    newcomer's tree would slow their pass and add nothing to them, so it must pay for the
    mix, not for a batch of trees (judged at an even margin: this pins the rates)."""
    gate = SpeculationGate(PassCost(0.04), margin=1.0)
    feed(gate, per_token_s=0.001, round_trip_s=0.02)
    assert gate.pays([300] * 3), "three requests with trees would beat plain"
    assert not gate.pays([300], plain=[300, 300]), "one tree beside two plain rows would not"


def test_requests_still_prefilling_count_in_the_batch_a_new_request_joins():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.003)
    assert gate.pays([300])
    assert not gate.pays([300], queued=5)


def test_the_slowdown_the_hub_adds_to_tree_passes_counts_against_trees():
    def gate_after(slowdown: float) -> SpeculationGate:
        gate = SpeculationGate(PassCost(0.04), margin=1.0)  # the rates, at an even margin
        for rows in range(1, 5):
            for fed_each, trees in ((1, False), (11, True)):
                cost = BatchStats(rows, rows * fed_each, rows * 200, rows * 200 * fed_each)
                alone = 0.04 + 0.002 * rows * fed_each
                gate.cost.observe(cost, alone, alone * (slowdown if trees else 1.0),
                                  rows if trees else 0)
        rounds(gate, round_trip_s=0.02)
        return gate

    assert gate_after(1.0).pays([200, 200])
    assert not gate_after(2.0).pays([200, 200])
    assert gate_after(2.0).rates([200])[1] == gate_after(1.0).rates([200])[1], \
        "plain batching is judged by the passes' time alone either way"


def test_a_spell_of_tree_passes_does_not_move_what_plain_batching_costs():
    """The fit of every pass forgets plain passes while trees run, and tree passes whose
    cost grows faster than their fed tokens pull its plain pass along; plain batching is
    priced by plain passes alone, so a tree spell cannot move it."""
    import random

    rng = random.Random(0)
    gate = SpeculationGate(PassCost(0.09))
    for rows in range(1, 5):
        for _ in range(20):
            gate.cost.observe(BatchStats(rows, rows, rows * 300, rows * 300), 0.09 + 0.005 * rows)
    for _ in range(300):  # 1 to 3 rows with trees, costing a little more than linear
        rows, cached = rng.choice([1, 2, 3]), rng.randint(100, 500)
        fed = 11 * rows
        seconds = (0.09 + 0.004 * fed + 0.00004 * fed * fed) * rng.uniform(0.9, 1.1)
        gate.cost.observe(BatchStats(rows, fed, rows * cached, fed * cached), seconds, trees=rows)
    assert abs(gate.plain_pass_s([300, 300]) - 0.1) < 0.002
    assert gate.tree_pass_s([], [300, 300]) == gate.plain_pass_s([300, 300])
    assert abs(gate.cost.trees.predict([1.0, 2, 600, 0.0]) - 0.1) > 0.005, \
        "the tree passes' fit would misprice plain rows"


def test_a_batch_left_by_a_request_is_judged_at_its_size_not_the_recent_average():
    """A newcomer is judged at the recent batch where that is larger (arrivals go on);
    the rows a departing request leaves are judged as they are, so two rows left after a
    spell of four can take up trees that pay at two."""
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.002)
    for t in range(50):
        gate.observe_batch(4, now=0.1 * t)
    arriving = gate.verdict([300, 300], now=5.0)
    leaving = gate.verdict([300, 300], now=5.0, current=True)
    assert (arriving.rows, leaving.rows) == (4, 2)
    assert leaving.tree_tok_s > leaving.plain_tok_s


def test_a_lone_request_opens_its_hub_session_whatever_the_rates_say():
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.0001, round_trip_s=0.2)
    alone = gate.verdict([300])
    assert alone.trees and alone.lone and alone.tree_tok_s < alone.plain_tok_s
    assert not gate.pays([300, 300]), "two rows are judged by the rates"


def test_a_tree_beside_plain_rows_waits_for_the_plain_passes_begun_while_it_was_away():
    """The engine does not hold plain rows' passes for a tree longer than a fraction of
    a pass, so a tree that comes back mid-pass waits for that pass to end: its round
    costs a whole plain pass, not the round trip alone."""
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.0005, round_trip_s=0.02)
    assert gate.pays([300, 300]), "two rows with trees pay"
    tree, _ = gate.rates([300], plain=[300])
    plain_s = gate.plain_pass_s([300])
    assert 0.02 > COALESCE * plain_s and 0.02 < plain_s, "the tree comes back mid-pass"
    cycle = gate.tree_pass_s([300], [300]) * gate.cost.slowdown.get(1.0) + plain_s
    assert tree == pytest.approx((gate.tau.get(PRIOR_TAU) + 2) / cycle), \
        "the plain row steps twice while the tree waits a whole pass"
    assert tree < 0.8 * gate.rates([300, 300])[0]


def test_a_few_rounds_move_the_gates_tau_as_far_as_their_mean():
    """The prior τ weighs as a few rounds, not as an average that moves 5% a round: two
    rounds that kept 4 tokens each read 2.67 (the prior 2.0 as four rounds), and a long run
    settles on what the rounds keep."""
    gate = SpeculationGate(PassCost(0.04))
    gate.observe_round(10, 4)
    gate.observe_round(10, 4)
    assert abs(gate.tau.get(0.0) - (4 * 2.0 + 2 * 4) / 6) < 1e-9
    gate.observe_round_trip(0.008)
    assert gate.round_trip.get(0.0) == 0.008, "the first measured round trip replaces zero"
    for _ in range(200):
        gate.observe_round(10, 3)
    assert abs(gate.tau.get(0.0) - 3.0) < 0.01


def tree_passes(gate: SpeculationGate, tree_row_s: float) -> None:
    """Tree passes at 1, 2 and 4 rows of 4- and 10-node trees, caches of 100: 60 ms, plus
    2 ms a fed token and ``tree_row_s`` a tree row."""
    for rows in (1, 2, 4):
        for nodes in (4, 10):
            fed = rows * (nodes + 1)
            gate.cost.observe(BatchStats(rows, fed, rows * 100, fed * 100),
                              0.06 + 0.002 * fed + tree_row_s * rows, trees=rows)


def test_a_spell_of_plain_passes_does_not_move_what_trees_add_to_a_pass():
    """A server whose requests all went plain still prices what trees add to a pass by
    the tree passes it ran: plain passes, whose fed tokens are all roots, teach the plain
    fit only (a plain row costing 8 ms would price a tree node at 8 ms)."""
    gate = SpeculationGate(PassCost(0.06))
    tree_passes(gate, tree_row_s=0.01)

    def added() -> float:
        return gate.tree_pass_s([100] * 5) - gate.plain_pass_s([100] * 5)

    before = added()
    for _ in range(300):  # plain rows cost 8 ms each: far more than a fed tree node
        gate.cost.observe(BatchStats(5, 5, 500, 500), 0.06 + 0.008 * 5)
    assert added() == pytest.approx(before)
    assert gate.plain_pass_s([100] * 5) == pytest.approx(0.1, rel=0.02)


def widths_then_one_row(anchored: bool) -> SpeculationGate:
    """Plain passes at 1, 2 and 4 rows (8 ms a row), then a long spell of one-row ones."""
    gate = SpeculationGate(PassCost(0.06))
    for rows in (1, 2, 4):
        for cached in (48, 144):
            gate.cost.observe(BatchStats(rows, rows, rows * cached, rows * cached),
                              0.06 + 0.008 * rows)
    if anchored:
        gate.cost.anchor()
    for i in range(500):
        cached = 100 + i % 300
        gate.cost.observe(BatchStats(1, 1, cached, cached), 0.068)
    return gate


def test_passes_of_several_widths_keep_pricing_wide_batches_after_a_spell_of_one_row():
    """One-row passes cannot tell a pass's fixed cost from its cost per row; once the
    passes that did are forgotten, an anchored fit keeps their split, not its first
    guess (a server's priced five plain rows at 175 ms where they took 100)."""
    five = 0.06 + 0.008 * 5
    anchored = widths_then_one_row(anchored=True).plain_pass_s([200] * 5)
    drifted = widths_then_one_row(anchored=False).plain_pass_s([200] * 5)
    assert anchored == pytest.approx(five, rel=0.05)
    assert abs(drifted - five) > 2 * abs(anchored - five)


def test_a_tree_among_many_plain_rows_is_priced_with_them_as_plain_passes_cost():
    """Wide plain batches of unlike cache lengths cost more than any fit term says (rows
    are padded to the longest); only the plain fit has seen it. A newcomer's tree beside
    nine plain rows is priced as their plain pass plus what its tree adds, so the cost
    the tree fit never saw counts on both sides and the tree is no gain."""
    gate = SpeculationGate(PassCost(0.06))
    tree_passes(gate, tree_row_s=0.004)
    for rows in (8, 9, 10):
        for _ in range(30):
            gate.cost.observe(BatchStats(rows, rows, rows * 300, rows * 300),
                              0.06 + 0.008 * rows + 0.06)
    rounds(gate, round_trip_s=0.02)
    assert not gate.pays([300], plain=[300] * 9)


def test_a_request_left_alone_takes_up_the_hub_only_with_tokens_left_for_trees_once_they_come():
    """A request opening its hub session mid-stream decodes plain until its first tree
    comes: it opens only where tokens would be left for trees by then, more than the
    plain steps the measured wait holds. Before that wait is measured a request left alone
    always takes up the hub. Where the gate's rates say trees lose alone, the hub judges."""
    gate = SpeculationGate(PassCost(0.04))
    feed(gate, per_token_s=0.003)
    tree, plain = gate.rates([300])
    assert tree > plain, "alone, trees pay on this machine"
    assert gate.rejoin_pays(300, left=2), "the wait is not yet measured"
    gate.observe_open_wait(0.3)
    during = 0.3 * plain
    assert during > 3
    assert not gate.rejoin_pays(300, left=int(during))
    assert gate.rejoin_pays(300, left=int(during) + 2)
    slow = SpeculationGate(PassCost(0.04))
    feed(slow, per_token_s=0.003, round_trip_s=0.5)
    slow.observe_open_wait(0.1)
    assert slow.rates([300])[0] < slow.rates([300])[1]
    assert slow.rejoin_pays(300, left=1), "the gate cannot price it: the hub judges"


def test_a_plain_row_beside_trees_steps_at_their_pass_not_at_the_plain_one():
    """The step a batched session's COMMIT reports, the one its hub round must beat: a
    plain round beside rows that keep their trees runs at their tree passes' pace."""
    gate = SpeculationGate(PassCost(0.05))
    feed(gate, per_token_s=0.004)
    plain = gate.plain_pass_s([250, 250, 250])
    assert gate.steps_beside([250], [250, 250]) == [plain]
    beside = gate.steps_beside([250, 250, 250], [])
    assert beside == pytest.approx([gate.tree_pass_s([250, 250], [250])] * 3)
    assert beside[0] > 1.5 * plain
    short, long = gate.steps_beside([100, 400], [])
    assert short == pytest.approx(gate.tree_pass_s([400], [100]))
    assert long == pytest.approx(gate.tree_pass_s([100], [400]))
    cost = BatchStats(3, 33, 750, 8250)
    for _ in range(50):  # the hub drafting on our cores stretches tree passes by half
        gate.cost.observe(cost, 0.172, 1.5 * 0.172, trees=3)
    assert gate.steps_beside([250, 250, 250], [])[0] == pytest.approx(
        1.5 * gate.tree_pass_s([250, 250], [250]), rel=0.05)


def test_trees_a_little_behind_plain_by_the_estimates_are_still_taken():
    """``BATCH_MARGIN`` below 1: a verdict at today's batch does not credit trees with the
    smaller batch they leave, so trees within a few percent of plain are taken."""
    def fed(margin: float) -> SpeculationGate:
        gate = SpeculationGate(PassCost(0.04), margin=margin)
        feed(gate, per_token_s=0.001, round_trip_s=0.02)
        return gate

    decision = fed(BATCH_MARGIN).verdict([300], plain=[300, 300])
    assert BATCH_MARGIN * decision.plain_tok_s <= decision.tree_tok_s < decision.plain_tok_s
    assert decision.trees
    assert not fed(1.0).verdict([300], plain=[300, 300]).trees


def test_a_wide_plain_pass_is_never_priced_below_the_fastest_pass_seen():
    """One row and two rows may run on kernels of their own (a two-token pass here cheaper
    than a one-token one): the plain fit's line then falls with the rows, and a wide batch
    must still cost at least what the fastest plain pass took, not nothing."""
    cost = PassCost(0.035)
    for i in range(40):
        rows = 1 + i % 2
        cost.observe(BatchStats(rows, rows, 100 * rows, 100 * rows),
                     0.035 if rows == 1 else 0.031)
    assert cost.plain.predict([1.0, 20, 2000]) < 0.0, "the line itself goes below zero"
    assert cost.plain_s([100] * 20) >= 0.031
