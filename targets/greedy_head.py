"""A greedy row's token from the LM head without streaming its float32 weights.

A greedy verdict or plain step needs each position's argmax over the vocabulary, not its
logits. The LM head is the largest product of a small model (SmolLM2-135M: 49,152 × 576,
113 MB of float32, a fifth of a step's weight reads), so where the CPU multiplies
bfloat16 in hardware the head first runs on a bfloat16 copy of its weight (half the
bytes), with a bound on how far each such logit can be from the float32 one, and only the
tokens the bound cannot rule out get their float32 logits (on answers to chat prompts, a
median of 7 to 24 weight rows).

The bound. With ``x`` the normed hidden row, ``w`` a vocabulary row and ``u = 2**-8``
bfloat16's unit roundoff, rounding both to bfloat16 moves each product ``x_i w_i`` by at
most ``(2u + u**2)|x_i w_i|``; accumulating ``d`` products in float32 (here and in the
float32 logit it stands for) adds at most ``d * 2**-24 * sum|x_i w_i|`` each, and the
product's bfloat16 output rounds the sum by at most ``u`` of itself. So the two logits
differ by at most ``EPS * sum|x_i w_i| <= EPS * |x| |w|`` (Cauchy-Schwarz), ``EPS``
rounded up. Every token whose approximate logit is within ``EPS * |x| (|w_best| + |w|)``
of the best approximate one is a candidate, and no token outside can hold the float32
argmax; the row's token is the candidates' float32 argmax, the first on a tie, as
``argmax_rows`` takes it. The output is the float32 head's argmax, not an approximation
of it.
"""

from __future__ import annotations

import numpy as np
import torch

from starhub.models.loading import OneDNNLinear, native_bf16_cpu

EPS = 2.0 ** -7 + 2.0 ** -8 + 2.0 ** -10
"""Bounds ``|logit - approximate logit| / sum|x_i w_i|``: ``2u + u**2`` for the operands
(``u = 2**-8``), ``u (1 + 2u + u**2)`` for the output, and two float32 sums of up to 4,096
products (``2 * 4096 * 2**-24 = 2**-11``), rounded up."""

MAX_WIDTH = 4096
"""Hidden widths the bound ``EPS`` covers."""

UNION_SHARE = 8
"""Where the rows' candidates together pass this share of the vocabulary (a flat
distribution), gathering their float32 rows would cost about what the float32 head does,
which runs instead."""

PACK_ROWS = 16
"""The row count oneDNN lays the bfloat16 weight out for (as ``OneDNNLinear``)."""


def head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The ``[vocab, width]`` weight of the model's LM head where it has no bias: its own,
    or where the loader prepacked it (``OneDNNLinear``), its plain copy or the input
    embedding it is tied to; None where none of these is at hand."""
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "bias", None) is not None:
        return None
    if isinstance(head, torch.nn.Linear):
        return head.weight
    if isinstance(head, OneDNNLinear):
        if isinstance(head.one_row, torch.Tensor) and head.one_row.dim() == 2:
            return head.one_row
        if getattr(model.config, "tie_word_embeddings", False):
            return model.get_input_embeddings().weight
    return None


class GreedyHead:
    """Argmax rows of ``x @ weight.T`` for a float32 ``[vocab, width]`` LM head weight."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()
        """The float32 weight itself (shared, not copied): the candidates' rows."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.bfloat16(), PACK_ROWS)
        norms = torch.linalg.vector_norm(self.weight, dim=1, dtype=torch.float64).numpy()
        self.norms = norms * (1 + 1e-6)
        """Each vocabulary row's length, rounded up."""
        self.longest = float(self.norms.max())

    @classmethod
    def of(cls, model: torch.nn.Module) -> GreedyHead | None:
        """The model's, where it pays and the bound holds: a float32 head without bias on a
        CPU that multiplies bfloat16 in hardware (so not on the AVX2 path); else None, and
        greedy rows take the argmax of the head's own logits."""
        weight = head_weight(model)
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or \
                weight.shape[1] > MAX_WIDTH or not native_bf16_cpu():
            return None
        try:
            return cls(weight)
        except RuntimeError:  # this oneDNN build cannot lay out bfloat16 weights
            return None

    def picks(self, x: torch.Tensor | np.ndarray) -> list[int]:
        """Each ``[width]`` row of ``x``'s float32 argmax over the vocabulary. Its products
        run on PyTorch's threads, as the pass around it does (numpy's BLAS pool beside them
        would fight them for the cores)."""
        rows = torch.as_tensor(x, dtype=torch.float32).reshape(-1, self.weight.shape[1])
        if not bool(rows.isfinite().all()):  # no bound holds: the float32 head, whole
            return self._whole(rows)
        approx = torch.ops.mkldnn._linear_pointwise(
            rows.bfloat16(), self.packed, None, "none", [], "").float().numpy()
        best = approx.argmax(-1)
        top = approx[np.arange(len(rows)), best].astype(np.float64)
        size = EPS * np.linalg.norm(rows.numpy().astype(np.float64), axis=1)
        # within reach of the best with the longest vocabulary row (the floor rounded down to
        # float32 keeps every such token), then with each one's own
        floor = (top - size * (self.norms[best] + self.longest)).astype(np.float32)
        floor = np.nextafter(floor, np.float32(-np.inf))
        at, token = np.divmod(np.flatnonzero(approx >= floor[:, None]), approx.shape[1])
        near = approx[at, token] >= top[at] - size[at] * (self.norms[best[at]] + self.norms[token])
        at, token = at[near], token[near]
        union, column = np.unique(token, return_inverse=True)
        if len(union) * UNION_SHARE > len(self.weight):  # as dear as the float32 head
            return self._whole(rows)
        exact = np.full((len(rows), len(union)), -np.inf, np.float32)
        exact[at, column] = (rows @ self.weight[torch.from_numpy(union)].T).numpy()[at, column]
        return union[exact.argmax(-1)].tolist()

    def _whole(self, rows: torch.Tensor) -> list[int]:
        """The argmax of the float32 head's every logit."""
        return (rows @ self.weight.T).numpy().argmax(-1).tolist()
