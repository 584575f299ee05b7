"""Passes timed when a serving target starts, so that its gate knows what plain batching
and trees cost on this CPU before the first request.

A fit of live passes knows only the batches the load has run, and its split of a pass into
a fixed cost and a cost per row or per fed token is its prior until passes of several
widths have run. ``calibrate`` runs a few batched passes over throwaway sessions, at 1, 2
and 4 rows, plain and with trees of two sizes, at two cache lengths, and teaches them to
the core's cost model, whose fits then fall back to what they tell where later passes stop
telling their terms apart (``PassCost.anchor``): 19 passes, one to five seconds on a 2-core CPU,
once per process."""

from __future__ import annotations

import numpy as np

from starhub.wire.tree import DraftTree
from targets.core import EngineCore

ROWS = (1, 2, 4)
TREE_NODES = (0, 4, 10)
"""0: a plain pass; the others: tree sizes around the hub's (its default is 10 nodes)."""
LENGTHS = (144, 48)
"""Cache lengths of the throwaway sessions, alike within a pass (rows of unlike lengths pay
for padding, which no fit term prices) and apart between the two groups, so that what
attention to the cache costs is told from what a fed token costs."""


def throwaway_tree(nodes: int, vocab: int) -> DraftTree:
    """A tree of ``nodes`` guesses, two at the root and two under each node after: a pass
    pays for its fed tokens and their mask, whatever the tokens are."""
    parents = np.array([-1 if i < 2 else (i - 2) // 2 for i in range(nodes)], np.int32)
    return DraftTree(np.array([(31 * i + 7) % vocab for i in range(nodes)], np.int32), parents)


def calibrate(core: EngineCore, vocab: int) -> dict[tuple[int, int], float]:
    """Run a pass of each shape (rows, tree nodes) over each group of throwaway sessions,
    after one untimed pass (a process's first passes run slow), and teach the core's cost
    model them. Returns the seconds alone of the last group's passes by (rows, tree
    nodes), for the log."""
    engine, groups, sid = core.engine, [], 0
    for length in LENGTHS:
        group = []
        for _ in range(max(ROWS)):
            sid -= 1  # requests are numbered from 1
            engine.open(sid, [(7 * sid + j) % vocab for j in range(length)])
            group.append(sid)
        groups.append(group)
    plan = [(group, rows, nodes) for group in groups for rows in ROWS for nodes in TREE_NODES]
    timed: dict[tuple[int, int], float] = {}
    try:
        for i, (group, rows, nodes) in enumerate([plan[-1], *plan]):
            batch = [(s, throwaway_tree(nodes, vocab)) for s in group[:rows]]
            done = core.verify(batch, trees=rows if nodes else 0, learn=i > 0)
            timed[rows, nodes] = done.alone
    finally:
        for group in groups:
            for s in group:
                engine.close(s)
    core.cost.anchor()
    return timed
