"""The batched verification engine: several sessions' trees in one forward pass give each
session exactly what verifying it alone gives, greedy and sampled."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from starhub.drafters.base import DraftContext, TreeShape
from starhub.drafters.model import ModelDrafter
from targets.acceptance import Sampling, argmax_rows
from targets.engine import VerifyEngine
from targets.forward import run_through
from targets.verify import TargetModel

PROMPTS = [[1, 5, 9, 14, 3], list(range(20, 43)), [7, 7, 8]]
SHAPES = [TreeShape(4, 3, 9), TreeShape(2, 2, 3), TreeShape(5, 1, 5)]


def _drafter(model) -> ModelDrafter:
    """A drafter with the target's own weights: trees hold the target's path, plus
    siblings that get rejected, so rounds accept several tokens and refuse others."""
    return ModelDrafter(model, label="self")


def _run(model, sampling: Sampling, batched: bool, rounds: int = 6):
    drafter = _drafter(model)
    engine = VerifyEngine(model)
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


def test_batched_greedy_verification_equals_generate(tiny_model):
    model, _ = tiny_model
    outs, accepted = _run(model, Sampling(), batched=True)
    assert max(accepted) >= 2, "the self drafter's trees must get tokens accepted"
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=len(out), do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
        assert out == ref


def test_greedy_picks_are_torchs_argmax_first_on_a_tie_in_any_float_dtype():
    logits = torch.randn(11, 4096, generator=torch.Generator().manual_seed(0))
    logits[3, [7, 900]] = 1e3
    assert argmax_rows(logits) == logits.argmax(-1).tolist()
    assert argmax_rows(logits)[3] == 7
    half = logits.bfloat16()
    assert argmax_rows(half) == half.float().argmax(-1).tolist()
    assert argmax_rows(logits.double()[:1]) == logits[:1].argmax(-1).tolist()


def test_batched_sampled_verification_equals_one_session_at_a_time(tiny_model):
    model, _ = tiny_model
    # The tiny random model is nearly flat over its vocabulary: a low temperature gives it
    # distributions peaked enough for draws to be accepted, and some to be refused.
    sampling = Sampling(temperature=0.05)
    batched, accepted = _run(model, sampling, batched=True)
    alone, _ = _run(model, sampling, batched=False)
    assert batched == alone
    assert sum(accepted) > len(accepted) and min(accepted) < max(SHAPES[0].depth, 1)


def test_batched_features_match_single_session_features(tiny_model):
    model, _ = tiny_model
    engine = VerifyEngine(model)
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


def test_a_prefill_computes_the_logits_of_its_last_token_only(tiny_model, monkeypatch):
    """The chunks before a long prompt's last need no logits and its end needs one row: the
    LM head (or the greedy head that stands for it) never multiplies a whole chunk (at 1,024
    tokens, 200 MB of float32 logits for a 49,152-token vocabulary), and the first token is
    still ``generate()``'s."""
    model, _ = tiny_model
    rows = []
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: rows.append(
        args[0].shape[-2]))
    engine = VerifyEngine(model)
    greedy = engine.runner.greedy_head
    if greedy is not None:
        picks = greedy.picks
        monkeypatch.setattr(greedy, "picks", lambda x: rows.append(len(x)) or picks(x))
    prompt = [(11 * i) % 900 + 3 for i in range(300)]
    try:
        chunks = engine.open_chunks(0, prompt, 64)
        while chunks.run() is None:
            pass
        first, _ = chunks.result
        assert chunks.chunks == 5
        alone, _ = engine.open(1, prompt[:50])
    finally:
        hook.remove()
    assert rows == [1, 1], "the last of five chunks and a short prompt, one row each"
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                              do_sample=False, pad_token_id=2)
    assert first == int(want[0, -1])


def test_an_empty_tree_in_a_batch_is_one_plain_step(tiny_model):
    from targets.batcher import EMPTY_TREE

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


def _dense(leaves) -> list[torch.Tensor]:
    """The tensors with storage of their own (not oneDNN's packed weights)."""
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.layout == torch.strided]


