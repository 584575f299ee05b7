"""How a drafter grows a draft tree: greedily (the best ``max_nodes`` by path score) or by
sampling without replacement, one frontier of expansions at a time, so that one batched
forward pass can grow many sessions' trees together.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from starhub.wire.tree import DraftTree

Expand = Callable[[Sequence[int], Sequence[int], Sequence[int]], torch.Tensor]
"""expand(node_ids, tokens, parent_ids) -> draft logits [len(node_ids), V] at those nodes.

Ids are candidate ids as the builder hands them out; a parent id is -1 for the root or the
id of a node passed to an earlier call. Drafters map ids to their own cache slots.
"""

Frontier = tuple[list[int], list[int], list[int]]
"""What a growing tree asks to have expanded next: (node ids, tokens, parent ids)."""

Grower = Generator[Frontier, "torch.Tensor | Ranked | None", DraftTree]
"""A tree being grown: it yields a frontier, is sent that frontier's draft logits (or None
to stop growing now and keep what it has), and returns the finished tree. A greedy grower
without a ``Score`` may be sent its frontier's ``Ranked`` children instead."""


@dataclass
class Ranked:
    """Rows of draft logits reduced to what a greedy tree keeps of them: each row's best
    children, best first, as log-probabilities and ids. A drafter that grows many trees
    in one pass ranks all their rows at once (``rank``, then ``split``): one
    ``log_softmax`` and one top-k per pass instead of one of each per tree and layer."""

    logp: list[list[float]]
    ids: list[list[int]]

    def split(self, sizes: Sequence[int]) -> list[Ranked]:
        out, start = [], 0
        for size in sizes:
            out.append(Ranked(self.logp[start:start + size], self.ids[start:start + size]))
            start += size
        return out


def rank(logits: torch.Tensor, k: int) -> Ranked:
    """The top ``k`` children of every row of ``logits`` [rows, V]. ``log_softmax`` is
    one vectorised pass on CPU, where ``logsumexp`` and ``topk`` over a long row are each
    more than twice as slow."""
    values, ids = top_k(torch.log_softmax(logits.float(), -1), k)
    return Ranked(values.tolist(), ids.tolist())


