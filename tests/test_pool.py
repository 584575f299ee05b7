"""A target given a pool of hubs: it reads each hub's offer, opens its sessions on the best,
moves to another when its hub dies or drains, decodes alone while none will have it, and
its output never changes."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import socket
import subprocess
import time

import msgspec
import pytest
import torch

from starhub.client.connection import HubClient
from starhub.client.pool import (
    TIE,
    Offer,
    move_chance,
    offer,
    pool_addresses,
    rank,
    survey,
)
from starhub.control import plane
from starhub.control.plane import OVER_S, ControlConfig, Controller
from starhub.drafters.ngram import NgramDrafter
from starhub.hub.shutdown import drain
from starhub.launch import child_env, spawn_hub, target_command
from starhub.options import AUTO
from starhub.wire.messages import DrafterCard, TargetCard
from targets import attach, hub_link
from tests.conftest import HubThread

PROMPT = [1, 5, 9, 14, 3, 5, 9, 14, 3]
NEW = 12
LONG = 2000
"""A request that decodes for seconds on the tiny model (its context is 2,048 tokens)."""


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _reference(model) -> list[int]:
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None)[0, len(PROMPT):].tolist()


HOLD = {"peer_grace_s": 600.0}
"""A hub's settings that keep its holders admitted (``_holder``) throughout a test."""


def _holder(address: str, vocab_size: int) -> HubClient:
    """A target that holds an admission slot at ``address`` and does nothing else: the hub
    forgets it after its peer grace (it opens no session), so a hub whose holders must stay
    through a test is started with ``HOLD``."""
    client = HubClient(address, timeout_s=10)
    assert isinstance(client.greet(TargetCard(name="holder", vocab_size=vocab_size)),
                      DrafterCard)
    return client


def test_pool_addresses_take_a_list_or_commas_and_name_each_hub_once():
    assert pool_addresses("tcp://a:1, tcp://b:2,tcp://a:1") == ["tcp://a:1", "tcp://b:2"]
    assert pool_addresses(["tcp://b:2"]) == ["tcp://b:2"]
    with pytest.raises(ValueError, match="no hub address"):
        pool_addresses(" , ")


def test_rank_puts_the_best_offer_first_then_fewer_targets_and_full_hubs_last():
    offers = [Offer("full", 0.0, 1, 0.2), Offer("busy", 100.0, 9, 1.0),
              Offer("fast", 300.0, 2, 0.5), Offer("fast-but-crowded", 299.0, 5, 0.5)]
    for seed in range(20):
        order = [o.address for o in rank(offers, random.Random(seed))]
        assert order == ["fast", "fast-but-crowded", "busy", "full"]


def test_equal_offers_are_tried_in_a_random_order_so_that_newcomers_spread():
    offers = [Offer(name, 100.0, 0, 0.0) for name in "abcd"]
    firsts = {rank(offers, random.Random(seed))[0].address for seed in range(40)}
    assert firsts == set("abcd")


def test_a_hubs_offer_follows_its_admission_rule_and_the_star_model(tiny_model):
    """The offer is read from a real hub's STATS: a rate while it has room, none once its
    admission limit is reached; asking took no slot."""
    model, _ = tiny_model
    hub = HubThread(NgramDrafter(), max_targets=1)
    try:
        reports = survey([hub.address])
        first = offer(hub.address, reports[hub.address])
        typical = reports[hub.address].control.typical
        s, z = typical.S_ms / 1e3, typical.Z_ms / 1e3
        assert first.admitted == 0 and first.tok_s == pytest.approx(typical.tau / max(s + z, s))
        holder = _holder(hub.address, model.config.vocab_size)
        full = offer(hub.address, survey([hub.address])[hub.address])
        assert full.admitted == 1 and full.tok_s == 0
        holder.close()
    finally:
        hub.stop()


def test_a_survey_leaves_out_hubs_that_do_not_answer():
    hub = HubThread(NgramDrafter())
    try:
        dead = _free_address()
        found = survey([dead, hub.address], timeout_s=0.5)
        assert list(found) == [hub.address]
    finally:
        hub.stop()


