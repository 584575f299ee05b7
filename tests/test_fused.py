"""A decoder layer's projections of one input fused into one product
(``starhub.models.fused``): the loaded model computes what the stock one does, through
transformers' forward and through the target engine's, and stock ``generate()`` gives the
tokens the engine decodes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from starhub.models.fused import FusedLinear, Part, fuse_projections
from starhub.models.loading import load_model
from targets.verify import TargetModel


@pytest.fixture(scope="module")
def stock(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("linear", ["torch", "auto"])
def test_a_loaded_model_runs_one_product_per_group_and_keeps_the_stock_logits(tiny_dir, stock,
                                                                              linear):
    model, _ = load_model(str(tiny_dir), linear=linear)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, FusedLinear)
        assert isinstance(layer.mlp.gate_up_proj, FusedLinear)
        assert all(isinstance(getattr(layer.self_attn, p), Part)
                   for p in ("q_proj", "k_proj", "v_proj"))
    calls = []
    hooks = [layer.self_attn.qkv_proj.joint.register_forward_hook(lambda *a: calls.append(1))
             for layer in model.model.layers]
    ids = torch.randint(3, 40000, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for n in (9, 1):  # several rows, then one (a plain step's kernel)
            torch.testing.assert_close(model(ids[:, :n]).logits, stock(ids[:, :n]).logits,
                                       rtol=1e-4, atol=1e-4)
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2 * len(model.model.layers), "one product per layer and pass"


def test_the_engine_decodes_stock_generates_tokens_on_fused_layers(tiny_dir, stock):
    model, _ = load_model(str(tiny_dir))
    prompt = [1, 5, 9, 14, 3, 77, 1200]
    target = TargetModel(model)
    first, _ = target.prefill(prompt)
    out = [first] + [target.step() for _ in range(11)]
    ref = stock.generate(torch.tensor([prompt]), max_new_tokens=len(out), do_sample=False,
                         eos_token_id=None)[0, len(prompt):].tolist()
    assert out == ref


def test_a_part_called_on_another_input_runs_its_own_product(tiny_dir):
    model, _ = load_model(str(tiny_dir), linear="torch")
    attn = model.model.layers[0].self_attn
    a, b = torch.randn(1, 2, attn.q_proj.in_features), torch.randn(1, 2, attn.q_proj.in_features)
    with torch.inference_mode():
        q_a = attn.q_proj(a)
        k_b = attn.k_proj(b)  # not a's product
        torch.testing.assert_close(k_b, attn.qkv_proj(b)[1])
        torch.testing.assert_close(q_a, attn.qkv_proj(a)[0])
        attn.q_proj(a), attn.k_proj(a), attn.v_proj(a)
    assert attn.qkv_proj._memo is None, "nothing held once every part is taken"


def test_layers_that_do_not_share_an_input_shape_are_left_alone(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(7, model.config.intermediate_size)
    fused = fuse_projections(model)
    assert fused == 2 * len(model.model.layers) - 1
    assert not hasattr(model.model.layers[0].mlp, "gate_up_proj")
