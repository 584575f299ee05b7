"""One session's one-token pass, a plain decoding step, run on numpy.

Such a pass streams every weight once through matrix-vector products; the rest of it is
about twenty small operations a layer (two norms, the rotary positions, attention over the
cache, the gated activation, two residual sums). At one token each of those costs what
dispatching it costs, and PyTorch's dispatch is the dearer: about 10 µs for an RMS norm of
one row and 17 µs for a batched product of a few heads against numpy's 1 to 5 µs. On the
embedded model that was a quarter of a step (figures in docs/benchmarks.md, "A plain step
on numpy"). So where the whole model is float32 on the CPU, with its projections fused
(``starhub.models.fused``) and a SiLU-gated MLP, ``targets.forward.DecoderPass`` runs a
pass of one row of one token here instead of through its layers: the same arithmetic in
the same order over numpy views of the same weights, and the session's own cache buffers
written in place (logits within about 1e-5 of the layered pass: float32 rounding).

A linear layer that runs single rows on numpy's BLAS (``--linear auto``'s choice where it
is fastest) is multiplied here directly; any other is called through PyTorch on a view of
the row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from starhub.models.loading import OneDNNLinear
from targets.kv import SessionKV

Product = Callable[[np.ndarray], np.ndarray]

ACTIVATIONS = ("silu", "swish")


def _product(linear: torch.nn.Module) -> Product:
    """``linear`` as a function of one numpy row: on numpy's BLAS where the layer runs
    single rows there (asked at each call: the choice can change after load), else through
    PyTorch."""
    bias = None if linear.bias is None else linear.bias.detach().numpy()

    def product(x: np.ndarray) -> np.ndarray:
        rows = linear.blas_rows if isinstance(linear, OneDNNLinear) else None
        if rows is None:
            return linear(torch.from_numpy(x)[None]).numpy()[0]
        return x @ rows if bias is None else x @ rows + bias
    return product


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class _Norm:
    """An RMS norm of transformers' usual form, over the last axis."""

    def __init__(self, module: torch.nn.Module):
        self.weight = _array(module.weight)
        self.eps = module.variance_epsilon

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == 1:
            scale = np.float32(1.0 / np.sqrt(np.dot(x, x) / x.shape[0] + self.eps))
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
    """Whether ``OneTokenStep`` can run ``model``: float32 weights on the CPU, every layer's
    projections fused and a SiLU-gated MLP."""
    params = list(model.parameters())
    cfg = model.config
    return (bool(params) and all(p.dtype == torch.float32 and p.device.type == "cpu"
                                 for p in params)
            and getattr(cfg, "hidden_act", None) in ACTIVATIONS
            and all(hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
                    for layer in model.model.layers))


class OneTokenStep:
    """Passes of one row of one token over a loaded model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        inner = model.model
        self.embed = _array(inner.embed_tokens.weight)
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.final_norm = _Norm(inner.norm)
        self.head = _product(model.lm_head)

    def _rotary(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The model's own cosines and sines at ``position`` (whatever its rope scaling)."""
        cos, sin = self.rotary(torch.zeros(1), torch.tensor([[position]]))
        return cos.numpy().reshape(-1), sin.numpy().reshape(-1)

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        half = self.head_dim // 2
        return x * cos + np.concatenate((-x[:, half:], x[:, :half]), -1) * sin

    @torch.inference_mode()
    def __call__(self, kv: SessionKV, token: int, logits: bool, features: set[int]
                 ) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """Feed ``token`` after the ``kv.length`` entries of ``kv`` (which must have room
        for one more), write its keys and values there and move ``kv`` on. Returns its
        logits (or None) and the hidden states ``features`` names (0: the embedding, i:
        layer i's output, the last layer's normed, as transformers numbers them)."""
        cos, sin = self._rotary(kv.length)
        x = self.embed[token]
        hidden = {0: x} if 0 in features else {}
        with np.errstate(over="ignore"):  # the SiLU's exp(-gate) may overflow: silu -> -0
            for li, layer in enumerate(self.layers):
                x = self._layer(layer, x, kv.keys[li].numpy(), kv.values[li].numpy(),
                                kv.length, cos, sin)
                if li + 1 in features:
                    hidden[li + 1] = x
        kv.advance(1)
        top = len(self.layers)
        normed = self.final_norm(x) if logits or top in features else None
        if top in features:  # transformers gives the last layer's output normed
            hidden[top] = normed
        return (self.head(normed) if logits else None), hidden

    def _layer(self, layer: _Layer, x: np.ndarray, keys: np.ndarray, values: np.ndarray,
               position: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """One decoder layer for the row ``x``, its key and value written at ``position``
        of the layer's cache buffers ``keys`` and ``values``."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(layer.input_norm(x)).reshape(heads + 2 * kv_heads, dim)
        q, k = qkv[:heads], qkv[heads:heads + kv_heads]
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        keys[:, position] = self._rotate(k, cos, sin)
        values[:, position] = qkv[heads + kv_heads:]
        end = position + 1
        # each key/value head's group of query heads, as sdpa's grouped-query attention
        scores = np.matmul(self._rotate(q, cos, sin).reshape(kv_heads, self.groups, dim),
                           keys[:, :end].transpose(0, 2, 1))
        scores *= layer.scale
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x + layer.o(np.matmul(weights, values[:, :end]).reshape(-1))
        gate_up = layer.gate_up(layer.post_norm(x))
        gate, up = gate_up[:layer.inner], gate_up[layer.inner:]
        return x + layer.down(gate / (1 + np.exp(-gate)) * up)
