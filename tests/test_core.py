"""``targets.core``: the one place a target runs its model, for the star's requests and the
edge's drafters alike: prefill turns and slices, passes timed and taught to the cost model."""

from __future__ import annotations

import numpy as np

from starhub.wire.tree import DraftTree
from targets.core import EngineCore
from targets.cost import PassCost
from targets.engine import VerifyEngine
from targets.prefill import SLICE_S

PROMPT = [(13 * i) % 700 + 3 for i in range(40)]


def tree(nodes: int) -> DraftTree:
    return DraftTree(np.arange(5, 5 + nodes, dtype=np.int32),
                     np.arange(-1, nodes - 1, dtype=np.int32))


def test_a_pass_returns_each_rows_verdict_and_teaches_the_cost_model_once(tiny_model):
    model, _ = tiny_model
    core = EngineCore(VerifyEngine(model), PassCost())
    for sid in (1, 2):
        core.engine.open(sid, PROMPT)
    alone = [core.engine.verify([(sid, tree(3))])[0].tokens for sid in (1, 2)]
    for sid in (1, 2):  # the same sessions again, batched
        core.engine.close(sid)
        core.engine.open(sid, PROMPT)
    done = core.verify([(1, tree(3)), (2, tree(3))])
    assert [v.tokens for v in done.verdicts] == alone, "batched rows verify as alone"
    assert done.stats.rows == 2 and done.stats.new_tokens == 8
    assert done.took > 0 and done.alone > 0 and core.passes == 1
    assert core.busy_s >= done.took
    assert core.cost.trees.samples == 1 and core.cost.plain.samples == 0
    plain = core.verify([(1, tree(0))], trees=0, learn=False)
    assert core.cost.plain.samples == 0, "not taught: its front end teaches it"
    core.learn(plain, trees=0)
    assert core.cost.plain.samples == 1 and core.passes == 2


def test_prefill_turns_go_to_the_shortest_and_the_oldest_in_turn_and_count_chunks(
        tiny_model):
    model, _ = tiny_model
    core = EngineCore(VerifyEngine(model), PassCost())
    jobs = {sid: core.engine.open_chunks(sid, PROMPT[:n], 16) for sid, n in
            ((1, 40), (2, 20))}
    left = {1: 40, 2: 20}.__getitem__
    assert core.prefill_slice([], left, False, False) is None
    assert core.prefill_slice([1, 2], left, False, False) == SLICE_S, "nothing else decodes"
    assert core.prefill_turn([1, 2], left) == 1, "the oldest first"
    assert core.prefill_turn([1, 2], left) == 2, "then the shortest"
    while (done := core.prefill(jobs[2], SLICE_S)) is None:
        pass
    first, _ = done
    assert core.prefill_chunks == 2 and core.busy_s > 0
    assert first == core.engine.open(3, PROMPT[:20])[0]
