"""A hub whose drafting process hangs or dies: the sessions it held end with an ERROR and
their targets finish alone, no target is admitted and no session opened until a fresh
process is up, then targets are served again; STATS and ``starhub status`` show it. Every
output stays identical to generate(). A process that cannot be started again stops the hub."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from starhub.client.connection import HubClient, HubUnavailable
from starhub.client.link import Backoff
from starhub.drafters.base import DrafterLost, TreeShape
from starhub.drafters.ngram import NgramDrafter
from starhub.hub import drafting_process, supervision
from starhub.launch.status import StatusPoller, query_stats, report
from starhub.wire.messages import DrafterCard, Error, ErrorCode, Open, Reject, TargetCard
from starhub.wire.reports import HubReport
from targets.generate import GenerationStats, SpeculativeGenerator
from tests.conftest import HubThread
from tests.servers import HubHarness
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


class Unrestartable(NgramDrafter):
    """A drafting process that dies while the hub idles and never starts again."""

    supervised = True
    dead = False
    tries = 0

    def check(self) -> None:
        if self.dead:
            raise DrafterLost("the drafting process (pid 7) was killed by SIGKILL")

    def restart(self) -> None:
        self.tries += 1
        raise RuntimeError("the drafting process exited with code 2 before it was ready")


def test_a_drafting_process_that_cannot_be_restarted_stops_the_hub(monkeypatch):
    monkeypatch.setattr(supervision, "RESTART_BACKOFF", Backoff(0.01, 0.01))
    drafter = Unrestartable()
    harness = HubHarness(drafter)
    try:
        assert isinstance(harness.ask(b"t", TargetCard(name="t", vocab_size=100)), DrafterCard)
        tag = harness.ask(b"t", Open(ref=1, prompt_len=3,
                                     tokens=np.arange(1, 5, dtype=np.int32))).tag
        drafter.dead = True
        with pytest.raises(RuntimeError, match=r"could not be restarted \(3 tries\)"):
            harness.loop.run_until_complete(asyncio.wait_for(harness.worker, 60))
        assert drafter.tries == 3
        (to, error), = harness.hub.outbox
        assert to == b"t" and isinstance(error, Error) and error.tag == tag
        assert error.code == ErrorCode.INTERNAL and "killed by SIGKILL" in error.message
        assert not harness.hub.table.sessions
        harness.hub.outbox.clear()
        reject = harness.ask(b"t", TargetCard(name="t2", vocab_size=100))
        assert isinstance(reject, Reject) and "restarting" in reject.reason
    finally:
        harness.close()
