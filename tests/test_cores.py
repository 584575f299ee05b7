"""Shared cores: a target on its hub's host times its plain steps alone (by CPU time), so
the hub's drafting is charged to trees and never makes plain decoding look slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from starhub.cores import (
    CoreClock,
    cpu_ids,
    host_id,
    load_target,
    on_passing_thread,
    own_cores,
    shares_cores,
)
from starhub.launch.status import query_stats
from targets import attach, runner
from tests.conftest import HubThread


def test_a_peer_shares_cores_only_on_this_host_and_on_cpus_this_process_may_use():
    here, mine = host_id(), cpu_ids()
    assert shares_cores(here, mine)
    assert not shares_cores("another-host", mine)
    assert not shares_cores("", mine), "a card that names no host shares nothing"
    assert not shares_cores(here, [max(mine) + 1]), "CPUs this process may not run on"
    assert shares_cores("another-host", [], "yes") and not shares_cores(here, mine, "no")


def test_a_shared_clock_counts_only_the_time_the_thread_computes():
    shared, plain = CoreClock(shared=True), CoreClock(shared=False)
    shared.start(), plain.start()
    time.sleep(0.05)  # off the CPU, as a step is while the hub's drafting holds its core
    wall, alone = shared.lap()
    assert wall >= 0.05 and alone < wall / 2
    wall, alone = plain.lap()
    assert alone == wall


def test_a_target_on_the_hubs_host_tells_the_hub_it_shares_its_cores(tiny_model):
    from starhub.drafters.ngram import NgramDrafter

    model, tok = tiny_model
    hub = HubThread(NgramDrafter())
    try:
        for setting, expected in (("auto", True), ("no", False)):
            with attach(model, tok, hub.address, name=f"t-{setting}",
                        shared_cores=setting) as session:
                session.generate("one two one two one two", max_new_tokens=8)
                entries = {t.name: t for t in query_stats(hub.address).control.targets}
                assert entries[f"t-{setting}"].shared_cores is expected
    finally:
        hub.stop()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_model_loaded_on_a_passing_thread_leaves_no_openmp_workers_behind():
    """libgomp keeps a pool of workers for each thread that ran a parallel region; work done
    on a passing thread leaves none, so the engine thread's pool is the process's only one,
    whose workers spin between a pass's products instead of sleeping. A fresh process: this
    one's main thread may hold a pool already."""
    script = """
import os, time, torch
from starhub.cores import on_passing_thread
torch.set_num_threads(2)
x = torch.randn(512, 512)
def threads(): return len(os.listdir("/proc/self/task"))
def settled(): # a thread's pool goes in its exit, just after the thread's join returns
    for _ in range(100):
        time.sleep(0.05)
        if threads() == start:
            break
    return threads()
start = threads()
on_passing_thread(lambda: torch.mm(x, x))
passing = settled()
torch.mm(x, x)
time.sleep(0.3)
print(start, passing, threads())
"""
    start, passing, here = map(int, subprocess.check_output([sys.executable, "-c", script],
                                                            text=True).split())
    assert passing == start, "the passing thread's pool went with it"
    assert here > start, "the same product on a thread that stays leaves its pool"


def test_a_passing_thread_gives_back_its_result_or_its_exception_and_only_own_cores_use_it():
    assert on_passing_thread(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad config"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad config")))
    assert own_cores(None) and own_cores("") and own_cores("tcp://h:5555", "no")
    assert not own_cores("tcp://h:5555") and not own_cores(["tcp://h:5555"], "yes")
    here = threading.current_thread().name
    assert load_target(lambda: threading.current_thread().name, None) != here
    assert load_target(lambda: threading.current_thread().name, "tcp://h:5555") == here


def test_a_target_with_no_hub_loads_and_starts_its_core_on_a_passing_thread(tiny_dir, tmp_path,
                                                                            monkeypatch):
    """``starhub target`` without a hub: everything before its engine thread's passes runs on
    a thread that ends, so no OpenMP pool stays beside the engine thread's."""
    loaded_on: list[str] = []
    real_load = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda **kw: loaded_on.append(
        threading.current_thread().name) or real_load(**kw))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    weights = {"spec": str(tiny_dir), "dtype": "auto", "linear": "auto", "device": "cpu",
               "device_map": None, "compile": False}
    out = tmp_path / "out.jsonl"
    assert runner.run(None, weights, str(prompts), str(out), 4, 0.0, 1.0, 0, 1, True,
                      "t") == 0
    assert loaded_on and loaded_on[0] != threading.main_thread().name
    assert len(out.read_text().splitlines()) == 1
