"""One forward pass of the target over the rows of several sessions, each row attending to
its own cache where that cache lies.

The pass runs the model's own modules (embedding, norms, projections, MLPs, rotary table,
LM head: whatever kernels the loader gave them) on every row's tokens at once, so each
weight is read once a pass whatever the rows. Only attention sees sessions apart: a row's
new keys and values go straight into its session's slot (``targets.kv``) and its queries
attend to the front of that slot under the row's own mask, so no cache is padded, stacked
or copied. Rows whose sessions share a shelf are attended to by one call over the shelf's
slots (``ShelfCall``), every other row by a call of its own. A greedy row may ask for its
positions' argmax instead of their logits (``Row.picks``), which ``targets.greedy_head``
finds without reading the float32 LM head whole (except in a pass that runs its products on
numpy's whole BLAS pool, ``NumpyPass.keeps_blas_pool``: the greedy head runs on PyTorch).

A fresh prompt makes the very attention call transformers' ``sdpa`` makes for it. A pass
of a few tokens (a plain step, one session's tree, plain steps of several sessions) runs
on numpy instead where the model allows (``targets.numpy_pass``: the same arithmetic
without PyTorch's dispatch). Here a row under a mask (a tree, a later chunk of a prompt)
folds a grouped-query model's query heads into the query length instead of repeating its
keys and values per head (as ``starhub.models.attention`` does for transformers' own
passes): the same attention, grouped differently by the kernel (logits within about
1e-6).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from targets.greedy_head import GreedyHead
from targets.kv import KVPool, SessionKV, Shelf
from targets.numpy_pass import NumpyPass, NumpyRow, runs_here, supported

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose decoder layers this pass runs: pre-norm attention with rotary
positions and a gated MLP, every layer attending to the whole context."""

T = TypeVar("T")

SHARED_WIDTH = 64
"""The most tokens a row may feed and share an attention call with other sessions' rows
(a tree's nodes and root, plain steps)."""

ALL, LAST, NONE = "all", "last", "none"
"""Which of a row's positions get logits."""


@dataclass
class Row:
    """One session's part of a pass."""

    kv: SessionKV
    ids: list[int]
    positions: torch.Tensor | None = None
    """``[n]`` absolute positions; None: the ones after the cache, in order."""
    mask: torch.Tensor | None = None
    """``[n, n]`` boolean, which new tokens each new token sees (a tree's ancestor mask);
    None: those before it (causal). Every new token sees the whole cache."""
    logits: str = ALL
    picks: bool = False
    """Greedy: the positions ``logits`` names get their argmax (``RowOut.picks``) instead
    of their logits where the pass has a ``GreedyHead``, which does not read the float32
    head."""
    features: tuple[int, ...] = ()
    """Hidden states to return for every new token, as transformers numbers them
    (0: the embeddings, i: layer i's output; negative from the end), concatenated."""


class Alone(NamedTuple):
    """A row attended to by a call of its own."""
    row: Row
    n: int
    start: int
    mask: torch.Tensor | None
    causal: bool


class ShelfCall(NamedTuple):
    """Rows whose sessions share a shelf (``targets.kv``), attended to by one call over its
    slots ``lo`` to ``lo + batch``, each row's queries padded to ``width`` and every key
    up to ``span`` read under ``mask``."""
    shelf: Shelf
    lo: int
    batch: int
    width: int
    span: int
    tokens: slice | torch.Tensor
    """The rows' tokens' places in the pass (a slice where they lie together)."""
    padded: torch.Tensor | None
    """``[T]``: each token's place among the ``batch * width`` queries; None where they
    are the same (every slot's row fills the width)."""
    entries: torch.Tensor
    """``[T * kv_heads]``: where each token's key and value for each head go, in the
    shelf's storage of a layer seen as ``[-1, head_dim]``."""
    mask: torch.Tensor
    """``[batch, 1, groups * width, span]`` additive, the query heads folded."""


