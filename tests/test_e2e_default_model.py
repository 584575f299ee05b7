"""The embedded SmolLM2 model, a hub process and two target processes: every output is
token-for-token what transformers' generate() returns for the same prompt ids."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from starhub.launch import child_env, spawn_hub, target_command
from starhub.models import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
    "Give me a tip for learning a new language.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
]
NEW = 48


@pytest.mark.slow
def test_two_targets_with_a_truncated_self_drafter_are_lossless(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    outs = [tmp_path / f"t{i}.jsonl" for i in range(2)]
    with spawn_hub(["--drafter", "model", "--draft", "self:layers=8", "--depth", "3",
                    "--topk", "2", "--max-nodes", "6"]) as hub:
        procs = [subprocess.Popen(target_command(hub.address, str(prompts), str(out),
                                                 extra=["--max-new-tokens", str(NEW),
                                                        "--shard", f"{i}/2"]),
                                  env=child_env(1), stderr=subprocess.DEVNULL)
                 for i, out in enumerate(outs)]
        assert [p.wait(600) for p in procs] == [0, 0]
    rows = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(PROMPTS)))
    model, _ = load_model("default")
    mismatches = []
    for row in rows:
        ids = row["prompt_ids"]
        expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                  do_sample=False)[0, len(ids):].tolist()
        if row["output_ids"] != expected:
            mismatches.append(row["id"])
        assert row["stats"]["rounds"] > 0, "the target never used the hub"
        assert {"rounds", "mean_accept_len", "tokens_per_s", "wall_s"} <= set(row["stats"])
    assert not mismatches, f"outputs differ from generate() for prompts {mismatches}"
