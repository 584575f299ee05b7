"""Greedy output through a hub process is token-for-token transformers' generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from starhub.launch import spawn_hub
from targets import attach

PROMPTS = ["Tell me about the moon.", "Write a list of fruits.", "def fib(n):", "Hi!"]
NEW = 33


def reference(model, ids: list[int], new: int = NEW) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def chain_hub(tiny_dir):
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "model", "--draft", "self",
                    "--depth", "3", "--topk", "1", "--max-nodes", "3"]) as hub:
        yield hub


def test_self_drafter_chain_is_lossless_and_accepts_everything(tiny_model, chain_hub):
    model, tok = tiny_model
    with attach(model, tok, chain_hub.address) as session:
        assert session.connected
        for prompt in PROMPTS:
            result = session.generate(prompt, max_new_tokens=NEW)
            assert result.output_ids == reference(model, result.prompt_ids)
            assert result.stats.mean_accept_len == 4.0
            assert result.stats.rounds == (NEW - 1 + 3) // 4
            assert result.text == tok.decode(result.output_ids, skip_special_tokens=True)


def test_tree_proposals_are_lossless(tiny_model, tiny_dir):
    model, tok = tiny_model
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "model", "--draft", "self",
                    "--depth", "4", "--topk", "3", "--max-nodes", "12"]) as hub, \
            attach(model, tok, hub.address) as session:
        for prompt in PROMPTS[:2]:
            result = session.generate(prompt, max_new_tokens=NEW)
            assert result.output_ids == reference(model, result.prompt_ids)
            assert result.stats.mean_accept_len > 1.5


def test_streaming_yields_the_same_text(tiny_model, chain_hub):
    model, tok = tiny_model
    with attach(model, tok, chain_hub.address) as session:
        pieces = list(session.stream(PROMPTS[0], max_new_tokens=NEW))
        full = session.generate(PROMPTS[0], max_new_tokens=NEW)
    assert len(pieces) > 1
    assert "".join(pieces) == full.text


def test_sampling_through_the_hub_is_reproducible_per_seed(tiny_model, chain_hub):
    model, tok = tiny_model
    with attach(model, tok, chain_hub.address) as session:
        a = session.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=5)
        b = session.generate(PROMPTS[1], max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=5)
    assert a.output_ids == b.output_ids
    assert len(a.output_ids) == NEW
    assert a.stats.rounds > 0


def test_without_a_reachable_hub_the_target_decodes_alone(tiny_model):
    model, tok = tiny_model
    with attach(model, tok, "tcp://127.0.0.1:1", timeout_s=0.5) as session:
        assert not session.connected
        result = session.generate(PROMPTS[2], max_new_tokens=12)
    assert result.output_ids == reference(model, result.prompt_ids, 12)
    assert result.stats.standalone
    assert "no reply" in result.stats.note


def test_generation_stops_at_eos_like_generate(tiny_model, chain_hub):
    model, tok = tiny_model
    ids = tok("x", add_special_tokens=False)["input_ids"]
    ref = reference(model, ids, 12)
    eos = ref[5]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        expected = reference(model, ids, 12)
        with attach(model, tok, chain_hub.address) as session:
            result = session.generate(ids, max_new_tokens=12)
    finally:
        model.generation_config.eos_token_id = saved
    assert expected[-1] == eos and len(expected) <= 6
    assert result.output_ids == expected


@pytest.mark.parametrize("lookup", ["on", "off"])
def test_lookup_branches_are_accepted_and_output_stays_generate(tiny_model, tokenizer, tmp_path,
                                                                tiny_dir, lookup):
    """The random target's greedy answers repeat their last token; the drafter, a random
    model with its own output layer, guesses other tokens, so only a prompt-lookup branch
    follows the loops."""
    from starhub.client.connection import HubClient
    from starhub.wire.messages import StatsQuery, TargetCard
    from tests.conftest import tiny_config

    torch.manual_seed(99)
    other = tiny_config()
    other.tie_word_embeddings = False
    LlamaForCausalLM(other).save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    model, tok = tiny_model
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "model", "--draft",
                    str(tmp_path / "other"), "--depth", "4", "--topk", "2", "--max-nodes", "4",
                    "--lookup", lookup]) as hub, attach(model, tok, hub.address) as session:
        for prompt in PROMPTS:
            result = session.generate(prompt, max_new_tokens=64)
            assert result.output_ids == reference(model, result.prompt_ids, 64)
        client = HubClient(hub.address, timeout_s=10)
        client.greet(TargetCard(name="probe", vocab_size=model.config.vocab_size))
        body = client.request(StatsQuery()).body
        client.close()
    if lookup == "on":
        assert body.lookup_round_share > 0.5 and body.lookup_token_share > 0.3
        assert body.mean_accept_len > 1.5
    else:
        assert body.lookup_round_share == body.lookup_token_share == 0
        assert body.mean_accept_len < 1.2
