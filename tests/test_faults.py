"""Faults in the star: a hub that dies, hangs, restarts, lies or shuts down, a hub's
drafting process that dies or hangs, and a target that dies. Targets' output stays complete
and identical to generate() throughout."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from starhub.client.connection import HubClient
from starhub.launch import child_env, spawn_hub, target_command
from starhub.launch.status import query_stats
from starhub.models.loading import load_model
from starhub.models.prompts import iter_results
from starhub.wire.codec import decode, encode
from starhub.wire.messages import DrafterCard, Open, Propose, StatsQuery, TargetCard
from starhub.wire.security import ServerSecurity, bind_server
from targets.generate import SpeculativeGenerator

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
    "Give me a tip for learning a new language.",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue? One sentence.",
    "Name two uses of a paperclip.",
    "Describe a cat in five words.",
    "What is 7 times 8?",
    "Say hello in French.",
]
NEW = 32


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _prompt_file(tmp_path, prompts: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def _check_lossless(results: list[dict]) -> None:
    model, _ = load_model("default")
    for r in results:
        ref = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=NEW,
                             do_sample=False)[0, len(r["prompt_ids"]):].tolist()
        assert r["output_ids"] == ref, r["id"]


def _targets(address: str, prompts, outs, extra=()) -> list[subprocess.Popen]:
    return [subprocess.Popen(target_command(address, str(prompts), str(out), extra=[
        "--max-new-tokens", str(NEW), "--shard", f"{i}/{len(outs)}", "--hub-timeout", "1",
        "--name", f"t{i}", *extra]), env=child_env(1), stderr=subprocess.DEVNULL)
        for i, out in enumerate(outs)]


def _wait_lines(paths, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(p.exists() and len(p.read_text().splitlines()) for p in paths) < count:
        assert time.monotonic() < deadline, "targets made no progress"
        time.sleep(0.1)


def _rows(path) -> list[dict]:
    """The complete lines a target has written so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


def _through_hub_after(row: dict, since: float) -> bool:
    """Whether this prompt started after ``since`` and ran through a hub."""
    return row["stats"]["started_at"] > since and row["stats"]["rounds"] > 0


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.slow
def test_targets_finish_and_come_back_when_the_hub_is_killed_and_restarted(tmp_path):
    """The targets have more prompts than the test needs: once each has run two prompts
    through the restarted hub it is stopped, so that the test lasts as long on a fast CPU
    as on a slow one (a fixed prompt count ran out before the hub was back on one, and took
    minutes on the other)."""
    address = _free_address()
    hub_args = ["--bind", address, "--drafter", "ngram", "--depth", "4"]
    prompts = _prompt_file(tmp_path, PROMPTS * 8)
    outs = [tmp_path / "t0.jsonl", tmp_path / "t1.jsonl"]
    hub = spawn_hub(hub_args)
    procs = _targets(address, prompts, outs)
    try:
        _wait_lines(outs, 2)
        hub.proc.send_signal(signal.SIGKILL)
        hub.proc.wait()
        with spawn_hub(hub_args):
            back_at = time.time()
            deadline = time.monotonic() + 120
            while not all(sum(_through_hub_after(r, back_at) for r in _rows(out)) >= 2
                          for out in outs):
                assert all(p.poll() is None for p in procs), "a target died"
                assert time.monotonic() < deadline, "the targets did not come back to the hub"
                time.sleep(0.2)
            # stopped while the hub is still up: a prompt begun after the hub's shutdown
            # would rightly run alone, and is not what this test asks about
            _kill(procs)
    finally:
        _kill(procs)
    results = [_rows(out) for out in outs]
    for k, rows in enumerate(results):
        # nothing lost: a target's rows are its shard's prompts in order, none skipped
        assert [r["id"] for r in rows] == list(range(k, 2 * len(rows), 2))
        # the prompt the kill interrupted finished alone, and says why
        assert any(r["stats"]["note"] for r in rows), "no prompt noticed the hub's death"
        # once back, a target stays with the hub
        first = next(i for i, r in enumerate(rows) if _through_hub_after(r, back_at))
        alone = [r["stats"] for r in rows[first:] if r["stats"]["rounds"] == 0]
        assert not alone, f"target {k} went alone with the hub up: {alone}"
    _check_lossless([r for rows in results for r in rows])


