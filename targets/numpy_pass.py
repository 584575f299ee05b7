"""Passes of a few tokens run on numpy: one session's (a plain step, a tree to verify, a
short chunk), or plain steps of several sessions at once.

Such a pass streams every weight once through the products of a few rows; the rest of it is
about twenty small operations a layer (two norms, the rotary positions, attention over each
cache, the gated activation, two residual sums). At a few tokens each of those costs what
dispatching it costs, and PyTorch's dispatch is the dearer: about 10 µs for an RMS norm of
one row and 17 µs for a batched product of a few heads, against numpy's 1 to 5 µs. On the
embedded model that was a quarter of a plain step, and a tenth to a quarter of a serving
pass of two to eight plain rows (figures in docs/benchmarks.md, "A pass of one row on
numpy" and "Plain steps of several sessions on numpy"). So where the whole model is
float32 on the CPU, with its projections fused (``starhub.models.fused``) and a SiLU-gated
MLP, ``DecoderPass`` runs such passes here instead of through its layers (``runs_here``):
the same arithmetic over numpy views of the same weights, each row's new keys and values
written in place into its session's own cache buffers, its tokens attending there under
the row's positions and mask as ``targets.forward`` has them (logits within about 1e-5 of
the layered pass: float32 rounding in another order). The products run over every row's
tokens at once; attention runs row by row.

The products stay on the kernels the loader chose: a layer that runs a few rows on numpy's
BLAS (``--linear auto``'s choice where it is fastest: ``OneDNNLinear.on_blas``) is
multiplied here directly, any other product is the layer's own, called through PyTorch on a
view of the rows. PyTorch's threads spin between its ops, so a pass of several tokens
(whose products may go through it) keeps numpy's products to one BLAS thread
(``blas_alone``, as the loader timed them); a plain step of one session runs no PyTorch op
and keeps the whole BLAS pool. A ``NumpyPass`` holds the model's modules and numpy views
of its weights as they were when it was made (the loaded model's, which nothing changes
afterwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from starhub.models.loading import OneDNNLinear, blas_alone
from targets.kv import SessionKV

Product = Callable[[np.ndarray], np.ndarray]

ACTIVATIONS = ("silu", "swish")

MAX_TOKENS = 32
"""The longest row run here (a tree's, never a whole prompt's), and the most rows of plain
steps. numpy's attention was as fast as PyTorch's for 5 and 11 new tokens over 261 cached
ones and 18% slower for 11 over 611: a pass of several sessions' trees, each row's
attention over its own cache, stays on PyTorch's, which runs on all the threads."""


def runs_here(sizes: list[int]) -> bool:
    """Whether a pass of rows of these token counts runs on numpy: a single row of up to
    ``MAX_TOKENS`` tokens, or up to ``MAX_TOKENS`` rows of one token each (plain steps of
    several sessions: two to eight of them ran up to a quarter faster here than through
    the layers on the embedded model at 100 and 600 cached tokens, none slower)."""
    if len(sizes) == 1:
        return sizes[0] <= MAX_TOKENS
    return len(sizes) <= MAX_TOKENS and all(n == 1 for n in sizes)


def _product(linear: torch.nn.Module) -> Product:
    """``linear`` as a function of ``[n, in]`` numpy rows: on numpy's BLAS where the layer
    takes that many rows there (asked at each call: the choice can change after load),
    anything else through the layer itself."""
    prepacked = isinstance(linear, OneDNNLinear)

    def product(x: np.ndarray) -> np.ndarray:
        if prepacked and linear.on_blas(x.shape[0]):
            return linear.blas(x)
        return linear(torch.from_numpy(x)[None]).numpy()[0]
    return product


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class _Norm:
    """An RMS norm of transformers' usual form, over the last axis."""

    def __init__(self, module: torch.nn.Module):
        self.weight = _array(module.weight)
        self.eps = module.variance_epsilon

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] == 1 and x.ndim == 2:  # one row: a dot product is the cheapest call
            row = x[0]
            scale = np.float32(1.0 / np.sqrt(np.dot(row, row) / row.shape[0] + self.eps))
        else:
            scale = (1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)
                     ).astype(np.float32)
        return self.weight * (x * scale)


