"""One session's pass (a plain step, or a tree to verify) run on numpy.

Such a pass streams every weight once through the products of a few rows; the rest of it is
about twenty small operations a layer (two norms, the rotary positions, attention over the
cache, the gated activation, two residual sums). At a few tokens each of those costs what
dispatching it costs, and PyTorch's dispatch is the dearer: about 10 µs for an RMS norm of
one row and 17 µs for a batched product of a few heads, against numpy's 1 to 5 µs. On the
embedded model that was a quarter of a plain step (figures in docs/benchmarks.md, "A pass
of one row on numpy"). So where the whole model is float32 on the CPU, with its
projections fused (``starhub.models.fused``) and a SiLU-gated MLP, ``DecoderPass`` runs a
pass of a single row here instead of through its layers: the same arithmetic over numpy
views of the same weights, the row's new keys and values written in place into the
session's own cache buffers, its tokens attending under the row's positions and mask as
``targets.forward`` has them (logits within about 1e-5 of the layered pass: float32
rounding in another order).

The products stay on the kernels the loader chose: a layer that runs a few rows on numpy's
BLAS (``--linear auto``'s choice where it is fastest: ``OneDNNLinear.on_blas``) is
multiplied here directly, any other product is the layer's own, called through PyTorch on a
view of the rows. PyTorch's threads spin between its ops, so a row of several tokens (a
tree's, whose products may go through it) keeps numpy's products to one BLAS thread
(``blas_alone``, as the loader timed them); a plain step runs no PyTorch op and keeps the
whole BLAS pool. Rows of more than
``MAX_TOKENS`` run through the layers: there attention is most of the rest, and PyTorch's
is the faster over many tokens. A ``OneRowPass`` holds the model's modules and numpy views
of its weights as they were when it was made (the loaded model's, which nothing changes
afterwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from starhub.models.loading import OneDNNLinear, blas_alone
from targets.kv import SessionKV

Product = Callable[[np.ndarray], np.ndarray]

ACTIVATIONS = ("silu", "swish")

MAX_TOKENS = 32
"""The longest row run here: a tree's, never a prompt's. numpy's attention was as fast as
PyTorch's for 5 and 11 new tokens over 261 cached ones and 18% slower for 11 over 611."""


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
    """Whether ``OneRowPass`` can run ``model``: float32 weights on the CPU, every layer's
    projections fused and a SiLU-gated MLP."""
    params = list(model.parameters())
    cfg = model.config
    return (bool(params) and all(p.dtype == torch.float32 and p.device.type == "cpu"
                                 for p in params)
            and getattr(cfg, "hidden_act", None) in ACTIVATIONS
            and all(hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
                    for layer in model.model.layers))


class OneRowPass:
    """Passes of one session's row over a loaded model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        inner = model.model
        self.embed = _array(inner.embed_tokens.weight)
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.final_norm = _Norm(inner.norm)
        self.head = _product(model.lm_head)

    def _rotary(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The model's own ``[n, 1, head_dim]`` cosines and sines at ``positions`` (whatever
        its rope scaling), to broadcast over the heads."""
        cos, sin = self.rotary(torch.zeros(1), torch.from_numpy(positions)[None])
        return cos.numpy()[0, :, None], sin.numpy()[0, :, None]

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        half = self.head_dim // 2
        return x * cos + np.concatenate((-x[..., half:], x[..., :half]), -1) * sin

    @torch.inference_mode()
    def __call__(self, kv: SessionKV, ids: list[int], positions: np.ndarray,
                 mask: np.ndarray | None, logits: slice | None, features: set[int]
                 ) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """Feed the tokens ``ids`` at ``positions`` after the ``kv.length`` entries of
        ``kv`` (which must have room for them), each new token seeing the whole cache and
        the new ones ``mask`` allows (``[n, n]`` boolean; None: all of them), write their
        keys and values there and move ``kv`` on. Returns the logits of the new tokens
        ``logits`` picks (None: none) and the hidden states ``features`` names (0: the
        embeddings, i: layer i's output, the last layer's normed, as transformers numbers
        them), each ``[n, ...]``."""
        n = len(ids)
        cos, sin = self._rotary(positions)
        additive = None
        if mask is not None:  # -inf where a new token must not look, across the cache's end
            additive = np.where(mask, np.float32(0), np.float32(-np.inf))
        x = self.embed[ids]
        hidden = {0: x} if 0 in features else {}
        # more than one token: products may run through PyTorch, whose threads spin
        # between them, so numpy's own products keep to one BLAS thread
        alone = blas_alone() if n > 1 else contextlib.nullcontext()
        with alone, np.errstate(over="ignore"):  # the SiLU's exp(-gate) may overflow
            for li, layer in enumerate(self.layers):
                x = self._layer(layer, x, kv.keys[li].numpy(), kv.values[li].numpy(),
                                kv.length, cos, sin, additive)
                if li + 1 in features:
                    hidden[li + 1] = x
        kv.advance(n)
        top = len(self.layers)
        if top in features:  # transformers gives the last layer's output normed
            hidden[top] = self.final_norm(x)
        if logits is None:
            return None, hidden
        picked = hidden[top][logits] if top in features else self.final_norm(x[logits])
        return self.head(picked), hidden

    def _layer(self, layer: _Layer, x: np.ndarray, keys: np.ndarray, values: np.ndarray,
               start: int, cos: np.ndarray, sin: np.ndarray, additive: np.ndarray | None
               ) -> np.ndarray:
        """One decoder layer for the rows ``x``, their keys and values written from
        ``start`` on in the layer's cache buffers ``keys`` and ``values``."""
        heads, kv_heads, dim, groups = self.heads, self.kv_heads, self.head_dim, self.groups
        n, end = x.shape[0], start + x.shape[0]
        qkv = layer.qkv(layer.input_norm(x)).reshape(n, heads + 2 * kv_heads, dim)
        q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        keys[:, start:end] = self._rotate(k, cos, sin).transpose(1, 0, 2)
        values[:, start:end] = qkv[:, heads + kv_heads:].transpose(1, 0, 2)
        # each key/value head's group of query heads, its rows one after another
        q = self._rotate(q, cos, sin).reshape(n, kv_heads, groups, dim).transpose(1, 2, 0, 3)
        scores = np.matmul(q.reshape(kv_heads, groups * n, dim),
                           keys[:, :end].transpose(0, 2, 1))
        scores *= layer.scale
        if additive is not None:
            scores.reshape(kv_heads, groups, n, end)[..., start:] += additive
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out = np.matmul(weights, values[:, :end]).reshape(kv_heads, groups, n, dim)
        x = x + layer.o(out.transpose(2, 0, 1, 3).reshape(n, heads * dim))
        gate_up = layer.gate_up(layer.post_norm(x))
        gate, up = gate_up[:, :layer.inner], gate_up[:, layer.inner:]
        return x + layer.down(gate / (1 + np.exp(-gate)) * up)
