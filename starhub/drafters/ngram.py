"""Prompt lookup: propose what followed the latest earlier occurrence of the recent n-gram."""

from __future__ import annotations

import numpy as np

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.tree import DraftTree


class NgramDrafter(Drafter):
    """Needs no model. Greedy sessions get a trie of the most recent distinct continuations;
    sampled sessions get one chain, with a point-mass q that targets no longer need (they
    verify with their own seeded draw, ``starhub.coupling``)."""

    name = "ngram"
    lookup_branches = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        branches = self.continuations(ctx.tokens, shape.depth, 1 if not ctx.greedy else shape.topk)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        for branch in branches:
            parent = -1
            for tok in branch:
                node = children.get((parent, tok))
                if node is None:
                    if len(tokens) >= shape.max_nodes:
                        break
                    node = children[(parent, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                parent = node
        tree = DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32))
        if not ctx.greedy:
            tree.dist_ids = np.zeros((len(tokens) + 1, 1), np.int32)
            tree.dist_probs = np.zeros((len(tokens) + 1, 1), np.float32)
            for tok, parent in zip(tokens, parents, strict=True):
                tree.dist_ids[parent + 1, 0] = tok
                tree.dist_probs[parent + 1, 0] = 1.0
        return tree

    def continuations(self, tokens: list[int], depth: int, count: int) -> list[list[int]]:
        """Up to ``count`` distinct continuations, longest n-gram match and latest first."""
        seq = np.asarray(tokens, np.int64)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            pattern = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            starts = np.nonzero((windows == pattern).all(axis=1))[0]
            for start in starts[::-1]:
                cont = seq[start + n: start + n + depth].tolist()
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) >= count:
                        return found
        return found