class _Layer:
    """One decoder layer's weights, as numpy arrays and products."""

    def __init__(self, layer: torch.nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _Norm(layer.input_layernorm)
        self.qkv = _product(attn.qkv_proj.joint)
        self.q_norm = _Norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = _Norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        self.o = _product(attn.o_proj)
        self.scale = np.float32(attn.scaling)
        self.post_norm = _Norm(layer.post_attention_layernorm)
        self.gate_up = _product(mlp.gate_up_proj.joint)
        self.inner = mlp.gate_up_proj.sizes[0]
        self.down = _product(mlp.down_proj)


def supported(model: torch.nn.Module) -> bool:
    """Whether ``NumpyPass`` can run ``model``: float32 weights on the CPU, every layer's
    projections fused and a SiLU-gated MLP."""
    params = list(model.parameters())
    cfg = model.config
    return (bool(params) and all(p.dtype == torch.float32 and p.device.type == "cpu"
                                 for p in params)
            and getattr(cfg, "hidden_act", None) in ACTIVATIONS
            and all(hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
                    for layer in model.model.layers))


class NumpyRow(NamedTuple):
    """One session's part of a numpy pass: ``targets.forward.Row`` as numpy holds it."""
    kv: SessionKV
    ids: list[int]
    positions: np.ndarray
    mask: np.ndarray | None


class NumpyPass:
    """Passes of a few tokens over a loaded model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        inner = model.model
        self.embed = _array(inner.embed_tokens.weight)
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.final_norm = _Norm(inner.norm)
        self.head = _product(model.lm_head)
        self._first = inner.layers[0].self_attn.qkv_proj.joint

    def keeps_blas_pool(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens runs its products on numpy's whole BLAS pool
        of several threads: one token, on layers whose single rows run there. Nothing of
        such a pass may run on PyTorch's threads: those spin a while after each parallel
        op, on the cores the BLAS's threads need."""
        return (tokens == 1 and torch.get_num_threads() > 1
                and isinstance(self._first, OneDNNLinear) and self._first.on_blas(1))

    def _rotary(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The model's own ``[n, 1, head_dim]`` cosines and sines at ``positions`` (whatever
        its rope scaling), to broadcast over the heads."""
        cos, sin = self.rotary(torch.zeros(1), torch.from_numpy(positions)[None])
        return cos.numpy()[0, :, None], sin.numpy()[0, :, None]

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        half = self.head_dim // 2
        return x * cos + np.concatenate((-x[..., half:], x[..., :half]), -1) * sin

    @torch.inference_mode()
    def __call__(self, rows: list[NumpyRow], logits: list[slice | None], features: set[int]
                 ) -> tuple[list[np.ndarray | None], dict[int, np.ndarray]]:
        """Feed each row's tokens ``ids`` at ``positions`` after the ``kv.length`` entries
        of its ``kv`` (which must have room for them), each new token seeing the whole
        cache and the row's new ones ``mask`` allows (``[n, n]`` boolean; None: all of
        them), write their keys and values there and move each ``kv`` on. Returns for each
        row the logits of the new tokens its ``logits`` picks (None: none), and the hidden
        states ``features`` names (0: the embeddings, i: layer i's output, the last layer's
        normed, as transformers numbers them), each ``[tokens, ...]`` over every row's
        tokens in order."""
        sizes = [len(row.ids) for row in rows]
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        cos, sin = self._rotary(np.concatenate([row.positions for row in rows]))
        additive = [None if row.mask is None else  # -inf where a new token must not look
                    np.where(row.mask, np.float32(0), np.float32(-np.inf)) for row in rows]
        x = self.embed[[t for row in rows for t in row.ids]]
        hidden = {0: x} if 0 in features else {}
        # more than one token: products may run through PyTorch, whose threads spin
        # between them, so numpy's own products keep to one BLAS thread
        alone = blas_alone() if sum(sizes) > 1 else contextlib.nullcontext()
        with alone, np.errstate(over="ignore"):  # the SiLU's exp(-gate) may overflow
            for li, layer in enumerate(self.layers):
                caches = [(row.kv.keys[li].numpy(), row.kv.values[li].numpy(), row.kv.length,
                           mask, slice(s, s + n)) for row, mask, s, n
                          in zip(rows, additive, starts, sizes, strict=True)]
                x = self._layer(layer, x, caches, cos, sin)
                if li + 1 in features:
                    hidden[li + 1] = x
        for row, n in zip(rows, sizes, strict=True):
            row.kv.advance(n)
        top = len(self.layers)
        if top in features:  # transformers gives the last layer's output normed
            hidden[top] = self.final_norm(x)
        picks = [None if pick is None else np.arange(s, s + n)[pick]
                 for pick, s, n in zip(logits, starts, sizes, strict=True)]
        flat = [i for pick in picks if pick is not None for i in pick]
        if not flat:
            return [None] * len(rows), hidden
        picked = hidden[top][flat] if top in features else self.final_norm(x[flat])
        every, at, out = self.head(picked), 0, []
        for pick in picks:
            out.append(None if pick is None else every[at:at + len(pick)])
            at += 0 if pick is None else len(pick)
        return out, hidden

    def _layer(self, layer: _Layer, x: np.ndarray, caches: list, cos: np.ndarray,
               sin: np.ndarray) -> np.ndarray:
        """One decoder layer for the rows ``x``: each row's keys and values written after
        the entries its cache holds, its queries attending there (``caches``: for each row
        the layer's keys and values buffers, the entries held, its additive mask or None,
        and its slice of ``x``)."""
        heads, kv_heads, dim, groups = self.heads, self.kv_heads, self.head_dim, self.groups
        qkv = layer.qkv(layer.input_norm(x)).reshape(x.shape[0], heads + 2 * kv_heads, dim)
        q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        k, v = self._rotate(k, cos, sin), qkv[:, heads + kv_heads:]
        q = self._rotate(q, cos, sin)
        out = np.empty((x.shape[0], kv_heads, groups, dim), np.float32)
        for keys, values, start, additive, rows in caches:
            self._attend_row(q[rows], k[rows], v[rows], keys, values, start, additive,
                             layer.scale, out[rows])
        x = x + layer.o(out.reshape(x.shape[0], heads * dim))
        gate_up = layer.gate_up(layer.post_norm(x))
        gate, up = gate_up[:, :layer.inner], gate_up[:, layer.inner:]
        return x + layer.down(gate / (1 + np.exp(-gate)) * up)

    def _attend_row(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray,
                    values: np.ndarray, start: int, additive: np.ndarray | None,
                    scale: np.float32, out: np.ndarray) -> None:
        """One row's attention: its ``[n, heads, dim]`` queries over its cache's ``start``
        entries and its own ``[n, kv_heads, dim]`` keys and values ``k``, ``v`` (written
        there first) under its ``additive`` mask; into ``out``, ``[n, kv_heads, groups,
        dim]``."""
        kv_heads, groups, dim = self.kv_heads, self.groups, self.head_dim
        n = q.shape[0]
        end = start + n
        keys[:, start:end] = k.transpose(1, 0, 2)
        values[:, start:end] = v.transpose(1, 0, 2)
        # each key/value head's group of query heads, the row's tokens one after another
        folded = q.reshape(n, kv_heads, groups, dim).transpose(1, 2, 0, 3).reshape(
            kv_heads, groups * n, dim)
        if n == 1:  # the cache on the left: a product numpy's BLAS runs without copying it
            scores = np.matmul(keys[:, :end], folded.transpose(0, 2, 1).copy()
                               ).transpose(0, 2, 1).copy()
        else:
            scores = np.matmul(folded, keys[:, :end].transpose(0, 2, 1))
        scores *= scale
        if additive is not None:
            scores.reshape(kv_heads, groups, n, end)[..., start:] += additive
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[:] = np.matmul(weights, values[:, :end]).reshape(
            kv_heads, groups, n, dim).transpose(2, 0, 1, 3)
