"""Shared cores: a target on its hub's host times its plain steps alone (by CPU time), so
the hub's drafting is charged to trees and never makes plain decoding look slow."""

from __future__ import annotations

import time

from starhub.cores import CoreClock, cpu_ids, host_id, shares_cores
from starhub.launch.status import query_stats
from targets import attach
from targets.engine import BatchStats
from targets.serve.gate import SpeculationGate
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


def test_the_slowdown_the_hub_adds_to_tree_passes_counts_against_trees():
    def gate_after(slowdown: float) -> SpeculationGate:
        gate = SpeculationGate(step_s=0.04)
        for rows in range(1, 5):
            for fed_each, trees in ((1, False), (11, True)):
                cost = BatchStats(rows, rows * fed_each, rows * 200, rows * 200 * fed_each)
                alone = 0.04 + 0.002 * rows * fed_each
                gate.observe_pass(cost, alone, alone * (slowdown if trees else 1.0),
                                  rows if trees else 0)
        for _ in range(50):
            gate.observe_round(10, 3)
            gate.observe_round_trip(0.02)
        return gate

    assert gate_after(1.0).pays([200, 200])
    assert not gate_after(2.0).pays([200, 200])
    assert gate_after(2.0).rates([200])[1] == gate_after(1.0).rates([200])[1], \
        "plain batching is judged by the passes' time alone either way"


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
