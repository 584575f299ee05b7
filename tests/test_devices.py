"""``--device`` and ``--device-map``: where a GPU is missing the error says so at once; where
GPUs are present, targets, drafters and the batched engine run on them and stay lossless.
The GPU tests skip themselves, with the reason, on machines without CUDA (as CI has)."""

from __future__ import annotations

import argparse

import pytest
import torch

from starhub.models.devices import device_map_kwargs, resolve_device
from starhub.options import Device
from starhub.settings.cli import value_type

device_arg = value_type(Device)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to this process")
needs_two = pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2,
                               reason="a device map needs at least two CUDA GPUs")


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cuda:-1", "tpu", ""])
def test_device_flag_rejects_what_is_no_device(text):
    with pytest.raises(argparse.ArgumentTypeError, match="cpu, cuda, cuda:N or auto"):
        device_arg(text)


def test_device_flag_accepts_every_documented_form():
    assert [device_arg(t) for t in ("cpu", "CUDA", "cuda:3", "auto")] == \
        ["cpu", "cuda", "cuda:3", "auto"]


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_a_clear_error():
    assert resolve_device("auto") == "cpu"
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {spec}: no CUDA GPU is visible"):
            resolve_device(spec)
    with pytest.raises(ValueError, match="--device-map auto: no CUDA GPU is visible"):
        device_map_kwargs("auto")
    assert device_map_kwargs(None) == {}


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_a_target_asked_for_a_gpu_it_lacks_exits_with_the_reason(tmp_path, caplog):
    from starhub.cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 0, "prompt": "hi"}\n')
    code = main(["target", "--device", "cuda:0", "--prompts", str(prompts),
                 "--out", str(tmp_path / "o.jsonl")])
    assert code == 2
    assert "no CUDA GPU is visible" in caplog.text


@needs_cuda
def test_cuda_resolves_to_a_numbered_device_and_checks_the_count():
    assert resolve_device("cuda") == resolve_device("auto") == "cuda:0"
    with pytest.raises(ValueError, match="GPU\\(s\\), numbered from 0"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@needs_cuda
def test_star_on_the_gpu_matches_generate_on_the_gpu():
    """The EAGLE head drafts on the GPU, the target verifies on it; float32, so that the
    comparison with generate() on the same GPU is exact."""
    from conftest import HubThread

    from starhub.drafters import make_drafter
    from starhub.models.loading import load_model
    from starhub.models.prompts import encode_prompt
    from targets.generate import SpeculativeGenerator

    drafter = make_drafter("eagle", device="cuda")
    assert drafter.device.type == "cuda"
    hub = HubThread(drafter, ttl_s=30.0)
    model, tokenizer = load_model("default", dtype="float32", device="cuda")
    gen = SpeculativeGenerator(model, tokenizer, hub.address)
    try:
        for prompt in ("What is the capital of France?", "Write a haiku about the sea."):
            ids = encode_prompt(tokenizer, prompt, True)
            result = gen.generate(ids, 48)
            expected = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=48,
                                      do_sample=False)[0, len(ids):].tolist()
            assert result.output_ids == expected
            assert result.stats.mean_accept_len > 1.2, "the GPU head must get drafts accepted"
    finally:
        gen.close()
        hub.stop()


@needs_cuda
def test_sampled_drafts_on_the_gpu_carry_their_distributions():
    """Sampled trees draw on the CPU from distributions the GPU computed."""
    from starhub.drafters.base import DraftContext, TreeShape
    from starhub.drafters.model import ModelDrafter
    from starhub.models.loading import load_model

    model, tokenizer = load_model("default", dtype="float32", device="cuda", layers=4)
    ctx = DraftContext(tokens=[1, 2, 3, 4], temperature=0.8,
                       generator=torch.Generator().manual_seed(0))
    tree = ModelDrafter(model, tokenizer).propose(ctx, TreeShape(3, 2, 6))
    assert len(tree) and tree.dist_probs is not None
    assert abs(float(tree.dist_probs[0].sum()) - 1.0) < 1e-4


@needs_two
def test_a_device_map_target_verifies_trees_like_a_single_device_one(tiny_dir):
    """Layers on two GPUs: tree verification, features and cache compaction agree with the
    same model on one GPU."""
    from starhub.drafters.base import DraftContext, TreeShape
    from starhub.drafters.model import ModelDrafter
    from starhub.models.loading import load_model
    from targets.acceptance import Sampling
    from targets.engine import VerifyEngine

    spread, _ = load_model(str(tiny_dir), dtype="float32", device_map="0,1")
    assert len({p.device for p in spread.parameters()}) == 2
    single, _ = load_model(str(tiny_dir), dtype="float32", device="cuda:0")
    outs = []
    for model in (spread, single):
        engine = VerifyEngine(model)
        drafter = ModelDrafter(single)
        first, _ = engine.open(0, [1, 5, 9, 14, 3], Sampling(), seed=0, feature_layers=[1, 2])
        ctx = DraftContext(tokens=[1, 5, 9, 14, 3, first])
        out = [first]
        for _ in range(4):
            verdict = engine.verify([(0, drafter.propose(ctx, TreeShape(3, 2, 6)))])[0]
            ctx.tokens.extend(verdict.tokens)
            out.extend(verdict.tokens)
            assert verdict.features is not None and len(verdict.features) == len(verdict.tokens)
        outs.append(out)
    assert outs[0] == outs[1]
