"""Attention for transformers' forward passes that feed several tokens under a mask, without
copying the cache.

A grouped-query model (SmolLM2: 9 query heads over 3 key/value heads) has transformers'
``sdpa`` attention copy every cached key and value once per query head (``repeat_kv``)
whenever a pass feeds several tokens under an explicit mask: for one token it folds the
query heads instead. This attention folds them for any number of tokens: each key/value
head's query heads are laid one after another along the query length and the mask
repeated for each, so attention reads the cache as it is. Each query row still attends to
the same keys under the same mask; only how the kernel groups rows changes (logits within
1e-4 of ``repeat_kv``'s). It serves what runs through transformers' own forward: a draft
model's tree passes and ``generate()``; the target engine folds its rows the same way in
its own pass (``targets.forward``).

Anything else (one token, no mask, a mask per head, a position bias, dropout) goes to
transformers' ``sdpa`` unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "sdpa_folded_gqa"


def folded_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward``'s contract: ``query`` ``[B, heads, T, D]``, ``key`` and
    ``value`` ``[B, kv_heads, S, D]``, a mask ``[B, 1, T, S]``; returns ``[B, T, heads, D]``."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    if (groups == 1 or length == 1 or attention_mask is None or attention_mask.shape[1] != 1
            or dropout or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    kv_heads, span = heads // groups, attention_mask.shape[-1]
    folded = query.reshape(batch, kv_heads, groups * length, dim)
    mask = attention_mask.expand(batch, groups, length, span).reshape(batch, 1, -1, span)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, folded_gqa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def fold_gqa(model: PreTrainedModel) -> bool:
    """Give a CPU model that runs transformers' ``sdpa`` this attention; whether it now does.
    Measured on CPUs only, so a model on an accelerator keeps ``sdpa``'s own kernels."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
