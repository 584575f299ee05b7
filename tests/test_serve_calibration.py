"""``targets.calibration``: a serving target times batched passes over throwaway
sessions at start, so that its cost model prices plain batching and trees from passes of several
widths before the first request."""

from __future__ import annotations

from targets.calibration import ROWS, TREE_NODES, calibrate, throwaway_tree
from targets.core import EngineCore
from targets.cost import PassCost
from targets.engine import VerifyEngine


def test_calibration_feeds_both_fits_every_width_and_leaves_no_session(tiny_model):
    model, _ = tiny_model
    engine = VerifyEngine(model)
    cost = PassCost(0.01)
    timed = calibrate(EngineCore(engine, cost), model.config.vocab_size)
    assert set(timed) == {(rows, nodes) for rows in ROWS for nodes in TREE_NODES}
    assert all(seconds > 0 for seconds in timed.values())
    assert cost.plain.samples == 2 * len(ROWS)
    assert cost.trees.samples == 2 * len(ROWS) * (len(TREE_NODES) - 1)
    assert cost.plain.prior == cost.plain.weights, "the fits are anchored"
    assert cost.trees.prior == cost.trees.weights
    assert len(engine) == 0


def test_a_throwaway_tree_is_a_valid_tree_of_the_size_asked():
    for nodes in TREE_NODES:
        tree = throwaway_tree(nodes, vocab=50)
        assert len(tree) == nodes
        assert all(-1 <= p < i for i, p in enumerate(tree.parents.tolist()))
        assert all(0 <= t < 50 for t in tree.tokens.tolist())
