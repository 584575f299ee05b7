"""A hub whose drafting process hangs or dies: the sessions it held end with an ERROR and
their targets finish alone, no target is admitted and no session opened until a fresh
process is up, then targets are served again; STATS and ``starhub status`` show it. Every
output stays identical to generate()."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from starhub.client.connection import HubClient, HubUnavailable
from starhub.drafters.base import TreeShape
from starhub.hub import drafting_process
from starhub.launch.status import StatusPoller, query_stats, report
from starhub.wire.reports import HubReport
from targets.generate import GenerationStats, SpeculativeGenerator
from tests.conftest import HubThread
from tests.test_drafting_process import head, remote_drafter  # noqa: F401  (fixture)

NEW = 24
PROMPTS = ["Tell me about the moon.", "Write a list of fruits.", "def fib(n):", "Hi!",
           "Count to ten."]


def reference(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def wait_for(address: str, ready, timeout_s: float = 120.0) -> HubReport:
    deadline = time.monotonic() + timeout_s
    while True:
        body = query_stats(address)
        if ready(body.drafting):
            return body
        assert time.monotonic() < deadline, f"the hub's drafter never got there: {body.drafting}"
        time.sleep(0.2)


@pytest.fixture
def hub(tiny_dir, head, monkeypatch):  # noqa: F811
    monkeypatch.setattr(drafting_process, "HANG_FLOOR_S", 1.0)  # a short test, same rule
    monkeypatch.setattr(drafting_process, "WATCH_FACTOR", 2.0)
    drafter = remote_drafter(tiny_dir, head)
    gate = threading.Event()
    restart = drafter.restart

    def held_restart() -> None:  # lets the test look at the hub while it restarts
        gate.wait(120)
        restart()

    drafter.restart = held_restart
    server = HubThread(drafter, shape=TreeShape(depth=4, topk=3, max_nodes=10),
                       predraft=False)  # every round asks the drafting process
    try:
        yield server, drafter, gate
    finally:
        gate.set()
        server.stop()
        drafter.close()


def test_a_hung_drafting_process_ends_its_sessions_and_a_fresh_one_serves_again(tiny_model,
                                                                                hub):
    server, drafter, gate = hub
    model, tok = tiny_model
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    target = SpeculativeGenerator(model, tok, server.address, name="t", timeout_s=60)
    try:
        served = target.generate(ids[0], NEW)
        assert served.output_ids == reference(model, ids[0]) and served.stats.rounds > 0

        # a request in flight when the drafting process stops
        stats = GenerationStats()
        stream = target.stream_ids(ids[1], NEW, stats=stats)
        out = next(stream) + next(stream)  # the first token, then a round: the session is open
        stopped = drafter._proc
        os.kill(stopped.pid, signal.SIGSTOP)
        out += [t for chunk in stream for t in chunk]
        assert out == reference(model, ids[1])
        assert "stopped answering" in stats.note, "the hub should have ended the session"

        # while it restarts: no new target, no new session; the target decodes alone
        body = query_stats(server.address)
        assert not body.drafting.healthy
        assert body.drafting.events[-1].sessions == 1 and body.active_sessions == 0
        line = StatusPoller(server.address, 1.0, 1, edge=False).summarize(body, time.monotonic())
        assert "drafting process restarting" in line  # the launcher's status line
        with pytest.raises(HubUnavailable, match="restarting"):
            HubClient(server.address, timeout_s=10).greet(target.card())
        alone = target.generate(ids[2], NEW)
        assert alone.output_ids == reference(model, ids[2])
        assert alone.stats.rounds == 0 and "restarting" in alone.stats.note

        gate.set()
        body = wait_for(server.address, lambda d: d.healthy)
        assert stopped.poll() is not None, "the stopped process was left behind"
        assert body.drafting.restarts == 1 and body.drafting.pid == drafter.pid
        back = target.generate(ids[3], NEW)
        assert back.output_ids == reference(model, ids[3]) and back.stats.rounds > 0

        # one that dies while the hub idles is found and replaced as well
        os.kill(drafter.pid, signal.SIGKILL)
        body = wait_for(server.address, lambda d: d.restarts == 2 and d.healthy)
        again = target.generate(ids[4], NEW)
        assert again.output_ids == reference(model, ids[4]) and again.stats.rounds > 0
        text = report(server.address, body)
        assert "restarts 2" in text and "killed by SIGKILL" in text, text
    finally:
        target.close()