@pytest.mark.slow
def test_an_eagle_hub_replaces_a_killed_and_then_a_stopped_drafting_process(tmp_path):
    """Default flags: the shipped EAGLE head drafts in a process of its own. It is killed,
    then its successor is stopped; each time the hub finds out and starts a fresh one by
    itself (the test waits for that, as STATS tells it), and a new target's prompts go
    through the hub again."""
    prompts = _prompt_file(tmp_path, PROMPTS[:4])
    outs = [tmp_path / "after-kill.jsonl", tmp_path / "after-stop.jsonl"]
    with spawn_hub([]) as hub:
        for k, (sig, out) in enumerate(zip((signal.SIGKILL, signal.SIGSTOP), outs, strict=True)):
            os.kill(query_stats(hub.address).drafting.pid, sig)
            deadline = time.monotonic() + 180
            while not ((d := query_stats(hub.address).drafting).restarts == k + 1 and d.healthy):
                assert time.monotonic() < deadline, f"no fresh drafting process after {sig.name}"
                time.sleep(0.2)
            target = subprocess.Popen(target_command(hub.address, str(prompts), str(out), extra=[
                "--max-new-tokens", str(NEW), "--shard", f"{k}/2", "--name", f"t{k}"]),
                env=child_env(1), stderr=subprocess.DEVNULL)
            assert target.wait(300) == 0
        status = subprocess.run([sys.executable, "-m", "starhub", "status", hub.address],
                                capture_output=True, text=True, env=child_env(1), timeout=120)
    assert "up, restarts 2" in status.stdout and "stopped answering" in status.stdout, \
        status.stdout + status.stderr
    results = [list(iter_results(out)) for out in outs]
    for rows in results:
        # through the hub: its trees, or plain rounds where its control plane judged
        # that no tree pays (a slow CPU, a loaded host)
        assert len(rows) == 2 and not rows[-1]["stats"]["standalone"], \
            "the last prompt must go through the hub again"
    _check_lossless([r for rows in results for r in rows])


@pytest.mark.slow
def test_a_killed_target_leaves_the_others_undisturbed_and_its_sessions_expire(tmp_path):
    prompts = _prompt_file(tmp_path, PROMPTS[:6])
    outs = [tmp_path / f"t{i}.jsonl" for i in range(3)]
    with spawn_hub(["--drafter", "ngram", "--depth", "4", "--ttl", "2"]) as hub:
        procs = _targets(hub.address, prompts, outs)
        _wait_lines(outs, 1)
        procs[0].send_signal(signal.SIGKILL)
        assert [p.wait(300) for p in procs[1:]] == [0, 0]
        client = HubClient(hub.address, timeout_s=10)
        deadline = time.monotonic() + 2 + 5
        while client.request(StatsQuery()).body.active_sessions and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.request(StatsQuery()).body.active_sessions == 0
        client.close()
    results = [r for out in outs[1:] for r in iter_results(out)]
    assert len(results) == 4
    _check_lossless(results)


@pytest.mark.slow
def test_sigterm_stops_the_hub_cleanly_and_targets_finish_alone(tmp_path):
    prompts = _prompt_file(tmp_path, PROMPTS[:3])
    outs = [tmp_path / "t0.jsonl"]
    hub = spawn_hub(["--drafter", "ngram", "--depth", "4"])
    procs = _targets(hub.address, prompts, outs)
    _wait_lines(outs, 1)
    hub.proc.send_signal(signal.SIGTERM)
    assert hub.proc.wait(15) == 0
    assert procs[0].wait(300) == 0
    results = list(iter_results(outs[0]))
    assert len(results) == 3
    _check_lossless(results)


class RogueHub:
    """A hub that answers a TARGET_CARD properly, then sends whatever PROPOSEs it is told to."""

    def __init__(self, proposals, card: DrafterCard | None = None):
        self.card = card or DrafterCard(drafter="rogue", depth=3, topk=1, max_nodes=3)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.release = bind_server(self.sock, "tcp://127.0.0.1:0", ServerSecurity())
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proposals = proposals
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.sock.poll(5000):
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, TargetCard):
                replies = [self.card]
            elif isinstance(msg, Open):
                replies = [p(msg, 7) for p in self.proposals]
            else:
                continue
            for reply in replies:
                self.sock.send_multipart([identity, *encode(reply)])

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close(0)
        self.release()


def _tree(tokens) -> dict:
    n = len(tokens)
    return {"tokens": np.asarray(tokens, np.int32), "parents": np.arange(-1, n - 1,
                                                                          dtype=np.int32)}


@pytest.mark.parametrize("proposal, note", [
    (lambda m, tag: Propose(tag=tag, ref=m.ref, **_tree([10 ** 6])), "outside"),
    (lambda m, tag: Propose(tag=tag, ref=m.ref, **_tree([5, -3])), "outside"),
])
def test_a_target_finishes_alone_on_an_invalid_propose(tiny_model, proposal, note):
    model, tokenizer = tiny_model
    rogue = RogueHub([proposal])
    gen = SpeculativeGenerator(model, tokenizer, rogue.address, timeout_s=2.0)
    prompt = [1, 5, 9, 14, 3]
    result = gen.generate(prompt, max_new_tokens=12)
    gen.close()
    rogue.close()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None)[0, len(prompt):].tolist()
    assert result.output_ids == ref[:len(result.output_ids)] and len(result.output_ids) == 12
    assert note in result.stats.note and result.stats.rounds == 0


