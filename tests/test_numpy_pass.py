"""Passes of a few tokens on numpy (``targets.numpy_pass``): the outputs and cache entries
of the layered pass they replace, for plain steps, trees and chunks of one session and plain
steps of several, on every one-row kernel and on the architectures the engine runs; taken
for those passes only, and only where it can run."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from threadpoolctl import ThreadpoolController
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from starhub.models.fused import fuse_projections
from starhub.models.loading import (
    BLAS_ROW,
    GEMV_ROW,
    TORCH_ROW,
    blas_alone,
    load_model,
    onednn_linears,
    prepack_linears,
    set_threads,
)
from starhub.wire.tree import DraftTree, ancestor_mask, depths
from targets.forward import ALL, LAST, NONE, DecoderPass, Row, run_through
from targets.numpy_pass import MAX_TOKENS, runs_here
from targets.verify import TargetModel

PROMPT = [1, 5, 9, 14, 3, 77, 1200, 40000, 8]
FEATURES = (0, 1, -1)
TREE = DraftTree(np.array([21, 22, 23, 24, 25, 26]), np.array([-1, 0, 0, 1, 1, 3]))


def _rows(kv, token: int) -> list[Row]:
    """A plain step, a tree's row, a causal chunk, a chunk that sees all of itself: each
    logits choice at least once."""
    positions = kv.length + torch.from_numpy(np.concatenate([[0], depths(TREE.parents)]))
    return [Row(kv, [token], features=FEATURES, logits=ALL),
            Row(kv, [token, *TREE.tokens.tolist()], positions, ancestor_mask(TREE.parents),
                features=FEATURES, logits=ALL),
            Row(kv, [token, 40, 41], features=FEATURES, logits=LAST),
            Row(kv, [token, 43], mask=torch.ones(2, 2, dtype=torch.bool), logits=ALL),
            Row(kv, [token, 42], logits=NONE)]


BLAS_ROWS = "blas rows"
"""``BLAS_ROW`` taking products of every row count a pass here has (two of them padded)."""


def _prepared(path, kernel: str | None):
    """The model at ``path`` with norm weights and biases moved off their initial 1s and 0s
    (so that a norm or bias left out or misplaced shows), fused and prepacked with single
    rows on ``kernel`` (``BLAS_ROWS``: a tree's and a chunk's rows as well)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    fuse_projections(model)
    prepack_linears(model, BLAS_ROW if kernel == BLAS_ROWS else kernel)
    linears = onednn_linears(model)
    assert {linear.one_row_kernel for linear in linears} == \
        {BLAS_ROW if kernel == BLAS_ROWS else kernel}
    if kernel == BLAS_ROWS:
        for linear in linears:
            linear.blas_max, linear.blas_pad = MAX_TOKENS, {2: 3, 7: 8}
    return model


def _close(a, b) -> None:
    for mine, theirs in ((a.logits, b.logits), (a.features, b.features)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def _both_ways(model) -> None:
    """Passes of each kind on numpy and the same ones on the layered pass, from one
    prefilled cache each (and a prompt's first chunk, from none): every pass's logits,
    features and cache entries agree."""
    runner = DecoderPass(model)
    assert runner.numpy_pass is not None
    fast, slow = runner.new_cache(64), runner.new_cache(64)
    with torch.inference_mode():
        _close(runner([Row(fast, PROMPT, features=FEATURES)])[0],
               run_through(runner.layer_by_layer([Row(slow, PROMPT, features=FEATURES)]))[0])
    token = 11
    for kind in range(len(_rows(fast, token))):
        with torch.inference_mode():
            (a,) = runner([_rows(fast, token)[kind]])
            (b,) = run_through(runner.layer_by_layer([_rows(slow, token)[kind]]))
        _close(a, b)
        if b.logits is not None:
            token = int(b.logits[-1].argmax())
    # plain steps of three sessions in one pass: this one, a fresh one and a longer one
    others = [(runner.new_cache(64), runner.new_cache(64)) for _ in range(2)]
    with torch.inference_mode():
        for a, b, prompt in ((*others[0], PROMPT[:2]), (*others[1], PROMPT * 3)):
            runner([Row(a, prompt)])
            run_through(runner.layer_by_layer([Row(b, prompt)]))
        several = [(fast, slow, token), (*others[0], 5), (*others[1], 6)]
        mine = runner([Row(a, [t], features=FEATURES) for a, _, t in several])
        theirs = run_through(runner.layer_by_layer(
            [Row(b, [t], features=FEATURES) for _, b, t in several]))
    for a, b in zip(mine, theirs, strict=True):
        _close(a, b)
    for a, b, _ in several:
        _same_entries(runner, a, b)


def _same_entries(runner, fast, slow) -> None:
    assert fast.length == slow.length
    for layer in range(len(runner.layers)):
        for mine, theirs in ((fast.keys, slow.keys), (fast.values, slow.values)):
            torch.testing.assert_close(mine[layer][:, :fast.length],
                                       theirs[layer][:, :slow.length], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [BLAS_ROW, BLAS_ROWS, GEMV_ROW, TORCH_ROW, None])
def test_a_numpy_pass_gives_the_layered_passs_logits_features_and_cache_on_every_kernel(
        tiny_dir, kernel):
    _both_ways(_prepared(tiny_dir, kernel))


@pytest.mark.parametrize("kernel", [BLAS_ROW, BLAS_ROWS, None])
@pytest.mark.parametrize("config", [
    Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2),  # biased q/k/v
    Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16),  # q/k norms
], ids=["qwen2", "qwen3"])
def test_a_numpy_pass_runs_the_other_architectures_as_the_layered_pass(tmp_path, config,
                                                                     kernel):
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    _both_ways(_prepared(tmp_path, kernel))


