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
