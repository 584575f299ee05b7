"""Shared cores: a target on its hub's host times its plain steps alone (by CPU time), so
the hub's drafting is charged to trees and never makes plain decoding look slow."""

from __future__ import annotations

import time

from starhub.cores import CoreClock, cpu_ids, host_id, shares_cores
from starhub.launch.status import query_stats
from targets import attach
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


def _nice_values(pid: int) -> set[int]:
    import os

    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _children(pid: int) -> list[int]:
    import os

    return [int(c) for tid in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]


def test_a_hub_yields_its_cores_once_a_target_computing_on_them_opens_a_session(tiny_model):
    """Drafting beside a target on the same cores takes the lowest CPU priority, every
    thread of the hub's process and of its drafting process, so that it never preempts the
    target's passes; a target elsewhere leaves it as it is, and so does
    ``--yield-cores off``."""
    import os

    import pytest

    from starhub.cores import NICE
    from starhub.launch.spawn import spawn_hub

    if not hasattr(os, "getpriority") or not os.path.isdir("/proc/self/task"):
        pytest.skip("per-thread priorities are read from Linux's /proc")
    model, tok = tiny_model
    base = os.getpriority(os.PRIO_PROCESS, 0)  # what a child starts with
    if base >= NICE:
        pytest.skip("this process already runs at the lowest priority")
    for flags, setting, expected in ((["--yield-cores", "off"], "auto", {base}),
                                     ([], "no", {base}), ([], "auto", {NICE}),
                                     (["--draft-process", "on"], "auto", {NICE})):
        with spawn_hub(["--drafter", "ngram", *flags]) as hub:
            procs = [hub.proc.pid, *_children(hub.proc.pid)]
            assert len(procs) == 1 + ("--draft-process" in flags)
            assert {nice for pid in procs for nice in _nice_values(pid)} == {base}
            with attach(model, tok, hub.address, shared_cores=setting) as session:
                session.generate("one two one two one two", max_new_tokens=8)
            for pid in procs:
                assert _nice_values(pid) == expected, (flags, setting, pid)
