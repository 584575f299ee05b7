"""The drafter in a process of its own: it drafts exactly the trees the same drafter drafts
in process, round after round (the sessions it mirrors stay in step), takes jobs handed
over mid-batch, and a child that cannot load gives a clear error. A child that dies or
hangs is reported lost, and a restarted one drafts as the first did."""

from __future__ import annotations

import argparse
import copy
import gc
import os
import signal
import tempfile
import threading

import pytest
import torch

from starhub.drafters.base import DraftContext, DrafterLost, TreeShape
from starhub.drafters.eagle import EagleDrafter
from starhub.drafters.eagle_head import EAGLE, save_eagle_head
from starhub.drafters.ngram import NgramDrafter
from starhub.hub import drafting_process
from starhub.hub.config import HubConfig
from starhub.hub.drafting_process import RemoteDrafter, Watch
from starhub.options import AUTO, AutoOnOff, draft_process_for
from starhub.settings.cli import value_type
from starhub.settings.processes import HubSettings
from starhub.wire.messages import TargetCard
from tests.test_batched_drafting import same
from tests.test_eagle_drafter import random_head

SHAPE = TreeShape(depth=4, topk=3, max_nodes=9)


@pytest.fixture(scope="module")
def head(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    save_eagle_head(random_head(tiny_dir, EAGLE, 500), out)
    return out


@pytest.fixture(scope="module")
def drafters(tiny_dir, head):
    local = EagleDrafter.load(head, str(tiny_dir), dtype=torch.float32)
    remote = remote_drafter(tiny_dir, head)
    yield local, remote
    remote.close()


def sessions(width: int, count: int = 3) -> list[DraftContext]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        n = 6 + 4 * i
        out.append(DraftContext(tokens=torch.randint(3, 4000, (n,), generator=g).tolist(),
                                features=[torch.randn(n - 1, width, generator=g).numpy()]))
    return out


def commit(ctxs: list[DraftContext], width: int, round_: int) -> None:
    """What a COMMIT adds: three tokens and their feature rows (as the wire gives them)."""
    g = torch.Generator().manual_seed(100 + round_)
    for ctx in ctxs:
        ctx.tokens += torch.randint(3, 4000, (3,), generator=g).tolist()
        ctx.features.append(torch.randn(3, width, generator=g).numpy())


def test_the_child_drafts_the_trees_the_drafter_drafts_in_process(drafters):
    local, remote = drafters
    assert (remote.name, remote.feature_size, remote.batches, remote.predrafts) == \
        (local.name, local.feature_size, local.batches, local.predrafts)
    here = sessions(local.feature_size)
    there = copy.deepcopy(here)
    for round_ in range(4):
        want = local.propose_batch([(ctx, SHAPE) for ctx in here])
        got = remote.propose_batch([(ctx, SHAPE) for ctx in there])
        assert all(same(a, b) for a, b in zip(want, got, strict=True)), round_
        assert len(got[0]) > 1
        assert not any(ctx.features for ctx in there), "the features went to the child"
        commit(here, local.feature_size, round_)
        commit(there, local.feature_size, round_)


def test_jobs_handed_over_mid_batch_are_drafted_and_each_is_reported(drafters):
    local, remote = drafters
    first, late = sessions(local.feature_size, 2), sessions(local.feature_size, 3)[2:]
    want = [local.propose(ctx, SHAPE) for ctx in copy.deepcopy(first + late)]
    handed = [(ctx, SHAPE) for ctx in late]
    reported: dict[int, object] = {}

    def admit():
        jobs = list(handed)
        handed.clear()
        return jobs

    def finished(k, result, seconds, shared):
        reported[k] = result
        assert seconds > 0 and shared >= 1

    threading.Timer(0.0, remote.wake).start()
    got = remote.propose_batch([(ctx, SHAPE) for ctx in first], admit=admit, finished=finished)
    taken = len(got)
    assert taken in (2, 3) and sorted(reported) == list(range(taken))
    assert all(same(want[k], reported[k]) for k in range(taken))
    if taken == 2:  # the batch ended before the child looked: the next one drafts it
        assert same(want[2], remote.propose(late[0], SHAPE))


def test_predrafting_in_the_child_guesses_what_it_guesses_in_process(drafters):
    local, remote = drafters
    here = sessions(local.feature_size, 1)
    there = copy.deepcopy(here)
    tree = local.propose(here[0], SHAPE)
    assert same(tree, remote.propose(there[0], SHAPE))
    want = local.predraft(here[0], tree, SHAPE, lambda: False)
    got = remote.predraft(there[0], tree, SHAPE, lambda: False)
    assert want and sorted(want) == sorted(got)
    assert all(same(want[key], got[key]) for key in want)


def test_a_session_the_hub_drops_is_forgotten_by_the_child(drafters):
    _, remote = drafters
    ctx = sessions(remote.feature_size, 1)[0]
    remote.propose(ctx, SHAPE)
    sid = ctx.state.sid
    del ctx
    gc.collect()
    assert sid in remote._forgotten  # goes out with the next message
    remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)
    assert sid not in remote._forgotten


