"""The batched verification engine: several sessions' trees in one forward pass give each
session exactly what verifying it alone gives, greedy and sampled."""

from __future__ import annotations

import copy

import pytest
import torch

from starhub.drafters.base import DraftContext, TreeShape
from starhub.drafters.model import ModelDrafter
from targets.acceptance import Sampling
from targets.engine import RoomLayer, VerifyEngine
from targets.verify import TargetModel

PROMPTS = [[1, 5, 9, 14, 3], list(range(20, 43)), [7, 7, 8]]
SHAPES = [TreeShape(4, 3, 9), TreeShape(2, 2, 3), TreeShape(5, 1, 5)]


def _drafter(model) -> ModelDrafter:
    """A drafter with the target's own weights: trees hold the target's path, plus
    siblings that get rejected, so rounds accept several tokens and refuse others."""
    return ModelDrafter(model, label="self")


def _run(model, sampling: Sampling, batched: bool, rounds: int = 6, layout: str = "auto"):
    drafter = _drafter(model)
    engine = VerifyEngine(model, layout)
    singles = {}
    ctxs, outs = [], []
    for sid, prompt in enumerate(PROMPTS):
        if batched:
            first, _ = engine.open(sid, prompt, sampling, seed=sid)
        else:
            singles[sid] = TargetModel(model, sampling, seed=sid)
            first, _ = singles[sid].prefill(prompt)
        gen = torch.Generator().manual_seed(100 + sid)
        ctxs.append(DraftContext(tokens=[*prompt, first], temperature=sampling.temperature,
                                 generator=gen))
        outs.append([first])
    accepted = []
    for _ in range(rounds):
        trees = [drafter.propose(ctx, shape) for ctx, shape in zip(ctxs, SHAPES, strict=True)]
        if batched:
            verdicts = engine.verify(list(enumerate(trees)))
        else:
            verdicts = [singles[sid].verify(tree) for sid, tree in enumerate(trees)]
        for ctx, out, verdict in zip(ctxs, outs, verdicts, strict=True):
            ctx.tokens.extend(verdict.tokens)
            out.extend(verdict.tokens)
            accepted.append(len(verdict.path))
    return outs, accepted


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batched_greedy_verification_equals_generate(tiny_model, layout):
    model, _ = tiny_model
    outs, accepted = _run(model, Sampling(), batched=True, layout=layout)
    assert max(accepted) >= 2, "the self drafter's trees must get tokens accepted"
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=len(out), do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
        assert out == ref


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batched_sampled_verification_equals_one_session_at_a_time(tiny_model, layout):
    model, _ = tiny_model
    # The tiny random model is nearly flat over its vocabulary: a low temperature gives it
    # distributions peaked enough for draws to be accepted, and some to be refused.
    sampling = Sampling(temperature=0.05)
    batched, accepted = _run(model, sampling, batched=True, layout=layout)
    alone, _ = _run(model, sampling, batched=False)
    assert batched == alone
    assert sum(accepted) > len(accepted) and min(accepted) < max(SHAPES[0].depth, 1)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_batched_features_match_single_session_features(tiny_model, layout):
    model, _ = tiny_model
    engine = VerifyEngine(model, layout)
    drafter = _drafter(model)
    single = TargetModel(model, feature_layers=[-1])
    first, feats = single.prefill(PROMPTS[1])
    e_first, e_feats = engine.open(1, PROMPTS[1], feature_layers=[-1])
    engine.open(0, PROMPTS[0])
    assert first == e_first and torch.allclose(feats, e_feats)
    ctx = DraftContext(tokens=[*PROMPTS[1], first])
    tree = drafter.propose(copy.deepcopy(ctx), SHAPES[0])
    other = drafter.propose(DraftContext(tokens=[*PROMPTS[0], engine.sessions[0].last]),
                            SHAPES[1])
    alone = single.verify(tree)
    together = engine.verify([(0, other), (1, tree)])[1]
    assert together.tokens == alone.tokens
    assert torch.allclose(together.features, alone.features, atol=1e-5)
    assert engine.cached(1) == len(PROMPTS[1]) + len(alone.tokens)


