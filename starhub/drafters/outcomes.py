"""Which way a proposed tree's round will likely end, so a drafter can draft the next tree
before the COMMIT arrives (pre-drafting).

A greedy round ends at node v (the deepest accepted; -1 for none) with a bonus token b
that is none of v's children: the target's choice there. Taking the draft's own
distributions as the best guess of the target's, that outcome has probability

    P(v, b) = prod over v's path of q(node | parent) * q(b | v),   b not a child of v,

which sums to one over all outcomes of the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from starhub.wire.tree import children


def likely_outcomes(parents: Sequence[int], tokens: Sequence[int],
                    logp: dict[int, torch.Tensor], limit: int,
                    per_node: int = 2) -> list[tuple[float, int, int]]:
    """The ``limit`` likeliest (log-probability, v, b) outcomes, best first.

    ``logp[v]`` holds the draft's log-probabilities after node v (-1: after the root) over
    the same vocabulary as ``tokens``; nodes without an entry cannot end a guessed round.
    At most ``per_node`` bonus tokens are considered per node.
    """
    reach = {-1: 0.0}
    for i, p in enumerate(parents):
        if p in reach and p in logp:
            reach[i] = reach[p] + float(logp[p][tokens[i]])
    kids = children(list(parents))
    found: list[tuple[float, int, int]] = []
    for v, base in reach.items():
        if v not in logp:
            continue
        scores = logp[v].float().clone()
        taken = [tokens[c] for c in kids[v + 1]]
        if taken:
            scores[taken] = float("-inf")
        values, ids = scores.topk(min(per_node, scores.numel()))
        found += [(base + float(x), v, int(b)) for x, b in zip(values, ids, strict=True)
                  if x > float("-inf")]
    return heapq.nlargest(limit, found)


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's first child down to ``node`` (empty for -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