def test_targets_are_checked_against_what_the_child_drafts_for(drafters):
    local, remote = drafters
    card = TargetCard(name="t", vocab_size=local.head.vocab_size + 1, hidden_size=0, num_layers=2)
    assert remote.check_target(card) == local.check_target(card) is not None
    card = TargetCard(name="t", vocab_size=local.head.vocab_size, hidden_size=0, num_layers=2)
    assert remote.check_target(card) is None


def test_a_drafter_that_cannot_load_fails_the_start_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the link's folder goes
    with pytest.raises(RuntimeError, match="no EAGLE head"):
        RemoteDrafter(HubSettings(draft=str(tmp_path)))
    assert not list(tmp_path.glob("starhub-draft-*")), "the failed start left its folder"


def remote_drafter(tiny_dir, head) -> RemoteDrafter:
    return RemoteDrafter(HubSettings(draft=str(head), model=str(tiny_dir),
                                     draft_dtype="float32"))


def test_a_killed_child_is_lost_and_a_restarted_one_drafts_as_before(tiny_dir, head, drafters):
    local, _ = drafters
    remote = remote_drafter(tiny_dir, head)
    try:
        before = sessions(remote.feature_size, 1)[0]
        remote.propose(before, SHAPE)
        first = remote.pid
        os.kill(first, signal.SIGKILL)
        remote._proc.wait()
        with pytest.raises(DrafterLost, match="killed by SIGKILL"):
            remote.check()
        with pytest.raises(DrafterLost, match="killed by SIGKILL"):
            remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)
        remote.restart()
        assert remote.pid != first and remote.starts == 2
        remote.check()
        here = sessions(local.feature_size, 1)
        there = copy.deepcopy(here)
        assert same(local.propose(here[0], SHAPE), remote.propose(there[0], SHAPE))
        with pytest.raises(RuntimeError, match="since been restarted"):
            remote.propose(before, SHAPE)  # its drafting state died with the first child
    finally:
        remote.close()
    assert remote._proc.poll() is not None


def test_a_stopped_child_is_found_by_its_silent_heartbeat_and_replaced(tiny_dir, head,
                                                                       monkeypatch):
    monkeypatch.setattr(drafting_process, "HANG_FLOOR_S", 1.0)  # a short test, same rule
    monkeypatch.setattr(drafting_process, "WATCH_FACTOR", 2.0)
    remote = remote_drafter(tiny_dir, head)
    stopped = remote._proc
    try:
        remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)
        os.kill(stopped.pid, signal.SIGSTOP)
        with pytest.raises(DrafterLost, match="stopped answering"):
            remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)  # waits, never ends
        remote.restart()
        assert stopped.poll() is not None, "the stopped child was left behind"
        assert len(remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)) > 1
    finally:
        if stopped.poll() is None:
            stopped.kill()
        remote.close()


def test_the_watch_tells_a_slow_child_from_a_hung_one():
    watch = Watch(now=0.0)
    for t in range(1, 100):  # beats every half second through a 50 s draft: alive
        watch.beat(at=t / 2, gap=0.5)
        if t == 1:
            watch.call(0.5)
        assert watch.verdict(t / 2 + 0.1) is None
    watch.heard(50.0)
    assert watch.longest_wait == 49.5
    assert watch.call_s == 495.0, "a call may take ten times the longest wait seen"
    assert watch.verdict(50.0 + watch.hang_s + 1) == "stopped answering: no sign of life " \
        "for 6.0s"
    for t in range(101, 1200):
        watch.beat(at=t / 2, gap=0.5)
    assert "though it still beats" in watch.verdict(599.6)
    watch.call(None)
    assert watch.verdict(599.6) is None, "between calls only the beats count"
    watch.beat(at=600.0, gap=1.5)  # a child that beats late sometimes is given longer
    assert watch.hang_s == 15.0


def test_closing_mid_call_stops_the_child_and_later_calls_fail_clearly(tiny_dir, head):
    remote = remote_drafter(tiny_dir, head)
    with remote._busy:  # what a call in flight on the hub's drafting thread holds
        remote.close(timeout_s=5.0)
        assert remote._proc.poll() is not None, "the child was left running"
        assert not remote._link.closed, "the link was closed under the call"
    with pytest.raises(RuntimeError, match="stopped"):
        remote.propose(sessions(remote.feature_size, 1)[0], SHAPE)
    remote.close()
    assert remote._link.closed


def test_auto_gives_only_the_batching_drafter_a_process_of_its_own():
    assert draft_process_for(AUTO, "eagle")
    assert not draft_process_for(AUTO, "ngram") and not draft_process_for(AUTO, "model")
    assert draft_process_for(True, "ngram") and not draft_process_for(False, "eagle")
    read = value_type(AutoOnOff)
    assert [read(v) for v in ("auto", "on", "off")] == [AUTO, True, False]
    with pytest.raises(argparse.ArgumentTypeError, match="'auto', 'on' or 'off'"):
        read("maybe")


def test_the_hub_prunes_trees_only_for_a_drafter_whose_probabilities_track_acceptance(
        drafters):
    _, remote = drafters
    assert remote.calibrated, "the child reports the EAGLE head's calibration"
    assert HubConfig().control(calibrated=remote.calibrated).prune
    assert not HubConfig().control(calibrated=NgramDrafter().calibrated).prune
    assert not HubConfig(prune=False).control(calibrated=True).prune
