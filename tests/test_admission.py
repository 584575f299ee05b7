"""Admission slots free when a target's last session ends, and are reused by a new target
process; a session that no tree speeds up decodes plainly and stays lossless."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from starhub.client.connection import HubClient
from starhub.launch import child_env, spawn_hub
from starhub.launch.status import query_stats
from starhub.wire.messages import DrafterCard, Reject, TargetCard
from starhub.wire.reports import HubReport
from targets import attach
from tests.conftest import HubThread


def run_target(hub: str, model_dir, prompts, out, name: str) -> list[dict]:
    cmd = [sys.executable, "-m", "starhub", "target", "--hub", hub, "--model", str(model_dir),
           "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "12",
           "--threads", "1", "--name", name]
    subprocess.run(cmd, check=True, env=child_env(1), timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in out.read_text().splitlines()]


def stats(address: str) -> HubReport:
    """The hub's STATS as an observer, which sees each target's entries."""
    return query_stats(address, timeout_s=10)


def test_a_freed_slot_is_reused_by_a_new_target_process(tiny_dir, tmp_path):
    from starhub.drafters.ngram import NgramDrafter

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "one two one two one two"}\n')
    hub = HubThread(NgramDrafter(), max_targets=1, peer_grace_s=0.3, retry_after_s=0.5)
    try:
        holder = HubClient(hub.address, timeout_s=10)
        assert isinstance(holder.greet(TargetCard(name="holder", vocab_size=49152)), DrafterCard)
        waiting = HubClient(hub.address, timeout_s=10)
        waiting.send(TargetCard(name="waiting", vocab_size=49152))
        reply = waiting.recv()
        assert isinstance(reply, Reject) and reply.retry_after_s > 0
        waiting.close()
        holder.close()
        time.sleep(1.5)  # the holder never opened a session: its slot frees after the grace
        assert stats(hub.address).admitted == 0

        first = run_target(hub.address, tiny_dir, prompts, tmp_path / "a.jsonl", "first")
        assert not first[0]["stats"]["standalone"], first[0]["stats"]["note"]
        time.sleep(1.5)
        assert stats(hub.address).admitted == 0
        second = run_target(hub.address, tiny_dir, prompts, tmp_path / "b.jsonl", "second")
        assert not second[0]["stats"]["standalone"], second[0]["stats"]["note"]
        assert second[0]["output_ids"] == first[0]["output_ids"]
        body = stats(hub.address)
        assert body.rejections == 1 and body.max_targets == 1
    finally:
        hub.stop()


def test_a_rejected_target_decodes_alone_then_asks_again(tiny_model):
    from starhub.drafters.ngram import NgramDrafter

    model, tok = tiny_model
    hub = HubThread(NgramDrafter(), max_targets=1, peer_grace_s=0.3, retry_after_s=0.5)
    try:
        holder = HubClient(hub.address, timeout_s=10)
        holder.greet(TargetCard(name="holder", vocab_size=model.config.vocab_size))
        with attach(model, tok, hub.address, name="late") as session:
            assert not session.connected
            alone = session.generate("one two one two", max_new_tokens=8)
            assert alone.stats.standalone
            holder.close()
            time.sleep(1.5)
            again = session.generate("one two one two", max_new_tokens=8)
            assert session.connected and not again.stats.standalone
            assert again.output_ids == alone.output_ids
    finally:
        hub.stop()


def test_a_target_whose_idle_slot_was_freed_says_hello_again_and_keeps_speculating(
        tiny_model):
    from starhub.drafters.ngram import NgramDrafter

    model, tok = tiny_model
    hub = HubThread(NgramDrafter(), peer_grace_s=0.3)
    try:
        with attach(model, tok, hub.address, name="idle") as session:
            time.sleep(1.5)
            assert stats(hub.address).admitted == 0
            result = session.generate("one two one two one two", max_new_tokens=8)
            assert not result.stats.standalone and not result.stats.note
    finally:
        hub.stop()


@pytest.mark.slow
def test_a_session_no_tree_helps_decodes_plainly_and_stays_lossless(tiny_model, tiny_dir):
    """A one-layer truncation of a random model is almost never right: under --depth auto
    the hub sends plain rounds, which the target decodes alone, and re-probes now and then."""
    model, tok = tiny_model
    with spawn_hub(["--model", str(tiny_dir), "--drafter", "model", "--draft",
                    "self:layers=1", "--depth", "auto"]) as hub, \
            attach(model, tok, hub.address) as session:
        result = session.generate("Tell me about the moon.", max_new_tokens=120)
        ids = torch.tensor([result.prompt_ids])
        expected = model.generate(ids, max_new_tokens=120, do_sample=False)[0, ids.shape[1]:]
        assert result.output_ids == expected.tolist()
        assert result.stats.plain_rounds > 0 and result.stats.plain_tokens > 60
        assert result.stats.rounds >= 1, "the hub probed with a tree at least once"
        body = stats(hub.address)
        assert body.plain_rounds == result.stats.plain_rounds
        assert body.depth == "auto"
        target = body.control.targets[0]
        assert target.verify_samples >= 1, \
            "each tree round's COMMIT reports the target's verification time"
        intercept, per_node = target.verify_ms_fit
        assert intercept + 4 * per_node > 0
