"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) and their checkpoint format.

An EAGLE head is one decoder layer that predicts the target's next feature from the target's
current feature and the embedding of the token that follows it. It borrows the target's token
embedding (and, for EAGLE-1/2 with the full vocabulary, the target's LM head); those tensors
are handed in at load time and are not part of the checkpoint.

Sequence convention (same as the public EAGLE code): for target tokens ``x_0..x_n`` with
features ``f_0..f_n`` (``f_i`` is what the target used to predict ``x_{i+1}``), the head is fed
the pairs ``(x_{i+1}, f_i)`` at position ``i``. Its output ``h_i`` approximates ``f_{i+1}`` and
``logits(h_i)`` predict ``x_{i+2}``. While drafting, ``h_i`` is fed back as the next feature.

Features: EAGLE-1/2 heads use the target's final hidden state after the final norm (the LM
head's input, ``output_hidden_states[-1]`` in transformers). EAGLE-3 heads use three hidden
states concatenated low/mid/high, ``output_hidden_states[i]`` for ``i`` in
``EagleHead.feature_layers`` (by default ``2, L // 2, L - 3``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from starhub.models.kvcache import KVCache, Segment

EAGLE = "eagle"
EAGLE3 = "eagle3"
OPTIONAL_KEYS = ("embed_tokens.weight",)
_CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "attention_bias",
    "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_features: int) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None,
                cache: KVCache | None, segments: list[Segment] | None = None) -> Tensor:
        """``segments`` packs rows of several caches (sessions, or outcomes sharing one):
        projections run once over all rows, attention per segment over its own cache."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if segments is None:
            y = self._attend(q, k, v, mask, cache)
        else:
            ys, start = [], 0
            for seg in segments:
                end = start + seg.rows
                ys.append(self._attend(q[:, :, start:end], k[:, :, start:end],
                                       v[:, :, start:end], seg.mask, seg.cache))
                start = end
            y = torch.cat(ys, dim=2)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                cache: KVCache | None) -> Tensor:
        t = q.shape[2]
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        if mask is None and past > 0 and t > 1:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        causal = mask is None and past == 0 and t > 1
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        group = self.n_heads // self.n_kv
        if group > 1 and not causal and (mask is None or mask.shape[1] == 1):
            return self._attend_grouped(q, k, v, mask, group)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=self.n_kv != self.n_heads)

    @staticmethod
    def _attend_grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                        group: int) -> Tensor:
        """Grouped-query attention as plain attention per key-value head: the ``group``
        query heads that share one are stacked along the query axis (and the mask tiled to
        match), so the keys and values are read as they are rather than repeated per query
        head. On CPU this is about a third faster for the few queries of a draft layer."""
        b, heads, t, d = q.shape
        stacked = q.reshape(b, heads // group, group * t, d)
        if mask is not None:
            mask = mask.repeat(1, 1, group, 1)
        y = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask)
        return y.view(b, heads, t, d)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama layer. EAGLE-1/2 drops ``input_layernorm``; EAGLE-3 attends over
    ``[input_layernorm(embedding); hidden_norm(feature)]`` (width 2H)."""

    def __init__(self, cfg: LlamaConfig, eagle3: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eagle3 = eagle3
        self.self_attn = Attention(cfg, 2 * h if eagle3 else h)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x: Tensor, emb: Tensor | None, rope: tuple[Tensor, Tensor],
                mask: Tensor | None, cache: KVCache | None,
                segments: list[Segment] | None = None) -> Tensor:
        attn_in = x
        if self.eagle3:
            attn_in = torch.cat((self.input_layernorm(emb), self.hidden_norm(x)), dim=-1)
        x = x + self.self_attn(attn_in, rope, mask, cache, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


def default_feature_layers(kind: str, target_layers: int) -> tuple[int, ...]:
    """Target hidden states a head reads: the last for EAGLE-1/2, low/middle/high for
    EAGLE-3."""
    if kind == EAGLE3:
        return (2, target_layers // 2, target_layers - 3)
    return (-1,)


class EagleHead(nn.Module):
    """EAGLE-1/2 (``kind="eagle"``) or EAGLE-3 (``kind="eagle3"``) draft head.

    ``embed_weight`` ([V, H]) is the target's token embedding; ``target_lm_head`` ([V, H]) is
    the target's LM head, used by EAGLE-1/2 heads without their own ``lm_head``. Both are
    non-persistent buffers, so they never enter the checkpoint.
    """

    def __init__(self, cfg: LlamaConfig, kind: str, embed_weight: Tensor,
                 target_lm_head: Tensor | None = None, draft_vocab_size: int | None = None,
                 fc_bias: bool = True, target_hidden_size: int | None = None,
                 feature_layers: tuple[int, ...] | None = None,
                 target_num_layers: int | None = None) -> None:
        super().__init__()
        if kind not in (EAGLE, EAGLE3):
            raise ValueError(f"unknown EAGLE head kind {kind!r}")
        h = cfg.hidden_size
        vocab = embed_weight.shape[0]
        self.cfg, self.kind = cfg, kind
        self.vocab_size = vocab
        self.draft_vocab_size = draft_vocab_size or vocab
        self.target_hidden_size = target_hidden_size or h
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        if kind == EAGLE:
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.layers = nn.ModuleList([DecoderLayer(cfg, eagle3=False)])
            self.feature_layers = feature_layers or default_feature_layers(kind, 0)
        else:
            self.fc = nn.Linear(3 * self.target_hidden_size, h, bias=False)
            self.midlayer = DecoderLayer(cfg, eagle3=True)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.feature_layers = feature_layers or default_feature_layers(
                kind, target_num_layers or cfg.num_hidden_layers)
        reduced = self.draft_vocab_size != vocab
        if kind == EAGLE3 or reduced:
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.register_buffer("target_lm_head", None, persistent=False)
        else:
            if target_lm_head is None:
                raise ValueError("an EAGLE-1/2 head with the full vocabulary needs the target's "
                                 "lm_head weight")
            self.lm_head = None
            self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        if reduced:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        else:
            self.register_buffer("d2t", None)
            self.register_buffer("t2d", None)
        self.rotary = LlamaRotaryEmbedding(cfg)

    @property
    def layer(self) -> DecoderLayer:
        return self.midlayer if self.kind == EAGLE3 else self.layers[0]

    @property
    def feature_size(self) -> int:
        """Width of the target features this head expects on first use."""
        if self.kind == EAGLE3:
            return 3 * self.target_hidden_size
        return self.cfg.hidden_size

    def set_draft_vocab(self, draft_ids: Tensor) -> None:
        """Map draft ids to these target ids (sorted ascending, as in public checkpoints)."""
        ids = torch.sort(torch.as_tensor(draft_ids, dtype=torch.long)).values
        if self.d2t is None or ids.numel() != self.draft_vocab_size:
            raise ValueError(f"need exactly {self.draft_vocab_size} ids for a reduced draft vocab")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def resize_draft_vocab(self, draft_ids: Tensor, fill: Tensor | None = None) -> None:
        """Make ``draft_ids`` (target ids) the draft vocabulary. Ids already in it keep their
        trained LM-head rows: a smaller head ships smaller and runs cheaper. New ids take
        their row of ``fill`` (the target's LM head, [V, H]), where a head with the full
        vocabulary would read it, so a larger vocabulary starts from what the target knows."""
        if self.d2t is None:
            raise ValueError("only a head with a reduced draft vocabulary can be resized")
        ids = torch.sort(torch.as_tensor(draft_ids, dtype=torch.long)).values
        rows = self.draft_index()[ids]
        new = rows < 0
        if new.any() and fill is None:
            raise ValueError(f"{int(new.sum())} of the ids are not in the draft vocabulary")
        old = self.lm_head.weight.data
        weight = old[rows.clamp(min=0).to(old.device)]
        if new.any():
            weight[new.to(old.device)] = fill[ids[new].to(fill.device)].to(old)
        self.draft_vocab_size = ids.numel()
        self.lm_head = nn.Linear(weight.shape[1], ids.numel(), bias=False,
                                 device=weight.device, dtype=weight.dtype)
        self.lm_head.weight.data.copy_(weight)
        self.d2t = torch.zeros(ids.numel(), dtype=torch.long, device=self.d2t.device)
        self.set_draft_vocab(ids)

    def draft_index(self) -> Tensor:
        """Draft id of every target token, -1 outside the draft vocabulary (on CPU)."""
        index = torch.full((self.vocab_size,), -1, dtype=torch.long)
        arange = torch.arange(self.draft_vocab_size)
        index[self.to_target_ids(arange.to(self.embed_weight.device)).cpu()] = arange
        return index

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Target token ids for draft-vocabulary ids: ``draft_id + d2t[draft_id]``."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def embed(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits for head outputs ``hidden`` [..., H]."""
        if self.kind == EAGLE3:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return F.linear(hidden, self.target_lm_head)

    def fused(self, features: Tensor) -> Tensor:
        """Rows at the width the head's layer reads: EAGLE-3's ``fc`` folds the target's
        three layers into one, and rows already that wide (the head's own outputs, fed back
        while drafting) pass as they are. EAGLE's ``fc`` reads the token embedding too, so
        its features pass unchanged here."""
        if self.kind == EAGLE or features.shape[-1] == self.cfg.hidden_size:
            return features
        return self.fc(features)

    def forward(self, features: Tensor, input_ids: Tensor | None = None, *,
                inputs_embeds: Tensor | None = None, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, cache: KVCache | None = None,
                num_logits: int | None = None, segments: list[Segment] | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """Run the head over T new (token, feature) pairs.

        features: [B, T, F]; F is ``feature_size`` for target features, or H for the head's
            own outputs fed back while drafting (EAGLE-3 applies ``fc`` only to the former).
        input_ids / inputs_embeds: [B, T] tokens following each feature (or their embeddings).
        position_ids: [B, T] or [T]; default ``cache.length + arange(T)``.
        attention_mask: None means causal among the new entries and full view of the cache.
            Otherwise [B or 1, 1, T, cache.length + T], boolean (True = attend) or additive
            float; use it for tree drafting.
        cache: appended in place with the T new entries.
        num_logits: compute logits for the last ``num_logits`` positions only (0 = none).
        segments: instead of ``attention_mask`` and ``cache``, rows packed from several caches
            (B = 1): the matrix products run once over all of them (batched drafting).

        Returns (hidden [B, T, H], logits [B, T', draft_vocab] or None). Map logits' argmax or
        top-k indices to target ids with ``to_target_ids``.
        """
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        emb = inputs_embeds.to(features.dtype)
        b, t, _ = features.shape
        if position_ids is None:
            if segments is not None:
                raise ValueError("packed segments need explicit position_ids")
            past = 0 if cache is None else cache.length
            position_ids = torch.arange(past, past + t, device=features.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, t)
        rope = self.rotary(features, position_ids)
        if self.kind == EAGLE:
            x = self.fc(torch.cat((emb, features), dim=-1))
            hidden = self.layers[0](x, None, rope, attention_mask, cache, segments)
        else:
            hidden = self.midlayer(self.fused(features), emb, rope, attention_mask, cache,
                                   segments)
        if num_logits == 0:
            return hidden, None
        tail = hidden if num_logits is None else hidden[:, -num_logits:]
        return hidden, self.logits(tail)


def _config_dict(config: PretrainedConfig | dict) -> dict:
    d = dict(config) if isinstance(config, dict) else config.to_dict()
    rope = d.get("rope_parameters") or {}
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    return d


def head_config(target_config: PretrainedConfig | dict, overrides: dict | None = None
                ) -> LlamaConfig:
    """A one-layer LlamaConfig: the head's own fields win, the target fills the rest."""
    merged = {k: v for k, v in _config_dict(target_config).items()
              if k in _CONFIG_FIELDS or k.startswith("rope")}
    merged.update({k: v for k, v in (overrides or {}).items()
                   if k in _CONFIG_FIELDS or k.startswith("rope")})
    if merged.get("rope_parameters") and "rope_theta" in (overrides or {}):
        merged["rope_parameters"] = dict(merged["rope_parameters"],
                                         rope_theta=overrides["rope_theta"])
    if not merged.get("rope_parameters") and not merged.get("rope_theta"):
        merged.pop("rope_parameters", None)
    merged["num_hidden_layers"] = 1
    return LlamaConfig(**merged)


def _detect_kind(keys: set[str]) -> str:
    if any(k.startswith("midlayer.") for k in keys):
        return EAGLE3
    if any(k.startswith("layers.0.") for k in keys):
        return EAGLE
    raise ValueError("not an EAGLE checkpoint: no 'layers.0.*' (EAGLE-1/2) or 'midlayer.*' "
                     f"(EAGLE-3) keys; found {sorted(keys)[:8]}")


def _read_state(path: Path) -> dict[str, Tensor]:
    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} has neither model.safetensors nor pytorch_model.bin")


def load_eagle_head(path: str | Path, target_config: PretrainedConfig | dict,
                    embed_tokens_weight: Tensor, lm_head_weight: Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> EagleHead:
    """Load a public-format EAGLE-1/2 or EAGLE-3 head (``config.json`` + weights).

    Raises ValueError naming the key(s) when the checkpoint lacks or has extra tensors, or a
    tensor has the wrong shape.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} is missing")
    raw = json.loads(cfg_path.read_text())
    state = _read_state(path)
    kind = _detect_kind(set(state))
    target = _config_dict(target_config)
    cfg = head_config(target, raw)
    shipped_embed = state.pop("embed_tokens.weight", None)
    embed = (shipped_embed if shipped_embed is not None else embed_tokens_weight).to(dtype)
    vocab = embed.shape[0]
    draft_vocab = raw.get("draft_vocab_size") or vocab
    if "d2t" in state and state["d2t"].shape[0] == vocab:
        if state["d2t"].any():
            raise ValueError(f"{path}: key d2t remaps a full-size draft vocabulary")
        del state["d2t"]
        state.pop("t2d", None)
    if "d2t" in state:
        draft_vocab = state["d2t"].shape[0]
    elif kind == EAGLE and "lm_head.weight" in state:
        draft_vocab = state["lm_head.weight"].shape[0]
    head = EagleHead(
        cfg, kind, embed,
        target_lm_head=None if lm_head_weight is None else lm_head_weight.to(dtype),
        draft_vocab_size=draft_vocab,
        fc_bias=bool(raw.get("bias", "fc.bias" in state)),
        target_hidden_size=raw.get("target_hidden_size"),
        feature_layers=tuple(raw["eagle_aux_hidden_state_layer_ids"])
        if raw.get("eagle_aux_hidden_state_layer_ids") else None,
        target_num_layers=target.get("num_hidden_layers"),
    )
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected)}")
        raise ValueError(f"{path}: {kind} checkpoint does not match: " + "; ".join(parts))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: key {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return head.to(dtype).eval()


def save_eagle_head(head: EagleHead, path: str | Path, dtype: torch.dtype = torch.float16
                    ) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the public EAGLE layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config_dict(head.cfg)
    out = {k: cfg[k] for k in _CONFIG_FIELDS if cfg.get(k) is not None}
    out["rope_theta"] = cfg.get("rope_theta", 10000.0)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.update(model_type="llama", num_hidden_layers=1, torch_dtype=str(dtype).split(".")[-1],
               tie_word_embeddings=False)
    if head.kind == EAGLE:
        out["architectures"] = ["LlamaForCausalLM"]
        out["bias"] = head.fc.bias is not None
    else:
        out["architectures"] = ["LlamaForCausalLMEagle3"]
        out["eagle_aux_hidden_state_layer_ids"] = list(head.feature_layers)
        if head.target_hidden_size != head.cfg.hidden_size:
            out["target_hidden_size"] = head.target_hidden_size
    out["draft_vocab_size"] = head.draft_vocab_size
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
