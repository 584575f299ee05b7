"""Prompt lookup: propose what followed the latest earlier occurrence of the recent n-gram."""

from __future__ import annotations

import numpy as np

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.wire.tree import DraftTree, graft


class NgramDrafter(Drafter):
    """Needs no model. Greedy sessions get a trie of the most recent distinct continuations;
    sampled sessions get one chain, with a point-mass q that targets no longer need (they
    verify with their own seeded draw, ``starhub.models.coupling``)."""

    name = "ngram"
    lookup_branches = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        branches = self.continuations(ctx.tokens, shape.depth, 1 if not ctx.greedy else shape.topk)
        tree = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32))
        for branch in branches:
            tree = graft(tree, branch, shape.max_nodes)
        if not ctx.greedy:
            tree.dist_ids = np.zeros((len(tree) + 1, 1), np.int32)
            tree.dist_probs = np.zeros((len(tree) + 1, 1), np.float32)
            tree.dist_ids[tree.parents + 1, 0] = tree.tokens
            tree.dist_probs[tree.parents + 1, 0] = 1.0
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


class NgramIndex:
    """Prompt lookup for one growing token list, kept as it grows: where each n-gram last
    began, so a lookup costs the tokens appended since the last one, not a scan of them
    all. Answers what ``NgramDrafter.continuations(tokens, depth, 1)`` does."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = {n: 0 for n in self.sizes}
        """Per n, the n-grams starting before this are in ``latest``."""

    def continuation(self, tokens: list[int], depth: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix of
        ``tokens`` ([] if none); ``tokens`` may only have grown since the last call."""
        for n in self.sizes:
            # an n-gram is looked up only once a token follows it: the suffix itself is not
            end = len(tokens) - n
            for start in range(self.indexed[n], end):
                self.latest[tuple(tokens[start:start + n])] = start
            self.indexed[n] = max(self.indexed[n], end)
        for n in self.sizes:
            if len(tokens) > n:
                start = self.latest.get(tuple(tokens[-n:]))
                if start is not None:
                    return tokens[start + n:start + n + depth]
        return []