def top_k(x: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, -1)`` for [rows, V], in two short steps: the k best of each row lie in
    the k blocks of ``block`` columns with the largest maxima, so only those are searched.
    Ties may pick other, equally good ids."""
    rows, width = x.shape
    k = min(k, width)
    if width % block or width < 4 * k * block:
        return x.topk(k, -1)
    blocks = x.view(rows, width // block, block)
    best = blocks.amax(-1).topk(k, -1).indices
    picked = blocks.gather(1, best[..., None].expand(-1, -1, block)).reshape(rows, k * block)
    values, at = picked.topk(k, -1)
    return values, best.gather(1, at // block) * block + at % block


def drive(grower: Grower, expand: Expand) -> DraftTree:
    """Grow one tree to the end, expanding each frontier with ``expand``."""
    return grow_together([grower], lambda frontiers: [expand(*f) for _, f in frontiers])[0]


def grow_together(growers: list[Grower],
                  expand_many: Callable[[list[tuple[int, Frontier]]], list[torch.Tensor]],
                  stop: Callable[[], bool] | None = None,
                  admit: Callable[[], list[Grower]] | None = None,
                  finished: Callable[[int, DraftTree], None] | None = None
                  ) -> list[DraftTree]:
    """Grow several trees layer by layer in lockstep, so that a drafter expands every
    tree's frontier in one batched pass (``expand_many`` gets (index, frontier) pairs and
    returns their logits in order). ``stop()`` true between layers ends every tree with
    the nodes it has.

    Continuous batching: ``admit()``, asked between layers, returns more growers to join
    (their indices follow the ones before), and ``finished(i, tree)`` hears of each tree
    the moment it is done, while the others grow on."""
    growers = list(growers)
    trees: list[DraftTree | None] = [None] * len(growers)
    waiting: dict[int, Frontier] = {}

    def advance(i: int, logits: torch.Tensor | None, first: bool = False) -> None:
        _advance(growers[i], logits, i, waiting, trees, first)
        if finished is not None and i not in waiting:
            finished(i, trees[i])

    for i in range(len(growers)):
        advance(i, None, first=True)
    while True:
        if admit is not None and not (stop is not None and stop()):
            for grower in admit():
                growers.append(grower)
                trees.append(None)
                advance(len(growers) - 1, None, first=True)
        if not waiting:
            break
        halt = stop is not None and stop()
        asks = list(waiting.items())
        answers = [None] * len(asks) if halt else expand_many(asks)
        waiting = {}
        for (i, _), logits in zip(asks, answers, strict=True):
            advance(i, logits)
    return trees  # type: ignore[return-value]


def _advance(grower: Grower, logits: torch.Tensor | None, i: int,
             waiting: dict[int, Frontier], trees: list, first: bool = False) -> None:
    try:
        waiting[i] = next(grower) if first else grower.send(logits)
    except StopIteration as done:
        trees[i] = done.value


class TreeFeed:
    """Where fed tree nodes sit in a drafter's cache after the ``base`` committed entries.

    ``layout`` gives the mask rows and positions for the next frontier: each node sees the
    committed prefix, its fed ancestors and itself, at position ``base + depth - 1``.
    """

    def __init__(self, base: int):
        self.base = base
        self.ancestors: dict[int, list[int]] = {-1: []}

    def layout(self, ids: Sequence[int], parents: Sequence[int],
               start: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = len(ids)
        mask = torch.zeros(m, start + m, dtype=torch.bool)
        mask[:, : self.base] = True
        rows, cols, positions = [], [], []
        for row, (node, parent) in enumerate(zip(ids, parents, strict=True)):
            seen = self.ancestors[node] = self.ancestors[parent] + [start + row]
            rows += [row] * len(seen)
            cols += seen
            positions.append(self.base + len(seen) - 1)
        mask[rows, cols] = True
        return mask, torch.tensor(positions)


Score = Callable[[torch.Tensor, int], torch.Tensor]
"""Turns a layer's logits into the scores its children are ranked by, given the layer's
depth (1 for the root's children); a seeded sampled session adds the target's noise."""


def build_greedy_tree(root_logits: torch.Tensor, expand: Expand, depth: int, topk: int,
                      max_nodes: int, score: Score | None = None, floor: float = 0.0
                      ) -> DraftTree:
    return drive(grow_greedy(root_logits, depth, topk, max_nodes, score, floor), expand)


def grow_greedy(root_logits: torch.Tensor | Ranked, depth: int, topk: int, max_nodes: int,
                score: Score | None = None, floor: float = 0.0) -> Grower:
    """EAGLE-2 dynamic tree: expand the top-k paths per layer, keep the best nodes overall.

    A node's score is its path's cumulative log-probability, which never grows along a
    path, so the best ``max_nodes`` always include each chosen node's ancestors, and only
    nodes that could still have a child among them are expanded (``_useful``). With
    ``score``, the log-probabilities are those of the softmax of ``score(logits, layer
    depth)``.

    Nodes whose path probability is below ``floor`` are left out, all but the root's best
    child: a node is accepted about as often as its path probability says, so where each
    node costs the target verify time, the unlikely ones cost more than they add. Their
    subtrees score lower still, so a layer whose nodes all fall below it ends the tree.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    least = math.log(floor) if floor > 0 else -math.inf

    def add(nodes: list[int], logits: torch.Tensor | Ranked, layer: int) -> list[int]:
        """Each node's top-k children, scored by log-probability: one top-k and one
        log-sum-exp for the whole layer rather than a softmax per node."""
        if not isinstance(logits, Ranked):
            logits = rank(logits if score is None else score(logits, layer), topk)
        new = []
        for node, vals, toks in zip(nodes, logits.logp, logits.ids, strict=True):
            base = scores[node] if node >= 0 else 0.0
            for v, t in zip(vals[:topk], toks[:topk], strict=True):
                if base + v < least and tokens:  # best first: the rest are lower
                    break
                new.append(len(tokens))
                tokens.append(t)
                parents.append(node)
                scores.append(base + v)
        return new

    root = root_logits if isinstance(root_logits, Ranked) else root_logits[None]
    frontier = _useful(_best(add([-1], root, 1), scores, topk), scores, max_nodes)
    for layer in range(2, depth + 1):
        if not frontier:
            break
        logits = yield frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier]
        if logits is None:
            break
        frontier = _useful(_best(add(frontier, logits, layer), scores, topk), scores,
                           max_nodes)
    keep = sorted(_best(range(len(tokens)), scores, max_nodes))
    return _subtree(keep, tokens, parents)


