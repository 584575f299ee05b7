import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from starhub.cli.main import build_parser
from starhub.drafters import parse_draft
from starhub.models.loading import ModelNotFound, resolve
from targets.runner import read_prompts

needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile's CPU backend needs a C++ compiler")


def test_unknown_model_spec_names_what_is_accepted(tmp_path):
    with pytest.raises(ModelNotFound, match="nothing is downloaded"):
        resolve("no-such-org/no-such-model")
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(ModelNotFound, match="no GGUF file"):
        resolve(str(tmp_path / "x.gguf"))


def test_draft_specs_parse():
    assert parse_draft("self") == ("self", None)
    assert parse_draft("self:layers=8") == ("self", 8)
    assert parse_draft("/models/small") == ("/models/small", None)
    with pytest.raises(ValueError):
        parse_draft("self:depth=3")


def test_prompt_files_accept_plain_and_mt_bench_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "hi"}\n\n'
                    '{"question_id": 81, "turns": ["first", "second"]}\n')
    assert read_prompts(path) == [("a", "hi"), (81, "first")]
    path.write_text('{"text": "nope"}\n')
    with pytest.raises(ValueError, match=":1: needs 'prompt'"):
        read_prompts(path)


def test_conversation_prompts_keep_their_turns_and_end_with_the_user(tmp_path, tokenizer):
    from starhub.models.prompts import encode_prompt

    turns = [{"role": "user", "content": "Name a planet."},
             {"role": "assistant", "content": "Mars."},
             {"role": "user", "content": "Why is it red?"}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "c", "messages": turns}) + "\n")
    [(id_, prompt)] = read_prompts(path)
    assert id_ == "c" and prompt == turns
    ids = encode_prompt(tokenizer, prompt)
    assert ids == list(tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    assert "Mars." in tokenizer.decode(ids) and len(ids) > len(encode_prompt(tokenizer, "Why?"))
    for bad in ([], turns[:2], [{"role": "robot", "content": "x"}], [{"role": "user"}]):
        path.write_text(json.dumps({"id": "c", "messages": bad}) + "\n")
        with pytest.raises(ValueError, match=":1: 'messages' must be a list"):
            read_prompts(path)


def test_the_held_out_set_covers_its_styles_and_shares_nothing_with_training():
    root = Path(__file__).resolve().parent.parent / "scripts" / "prompts"
    rows = [json.loads(line) for line in (root / "heldout.jsonl").read_text().splitlines()]
    assert {r["category"] for r in rows} == {"multi-part", "passage", "code", "persona",
                                             "math-word", "two-turn"}
    assert all(len(r["messages"]) == 3 and r["messages"][1]["content"]
               for r in rows if r["category"] == "two-turn")
    assert len(read_prompts(root / "heldout.jsonl")) == len(rows) == 40
    train = {json.loads(line)["prompt"] for line in (root / "train.jsonl").read_text().splitlines()}
    asked = {r.get("prompt") or r["messages"][0]["content"] for r in rows}
    assert not asked & train


def test_help_explains_every_command():
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("hub", "target", "generate", "demo", "bench", "train-eagle"):
        assert cmd in text


def test_train_eagle_subcommand_hands_its_options_to_the_training_script():
    out = subprocess.run([sys.executable, "-m", "starhub", "train-eagle", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--draft-vocab" in out.stdout and "--unroll" in out.stdout


def test_eagle_is_the_default_drafter_and_needs_a_head_for_other_models():
    from starhub.drafters import make_drafter

    assert build_parser().parse_args(["hub"]).drafter == "eagle"
    with pytest.raises(ValueError, match="--draft HEAD_DIR"):
        make_drafter("eagle", None, "some/other-model")


def test_dtype_auto_keeps_cpu_targets_exact_and_gives_eagle_heads_bf16_or_int8(tiny_dir,
                                                                              tmp_path):
    import torch

    from starhub.drafters import make_drafter
    from starhub.drafters.eagle_head import EAGLE, save_eagle_head
    from starhub.models.loading import (
        DraftWeights,
        draft_weights,
        int8_cpu,
        native_bf16_cpu,
        target_dtype,
    )
    from tests.test_eagle_drafter import random_head

    assert target_dtype("auto") == torch.float32
    assert target_dtype("auto", device="cuda") == torch.bfloat16
    assert draft_weights("auto") == (DraftWeights(torch.bfloat16, False) if native_bf16_cpu()
                                     else DraftWeights(torch.float32, int8_cpu()))
    assert draft_weights("auto", device="cuda") == DraftWeights(torch.bfloat16, False)
    assert draft_weights("float32") == DraftWeights(torch.float32, False)
    if int8_cpu():
        assert draft_weights("int8") == DraftWeights(torch.float32, True)
    with pytest.raises(ValueError, match="int8 needs a CPU"):
        draft_weights("int8", device="cuda")
    with pytest.raises(ValueError, match="unknown draft dtype 'fp8'"):
        draft_weights("fp8")
    with pytest.raises(ValueError, match="is for an EAGLE head"):
        make_drafter("model", "self", str(tiny_dir), "int8")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        target_dtype("fp8")
    head = tmp_path / "head"
    save_eagle_head(random_head(tiny_dir, EAGLE, None), head)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        drafter = make_drafter("eagle", str(head), str(tiny_dir), name)
        assert drafter.dtype == dtype and drafter.weights == name and not drafter.int8
    if int8_cpu():
        drafter = make_drafter("eagle", str(head), str(tiny_dir), "int8")
        assert drafter.int8 and drafter.dtype == torch.float32
        assert drafter.weights == "int8 linear layers (fc in float32)"
    assert make_drafter("model", "self", str(tiny_dir), "auto").model.dtype == torch.float32


def test_onednn_linears_keep_float32_logits_and_greedy_tokens(tiny_dir):
    import torch

    from starhub.models.loading import linear_kernel, load_model

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert linear_kernel("auto", torch.float32) == "onednn"
    assert linear_kernel("auto", torch.float32, device="cuda") == "torch"
    assert linear_kernel("auto", torch.float32, compile=True) == "torch"
    with pytest.raises(ValueError, match="compile"):
        linear_kernel("onednn", torch.float32, compile=True)
    assert linear_kernel("auto", torch.float16) == "torch"
    with pytest.raises(ValueError, match="needs a CPU with oneDNN"):
        linear_kernel("onednn", torch.float16)
    with pytest.raises(ValueError, match="unknown linear kernel 'blas'"):
        linear_kernel("blas", torch.float32)
    plain, _ = load_model(str(tiny_dir), linear="torch")
    packed, _ = load_model(str(tiny_dir), linear="onednn")
    assert type(packed.lm_head) is not torch.nn.Linear
    ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = plain(ids).logits, packed(ids).logits
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=2)
        assert packed.generate(ids, **kw).tolist() == plain.generate(ids, **kw).tolist()


def _plain_twice(tiny_dir):
    """Two loads of the tiny model on PyTorch's own linears (skips without oneDNN)."""
    import torch

    from starhub.models.loading import load_model

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    return (load_model(str(tiny_dir), linear="torch")[0],
            load_model(str(tiny_dir), linear="torch")[0])


def _all_layers_take(packed, plain, most: int, attr: str, kernel: str, tokens: int) -> None:
    """A timing at load left every layer of ``packed`` taking ``most`` rows (``attr``) on
    its one-row ``kernel``, as its start-up line says, and the model's logits over
    ``tokens`` tokens stay the plain model's."""
    import torch

    from starhub.models.loading import FEW_ROWS, linear_in_use, onednn_linears

    assert 1 <= most <= FEW_ROWS
    assert {getattr(m, attr) for m in onednn_linears(packed)} == {most}
    assert linear_in_use(packed) == (f"onednn ({kernel} for one row)" if most == 1
                                     else f"onednn ({kernel} for up to {most} rows)")
    ids = torch.randint(3, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def _telling_layer():
    """``(layer, prepacked, plain)``: a ``TORCH_ROW`` layer whose plain copy is made to
    differ from its prepacked weight (doubled), and the two as linear layers, to tell which
    of them a product ran on."""
    import torch

    from starhub.models.loading import TORCH_ROW, OneDNNLinear

    linear = torch.nn.Linear(48, 40)
    layer = OneDNNLinear(linear, TORCH_ROW)
    doubled = torch.nn.Linear(48, 40)
    with torch.no_grad():
        doubled.weight.copy_(2 * linear.weight)
        doubled.bias.copy_(linear.bias)
    layer.one_row = doubled.weight.detach()
    return layer, linear, doubled


@pytest.mark.parametrize("kernel", ["torch", "blas", "gemv"])
def test_prepacked_linears_keep_plain_weights_for_single_rows_only_where_asked(tiny_dir, kernel):
    """``--linear auto`` may keep each layer's plain weight for one-row products (a plain
    decoding step) beside the prepacked one (the rest), run by PyTorch or by numpy's BLAS
    (over blocks of columns or the whole transpose): each gives the plain model's logits,
    one row goes through the plain weight, a tied LM head shares the embeddings' copy under
    PyTorch, and nothing is left in the weights file's map."""
    import torch

    from starhub.models.loading import (
        fastest_one_row,
        linear_in_use,
        load_model,
        onednn_linears,
        prepack_linears,
        release_weights_file,
    )

    plain, both = _plain_twice(tiny_dir)
    prepack_linears(both, one_row=kernel)
    release_weights_file(both)
    assert linear_in_use(both) == f"onednn ({kernel} for one row)"
    assert linear_in_use(plain) == "torch"
    if both.config.tie_word_embeddings and kernel == "torch":
        assert both.lm_head.one_row.data_ptr() == both.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(both(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(both(ids[:, :1]).logits, plain(ids[:, :1]).logits,
                                   rtol=1e-4, atol=1e-4)
        layer = both.model.layers[0].mlp.down_proj
        x = torch.randn(1, 1, layer.in_features)
        before = layer(x)
        assert before.shape == (1, 1, layer.out_features)
        layer.packed.zero_()  # one row never reads the prepacked weight
        torch.testing.assert_close(layer(x), before)
        assert not layer(torch.randn(2, layer.in_features)).any()
    packed, _ = load_model(str(tiny_dir), linear="onednn")
    assert all(m.one_row is None for m in onednn_linears(packed))
    assert linear_in_use(packed) == "onednn"
    with pytest.raises(ValueError, match="plain weights"):
        fastest_one_row(packed)


@pytest.mark.parametrize("whole", [False, True])
def test_auto_runs_single_rows_on_the_kernel_it_timed_fastest_and_keeps_the_logits(tiny_dir,
                                                                                   whole):
    """The timing at load leaves every layer on one kernel for single rows (or none; the
    whole transpose only for a model that runs single rows only), and whichever it chose,
    one row's logits are the plain model's."""
    import torch

    from starhub.models.loading import (
        TORCH_ROW,
        fastest_one_row,
        linear_in_use,
        onednn_linears,
        prepack_linears,
    )

    plain, auto = _plain_twice(tiny_dir)
    prepack_linears(auto, TORCH_ROW)
    chosen = fastest_one_row(auto, rounds=1, whole=whole)
    assert chosen in (None, "torch", "blas", *(("gemv",) if whole else ()))
    assert {m.one_row_kernel for m in onednn_linears(auto)} == {chosen}
    assert linear_in_use(auto) == ("onednn" if chosen is None else f"onednn ({chosen} for one row)")
    ids = torch.tensor([[5, 17, 301]])
    with torch.inference_mode():
        torch.testing.assert_close(auto(ids[:, :1]).logits, plain(ids[:, :1]).logits,
                                   rtol=1e-4, atol=1e-4)


@needs_compiler
def test_compiled_mlps_give_the_eager_models_logits_at_any_length(tiny_dir):
    import torch

    from starhub.models.loading import load_model

    eager, _ = load_model(str(tiny_dir), linear="torch")
    compiled, _ = load_model(str(tiny_dir), compile=True)
    assert all(type(layer.mlp).__name__ == "OptimizedModule"
               for layer in compiled.model.layers)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (1, 5, 12):  # one token, then the shape every longer pass shares
            ids = torch.randint(3, 40000, (1, n), generator=g)
            torch.testing.assert_close(compiled(ids).logits, eager(ids).logits)


COMPILED_MATCHES_EAGER = """
import sys, torch
from starhub.models.loading import load_model
eager, _ = load_model(sys.argv[1], linear="torch")
compiled, _ = load_model(sys.argv[1], compile=True)
ids = torch.randint(3, 40000, (1, 7), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    torch.testing.assert_close(compiled(ids).logits, eager(ids).logits)
"""


@needs_compiler
def test_compiled_kernels_cached_for_one_vector_isa_are_not_read_back_under_another(
        tiny_dir, tmp_path):
    import torch

    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU has only the one vector ISA")
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # one cache, as on any machine
    for isa in ({}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}):
        run = subprocess.run([sys.executable, "-c", COMPILED_MATCHES_EAGER, str(tiny_dir)],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, **cache, **isa})
        assert run.returncode == 0, f"compiled logits differ under {isa}:\n{run.stderr[-2000:]}"


def test_target_without_hub_writes_generate_compatible_lines(tiny_dir, tiny_model, tmp_path):
    import torch

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": 1, "turns": ["TargetCard there"]}\n')
    out = tmp_path / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "starhub", "target", "--model", str(tiny_dir),
                           "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "9",
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())
    assert set(row) == {"id", "prompt_ids", "output_ids", "text", "stats"}
    model, _ = tiny_model
    ids = row["prompt_ids"]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=9, do_sample=False)
    assert row["output_ids"] == expected[0, len(ids):].tolist()


def test_a_missing_prompt_file_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "starhub", "target", "--prompts",
                           str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "none.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_a_prepacked_model_keeps_no_weight_in_its_files_memory_map(tiny_dir):
    """Packed linears hold copies of their own; what is left (embeddings, norms) is copied
    out too, so that the file's map, whose pages read while packing count as resident,
    goes away."""
    import torch

    from starhub.models.loading import load_model

    if not torch.backends.mkldnn.is_available() or not Path("/proc/self/maps").exists():
        pytest.skip("needs oneDNN and /proc")
    weights = tiny_dir / "model.safetensors"
    plain, _ = load_model(str(tiny_dir), linear="torch")
    mapped = _mapped_ranges(weights)
    assert any(lo <= p.data_ptr() < hi for p in plain.parameters() for lo, hi in mapped), \
        "a plain load reads its weights through the map: nothing to check against"
    packed, _ = load_model(str(tiny_dir), linear="onednn")
    mapped = _mapped_ranges(weights)
    inside = [name for name, p in packed.named_parameters()
              if any(lo <= p.data_ptr() < hi for lo, hi in mapped)]
    assert not inside, f"still in the weights file's map: {inside}"


def test_a_tokenizer_fingerprint_is_hashed_once_and_follows_added_tokens(default_model_dir):
    """A target sends its card on every connection: the vocabulary is hashed once per
    tokenizer, and again only when tokens were added since."""
    from transformers import AutoTokenizer

    from starhub.models.loading import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    reads = []
    vocab = tokenizer.get_vocab
    tokenizer.get_vocab = lambda: reads.append(1) or vocab()
    first = tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == first and len(reads) == 1
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(default_model_dir)) == first
    tokenizer.add_tokens(["<a-token-added-later>"])
    assert tokenizer_fingerprint(tokenizer) != first and len(reads) == 2