@pytest.mark.parametrize("layers, note", [
    ([99], "feature layers [99] do not exist"),
    ([0, -4], "feature layers [-4] do not exist"),
    ([-1] * 4, "4 feature layers asked of a target with 3 hidden states"),
])
def test_a_target_decodes_alone_when_the_hubs_card_names_features_it_lacks(tiny_model, caplog,
                                                                          layers, note):
    """The tiny model has 2 layers, so 3 hidden states (-3..2): a DRAFTER_CARD naming others
    (or more of them than there are) ends that connection with a logged error, and the target
    decodes on its own instead of failing in prefill."""
    model, tokenizer = tiny_model
    rogue = RogueHub([], card=DrafterCard(drafter="rogue", feature_layers=layers))
    prompt = [1, 5, 9, 14, 3]
    with caplog.at_level(logging.ERROR, logger="starhub.client"):
        gen = SpeculativeGenerator(model, tokenizer, rogue.address, timeout_s=1.0)
        result = gen.generate(prompt, max_new_tokens=12)
        gen.close()
    rogue.close()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None)[0, len(prompt):].tolist()
    assert result.output_ids == ref[:len(result.output_ids)] and len(result.output_ids) == 12
    assert note in result.stats.note and result.stats.rounds == 0
    assert any(r.levelno == logging.ERROR and note in r.getMessage() for r in caplog.records)


def test_a_sampled_target_verifies_trees_without_distributions_as_if_alone(tiny_model):
    """A tree is only a guess: with or without draft distributions, and whatever it holds,
    sampled output is the target's own seeded draw, the same as with no hub at all."""
    model, tokenizer = tiny_model
    alone = SpeculativeGenerator(model, tokenizer, None)
    expected = alone.generate([1, 5, 9], max_new_tokens=8, temperature=0.7, seed=3)
    guess = expected.output_ids[1:3]
    rogue = RogueHub([lambda m, tag: Propose(tag=tag, ref=m.ref, **_tree(guess))])
    gen = SpeculativeGenerator(model, tokenizer, rogue.address, timeout_s=2.0)
    result = gen.generate([1, 5, 9], max_new_tokens=8, temperature=0.7, seed=3)
    gen.close()
    rogue.close()
    assert result.output_ids == expected.output_ids
    assert result.stats.rounds == 1 and result.stats.mean_accept_len == 3.0


def test_a_replayed_propose_is_never_applied_twice(tiny_model):
    model, tokenizer = tiny_model
    prompt = [1, 5, 9, 14, 3]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None)[0, len(prompt):].tolist()
    good = lambda m, tag: Propose(tag=tag, ref=m.ref, seq=0, **_tree(ref[1:3]))  # noqa: E731
    rogue = RogueHub([good, good])
    gen = SpeculativeGenerator(model, tokenizer, rogue.address, timeout_s=1.0)
    result = gen.generate(prompt, max_new_tokens=12)
    gen.close()
    rogue.close()
    assert result.output_ids == ref and result.stats.rounds == 1


def test_sampled_output_is_reproducible_for_a_seed(tiny_model):
    """One seed, one output: through a hub with a fixed tree, through a hub that chooses
    each round's depth from timings (here it decodes plainly: no tree pays for the tiny
    model), and without a hub."""
    from starhub.drafters.base import TreeShape
    from starhub.drafters.model import ModelDrafter
    from tests.conftest import HubThread

    model, tokenizer = tiny_model
    prompt, new = [1, 5, 9, 14], 24
    runs = {}
    for name, config in (("fixed", {"shape": TreeShape(3, 2, 5)}),
                         ("auto", {"shape": TreeShape(6, 2, 8), "adaptive": True})):
        hub = HubThread(ModelDrafter(model, label="self"), **config)
        for seed in (11, 11, 12):
            gen = SpeculativeGenerator(model, tokenizer, hub.address)
            runs.setdefault(name, []).append(gen.generate(prompt, new, temperature=0.8,
                                                          seed=seed))
            gen.close()
        hub.stop()
    alone = SpeculativeGenerator(model, tokenizer, None).generate(prompt, new,
                                                                  temperature=0.8, seed=11)
    for out in runs.values():
        assert out[0].output_ids == out[1].output_ids == alone.output_ids
        assert out[2].output_ids != out[0].output_ids, "the seed must matter"
    fixed = runs["fixed"][0].stats
    assert fixed.rounds > 0 and fixed.accepted_at_depth[0] == fixed.rounds, \
        "self-drafts ranked with the target's noise are the target's own draws"