class _Allocations(TorchDispatchMode):
    """Bytes of the storages that the ops run under it create (views make none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in _dense(pytree.tree_leaves((args, kwargs)))}
        for t in _dense(pytree.tree_leaves(out)):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_batched_pass_copies_no_session_cache(tiny_model):
    """A pass writes its new entries into each session's own storage and attends to it
    there: what it allocates grows with what the sessions hold only by the masks (a value
    for each fed token and entry it may see), never by a copy of the entries (a pass that
    padded or stacked the caches into a batch would allocate each of them again)."""
    model, _ = tiny_model
    drafter = _drafter(model)
    rows = 4
    allocated = {}
    for cached in (40, 400):
        engine = VerifyEngine(model)
        prompts = [[(7 * i + 3 * s) % 900 + 3 for i in range(cached)] for s in range(rows)]
        for sid, prompt in enumerate(prompts):
            engine.open(sid, prompt)
        trees = [drafter.propose(DraftContext(tokens=[*p, engine.sessions[s].last]),
                                 TreeShape(3, 3, 10)) for s, p in enumerate(prompts)]
        storage = [engine.sessions[s].kv.keys[0].data_ptr() for s in range(rows)]
        with _Allocations() as count:
            engine.verify(list(enumerate(trees)))
        allocated[cached] = count.bytes
        assert [engine.sessions[s].kv.keys[0].data_ptr() for s in range(rows)] == storage
    fed, groups = 11, model.config.num_attention_heads // model.config.num_key_value_heads
    width = next(model.parameters()).element_size()
    masks = rows * fed * groups * (400 - 40) * width  # a value for each query group and entry
    assert allocated[400] - allocated[40] <= masks < rows * (400 - 40) * engine.token_bytes


def test_features_are_the_hidden_states_transformers_returns(tiny_model):
    """A drafter's head was trained on transformers' ``output_hidden_states``: the engine's
    features are those tensors (the embeddings, each layer's output, the last normed)."""
    model, _ = tiny_model
    layers = [0, 1, -1]
    target = TargetModel(model, feature_layers=layers)
    _, feats = target.prefill(PROMPTS[1])
    with torch.inference_mode():
        states = model(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states
    assert torch.equal(feats, torch.cat([states[i][0] for i in layers], -1))


def test_a_model_the_engine_cannot_run_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    from targets.forward import DecoderPass

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="'gpt2'"):
        DecoderPass(model)


def test_prompt_logprobs_are_the_same_prefilled_whole_or_in_chunks(tiny_model):
    """An echo's prompt logprobs come from every prefill chunk's rows, each chunk's last
    row predicting the next chunk's first token."""
    from targets.verify import TargetModel

    model, _ = tiny_model
    prompt = [(7 * i + 3) % 1000 for i in range(40)]
    whole = TargetModel(model, logprobs=2, echo=True)
    first = whole.prefill(prompt)[0]
    chunked = TargetModel(model, logprobs=2, echo=True)
    assert run_through(chunked.prefill_chunks(prompt, 8))[0] == first
    assert whole.prompt_logprobs[0] is None and chunked.prompt_logprobs[0] is None
    assert len(whole.prompt_logprobs) == len(chunked.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        for got in (whole.prompt_logprobs[i], chunked.prompt_logprobs[i]):
            assert abs(got.logprob - float(ref[i - 1, prompt[i]])) < 1e-4
            assert [t for t, _ in got.top] == ref[i - 1].topk(2).indices.tolist()


def test_the_verifiers_budget_is_priced_against_a_tree_pass_never_a_one_token_pass(tiny_model):
    """A one-token pass may run on other kernels than a tree pass (``--linear auto`` keeps
    plain weights for one row where they are faster), so pricing the budget against it
    made the verifier's trees two tokens wide on a CPU where one row is fast."""
    from targets.engine import measure_budget

    model, _ = tiny_model
    fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: fed.append(args[0].numel()))
    try:
        budget = measure_budget(model, limit=8)
    finally:
        hook.remove()
    assert fed and min(fed) >= 2, f"a pass of {min(fed)} token timed"
    assert 2 <= budget <= 8


@pytest.mark.parametrize("fresh_at", [2, 1])
def test_rows_sharing_a_shelf_get_what_each_gets_alone_around_a_slot_not_in_the_pass(
        tiny_model, fresh_at):
    """One attention call over a shelf's slots serves rows of different lengths and tree
    sizes, skips a session in between that feeds nothing, and leaves a fresh prompt in the
    same pass to its own causal call: every row's logits and new cache entries are the ones
    it gets in a pass of its own."""
    import numpy as np

    from starhub.wire.tree import DraftTree, ancestor_mask, depths
    from targets.forward import ALL, SHARED_WIDTH, DecoderPass, Row

    model, _ = tiny_model
    runner = DecoderPass(model)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(50, 61))]
    trees = [DraftTree(np.array([9, 4, 2], np.int32), np.array([-1, 0, 0], np.int32)), None,
             DraftTree(np.array([8, 1, 6, 3, 2], np.int32), np.array([-1, 0, 1, 1, 2], np.int32))]

    def rows(caches, fresh):
        made = []
        for kv, tree, prompt in zip(caches, trees, prompts, strict=True):
            if tree is not None:
                depth = np.concatenate([[0], depths(tree.parents)])
                positions = kv.length + torch.from_numpy(depth)
                made.append(Row(kv, [prompt[-1], *tree.tokens.tolist()], positions,
                                ancestor_mask(tree.parents)))
        made.insert(fresh_at, Row(fresh, [4, 5, 6, 7]))
        return made

    with torch.inference_mode():
        together = [runner.new_cache(64) for _ in prompts]
        alone = [runner.new_cache(64) for _ in prompts]
        for kv, prompt in zip(together + alone, prompts + prompts, strict=True):
            run_through(runner.layer_by_layer([Row(kv, prompt[:-1], logits=ALL)]))
        assert len({kv.slot for kv in together}) == 3 and together[0].shelf is together[2].shelf
        fresh, fresh_alone = runner.new_cache(4), runner.new_cache(4)
        given = rows(together, fresh)
        sizes = [len(row.ids) for row in given]
        plan, _ = runner._plan(given, sizes, [sum(sizes[:i]) for i in range(3)])
        assert len(plan) == 1 and plan[0].batch == 3, "slots 0 to 2, one call"
        chunk = Row(together[2], list(range(3, 3 + SHARED_WIDTH + 1)))
        plan, alone_rows = runner._plan([given[0], chunk], [4, SHARED_WIDTH + 1], [0, 4])
        assert not plan and len(alone_rows) == 2, "a prompt's chunk is not padded to"
        mine = run_through(runner.layer_by_layer(rows(together, fresh)))
        theirs = [run_through(runner.layer_by_layer([row]))[0] for row in rows(alone, fresh_alone)]
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip([*together, fresh], [*alone, fresh_alone], strict=True):
        assert a.length == b.length
        torch.testing.assert_close(a.keys[1][:, :a.length], b.keys[1][:, :b.length])
        torch.testing.assert_close(a.values[1][:, :a.length], b.values[1][:, :b.length])