@dataclass
class RowOut:
    logits: torch.Tensor | None
    """``[k, vocab]`` for the positions the row asked for (None where picked)."""
    features: torch.Tensor | None
    picks: list[int] | None = None
    """The argmax of each of those positions, for a row that asked for ``picks``."""


def run_through(steps: Generator[object, None, T]) -> T:
    """What a generator returns, once run to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an RMS norm of transformers' usual form (these models' own), in
    one fused kernel that gives the same bits; any other module as it is."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or not type(module).__name__.endswith("RMSNorm"):
        return module(x)
    return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight, eps)


def _sees(row: Row, n: int) -> torch.Tensor:
    """``[n, n]`` boolean: which of the row's new tokens each new token sees."""
    return row.mask if row.mask is not None else torch.ones(n, n, dtype=torch.bool).tril()


def check_supported(model: PreTrainedModel) -> None:
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    windowed = getattr(cfg, "sliding_window", None) is not None and (
        getattr(cfg, "use_sliding_window", True) or kind == "mistral")
    if kind not in ARCHITECTURES or types != {"full_attention"} or windowed:
        window = " with sliding-window attention" if windowed or len(types) > 1 else ""
        raise ValueError(f"the target engine runs {', '.join(ARCHITECTURES)} models with "
                         f"full attention in every layer; this one is '{kind}'{window}")


