"""Draft trees: the shape both sides agree on (a drafter grows one in
``starhub.drafters.growing``).

A tree's root is the last committed token, which is not part of the tree. Node i has
parent ``parents[i]`` (-1 for the root) and every parent comes before its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: np.ndarray
    parents: np.ndarray
    dist_ids: np.ndarray | None = None
    dist_probs: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return int(depths(self.parents).max(initial=0))


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node; the root's children are at depth 1."""
    out: list[int] = []
    for p in np.asarray(parents).tolist():
        out.append(1 if p < 0 else out[p] + 1)
    return np.asarray(out, dtype=np.int64)


def graft(tree: DraftTree, chain: Sequence[int], max_nodes: int | None = None) -> DraftTree:
    """``tree`` with ``chain`` (tokens after the root) as one more branch: the part of it a
    path of the tree already holds costs nothing, the rest become new nodes, while the tree
    has fewer than ``max_nodes``. Greedy trees only: the grafted nodes have no draft
    distribution."""
    if tree.dist_ids is not None:
        raise ValueError("only greedy trees (without draft distributions) take a graft")
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents, strict=True))}
    parent = -1
    for tok in chain:
        node = child.get((parent, tok))
        if node is None:
            if max_nodes is not None and len(tokens) >= max_nodes:
                break
            node = child[(parent, tok)] = len(tokens)
            tokens.append(tok)
            parents.append(parent)
        parent = node
    if len(tokens) == len(tree):
        return tree
    return DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32))


def accepted_path(tokens: np.ndarray, parents: np.ndarray,
                  continuation: Sequence[int]) -> list[int]:
    """The nodes a greedy round accepts against a known continuation: from the root,
    follow the child whose token is the next one. Returns the node indices, root to leaf."""
    kids = children(np.asarray(parents))
    path: list[int] = []
    at = 0
    for want in np.asarray(continuation).tolist():
        nxt = next((c for c in kids[at] if int(tokens[c]) == want), None)
        if nxt is None:
            break
        path.append(nxt)
        at = nxt + 1
    return path


def ancestor_mask(parents: np.ndarray) -> torch.Tensor:
    """[n+1, n+1] boolean: row j may attend to column i when i is j itself or an ancestor.

    Index 0 is the root; node i of the tree is index i+1.
    """
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def children(parents: np.ndarray) -> list[list[int]]:
    """Children of each position (0 = root, i+1 = node i), in the order they were drawn."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def subtree(tree: DraftTree, node: int) -> DraftTree:
    """The nodes below ``node`` (-1: the root), as a tree whose root is ``node``: what is
    left to verify once a path to it is known to be the target's own. Draft distributions
    are left out (verification does not read them: ``targets.acceptance``)."""
    parents = np.asarray(tree.parents).tolist()
    keep, index = [], {node: -1}
    for i, p in enumerate(parents):
        if p in index:
            index[i] = len(keep)
            keep.append(i)
    return DraftTree(np.asarray(tree.tokens)[keep].astype(np.int32),
                     np.asarray([index[parents[i]] for i in keep], np.int32))


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree(np.asarray(tokens, np.int32), np.arange(-1, n - 1, dtype=np.int32))
