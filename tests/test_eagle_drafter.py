"""The EAGLE drafter through a hub process: features travel with OPEN and COMMIT, and the
output stays token-for-token generate()'s, for EAGLE-1/2 (full and reduced vocabulary) and
EAGLE-3 heads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from starhub.drafters.base import TreeShape
from starhub.drafters.eagle import EagleDrafter, target_embeddings
from starhub.drafters.eagle_head import EAGLE, EAGLE3, EagleHead, head_config, save_eagle_head
from starhub.launch import spawn_hub
from targets import attach
from tests.test_lossless_api import reference

KINDS = {"eagle": (EAGLE, None), "eagle-reduced": (EAGLE, 4096), "eagle3": (EAGLE3, None)}


def random_head(tiny_dir, kind: str, draft_vocab: int | None, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    target = AutoConfig.from_pretrained(tiny_dir)
    embed, lm_head = target_embeddings(tiny_dir)
    head = EagleHead(head_config(target), kind, embed, target_lm_head=lm_head,
                     draft_vocab_size=draft_vocab, target_num_layers=target.num_hidden_layers,
                     feature_layers=(0, 1, 2) if kind == EAGLE3 else None)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(embed.shape[0])[:draft_vocab])
    return head


@pytest.fixture(scope="module", params=sorted(KINDS))
def head_dir(request, tiny_dir, tmp_path_factory):
    kind, draft_vocab = KINDS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    save_eagle_head(random_head(tiny_dir, kind, draft_vocab), out)
    return out


def test_eagle_hub_is_lossless_and_receives_features(tiny_model, tiny_dir, head_dir):
    model, tok = tiny_model
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "eagle", "--draft", str(head_dir),
                    "--depth", "4", "--topk", "3", "--max-nodes", "10"]) as hub, \
            attach(model, tok, hub.address) as session:
        assert session.connected
        for prompt in ["Tell me a story.", "1, 2, 3, 4,"]:
            result = session.generate(prompt, max_new_tokens=20)
            assert result.output_ids == reference(model, result.prompt_ids, 20)
            assert result.stats.note == "", result.stats.note
            assert result.stats.rounds > 0


def test_an_int8_head_is_lossless_through_the_hub(tiny_model, tiny_dir, tmp_path):
    from starhub.models.loading import int8_cpu

    if not int8_cpu():
        pytest.skip("no x86 int8 kernels on this CPU")
    model, tok = tiny_model
    save_eagle_head(random_head(tiny_dir, EAGLE, 4096), tmp_path)
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "eagle", "--draft", str(tmp_path),
                    "--draft-dtype", "int8", "--depth", "4", "--max-nodes", "10"]) as hub, \
            attach(model, tok, hub.address) as session:
        result = session.generate("Tell me a story.", max_new_tokens=20)
        assert result.output_ids == reference(model, result.prompt_ids, 20)
        assert result.stats.rounds > 0


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_an_int8_head_keeps_the_feature_layer_float_and_its_float32_outputs(tiny_dir, kind):
    import copy

    from starhub.models.loading import int8_cpu

    if not int8_cpu():
        pytest.skip("no x86 int8 kernels on this CPU")
    head = random_head(tiny_dir, kind, 4096).eval()
    float_head = copy.deepcopy(head)
    drafter = EagleDrafter(head, int8=True)
    quantized = {n for n, m in head.named_modules()
                 if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)}
    layer = "layers.0" if kind == EAGLE else "midlayer"
    assert {"lm_head", f"{layer}.self_attn.q_proj", f"{layer}.mlp.down_proj"} <= quantized
    assert not any(n.endswith("fc") for n in quantized)
    torch.manual_seed(1)
    feats = torch.randn(1, 6, drafter.feature_size)
    ids = torch.randint(0, 4096, (1, 6))
    with torch.no_grad():
        got, want = head(feats, ids)[1], float_head(feats, ids)[1]
    assert (got - want).norm() < 0.05 * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


def test_reduced_vocab_drafts_only_draft_vocab_tokens(tiny_dir):
    from starhub.drafters.base import DraftContext

    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, 4096).eval())
    allowed = set(drafter.head.to_target_ids(torch.arange(4096)).tolist())
    feats = torch.randn(5, 64)
    ctx = DraftContext(tokens=[10, 11, 12, 13, 14, 15], features=[feats])
    tree = drafter.propose(ctx, TreeShape(depth=3, topk=3, max_nodes=9))
    assert len(tree) == 9
    assert set(tree.tokens.tolist()) <= allowed
    sampled = drafter.propose(DraftContext(tokens=list(ctx.tokens), features=[feats],
                                           temperature=1.0,
                                           generator=torch.Generator().manual_seed(0)),
                              TreeShape(depth=3, topk=3, max_nodes=9))
    assert set(sampled.tokens.tolist()) <= allowed
    assert set(sampled.dist_ids[sampled.dist_probs > 0].tolist()) <= allowed
    again = drafter.propose(DraftContext(tokens=list(ctx.tokens), features=[feats]),
                            TreeShape(depth=3, topk=3, max_nodes=9))
    assert again.tokens.tolist() == tree.tokens.tolist()


def test_feature_rows_must_match_tokens(tiny_dir):
    from starhub.drafters.base import DraftContext

    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())
    with pytest.raises(ValueError, match="feature rows"):
        drafter.propose(DraftContext(tokens=[1, 2, 3], features=[torch.randn(1, 64)]),
                        TreeShape())


def test_colocated_baseline_feeds_the_eagle_head_its_features(tiny_model, tiny_dir):
    from bench.baselines import colocated, hf_generate

    model, tok = tiny_model
    prompts = [("p", tok("The quick brown fox", add_special_tokens=False)["input_ids"])]
    drafter = EagleDrafter(random_head(tiny_dir, EAGLE3, None).eval())
    runs = colocated(model, drafter, TreeShape(3, 2, 6), prompts, 12)
    assert runs[0].output_ids == hf_generate(model, prompts, 12)[0].output_ids
    assert runs[0].rounds > 0


def test_training_writes_a_head_the_hub_can_load_and_resumes(tiny_dir, tmp_path, capsys):
    from scripts.train_eagle import main as train

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"id": {i}, "prompt": "Count to {i} slowly."}}\n'
                               for i in range(4)))
    args = ["--target", str(tiny_dir), "--work-dir", str(tmp_path / "work"),
            "--out", str(tmp_path / "head"), "--prompts", str(prompts), "--eval-prompts",
            str(prompts), "--max-new-tokens", "8", "--max-steps", "3", "--batch-tokens", "64",
            "--unroll", "2", "--draft-vocab", "512", "--depth", "2", "--gen-temperatures", "0,0.9",
            "--follow-ups", "2", "--synth-openers", "scripts/prompts/openers.jsonl"]
    # a state an older version saved, which weights_only=True cannot read, is set aside
    (tmp_path / "work").mkdir()
    torch.save({"signature": {"out": tmp_path}}, tmp_path / "work" / "train_state.pt")
    summary = train(args)
    assert "cannot read the saved training state" in capsys.readouterr().out
    assert summary["train_sequences"] >= 8 and summary["draft_vocab"] == 512
    # a random target rarely ends a follow-up message; every attempt is still recorded
    assert len((tmp_path / "work" / "follow-ups.jsonl").read_text().splitlines()) == 2
    greedy, sampled = (tmp_path / "work" / f"gen-train-n8{t}.jsonl" for t in ("", "-t0.9"))
    assert greedy.exists() and sampled.exists()
    assert greedy.read_text() != sampled.read_text()
    drafter = EagleDrafter.load(tmp_path / "head", str(tiny_dir))
    assert drafter.head.draft_vocab_size == 512
    capsys.readouterr()
    assert train(args)["steps"] == 3
    assert "resuming from step 3/3" in capsys.readouterr().out
    # a larger --draft-vocab grows the trained head and keeps every token it had
    grown = [*args, "--init-from", str(tmp_path / "head"), "--out", str(tmp_path / "grown"),
             "--max-steps", "1"]
    grown[grown.index("--draft-vocab") + 1] = "600"
    assert train(grown)["draft_vocab"] == 600
    bigger = EagleDrafter.load(tmp_path / "grown", str(tiny_dir)).head
    had = drafter.head.to_target_ids(torch.arange(512))
    assert bigger.t2d[had].all() and int(bigger.t2d.sum()) == 600


def test_synthesized_prompts_are_complete_unique_held_out_and_resume(tmp_path):
    from scripts.eagle_data import synthesize_prompts
    from starhub.models.loading import load_model

    model, tokenizer = load_model("default")
    first = synthesize_prompts(model, tokenizer, 4, tmp_path / "a.jsonl", 8, max_tokens=48)
    more = synthesize_prompts(model, tokenizer, 6, tmp_path / "a.jsonl", 8, max_tokens=48)
    assert more[:4] == first and len(more) == 6
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 6
    texts = [text for _, text in more]
    assert len({t.lower() for t in texts}) == 6
    assert all(len(t.split()) >= 3 for t in texts)
    held_out = first[0][1]
    other = synthesize_prompts(model, tokenizer, 4, tmp_path / "b.jsonl", 8, max_tokens=48,
                               exclude={held_out})
    assert held_out not in [text for _, text in other]


def test_steered_prompts_start_with_their_openers_and_follow_ups_extend_the_conversation(
        tmp_path):
    from scripts.eagle_data import follow_ups, synthesize_prompts
    from starhub.models.loading import load_model

    model, tokenizer = load_model("default")
    openers = ["Fix the bug in this Python function:\n\n```python\n", "A train leaves"]
    rows = synthesize_prompts(model, tokenizer, 4, tmp_path / "s.jsonl", 8, max_tokens=96,
                              openers=openers)
    assert len(rows) == 4
    assert all(text.startswith(tuple(o.strip() for o in openers)) for _, text in rows)
    assert {text.startswith("A train") for _, text in rows} == {True, False}
    firsts = [(sid, text, f"Answer number {i}.") for i, (sid, text) in enumerate(rows)]
    turns = follow_ups(model, tokenizer, firsts, tmp_path / "f.jsonl", 4)
    assert turns and all(sid.endswith("-2") for sid, _ in turns)
    for sid, messages in turns:
        first = next(f for f in firsts if f"{f[0]}-2" == sid)
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[0]["content"] == first[1] and messages[1]["content"] == first[2]
        assert len(messages[2]["content"].split()) >= 3
    lines = (tmp_path / "f.jsonl").read_text()
    assert follow_ups(model, tokenizer, firsts, tmp_path / "f.jsonl", 4) == turns
    # conversations already written come first, even behind a candidate not yet written
    fresh = ("s-new", "Name three rivers in Europe.", "The Rhine, the Danube and the Seine.")
    again = follow_ups(model, tokenizer, [fresh, *firsts[::-1]], tmp_path / "f.jsonl", 4,
                       count=3)
    assert again and {sid for sid, _ in again} <= {sid for sid, _ in turns}
    assert (tmp_path / "f.jsonl").read_text() == lines


def test_recorded_features_and_labels_match_a_full_forward(tiny_model, tmp_path):
    from scripts.eagle_data import FeatureStore, Record, Seq, answer_batch, dump_features

    model, _ = tiny_model
    prompts = [[1, 40, 41, 42, 43, 44], [1, 50, 51]]
    record = Record((-1,), 5)
    answers = answer_batch(model, prompts, 6, eos=2, pad=2, record=record)
    recorded = FeatureStore(tmp_path / "recorded")
    recorded.add([a.rows(p) for p, a in zip(prompts, answers, strict=True)])
    seqs = [Seq(i, len(p), p + a.ids) for i, (p, a) in enumerate(zip(prompts, answers,
                                                                       strict=True))]
    assert not recorded.missing(seqs)
    full = FeatureStore(tmp_path / "full")
    assert full.missing(seqs) == seqs
    ref, got = dump_features(model, seqs, full, record), recorded.dump(seqs)
    assert not full.missing(seqs) and torch.equal(got.ids, ref.ids)
    for i, s in enumerate(seqs):
        span, n, p = ref.span(i), len(s.ids), s.prompt_len
        fed, labelled = slice(0, n - 1), slice(p - 1, n - 1)
        torch.testing.assert_close(got.feats[span][fed].float(), ref.feats[span][fed].float(),
                                   atol=2e-3, rtol=1e-2)
        assert torch.equal(got.top_ids[span][labelled, 0], ref.top_ids[span][labelled, 0])
        torch.testing.assert_close(got.top_p[span][labelled].float(),
                                   ref.top_p[span][labelled].float(), atol=2e-3, rtol=1e-2)
        assert not got.top_p[span][:p - 1].any() and not got.feats[span][n - 1].any()


def test_synth_openers_file_errors_are_clear(tmp_path):
    from scripts.train_eagle import read_openers

    assert read_openers(None) == []
    good = tmp_path / "o.jsonl"
    good.write_text('{"opener": "A train leaves"}\n\n{"opener": "You are a"}\n')
    assert read_openers(good) == ["A train leaves", "You are a"]
    for text in ('{"prompt": "x"}\n', "not json\n", ""):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(SystemExit, match="--synth-openers"):
            read_openers(bad)
    with pytest.raises(SystemExit, match="--synth-openers"):
        read_openers(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("queries,keys,batch", [(4, 37, 1), (1, 20, 1), (3, 11, 2)])
def test_grouped_attention_matches_attention_with_repeated_keys(queries, keys, batch):
    """The head stacks the query heads that share a key-value head; each query head must
    still attend with its own key-value head, under its own rows of the mask."""
    from torch.nn import functional as F

    from starhub.drafters.eagle_head import Attention

    gen = torch.Generator().manual_seed(queries * keys)
    q = torch.randn(batch, 9, queries, 16, generator=gen)
    k, v = (torch.randn(batch, 3, keys, 16, generator=gen) for _ in range(2))
    mask = torch.rand(batch, 1, queries, keys, generator=gen) > 0.3
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(Attention._attend_grouped(q, k, v, mask, 3), expected, atol=1e-6)