def test_auto_layout_packs_ragged_short_rows_and_pads_long_caches(tiny_model):
    from targets.engine import _packing_pays

    config = tiny_model[0].config
    assert _packing_pays(config, cached=[40, 50, 60, 45], fed=[3, 4, 5, 6])
    assert not _packing_pays(config, cached=[4000, 5000, 6000, 4500], fed=[5, 5, 5, 6])
    assert not _packing_pays(config, cached=[40, 50], fed=[4, 4]), "equal rows: no padding"


def test_a_session_too_long_for_the_copy_budget_is_verified_alone_in_place(tiny_model):
    model, _ = tiny_model
    drafter = _drafter(model)
    long_prompt = [(7 * i) % 500 + 3 for i in range(300)]
    prompts = [long_prompt, PROMPTS[0], PROMPTS[2]]
    engine = VerifyEngine(model, "padded", copy_budget=0)
    engine.copy_budget = 64 * engine.token_bytes  # room for the short sessions only
    singles = [TargetModel(model) for _ in prompts]
    for sid, prompt in enumerate(prompts):
        assert engine.open(sid, prompt)[0] == singles[sid].prefill(prompt)[0]
    for _ in range(3):
        trees = [drafter.propose(DraftContext(tokens=[*p, t.last]), SHAPES[0])
                 for p, t in zip(prompts, singles, strict=True)]
        together = engine.verify(list(enumerate(trees)))
        alone = [t.verify(tree) for t, tree in zip(singles, trees, strict=True)]
        assert [v.tokens for v in together] == [v.tokens for v in alone]
        prompts = [[*p, *v.tokens[:-1]] for p, v in zip(prompts, alone, strict=True)]
    assert 0 < engine.copied_bytes <= engine.copy_budget


def test_a_prefill_computes_the_logits_of_its_last_token_only(tiny_model):
    """Chunks of a long prompt need no logits and its end needs one row: the LM head never
    multiplies a whole chunk (at 1,024 tokens, 200 MB of float32 logits for a
    49,152-token vocabulary), and the first token is still ``generate()``'s."""
    model, _ = tiny_model
    rows = []
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: rows.append(
        args[0].shape[-2]))
    prompt = [(11 * i) % 900 + 3 for i in range(300)]
    engine = VerifyEngine(model)
    try:
        chunks = engine.open_chunks(0, prompt, 64)
        with pytest.raises(StopIteration) as done:
            while True:
                next(chunks)
        first, _ = done.value.value
        alone, _ = engine.open(1, prompt[:50])
    finally:
        hook.remove()
    assert rows == [1] * 6, "five chunks and a short prompt, one row of logits each"
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                              do_sample=False, pad_token_id=2)
    assert first == int(want[0, -1])


def test_an_empty_tree_in_a_batch_is_one_plain_step(tiny_model):
    from targets.serve.batcher import EMPTY_TREE

    model, _ = tiny_model
    for sampling in (Sampling(), Sampling(temperature=0.9)):
        engine = VerifyEngine(model)
        singles = [TargetModel(model, sampling, seed=s) for s in range(3)]
        for sid, prompt in enumerate(PROMPTS):
            engine.open(sid, prompt, sampling, seed=sid)
            singles[sid].prefill(prompt)
        for _ in range(4):
            verdicts = engine.verify([(sid, EMPTY_TREE) for sid in range(3)])
            assert [v.tokens for v in verdicts] == [[t.step()] for t in singles]


def test_a_batched_pass_writes_its_new_entries_into_the_room_left_for_them():
    """The forward pass appends to a batched pass's cache in place: the keys and values it
    attends to are the buffers the caches were copied into, not a concatenated copy; a
    pass that feeds more than the room left is refused."""
    keys, values = torch.zeros(2, 3, 7, 4), torch.zeros(2, 3, 7, 4)
    layer = RoomLayer(keys, values, length=5)
    assert layer.get_seq_length() == 5
    new_keys, new_values = torch.ones(2, 3, 2, 4), torch.full((2, 3, 2, 4), 2.0)
    got_keys, got_values = layer.update(new_keys, new_values)
    assert got_keys.data_ptr() == keys.data_ptr() and got_keys.shape == keys.shape
    assert got_keys.is_contiguous() and got_values.is_contiguous()
    assert torch.equal(keys[:, :, 5:], new_keys) and torch.equal(values[:, :, 5:], new_values)
    assert layer.get_seq_length() == 7
    with pytest.raises(ValueError, match="room"):
        layer.update(new_keys, new_values)