def test_a_target_opens_on_the_hub_with_room_and_moves_when_its_hub_dies(tiny_model):
    """Two hubs, one of them holding a target already: the newcomer opens on the other; that
    one killed, the request under way finishes alone and a later one opens on the first.
    Every output is generate()'s."""
    model, tok = tiny_model
    want = _reference(model)
    a, b = HubThread(NgramDrafter(), **HOLD), HubThread(NgramDrafter())
    holder = _holder(a.address, model.config.vocab_size)
    try:
        with attach(model, tok, [a.address, b.address], name="pooled", timeout_s=1.0) as t:
            first = t.generate(PROMPT, max_new_tokens=NEW)
            assert first.output_ids == want
            assert first.stats.hub == b.address and first.stats.rounds > 0, first.stats
            b.stop()
            results = []
            deadline = time.monotonic() + 60
            while not results or results[-1].stats.hub != a.address:
                assert time.monotonic() < deadline, [r.stats for r in results]
                results.append(t.generate(PROMPT, max_new_tokens=NEW))
                time.sleep(0.05)
            assert all(r.output_ids == want for r in results)
            assert all(r.stats.standalone and r.stats.note for r in results[:-1])
            assert results[-1].stats.rounds > 0 and not results[-1].stats.note
    finally:
        holder.close()
        a.stop()
        b.stop()


def test_a_draining_hub_sends_its_targets_to_the_other_hub(tiny_model):
    """SIGTERM's drain on the hub a target decodes with: the request under way finishes
    with the same tokens, and once the link has moved, requests open on the other hub."""
    model, tok = tiny_model
    want = _reference(model)
    hubs = {h.address: h for h in (HubThread(NgramDrafter()), HubThread(NgramDrafter()))}
    try:
        with attach(model, tok, list(hubs), name="pooled", timeout_s=2.0) as t:
            first = t.generate(PROMPT, max_new_tokens=NEW)
            assert first.stats.hub in hubs and first.stats.rounds > 0
            draining = hubs[first.stats.hub]
            ids: list[int] = []
            for n, chunk in enumerate(t.stream(PROMPT, max_new_tokens=NEW)):
                ids.append(chunk)
                if n == 0:
                    asyncio.run_coroutine_threadsafe(drain(draining.hub, draining.task),
                                                     draining.loop).result(15)
            assert tok.decode(want, skip_special_tokens=True) == "".join(ids)
            deadline = time.monotonic() + 60
            while True:
                after = t.generate(PROMPT, max_new_tokens=NEW)
                assert after.output_ids == want and after.stats.hub != draining.address
                if after.stats.rounds > 0:
                    break
                assert time.monotonic() < deadline, after.stats
                time.sleep(0.05)
    finally:
        for hub in hubs.values():
            hub.stop()