class DecoderPass:
    """Forward passes of one loaded causal LM over rows (``__call__``)."""

    def __init__(self, model: PreTrainedModel):
        check_supported(model)
        self.model = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.layers = list(model.model.layers)
        self.devices = [layer.input_layernorm.weight.device for layer in self.layers]
        self.dtype = model.model.embed_tokens.weight.dtype
        self.token_bytes = 2 * len(self.layers) * self.kv_heads * self.head_dim * \
            self.dtype.itemsize
        """Bytes one cached token takes over every layer (keys and values)."""
        self.numpy_pass = NumpyPass(model, self.heads, self.kv_heads, self.head_dim) \
            if supported(model) else None
        """Where it runs passes of a few tokens (``targets.numpy_pass``)."""
        self.pool = KVPool(self.kv_heads, self.head_dim, self.dtype, self.devices)
        """Every session's cache (``targets.kv``)."""
        self.greedy_head = GreedyHead.of(model)
        """Where rows that ask for ``picks`` get them (``targets.greedy_head``); None: from
        the head's logits."""

    def picked(self, row: Row) -> bool:
        """Whether the pass gives ``row`` picks rather than logits."""
        return row.picks and self.greedy_head is not None and row.logits != NONE

    def new_cache(self, capacity: int = 0) -> SessionKV:
        return self.pool.new_cache(capacity)

    def _mask(self, row: Row, n: int) -> tuple[torch.Tensor | None, bool]:
        """The row's additive mask for its folded queries (each key/value head's query heads one
        after another along the query length), None for none; and whether the row is
        causal from the start of an empty cache (a fresh prompt)."""
        cached = row.kv.length
        if row.mask is None and (cached == 0 or n == 1):
            return None, n > 1
        if row.mask is not None and bool(row.mask.all()):
            return None, False
        new = _sees(row, n)
        # additive, as attention would make a boolean mask in each layer
        mask = torch.zeros(self.groups, n, cached + n, dtype=self.dtype)
        mask[:, :, cached:].masked_fill_(~new, float("-inf"))
        return mask.view(1, 1, self.groups * n, cached + n), False

    def __call__(self, rows: list[Row]) -> list[RowOut]:
        if self.numpy_pass is not None and runs_here([len(row.ids) for row in rows]):
            return self._on_numpy(rows)
        return run_through(self.layer_by_layer(rows))

    def _on_numpy(self, rows: list[Row]) -> list[RowOut]:
        """A pass on ``NumpyPass``: what ``layer_by_layer`` gives."""
        given = []
        for row in rows:
            n, cached = len(row.ids), row.kv.length
            positions = np.arange(cached, cached + n) if row.positions is None \
                else row.positions.numpy()
            if row.mask is None:
                mask = np.tri(n, dtype=bool) if n > 1 else None
            else:
                mask = None if bool(row.mask.all()) else row.mask.numpy()
            row.kv.reserve(n)
            given.append(NumpyRow(row.kv, row.ids, positions, mask))
        top = len(self.layers) + 1
        wanted = {i % top for row in rows for i in row.features}
        asked = [slice(None) if row.logits == ALL else slice(-1, None)
                 if row.logits == LAST else None for row in rows]
        # the greedy head's products run on PyTorch's threads, which a pass on the whole
        # BLAS pool must leave idle: such a pass gives logits
        alone = self.numpy_pass.keeps_blas_pool(sum(len(row.ids) for row in rows))
        picked = [self.picked(row) and not alone for row in rows]
        if any(picked):
            wanted.add(len(self.layers))  # the last layer's output, normed: the head's input
        logits, hidden = self.numpy_pass(
            given, [None if p else where for p, where in zip(picked, asked, strict=True)], wanted)
        # every picked row's positions in one call, so the head is read once a pass
        starts = np.cumsum([0, *[len(row.ids) for row in rows[:-1]]])
        chosen = [np.arange(s, s + len(row.ids))[where] if p else np.arange(0)
                  for row, s, p, where in zip(rows, starts, picked, asked, strict=True)]
        picks = self.greedy_head.picks(hidden[len(self.layers)][np.concatenate(chosen)]) \
            if any(picked) else []
        outs, at_picks = [], 0
        for row, s, out, p, taken in zip(rows, starts, logits, picked, chosen, strict=True):
            feats = None
            if row.features:
                feats = torch.from_numpy(np.concatenate(
                    [hidden[i % top][s:s + len(row.ids)] for i in row.features], -1))
            mine = picks[at_picks:at_picks + len(taken)] if p else None
            outs.append(RowOut(None if out is None else torch.from_numpy(out), feats, mine))
            at_picks += len(taken)
        return outs

    @torch.inference_mode()  # around each resumption of the generator
    def layer_by_layer(self, rows: list[Row]) -> Generator[None, None, list[RowOut]]:
        """The pass, paused after each decoder layer (a ``yield``), so that a caller can run
        other passes in between (over other sessions: this one's rows are written as the
        layers run); returns what ``__call__`` returns."""
        model = self.model.model
        sizes = [len(row.ids) for row in rows]
        starts = [sum(sizes[:i]) for i in range(len(rows))]
        ids = torch.tensor([t for row in rows for t in row.ids])
        positions = torch.cat([
            row.positions if row.positions is not None
            else torch.arange(row.kv.length, row.kv.length + n)
            for row, n in zip(rows, sizes, strict=True)])
        for row, n in zip(rows, sizes, strict=True):
            row.kv.reserve(n)
        calls, alone = self._plan(rows, sizes, starts)
        device = model.embed_tokens.weight.device
        x = model.embed_tokens(ids[None].to(device))
        rotary = model.rotary_emb(x, positions[None].to(device))
        total = sum(sizes)
        wanted = sorted({i % (len(self.layers) + 1) for row in rows for i in row.features})
        hidden = {0: x} if 0 in wanted else {}
        for li, layer in enumerate(self.layers):
            if x.device != self.devices[li]:
                x = x.to(self.devices[li])
                rotary = tuple(t.to(x.device) for t in rotary)
            x = x + self._attention(li, layer, norm(layer.input_layernorm, x), rotary, calls,
                                    alone, total)
            x = x + self._mlp(layer.mlp, norm(layer.post_attention_layernorm, x))
            if li + 1 in wanted:
                hidden[li + 1] = x
            yield
        top = len(self.layers)
        if top in wanted:  # transformers gives the last layer's output normed
            hidden[top] = norm(model.norm, x)
        for row, n in zip(rows, sizes, strict=True):
            row.kv.advance(n)
        return self._outputs(rows, sizes, starts, x, hidden)

    def _plan(self, rows: list[Row], sizes: list[int], starts: list[int]
              ) -> tuple[list[ShelfCall], list[Alone]]:
        """How each row is attended to: rows of sessions that share a shelf by one call over
        it, any other row by a call of its own (a fresh prompt, which runs causal, and a
        prompt's later chunk, whose width every row of a shared call would be padded to)."""
        by_shelf: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.kv.length and row.kv.shelf is not None and len(row.ids) <= SHARED_WIDTH:
                by_shelf.setdefault(id(row.kv.shelf), []).append(i)
        calls, shared = [], set()
        for members in by_shelf.values():
            if len(members) > 1 and len({rows[i].kv.slot for i in members}) == len(members):
                calls.append(self._shelf_call([rows[i] for i in members],
                                              [starts[i] for i in members]))
                shared.update(members)
        alone = [Alone(row, n, s, *self._mask(row, n)) for i, (row, n, s)
                 in enumerate(zip(rows, sizes, starts, strict=True)) if i not in shared]
        return calls, alone

    def _shelf_call(self, rows: list[Row], starts: list[int]) -> ShelfCall:
        shelf = rows[0].kv.shelf
        slots = [row.kv.slot for row in rows]
        lo, batch = min(slots), max(slots) - min(slots) + 1
        width = max(len(row.ids) for row in rows)
        span = max(row.kv.length + len(row.ids) for row in rows)
        # additive, as attention would make a boolean mask in each layer; a query that
        # feeds nothing (a shorter row's padding, a slot outside the pass) sees the first
        # entry only, and its output is dropped
        mask = torch.full((batch, self.groups, width, span), float("-inf"), dtype=self.dtype)
        mask[..., 0] = 0
        tokens, padded, entries = [], [], []
        heads = torch.arange(self.kv_heads)[None] * shelf.capacity
        for row, s, slot in zip(rows, starts, slots, strict=True):
            n, cached, b = len(row.ids), row.kv.length, slot - lo
            mask[b, :, :n, :cached] = 0
            mask[b, :, :n, cached:cached + n].masked_fill_(_sees(row, n), 0)
            tokens.extend(range(s, s + n))
            padded.extend(range(b * width, b * width + n))
            at = slot * self.kv_heads * shelf.capacity + torch.arange(cached, cached + n)
            entries.append((at[:, None] + heads).flatten())
        first = tokens[0]
        return ShelfCall(
            shelf, lo, batch, width, span,
            slice(first, first + len(tokens)) if tokens == list(range(first, first + len(tokens)))
            else torch.tensor(tokens),
            None if padded == list(range(batch * width)) else torch.tensor(padded),
            torch.cat(entries), mask.view(batch, 1, self.groups * width, span))

    def _attention(self, li: int, layer, h: torch.Tensor, rotary, calls: list[ShelfCall],
                   alone: list[Alone], total: int) -> torch.Tensor:
        attn = layer.self_attn
        shape = (1, total, -1, self.head_dim)
        if hasattr(attn, "qkv_proj"):  # one product (``starhub.models.fused``)
            q, k, v = attn.qkv_proj(h)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k = q.view(shape), k.view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's queries and keys
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = v.view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rotary)
        out = h.new_empty(total, self.heads, self.head_dim)
        if calls:
            by_token = [t[0].transpose(0, 1) for t in (q, k, v)]  # [tokens, heads, head_dim]
            for call in calls:
                self._over_shelf(li, call, *by_token, out, attn.scaling)
        for row, n, s, mask, causal in alone:
            keys, values = row.kv.write(li, k[0, :, s:s + n], v[0, :, s:s + n])
            query = q[:, :, s:s + n]
            if mask is None:
                got = sdpa(query, keys[None], values[None], is_causal=causal,
                           scale=attn.scaling, enable_gqa=self.groups > 1)
                out[s:s + n] = got[0].transpose(0, 1)
            else:
                folded = query.reshape(1, self.kv_heads, self.groups * n, self.head_dim)
                got = sdpa(folded, keys[None], values[None], attn_mask=mask.to(keys.device),
                           scale=attn.scaling)
                out[s:s + n] = got.view(self.heads, n, self.head_dim).transpose(0, 1)
        return attn.o_proj(out.view(1, total, -1))

    def _over_shelf(self, li: int, call: ShelfCall, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """One attention call over the shelf's slots ``call.lo`` on for ``call``'s rows,
        whose ``[tokens, heads, head_dim]`` queries, keys and values are in ``q``, ``k``,
        ``v``: the keys and values go into their slots, and the rows' output into ``out``."""
        keys, values = call.shelf.keys[li], call.shelf.values[li]
        dim, batch, width = self.head_dim, call.batch, call.width
        entries = call.entries.to(keys.device)
        padded = None if call.padded is None else call.padded.to(keys.device)
        keys.view(-1, dim).index_copy_(0, entries, k[call.tokens].reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, entries, v[call.tokens].reshape(-1, dim))
        queries = q[call.tokens]
        if padded is not None:
            queries = q.new_zeros(batch * width, self.heads, dim).index_copy_(0, padded, queries)
        folded = queries.view(batch, width, self.heads, dim).transpose(1, 2).reshape(
            batch, self.kv_heads, self.groups * width, dim)
        window = slice(call.lo, call.lo + batch)
        got = sdpa(folded, keys[window, :, :call.span], values[window, :, :call.span],
                   attn_mask=call.mask.to(keys.device), scale=scale)
        got = got.view(batch, self.heads, width, dim).transpose(1, 2).reshape(-1, self.heads, dim)
        out[call.tokens] = got if padded is None else got.index_select(0, padded)

    @staticmethod
    def _mlp(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The gated MLP, its gate and up projections as one product where they are fused."""
        if not hasattr(mlp, "gate_up_proj"):
            return mlp(h)
        gate, up = mlp.gate_up_proj(h)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _outputs(self, rows: list[Row], sizes: list[int], starts: list[int],
                 x: torch.Tensor, hidden: dict[int, torch.Tensor]) -> list[RowOut]:
        wanted: list[list[int]] = []  # each row's positions in the pass that get an output
        for row, n, s in zip(rows, sizes, starts, strict=True):
            wanted.append(list(range(s, s + n)) if row.logits == ALL
                          else [s + n - 1] if row.logits == LAST else [])
        flat = [i for where in wanted for i in where]
        normed = None
        if flat:
            normed = hidden.get(len(self.layers))
            if normed is None:
                normed = norm(self.model.model.norm, x[:, flat] if len(flat) < x.shape[1] else x)
            else:
                normed = normed[:, flat]
            normed = normed[0]
        picked = [self.picked(row) for row in rows]
        at, by_head, by_picks = 0, [], []  # rows of ``normed`` for the head and for picks
        for where, p in zip(wanted, picked, strict=True):
            (by_picks if p else by_head).extend(range(at, at + len(where)))
            at += len(where)
        logits = picks = None
        if by_head:
            logits = self.model.lm_head(normed if not by_picks else normed[by_head])
        if by_picks:
            picks = self.greedy_head.picks(normed[by_picks].cpu())
        outs, at_head, at_picks = [], 0, 0
        top = len(self.layers) + 1
        for row, n, s, where, p in zip(rows, sizes, starts, wanted, picked, strict=True):
            feats = None
            if row.features:
                first = hidden[row.features[0] % top].device
                feats = torch.cat([hidden[i % top][0, s:s + n].to(first)
                                   for i in row.features], -1)
            k = len(where)
            if p:
                outs.append(RowOut(None, feats, picks[at_picks:at_picks + k]))
                at_picks += k
            else:
                outs.append(RowOut(logits[at_head:at_head + k] if k else None, feats))
                at_head += k
        return outs
