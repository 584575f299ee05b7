"""Folded grouped-query attention: the same attention as transformers' sdpa, reading the
cache once rather than once per query head."""

from __future__ import annotations

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from starhub.models.attention import NAME, folded_gqa_attention
from starhub.wire.tree import ancestor_mask


def _tree_mask(batch: int, cached: int, parents: list[int]) -> torch.Tensor:
    """Each row sees its cache and its tree's ancestors (the root fed first)."""
    tree = torch.as_tensor(ancestor_mask(np.array([-1, *[p + 1 for p in parents]], np.int32)))
    fed = tree.shape[0]
    mask = torch.zeros(batch, 1, fed, cached + fed, dtype=torch.bool)
    mask[:, 0, :, :cached] = True
    mask[:, 0, :, cached:] = tree
    mask[1, 0, :, :3] = False  # rows differ: the second's cache starts later (padding)
    return mask


def test_folded_attention_equals_sdpa_under_a_tree_mask(tiny_model):
    model, _ = tiny_model
    attn = model.model.layers[0].self_attn
    groups = attn.num_key_value_groups
    assert groups > 1, "the tiny model must be grouped-query for this test to mean anything"
    heads, dim = model.config.num_attention_heads, attn.head_dim
    gen = torch.Generator().manual_seed(0)
    mask = _tree_mask(2, 9, [-1, -1, 0, 0, 2])
    fed, span = mask.shape[2], mask.shape[3]
    query = torch.randn(2, fed, heads, dim, generator=gen).transpose(1, 2)
    key = torch.randn(2, heads // groups, span, dim, generator=gen)
    value = torch.randn(2, heads // groups, span, dim, generator=gen)
    want, _ = sdpa_attention_forward(attn, query, key, value, mask, scaling=attn.scaling)
    got, _ = folded_gqa_attention(attn, query, key, value, mask, scaling=attn.scaling)
    assert got.shape == want.shape == (2, fed, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    one, _ = folded_gqa_attention(attn, query[:, :, :1], key, value, mask[:, :, :1],
                                  scaling=attn.scaling)
    torch.testing.assert_close(one, want[:, :1], rtol=1e-5, atol=1e-6)


def test_cpu_models_load_with_it_and_tree_passes_keep_their_logits(tiny_model):
    model, _ = tiny_model
    assert model.config._attn_implementation == NAME
    mask = _tree_mask(2, 9, [-1, 0, 0, 1])
    ids = torch.arange(2 * mask.shape[3]).reshape(2, -1) % model.config.vocab_size
    positions = torch.arange(mask.shape[3]).expand(2, -1)
    full = torch.ones(2, 1, mask.shape[3], mask.shape[3], dtype=torch.bool).tril()
    full[:, :, -mask.shape[2]:] = mask
    full[1, 0, :, :3] = False
    full[1, 0, torch.arange(3), torch.arange(3)] = True  # padding rows see themselves
    try:
        folded = model(ids, position_ids=positions, attention_mask=full).logits
        model.set_attn_implementation("sdpa")
        stock = model(ids, position_ids=positions, attention_mask=full).logits
    finally:
        model.set_attn_implementation(NAME)
    torch.testing.assert_close(folded, stock, rtol=1e-5, atol=1e-5)
    assert torch.equal(folded.argmax(-1), stock.argmax(-1))