def test_a_target_whose_whole_pool_is_down_decodes_alone_says_so_once_and_joins_later(
        tiny_model, caplog):
    model, tok = tiny_model
    want = _reference(model)
    pool = [_free_address(), _free_address()]
    with caplog.at_level(logging.INFO, logger="starhub"), \
            attach(model, tok, pool, name="pooled", timeout_s=1.0) as t:
        alone = [t.generate(PROMPT, max_new_tokens=NEW) for _ in range(3)]
        assert all(r.output_ids == want and r.stats.standalone for r in alone)
        said = [r for r in caplog.records if "no hub" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        hub = HubThread(NgramDrafter(), bind=pool[1])
        try:
            deadline = time.monotonic() + 60
            while True:
                result = t.generate(PROMPT, max_new_tokens=NEW)
                assert result.output_ids == want
                if result.stats.hub == pool[1] and result.stats.rounds > 0:
                    break
                assert time.monotonic() < deadline, result.stats
                time.sleep(0.2)
        finally:
            hub.stop()


def _rows(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "drained"])
def test_target_processes_carry_on_at_the_other_hub_when_theirs_is_killed_or_drained(
        tiny_dir, tiny_model, tmp_path, sig):
    """Two hub processes, two target processes given both: the hub the first target uses is
    SIGKILLed (or SIGTERMed: it drains and exits 0) mid-run. No request fails or is lost,
    every output is generate()'s, and every request that starts 5 s after the signal runs
    through the other hub, as the targets' stats say."""
    model, tok = tiny_model
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"count {i} {i + 1} {i + 2}"})
                               + "\n" for i in range(400)))
    outs = [tmp_path / "t0.jsonl", tmp_path / "t1.jsonl"]
    hubs = {h.address: h for h in (spawn_hub(["--drafter", "ngram", "--depth", "4"]),
                                   spawn_hub(["--drafter", "ngram", "--depth", "4"]))}
    procs = [subprocess.Popen(target_command(",".join(hubs), str(prompts), str(out), extra=[
        "--model", str(tiny_dir), "--max-new-tokens", str(NEW), "--shard", f"{i}/2",
        "--hub-timeout", "1", "--name", f"t{i}"]), env=child_env(1),
        stderr=subprocess.DEVNULL) for i, out in enumerate(outs)]
    try:
        deadline = time.monotonic() + 120
        while not all(any(r["stats"]["hub"] for r in _rows(out)) for out in outs):
            assert time.monotonic() < deadline, "the targets never used a hub"
            time.sleep(0.1)
        gone = next(r["stats"]["hub"] for r in _rows(outs[0]) if r["stats"]["hub"])
        (other,) = set(hubs) - {gone}
        hubs[gone].proc.send_signal(sig)
        signalled = time.time()
        if sig == signal.SIGTERM:
            assert hubs[gone].proc.wait(15) == 0
        settled = signalled + 5.0
        deadline = time.monotonic() + 120
        while not all(sum(r["stats"]["started_at"] > settled for r in _rows(out)) >= 2
                      for out in outs):
            assert all(p.poll() is None for p in procs), "a target died"
            assert time.monotonic() < deadline, "the targets made no progress"
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for hub in hubs.values():
            hub.stop()
    for k, out in enumerate(outs):
        rows = _rows(out)
        assert [r["id"] for r in rows] == list(range(k, 2 * len(rows), 2))  # none lost
        later = [r["stats"] for r in rows if r["stats"]["started_at"] > settled]
        assert all(s["hub"] == other and s["rounds"] > 0 for s in later), later
        for r in rows:
            want = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=NEW,
                                  do_sample=False)[0, len(r["prompt_ids"]):].tolist()
            assert r["output_ids"] == want, r["id"]


def _real_report():
    """A real hub's STATS, with no target yet, for the tests to edit."""
    hub = HubThread(NgramDrafter())
    try:
        return survey([hub.address])[hub.address]
    finally:
        hub.stop()


def test_move_chance_evens_out_a_crowd_but_never_follows_an_offer_alone(tiny_model):
    report = _real_report()

    def at(n: int):
        return msgspec.structs.replace(report, control=msgspec.structs.replace(
            report.control, admitted=n))

    def there(n: int, faster: float = 1.0) -> Offer:
        o = offer("b", at(n))
        return Offer("b", o.tok_s * faster, n, 0.0)

    assert move_chance(at(4), there(0)) == 0.25  # one of four moves at a look, on average
    assert move_chance(at(3), there(1)) == pytest.approx(1 / 6)
    assert move_chance(at(2), there(1)) == 0 and move_chance(at(1), there(0)) == 0
    assert move_chance(at(1), there(0, faster=1.5)) == 0  # counts move targets, offers not
    assert move_chance(at(4), there(1, faster=1 / 1.5)) == 0  # fewer targets, far slower
    assert move_chance(at(4), there(1, faster=1 / 1.2)) == pytest.approx(0.1875)  # noise
    assert move_chance(at(4), there(0, faster=1 / 1.5)) == 0.25  # an empty hub: its priors
    assert move_chance(at(1), Offer("b", 0.0, 0, 0.0)) == 0  # full