@contextmanager
def _layered_passes(model):
    """A list that counts the decoder layers the layered pass runs (the numpy pass runs
    none of them as modules)."""
    calls: list[int] = []
    hooks = [layer.self_attn.qkv_proj.register_forward_hook(lambda *a: calls.append(1))
             for layer in model.model.layers]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def test_a_row_too_long_for_numpy_runs_through_the_layers(tiny_model):
    model, _ = tiny_model
    runner = DecoderPass(model)
    with _layered_passes(model) as calls, torch.inference_mode():
        runner([Row(runner.new_cache(64), list(range(3, 3 + MAX_TOKENS)))])
        assert calls == []
        runner([Row(runner.new_cache(64), list(range(3, 4 + MAX_TOKENS)))])
        assert len(calls) == len(model.model.layers)


def test_a_sessions_row_and_several_plain_steps_run_on_numpy_several_trees_through_layers(
        tiny_model):
    model, _ = tiny_model
    target, other = TargetModel(model), TargetModel(model)
    target.prefill(PROMPT)
    other.prefill(PROMPT)
    with _layered_passes(model) as calls:
        target.step()
        target.verify(TREE)
        with torch.inference_mode():
            target.runner([Row(target.kv, [3]), Row(other.kv, [4])])
        assert calls == [], "a plain step, a tree, plain steps of two sessions run on numpy"
        with torch.inference_mode():
            target.runner([Row(target.kv, [3, 5]), Row(other.kv, [4])])
        assert len(calls) == len(model.model.layers)
    assert runs_here([1] * MAX_TOKENS) and not runs_here([1] * (MAX_TOKENS + 1))


def test_a_model_the_numpy_pass_cannot_run_keeps_the_layered_pass(tiny_dir):
    half, _ = load_model(str(tiny_dir), dtype="bfloat16")
    assert DecoderPass(half).numpy_pass is None
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert DecoderPass(stock).numpy_pass is None, "unfused projections"
    compiled, _ = load_model(str(tiny_dir), compile=True)  # its MLPs stay unfused
    assert DecoderPass(compiled).numpy_pass is None


def test_a_blas_product_inside_a_pytorch_pass_runs_on_one_blas_thread_and_gives_it_back():
    """Torch's threads spin between ops; a BLAS pool as large fought them for the cores
    (generate() at 2 threads ran 3.7 tokens/s against 22 at one)."""
    def blas_threads() -> list[int]:
        return [lib.num_threads for lib in
                ThreadpoolController().select(user_api="blas").lib_controllers]

    before = torch.get_num_threads()
    try:
        set_threads(2)
        with blas_alone():
            inside = blas_threads()
        assert inside and set(inside) == {1} and set(blas_threads()) == {2}
        set_threads(1)
        with blas_alone():
            assert set(blas_threads()) == {1}
    finally:
        set_threads(before)


def test_a_numpy_pass_of_several_tokens_keeps_numpys_products_to_one_blas_thread(tiny_model):
    """A tree's products run through PyTorch, whose threads spin between ops: the row's
    attention on numpy's BLAS pool fought them (a 10-node tree over 600 cached tokens took
    450-580 ms on the embedded model instead of 45-55). A plain step runs no PyTorch product
    and keeps the whole pool."""
    model, _ = tiny_model
    target = TargetModel(model)
    target.prefill(PROMPT)
    layer = target.runner.numpy_pass.layers[0]
    seen: list[set[int]] = []
    attention_out = layer.o

    def o(x):  # the first product after the row's attention
        seen.append({lib.num_threads for lib in
                     ThreadpoolController().select(user_api="blas").lib_controllers})
        return attention_out(x)

    before = torch.get_num_threads()
    layer.o = o
    try:
        set_threads(2)
        target.verify(TREE)
        target.step()
    finally:
        layer.o = attention_out
        set_threads(before)
    assert seen == [{1}, {2}], "a tree's row on one BLAS thread, a plain step on the pool"


def test_a_greedy_plain_step_on_the_whole_blas_pool_leaves_pytorchs_threads_idle(tiny_dir):
    """A plain step whose products run on numpy's BLAS pool of several threads takes its
    token from the float32 head's logits there: the greedy head's products run on PyTorch's
    threads, which then spin on the cores the BLAS's threads need (a 2-thread plain step of
    the embedded model took 53-55 ms with them, 38 without). On one thread, or with its
    single rows on PyTorch, the step gets the greedy head's picks. The token is the same."""
    model = _prepared(tiny_dir, GEMV_ROW)
    runner = DecoderPass(model)
    if runner.greedy_head is None:
        pytest.skip("no greedy head here (no native bfloat16)")
    before = torch.get_num_threads()
    try:
        for threads, on_logits in ((2, True), (1, False)):
            set_threads(threads)
            kv = runner.new_cache(64)
            with torch.inference_mode():
                runner([Row(kv, PROMPT)])
                (out,) = runner([Row(kv, [11], picks=True, logits=LAST)])
                (want,) = run_through(runner.layer_by_layer([Row(runner.new_cache(64),
                                                                 [*PROMPT, 11], logits=LAST)]))
            assert (out.picks is None) == on_logits, f"{threads} threads"
            token = int(out.logits[-1].argmax()) if on_logits else out.picks[-1]
            assert token == int(want.logits[-1].argmax())
        set_threads(2)
        torch_rows = DecoderPass(_prepared(tiny_dir, TORCH_ROW))
        kv = torch_rows.new_cache(64)
        with torch.inference_mode():
            torch_rows([Row(kv, PROMPT)])
            (out,) = torch_rows([Row(kv, [11], picks=True, logits=LAST)])
        assert out.picks is not None, "single rows on PyTorch keep the greedy head"
    finally:
        set_threads(before)
