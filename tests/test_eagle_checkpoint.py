"""EAGLE head checkpoints round-trip in the public layouts, and the cache/mask API is exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from starhub.drafters.eagle_head import (
    EAGLE,
    EAGLE3,
    EagleHead,
    KVCache,
    head_config,
    load_eagle_head,
    save_eagle_head,
)

VOCAB, H = 100, 64


@pytest.fixture(scope="module")
def target_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=128,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       num_hidden_layers=8, rope_theta=10000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def target_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, H, generator=g), torch.randn(VOCAB, H, generator=g) * 0.1


def _randomize(head: EagleHead, seed: int) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return head.eval()


def make_head(target_config, target_weights, kind=EAGLE, draft_vocab=None, seed=1) -> EagleHead:
    embed, lm_head = target_weights
    head = EagleHead(head_config(target_config), kind, embed, lm_head,
                     draft_vocab_size=draft_vocab,
                     target_num_layers=target_config.num_hidden_layers)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
                             [:draft_vocab])
    return _randomize(head, seed)


def inputs(head: EagleHead, t: int = 7, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, t, head.feature_size, generator=g), torch.randint(0, VOCAB, (2, t),
                                                                            generator=g)


def run(head, feats, ids):
    with torch.no_grad():
        return head(feats, ids)


@pytest.mark.parametrize("kind,draft_vocab", [(EAGLE, None), (EAGLE, 40), (EAGLE3, 40),
                                              (EAGLE3, None)])
def test_round_trip(tmp_path, target_config, target_weights, kind, draft_vocab):
    head = make_head(target_config, target_weights, kind, draft_vocab)
    save_eagle_head(head, tmp_path, dtype=torch.float32)
    loaded = load_eagle_head(tmp_path, target_config, *target_weights)
    assert loaded.kind == kind and loaded.draft_vocab_size == (draft_vocab or VOCAB)
    feats, ids = inputs(head)
    h0, l0 = run(head, feats, ids)
    h1, l1 = run(loaded, feats, ids)
    torch.testing.assert_close(h1, h0, rtol=0, atol=0)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    if draft_vocab:
        torch.testing.assert_close(loaded.d2t, head.d2t)
        target_ids = loaded.to_target_ids(l1.argmax(-1))
        assert loaded.t2d[target_ids].all()
        assert int(loaded.t2d.sum()) == draft_vocab


def test_resized_draft_vocab_keeps_trained_rows_takes_new_ones_from_the_target_and_round_trips(
        tmp_path, target_config, target_weights):
    head = make_head(target_config, target_weights, EAGLE, 40)
    old_ids = head.to_target_ids(torch.arange(40))
    feats, ids = inputs(head)
    _, before = run(head, feats, ids)
    trained = head.lm_head.weight.detach().clone()
    # shrinking keeps each kept token's trained row (the rows exactly; the logits to float
    # rounding: a product over another number of columns may add in another order, as
    # MKL's AVX2 kernels do)
    keep = old_ids[torch.randperm(40, generator=torch.Generator().manual_seed(5))[:25]]
    head.resize_draft_vocab(keep)
    assert head.draft_vocab_size == 25 and int(head.t2d.sum()) == 25
    new_ids = head.to_target_ids(torch.arange(25))
    assert sorted(new_ids.tolist()) == sorted(keep.tolist())
    hidden, after = run(head, feats, ids)
    rows = [old_ids.tolist().index(t) for t in new_ids.tolist()]
    torch.testing.assert_close(head.lm_head.weight, trained[rows], rtol=0, atol=0)
    torch.testing.assert_close(after, before[..., rows])
    outside = next(t for t in range(VOCAB) if not head.t2d[t])
    with pytest.raises(ValueError, match="1 of the ids are not in the draft vocabulary"):
        head.resize_draft_vocab(torch.cat([new_ids[:5], torch.tensor([outside])]))
    # growing keeps every trained row; new tokens read the target's LM head
    added = torch.tensor([t for t in range(VOCAB) if not head.t2d[t]][:12])
    lm_head = target_weights[1]
    head.resize_draft_vocab(torch.cat([new_ids, added]), fill=lm_head)
    assert head.draft_vocab_size == 37 and int(head.t2d.sum()) == 37
    grown_ids = head.to_target_ids(torch.arange(37)).tolist()
    _, grown = run(head, feats, ids)
    kept = [grown_ids.index(t) for t in new_ids.tolist()]
    torch.testing.assert_close(head.lm_head.weight[kept], trained[rows], rtol=0, atol=0)
    torch.testing.assert_close(grown[..., kept], after)
    fresh = [grown_ids.index(t) for t in added.tolist()]
    torch.testing.assert_close(grown[..., fresh], hidden @ lm_head[added].T)
    save_eagle_head(head, tmp_path, dtype=torch.float32)
    loaded = load_eagle_head(tmp_path, target_config, *target_weights)
    torch.testing.assert_close(run(loaded, feats, ids)[1], grown, rtol=0, atol=0)


def test_fp16_default_and_public_config(tmp_path, target_config, target_weights):
    head = make_head(target_config, target_weights, EAGLE3, 40)
    save_eagle_head(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.float16 and state["d2t"].dtype == torch.long
    assert state["t2d"].dtype == torch.bool
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * H)
    assert state["fc.weight"].shape == (H, 3 * H)
    loaded = load_eagle_head(tmp_path, target_config, *target_weights)
    feats, ids = inputs(head)
    torch.testing.assert_close(run(loaded, feats, ids)[1], run(head, feats, ids)[1],
                               rtol=2e-2, atol=2e-2)


def test_eagle1_public_bin_with_shipped_embedding(tmp_path, target_config, target_weights):
    head = make_head(target_config, target_weights, EAGLE)
    state = dict(head.state_dict())
    assert "layers.0.input_layernorm.weight" not in state
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= set(state)
    shipped = torch.randn(VOCAB, H)
    state["embed_tokens.weight"] = shipped
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
         "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "bias": True, "hidden_act": "silu"}))
    loaded = load_eagle_head(tmp_path, target_config, *target_weights)
    torch.testing.assert_close(loaded.embed_weight, shipped)
    head.embed_weight = shipped
    feats, ids = inputs(head)
    torch.testing.assert_close(run(loaded, feats, ids)[1], run(head, feats, ids)[1])


def _corrupt(tmp_path, mutate) -> None:
    state = load_file(str(tmp_path / "model.safetensors"))
    mutate(state)
    save_file(state, str(tmp_path / "model.safetensors"))


def test_key_errors_name_the_key(tmp_path, target_config, target_weights):
    head = make_head(target_config, target_weights, EAGLE)
    save_eagle_head(head, tmp_path)
    _corrupt(tmp_path, lambda s: s.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing keys: layers\.0\.mlp\.up_proj\.weight"):
        load_eagle_head(tmp_path, target_config, *target_weights)
    save_eagle_head(head, tmp_path)
    _corrupt(tmp_path, lambda s: s.update(bogus=torch.zeros(1)))
    with pytest.raises(ValueError, match="unexpected keys: bogus"):
        load_eagle_head(tmp_path, target_config, *target_weights)
    save_eagle_head(head, tmp_path)
    _corrupt(tmp_path, lambda s: s.update({"fc.weight": torch.zeros(H, 3 * H)}))
    with pytest.raises(ValueError, match=r"fc\.weight has shape"):
        load_eagle_head(tmp_path, target_config, *target_weights)
    _corrupt(tmp_path, lambda s: [s.pop(k) for k in list(s) if k.startswith("layers.")])
    with pytest.raises(ValueError, match="not an EAGLE checkpoint"):
        load_eagle_head(tmp_path, target_config, *target_weights)


def test_eagle1_layer_is_a_llama_layer_without_input_norm(target_config, target_weights):
    head = make_head(target_config, target_weights, EAGLE)
    ref = LlamaDecoderLayer(head.cfg, layer_idx=0).eval()
    missing = ref.load_state_dict(head.layers[0].state_dict(), strict=False).missing_keys
    assert missing == ["input_layernorm.weight"]
    ref.input_layernorm = torch.nn.Identity()
    x = torch.randn(2, 5, H)
    pos = torch.arange(5).expand(2, 5)
    rope = LlamaRotaryEmbedding(head.cfg)(x, pos)
    with torch.no_grad():
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
        want = ref(x, attention_mask=torch.where(mask, 0.0, float("-inf")),
                   position_embeddings=rope)
        got = head.layers[0](x, None, rope, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_cache_and_tree_mask(target_config, target_weights, kind):
    head = make_head(target_config, target_weights, kind, 40)
    feats, ids = inputs(head, t=6)
    full_h, full_l = run(head, feats, ids)
    cache = KVCache()
    with torch.no_grad():
        h1, _ = head(feats[:, :4], ids[:, :4], cache=cache, num_logits=0)
        h2, l2 = head(feats[:, 4:], ids[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat([h1, h2], 1), full_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l2, full_l[:, 4:], rtol=1e-5, atol=1e-5)
    assert cache.length == 6
    cache.crop(4)
    # Two sibling branches after a 4-entry prefix, each with two nodes: a->b and c->d.
    tree_feats = torch.cat([h1[:, -1:]] * 4, 1)
    tree_ids = ids[:, [4, 5, 5, 4]]
    parents = [-1, 0, -1, 2]
    allow = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        allow[i, i] = True
        if p >= 0:
            allow[i] |= allow[p]
    mask = torch.cat([torch.ones(4, 4, dtype=torch.bool), allow], 1)[None, None]
    pos = torch.tensor([4, 5, 4, 5])
    with torch.no_grad():
        tree_h, tree_l = head(tree_feats, tree_ids, position_ids=pos, attention_mask=mask,
                              cache=cache)
    assert cache.length == 8
    for nodes in ([0, 1], [2, 3]):
        path = cache.clone()
        path.crop(4)
        with torch.no_grad():
            h, lg = head(tree_feats[:, nodes], tree_ids[:, nodes], cache=path)
        torch.testing.assert_close(tree_h[:, nodes], h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree_l[:, nodes], lg, rtol=1e-5, atol=1e-5)
    additive = torch.where(mask, 0.0, float("-inf"))
    cache.crop(4)
    with torch.no_grad():
        tree_h2, _ = head(tree_feats, tree_ids, position_ids=pos, attention_mask=additive,
                          cache=cache)
    torch.testing.assert_close(tree_h2, tree_h, rtol=1e-5, atol=1e-5)
    cache.keep([0, 1, 2, 3, 6, 7])
    assert cache.length == 6


def test_shipped_smollm2_head_loads():
    from pathlib import Path

    import starhub

    path = Path(starhub.__file__).parent / "heads" / "smollm2-135m"
    assert (path / "model.safetensors").stat().st_size < 16 * 2**20
    cfg = json.loads((path / "config.json").read_text())
    embed = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
    head = load_eagle_head(path, cfg, embed, None)
    assert head.kind == EAGLE and head.feature_layers == (-1,)
    assert head.draft_vocab_size == cfg["draft_vocab_size"] < cfg["vocab_size"]
    assert head.lm_head.weight.shape == (cfg["draft_vocab_size"], cfg["hidden_size"])


def test_cache_rounds_write_in_place_instead_of_reallocating():
    cache = KVCache()
    step = torch.randn(1, 2, 10, 4)
    cache.append(step, step)
    buffer = cache._k.data_ptr()
    for _ in range(5):
        cache.append(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
        cache.keep([*range(10), 12])
        torch.testing.assert_close(cache.k[:, :, :10], step)
        cache.crop(10)
    assert cache.length == 10 and cache._k.data_ptr() == buffer