def test_idle_hubs_a_millisecond_apart_in_drafting_tie_for_a_newcomer_that_knows_its_step():
    """Two hubs with no targets (so no step in their round trip) whose drafting was timed
    8 and 9 ms: by their figures alone one offers 11% more and every newcomer would greet it;
    with the newcomer's own 28 ms step in the round trip they tie, and newcomers spread."""
    report = _real_report()

    def idle(s_ms: float):
        typical = msgspec.structs.replace(report.control.typical, S_ms=s_ms, Z_ms=1.0)
        return msgspec.structs.replace(report, control=msgspec.structs.replace(
            report.control, admitted=0, typical=typical))

    fast, slow = idle(8.0), idle(9.0)
    apart = [offer("fast", fast), offer("slow", slow)]
    assert apart[0].tok_s > apart[1].tok_s * (1 + TIE)
    with_step = [offer("fast", fast, step_s=0.028), offer("slow", slow, step_s=0.028)]
    assert with_step[0].tok_s <= with_step[1].tok_s * (1 + TIE)
    firsts = {rank(with_step, random.Random(seed))[0].address for seed in range(20)}
    assert firsts == {"fast", "slow"}


def test_a_target_moves_between_requests_to_a_hub_that_serves_it_better(tiny_model,
                                                                       monkeypatch):
    """A target that found only a crowded hub (three targets beside it) moves to an empty
    one that comes up later, between two requests, with the same output."""
    monkeypatch.setattr(hub_link, "REBALANCE_S", hub_link.LOOK_GAP_S)  # a look a second
    model, tok = tiny_model
    want = _reference(model)
    crowded, later = HubThread(NgramDrafter(), **HOLD), _free_address()
    holders = [_holder(crowded.address, model.config.vocab_size) for _ in range(3)]
    empty = None
    try:
        with attach(model, tok, [crowded.address, later], name="pooled", timeout_s=1.0) as t:
            first = t.generate(PROMPT, max_new_tokens=NEW)
            assert first.stats.hub == crowded.address and first.output_ids == want
            empty = HubThread(NgramDrafter(), bind=later)
            deadline = time.monotonic() + 60
            while True:
                result = t.generate(PROMPT, max_new_tokens=NEW)
                assert result.output_ids == want and not result.stats.note, result.stats
                if result.stats.hub == later:
                    break
                assert time.monotonic() < deadline, result.stats
                time.sleep(0.05)
    finally:
        for h in holders:
            h.close()
        crowded.stop()
        if empty is not None:
            empty.stop()


def test_a_hub_over_its_limit_asks_those_it_serves_least_well_to_leave_and_keeps_asking_them():
    """Once over its limit for OVER_S, the control plane names as many targets as it is
    over: of those admitted at least OVER_S ago, the ones whose predicted speed here beats
    their standalone speed least (a target with no session gains nothing now); those it
    asked stay asked while admitted; within the limit, nobody."""
    control = Controller(ControlConfig(max_targets=4))
    for name, at in ((b"a", 0.0), (b"b", 0.0), (b"c", 0.0), (b"d", 105.0)):
        assert control.join(name, name.decode(), 0.05, at) is None
    # a speculates at 0.8x its standalone speed, b holds no session, c 3x, d (new) 0.5x
    for tag, who, tokens in ((1, b"a", 0.8), (3, b"c", 3.0), (4, b"d", 0.5)):
        control.open(tag, who, 0.05)
        sm = control.sessions[tag]
        sm.s, sm.z, sm.e = 0.001, 0.049, tokens
    assert control.review(100.0) == frozenset()
    control.config.max_targets = 2  # the limit falls below the count (as N_max does)
    assert control.review(101.0) == frozenset(), "not over for OVER_S yet"
    assert control.review(101.0 + OVER_S) == {b"a", b"b"}, "d joined too lately to ask"
    assert control.snapshot(0.0).unwanted == 2
    control.config.max_targets = 3
    control.sessions[1].e = 10.0  # a gains most now, but b and a were asked: b stays asked
    assert control.review(102.0 + OVER_S) == {b"b"}
    control.leave(b"b")  # its peer grace ended
    assert control.review(103.0 + OVER_S) == frozenset()