def build_sampled_tree(root_logits: torch.Tensor, expand: Expand, depth: int, topk: int,
                       max_nodes: int, temperature: float, support: int,
                       generator: torch.Generator) -> DraftTree:
    return drive(grow_sampled(root_logits, depth, topk, max_nodes, temperature, support,
                              generator), expand)


def grow_sampled(root_logits: torch.Tensor, depth: int, topk: int, max_nodes: int,
                 temperature: float, support: int, generator: torch.Generator) -> Grower:
    """A tree whose children are drawn without replacement from top-``support`` draft q.

    Which nodes get children, and how many, is decided before those children are drawn,
    and every drawn child is kept: that is what keeps recursive rejection lossless.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    dists: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    budget = max_nodes

    def draw(node: int, logits: torch.Tensor, base: float, count: int) -> list[int]:
        q_ids, q_probs = truncated_distribution(logits, temperature, support)
        dists[node] = (q_ids.numpy().astype(np.int32), q_probs.numpy().astype(np.float32))
        order = sample_without_replacement(q_probs, count, generator)
        new = []
        for j in order.tolist():
            new.append(len(tokens))
            tokens.append(int(q_ids[j]))
            parents.append(node)
            scores.append(base + float(torch.log(q_probs[j])))
        return new

    count = min(topk, budget)
    layer = draw(-1, root_logits, 0.0, count)
    budget -= len(layer)
    for _ in range(depth - 1):
        if budget <= 0:
            break
        frontier = _best(layer, scores, topk)
        logits = yield frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier]
        if logits is None:
            break
        layer = []
        for row, node in enumerate(frontier):
            count = min(topk, budget)
            if count <= 0:
                break
            layer += draw(node, logits[row], scores[node], count)
            budget -= count
    tree = DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32))
    width = support
    tree.dist_ids = np.zeros((len(tokens) + 1, width), np.int32)
    tree.dist_probs = np.zeros((len(tokens) + 1, width), np.float32)
    for node, (ids, probs) in dists.items():
        tree.dist_ids[node + 1, : len(ids)] = ids
        tree.dist_probs[node + 1, : len(probs)] = probs
    return tree


def truncated_distribution(logits: torch.Tensor, temperature: float,
                           support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``support`` entries of softmax(logits / T), renormalised: exact q, k entries."""
    probs = torch.softmax(logits.double() / max(temperature, 1e-5), -1)
    values, ids = probs.topk(min(support, probs.numel()))
    return ids.cpu(), (values / values.sum()).cpu()  # drawn with a CPU generator, sent as is


def sample_without_replacement(probs: torch.Tensor, count: int,
                               generator: torch.Generator) -> torch.Tensor:
    """Indices in sequential draw order (Gumbel-top-k is exactly sequential sampling)."""
    count = min(count, int((probs > 0).sum()))
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float64).clamp_min(1e-300)
    keys = torch.log(probs.double()) - torch.log(-torch.log(u))
    return keys.topk(count).indices


def _useful(frontier: list[int], scores: list[float], max_nodes: int) -> list[int]:
    """The frontier nodes whose children could still enter the best ``max_nodes``. A child
    never scores above its parent, ``_best`` breaks ties in favour of older nodes, and the
    cutoff only rises as nodes are added: so expanding any other node is wasted work, and
    leaving it out changes nothing in the tree."""
    if len(scores) < max_nodes:
        return frontier
    cutoff = heapq.nlargest(max_nodes, scores)[-1]
    return [i for i in frontier if scores[i] > cutoff]


def _best(ids: Sequence[int] | range, scores: list[float], k: int) -> list[int]:
    return sorted(ids, key=lambda i: (-scores[i], i))[:k]


def _subtree(keep: list[int], tokens: list[int], parents: list[int]) -> DraftTree:
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        np.asarray([tokens[i] for i in keep], np.int32),
        np.asarray([index[parents[i]] if parents[i] >= 0 else -1 for i in keep], np.int32),
    )
