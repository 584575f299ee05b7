"""Walking a verified draft tree: which nodes the target keeps, and its own next token.

Greedy keeps the child equal to the target's argmax. Sampling applies recursive rejection
over each node's children in draw order, against the exact truncated draft q the drafter
sent, so the committed tokens are distributed exactly as the target's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from starhub.tree import DraftTree, children


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """softmax(logits / T) with nucleus filtering, in float64, as transformers' warpers do."""
    probs = torch.softmax(logits.double() / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        cum = sorted_probs.cumsum(-1)
        drop = cum - sorted_probs > sampling.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """(accepted node indices along one path, bonus token). ``logits[0]`` is the root's."""
    kids = children(tree.parents)
    argmax = logits.argmax(-1).tolist()
    path: list[int] = []
    pos = 0
    while True:
        want = argmax[pos]
        nxt = next((c for c in kids[pos] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        pos = nxt + 1


def accept_sampled(tree: DraftTree, logits: torch.Tensor, sampling: Sampling,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree (lossless for draws without replacement)."""
    kids = children(tree.parents)
    path: list[int] = []
    pos = 0
    while True:
        p = target_probs(logits[pos], sampling)
        if kids[pos]:
            q = _sparse_q(tree, pos, p)
            for child in kids[pos]:
                token = int(tree.tokens[child])
                q_x = float(q[token])
                if q_x <= 0:
                    continue
                if float(torch.rand((), generator=generator, dtype=torch.float64)) \
                        < min(1.0, float(p[token]) / q_x):
                    path.append(child)
                    pos = child + 1
                    break
                residual = (p - q).clamp_min(0)
                if residual.sum() > 1e-12:
                    p = residual / residual.sum()
                q[token] = 0.0
                if q.sum() > 0:
                    q = q / q.sum()
            else:
                return path, sample(p, generator)
        else:
            return path, sample(p, generator)


def _sparse_q(tree: DraftTree, pos: int, like: torch.Tensor) -> torch.Tensor:
    """The dense draft distribution at tree position ``pos`` from its sparse row."""
    if tree.dist_ids is None:
        raise ValueError("a sampled session needs draft distributions in PROPOSE")
    q = torch.zeros_like(like)
    ids = torch.from_numpy(np.asarray(tree.dist_ids[pos], np.int64))
    probs = torch.from_numpy(np.asarray(tree.dist_probs[pos], np.float64))
    q.index_add_(0, ids.clamp(0, like.numel() - 1), probs)
    total = q.sum()
    return q / total if total > 0 else q