def test_a_target_its_hub_would_rather_lose_moves_to_a_hub_with_room_and_no_other_does(
        tiny_model, monkeypatch):
    """Two targets on a hub whose limit falls to one: the hub asks one of them to leave (in
    its PROPOSEs), and that one opens its next sessions on the other hub once it is up; the
    other stays. Outputs are generate()'s throughout."""
    monkeypatch.setattr(plane, "OVER_S", 0.5)
    monkeypatch.setattr(hub_link, "move_chance", lambda *_: 0.0)  # the hub's word
    model, tok = tiny_model                                               # alone moves them
    want = _reference(model)
    a, later = HubThread(NgramDrafter(), peer_grace_s=1.0), _free_address()
    b = None
    try:
        with attach(model, tok, [a.address, later], name="one", timeout_s=1.0) as one, \
                attach(model, tok, [a.address, later], name="two", timeout_s=1.0) as two:
            for t in (one, two):
                assert t.generate(PROMPT, max_new_tokens=NEW).stats.hub == a.address
            b = HubThread(NgramDrafter(), bind=later)
            a.hub.control.config.max_targets = 1
            hubs: dict[str, list[str]] = {"one": [], "two": []}
            deadline = time.monotonic() + 60
            while later not in hubs["one"] + hubs["two"]:
                assert time.monotonic() < deadline, hubs
                for name, t in (("one", one), ("two", two)):
                    result = t.generate(PROMPT, max_new_tokens=NEW)
                    assert result.output_ids == want and not result.stats.note, result.stats
                    hubs[name].append(result.stats.hub)
            moved = "one" if later in hubs["one"] else "two"
            for _ in range(8):  # past the moved one's peer grace at the first hub
                for name, t in (("one", one), ("two", two)):
                    result = t.generate(PROMPT, max_new_tokens=NEW)
                    assert result.output_ids == want, result.stats
                    assert result.stats.hub == (later if name == moved else a.address)
                time.sleep(0.2)
            assert a.hub.control.unwanted == frozenset()  # within its limit again
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_serving_target_moves_at_a_session_boundary_while_its_open_request_finishes(
        tiny_model, monkeypatch):
    """A server asked to leave while a request decodes with its hub: that request finishes
    its rounds at the old hub, and a request that begins once the server has chosen where
    to go opens at the new one. Every output is generate()'s."""
    import queue

    from targets.batcher import Batcher, Request
    from tests.test_serve_gate import stats_of

    monkeypatch.setattr(plane, "OVER_S", 0.2)
    monkeypatch.setattr(hub_link, "move_chance", lambda *_: 0.0)
    monkeypatch.setattr(hub_link, "LOOK_GAP_S", 0.1)  # choose while the long one decodes
    model, tok = tiny_model
    want = _reference(model)
    a, later = HubThread(NgramDrafter()), _free_address()
    b = None
    # trees always: on a loaded machine the gate may send a batch of two plain, and the
    # long request would leave its hub for that, not for the move
    batcher = Batcher(model, tok, [a.address, later], timeout_s=1.0, speculate="always")
    batcher.start()
    try:
        long, short = queue.SimpleQueue(), queue.SimpleQueue()
        batcher.submit(Request(prompt=PROMPT, max_tokens=LONG, sink=long.put))
        assert _wait(lambda: a.hub.metrics.sessions_opened >= 1)
        b = HubThread(NgramDrafter(), bind=later)
        a.hub.sweep_s = 0.2  # reviews its targets five times a second
        a.hub.control.config.max_targets = AUTO  # N_max falls to nothing: every target
        a.hub.control.n_max = lambda: 0          # here would be better off elsewhere
        deadline = time.monotonic() + 60
        while True:  # requests that begin while the long one decodes: the first ones may
            # come before the target has chosen where to go, and open at the first hub
            assert time.monotonic() < deadline, "the target never moved"
            batcher.submit(Request(prompt=PROMPT, max_tokens=NEW, sink=short.put))
            got_short, short_stats = stats_of(short)
            assert got_short == want
            if short_stats.hub == later:
                break
            time.sleep(0.2)
        assert batcher.active == 1, "the long request is still open"
        got_long, long_stats = stats_of(long)
        assert long_stats.hub == a.address and long_stats.rounds > 0, long_stats
        assert not long_stats.note, "the open request finished with its hub, not alone"
        assert _wait(lambda: not batcher.link.retiring), "the old connection closes"
    finally:
        batcher.stop()
        a.stop()
        if b is not None:
            b.stop()
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=LONG, do_sample=False,
                         eos_token_id=None)
    assert got_long == ref[0, len(PROMPT):].tolist()


def _wait(check, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
