"""The edge topology on the embedded model, as processes: one verifier and four drafter
processes, each drafter's output token-for-token what generate() returns."""

from __future__ import annotations

import json

import pytest

from bench.edge import EdgeConfig, run_edge_real

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
]


@pytest.mark.parametrize("drafter, draft", [("model", "self:layers=8"), ("eagle", None)])
def test_four_drafter_processes_match_generate(tmp_path, drafter, draft):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    cfg = EdgeConfig(drafters=[4], schedules=["fifo"], max_batch=["auto"], drafter=drafter,
                     draft=draft, prompts=str(prompts), max_new_tokens=24,
                     log_dir=str(tmp_path / "logs"))
    doc = run_edge_real(cfg, progress=False)
    row = doc["rows"][-1]
    assert row["mode"] == "edge" and row["drafters"] == 4 and row["failed"] == 0
    assert row["lossless"] is True, row["lossless_mismatches"]
    assert row["tokens"] == doc["rows"][0]["tokens"]
    assert row["mean_accept_len"] > 1.0 and len(row["per_drafter_tok_s"]) == 4
