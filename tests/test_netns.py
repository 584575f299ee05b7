"""The star across a real link: hub and target in two network namespaces joined by a veth
pair, with delay injected by netem (or, where the kernel lacks it, a user-space relay).
Skips itself, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json

import pytest
import torch

from bench.netns import measure, netem_unavailable, netns_unavailable
from starhub.models.prompts import encode_prompt

PROMPTS = ["the quick brown fox", "one two three four five"]


def _prompts(tmp_path) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return str(path)


def test_the_star_runs_across_a_veth_link_and_stays_lossless(tiny_dir, tiny_model, tmp_path):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    model, tokenizer = tiny_model
    [row] = measure([0.0], _prompts(tmp_path), model=str(tiny_dir), drafter="ngram",
                    max_new_tokens=24, chat_template=False)
    assert row.rounds > 0 and row.t_c_ms > 0
    for prompt, out in zip(PROMPTS, row.output_ids, strict=True):
        ids = encode_prompt(tokenizer, prompt, False)
        assert out == model.generate(torch.tensor([ids]), max_new_tokens=24,
                                     do_sample=False)[0, len(ids):].tolist()


def test_t_c_follows_the_delay_injected_on_the_link(tiny_dir, tmp_path):
    """20 ms each way by netem where the kernel has it, else by the user-space relay."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    [row] = measure([20.0], _prompts(tmp_path), model=str(tiny_dir), drafter="ngram",
                    max_new_tokens=8, chat_template=False)
    assert row.delay_by == ("relay" if netem_unavailable() else "netem")
    assert row.rounds > 0
    assert row.t_c_ms >= 40.0, f"20 ms each way ({row.delay_by}) must show in every round trip"