def test_a_shard_is_parsed_once_and_a_bad_one_is_refused_by_name(capsys):
    parse = build_parser().parse_args
    base = ["--prompts", "p.jsonl"]
    assert parse(["target", *base, "--out", "o", "--shard", "1/3"]).shard == (1, 3)
    assert parse(["target", *base, "--out", "o"]).shard == (0, 1)
    assert parse(["drafter", "--verifier", "tcp://h:1", *base, "--out", "o",
                  "--shard", "2/4"]).shard == (2, 4)
    for bad in ("2/2", "1/0", "-1/2", "x", "1/y"):
        with pytest.raises(SystemExit):
            parse(["target", *base, "--out", "o", f"--shard={bad}"])
        assert f"expected I/N with 0 <= I < N, got '{bad}'" in capsys.readouterr().err


def test_two_row_products_run_as_three_only_where_timed_faster_and_give_the_same_rows(tiny_dir):
    """``two_rows_as_three`` pads two-row products with a copy of the first row where a
    timing says three rows run faster; the two rows' outputs are what two rows give."""
    import torch

    from starhub.models.loading import load_model, onednn_linears, two_rows_as_three

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    model, _ = load_model(str(tiny_dir), linear="onednn")
    decided = two_rows_as_three(model, rounds=1)
    assert {m.pad_two_rows for m in onednn_linears(model)} == {decided}
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 2, layer.in_features)
    with torch.inference_mode():
        layer.pad_two_rows = False
        plain = layer(x)
        layer.pad_two_rows = True
        padded = layer(x)
        three = torch.randn(3, layer.in_features)
        torch.testing.assert_close(layer(three)[:2], layer(three[:2]))
    assert padded.shape == plain.shape == (1, 2, layer.out_features)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_products_of_a_few_rows_on_the_blas_give_the_prepacked_products_padded_or_not(
        tiny_dir):
    """Where single rows run on the BLAS, ``rows_on_blas`` leaves every layer taking the same
    number of rows there, and the model's logits stay the plain model's; a layer's products
    of any count up to it (padded to a larger count or not, its weight in blocks or in one)
    are the plain layer's, bias included."""
    import torch

    from starhub.models import loading

    plain, packed = _plain_twice(tiny_dir)
    loading.prepack_linears(packed, loading.BLAS_ROW)
    _all_layers_take(packed, plain, loading.rows_on_blas(packed, rounds=1), "blas_max",
                     "blas", tokens=6)
    for out in (64, 40):  # two blocks of columns; one
        linear = torch.nn.Linear(48, out)
        layer = loading.OneDNNLinear(linear, loading.BLAS_ROW)
        layer.blas_max, layer.blas_pad = 8, {3: 6, 5: 8}
        x = torch.randn(8, 48)
        with torch.inference_mode():
            for rows in range(1, 9):
                assert layer.on_blas(rows)
                torch.testing.assert_close(layer(x[:rows]), linear(x[:rows]), rtol=1e-5,
                                           atol=1e-5)
        assert not layer.on_blas(9)


