"""The embedded SmolLM2 model, a hub process and two target processes: every output is
token-for-token what transformers' generate() returns for the same prompt ids."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from starhub.launch import child_env, spawn_hub, target_command
from starhub.models.loading import load_model
from tests.test_models_and_cli import needs_compiler

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
NEW = 32


def run_targets(tmp_path, hub_args: list[str], prompts: list[str], targets: int,
                new: int, target_args: tuple[str, ...] = ()) -> list[dict]:
    """Decode ``prompts`` with ``targets`` target processes sharing one hub process."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in enumerate(prompts)))
    outs = [tmp_path / f"t{i}.jsonl" for i in range(targets)]
    with spawn_hub(hub_args) as hub:
        procs = [subprocess.Popen(target_command(hub.address, str(path), str(out),
                                                 extra=["--max-new-tokens", str(new),
                                                        "--shard", f"{i}/{targets}",
                                                        *target_args]),
                                  env=child_env(1), stderr=subprocess.DEVNULL)
                 for i, out in enumerate(outs)]
        assert [p.wait(600) for p in procs] == [0] * targets
    rows = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))
    return rows


def assert_identical_to_generate(rows: list[dict], new: int) -> None:
    model, _ = load_model("default")
    mismatches = []
    for row in rows:
        ids = row["prompt_ids"]
        expected = model.generate(torch.tensor([ids]), max_new_tokens=new,
                                  do_sample=False)[0, len(ids):].tolist()
        if row["output_ids"] != expected:
            mismatches.append(row["id"])
        # the prompt's session opened on a hub. It may still rightly see no tree: the
        # hub's control plane may send a short prompt plain rounds only (a slow CPU, a
        # loaded host), and a target decodes on while the hub's first answer is on its
        # way, so under load 24 tokens can be done before it comes
        assert row["stats"]["hub"], "the prompt never opened a hub session"
        assert {"rounds", "mean_accept_len", "tokens_per_s", "wall_s"} <= set(row["stats"])
    assert sum(row["stats"]["rounds"] for row in rows) > 0, \
        "no tree was verified: equal outputs would prove nothing"
    assert not mismatches, f"outputs differ from generate() for prompts {mismatches}"


@pytest.mark.slow
def test_two_targets_with_a_truncated_self_drafter_are_lossless(tmp_path):
    rows = run_targets(tmp_path, ["--drafter", "model", "--draft", "self:layers=8", "--depth",
                                  "3", "--topk", "2", "--max-nodes", "6"], PROMPTS[:4], 2, NEW)
    assert_identical_to_generate(rows, NEW)


@pytest.mark.slow
@needs_compiler
def test_a_target_with_compiled_mlps_is_lossless(tmp_path):
    rows = run_targets(tmp_path, [], PROMPTS[3:5], 1, NEW, ("--compile", "on"))
    assert_identical_to_generate(rows, NEW)


@pytest.mark.slow
def test_the_shipped_eagle_head_is_the_default_and_lossless_over_128_tokens(tmp_path):
    rows = run_targets(tmp_path, [], PROMPTS[:2], 1, 128)
    assert_identical_to_generate(rows, 128)
    assert max(r["stats"]["mean_accept_len"] for r in rows) > 1.5, "the head accepts nothing"


@pytest.mark.slow
def test_the_demo_compares_each_target_with_generate_run_as_the_targets_ran(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in enumerate(PROMPTS[:4])))
    done = subprocess.run([sys.executable, "-m", "starhub", "demo", "--prompts", str(path),
                           "--max-new-tokens", "12"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("target")]
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert "4 prompts" not in line and "2 prompts" in line, line  # a shard each
        assert re.search(r"generate\(\) 2 at once [\d.]+ tok/s -> [\d.]+x "
                         r"\(alone [\d.]+ tok/s -> [\d.]+x\), output identical$", line), line