def test_many_row_products_run_on_the_plain_weights_only_at_the_counts_timed_faster(tiny_dir):
    """``many_rows_on_plain`` leaves every layer of a shape on the counts it timed faster on
    the plain weights, and the model's logits stay the plain model's; a layer sends a
    product there by the first timed count at or above its rows (the last beyond them),
    never a product of a few rows, and reads the prepacked weight for the rest."""
    import torch

    from starhub.models import loading

    plain, both = _plain_twice(tiny_dir)
    loading.prepack_linears(both, loading.TORCH_ROW)
    chosen = loading.many_rows_on_plain(both, rounds=1)
    layers = loading.onednn_linears(both)
    assert set(chosen) == {(m.in_features, m.out_features) for m in layers}
    for m in layers:
        assert m.plain_rows == chosen[m.in_features, m.out_features] <= set(loading.MANY_ROWS)
    ids = torch.randint(3, 40000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(both(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    layer, linear, doubled = _telling_layer()
    layer.plain_rows = frozenset({48})
    x = torch.randn(80, 48)
    with torch.inference_mode():
        for rows, on_plain in [(1, True), (2, False), (15, False), (32, False), (33, True),
                               (48, True), (64, False), (80, False)]:
            assert layer.runs_plain(rows) is on_plain
            want = (doubled if on_plain else linear)(x[:rows])
            torch.testing.assert_close(layer(x[:rows]), want, rtol=1e-5, atol=1e-5)
    layer.plain_rows = frozenset({64})
    assert layer.runs_plain(80) and not layer.runs_plain(48)
    layer.keep_one_row(None)
    assert not layer.plain_rows and not layer.runs_plain(64)


def test_few_row_products_run_on_the_plain_weights_up_to_the_count_timed_faster(tiny_dir,
                                                                              monkeypatch):
    """``few_rows_on_plain`` leaves every layer taking the same number of rows on the plain
    weights, and the model's logits stay the plain model's; a layer sends products of up to
    that many rows there and reads the prepacked weight for more (short of ``MANY_ROWS``),
    ``two_rows_as_three`` times none of them where two rows go there, and a new one-row
    kernel drops the count."""
    import torch

    from starhub.models import loading

    plain, both = _plain_twice(tiny_dir)
    loading.prepack_linears(both, loading.TORCH_ROW)
    _all_layers_take(both, plain, loading.few_rows_on_plain(both, rounds=1), "plain_few",
                     "torch", tokens=3)
    for m in loading.onednn_linears(both):  # two rows on the plain weights: nothing to time
        m.plain_few = 2

    def timed(*_):
        raise AssertionError("two_rows_as_three timed layers that run two rows plain")
    monkeypatch.setattr(loading, "_best_seconds", timed)
    assert not loading.two_rows_as_three(both, rounds=1)
    layer, linear, doubled = _telling_layer()
    layer.plain_few = 3
    x = torch.randn(6, 48)
    with torch.inference_mode():
        for rows in range(1, 7):
            want = (doubled if rows <= 3 else linear)(x[:rows])
            torch.testing.assert_close(layer(x[:rows]), want, rtol=1e-5, atol=1e-5)
    layer.keep_one_row(None)
    assert layer.plain_few == 1 and not layer.runs_plain(2)


def test_single_rows_over_the_whole_transpose_take_one_row_and_leave_more_to_onednn(tiny_dir):
    """``GEMV_ROW`` holds each weight's ``[in, out]`` transpose as one block: one row's
    product runs there and equals the plain layer's, two rows go to the prepacked weight,
    and ``rows_on_blas`` sends no more rows to it (OpenBLAS would pack the whole weight)."""
    import torch

    from starhub.models import loading

    plain, packed = _plain_twice(tiny_dir)
    loading.prepack_linears(packed, loading.GEMV_ROW)
    assert loading.rows_on_blas(packed, rounds=1) == 1
    assert loading.linear_in_use(packed) == "onednn (gemv for one row)"
    for out in (64, 40):
        linear = torch.nn.Linear(48, out)
        layer = loading.OneDNNLinear(linear, loading.GEMV_ROW)
        assert layer.blocks.shape == (1, 48, out)
        assert layer.on_blas(1) and not layer.on_blas(2)
        x = torch.randn(2, 48)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x[:1]), linear(x[:1]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    ids = torch.randint(3, 40000, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids[:, :1]).logits, plain(ids[:, :1]).logits,
                                   rtol=1e-4, atol=1e-4)
