"""What a hostile peer can no longer do to a server: skew the hub's acceptance estimate with
a COMMIT that misreports, grow the verifier's peer table, stall other sessions with a long
prompt, take a fresh allowance with each connection, or hold admission slots idle."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from starhub.client.connection import HubClient, HubError
from starhub.drafters.ngram import NgramDrafter
from starhub.hub.server import TOKEN_BYTES
from starhub.server.limits import VERIFIER_LIMITS, SessionLimits
from starhub.server.loop import QUEUED_PER_PEER
from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Opened,
    Ping,
    Propose,
    Reject,
    TargetCard,
)
from starhub.wire.security import ClientSecurity
from starhub.wire.tree import DraftTree
from targets.acceptance import walk
from tests.conftest import HubThread
from tests.servers import HubHarness, VerifierHarness, wire
from tests.test_edge import VerifierThread
from tests.test_edge import _reference as reference
from tests.test_flood import ask, dealer
from tests.test_security import keys  # noqa: F401 - the fixture

T = b"target-a"
REPEATING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


@pytest.fixture
def hub():
    harness = HubHarness(NgramDrafter())
    assert isinstance(harness.ask(T, TargetCard(name="t", vocab_size=100)), DrafterCard)
    yield harness
    harness.close()


def commit(prop: Propose, accepted: int, tokens: list[int]) -> Commit:
    return Commit(tag=prop.tag, seq=prop.seq, accepted=accepted,
                  tokens=np.asarray(tokens, np.int32))


def test_a_commit_whose_accepted_count_its_tokens_do_not_walk_gets_an_error(hub):
    prop = hub.ask(T, Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32)))
    assert isinstance(prop, Propose) and len(prop.tokens) >= 2, prop
    first = int(prop.tokens[0])
    stranger = next(t for t in range(1, 100) if t not in prop.tokens.tolist())
    acceptance = hub.hub.control.hub_acceptance
    before, seen = hub.state(), (list(acceptance.trials), list(acceptance.hits))
    # claims a whole path accepted, but its tokens leave the tree at once
    lie = hub.ask(T, commit(prop, 2, [stranger, stranger, stranger]))
    assert isinstance(lie, Error) and lie.code == ErrorCode.BAD_FIELD, lie
    assert "walk 0 nodes" in lie.message
    # claims nothing accepted, though its first token is the tree's first node
    modest = hub.ask(T, commit(prop, 0, [first]))
    assert isinstance(modest, Error) and modest.code == ErrorCode.BAD_FIELD, modest
    assert hub.state() == before
    assert (acceptance.trials, acceptance.hits) == seen, "the estimate learnt nothing"
    # what walking the tree gives is taken
    path, bonus = walk(DraftTree(prop.tokens, prop.parents), lambda pos, depth: (
        int(prop.tokens[pos]) if pos < len(prop.tokens) else stranger))
    honest = [int(prop.tokens[i]) for i in path] + [bonus]
    assert isinstance(hub.ask(T, commit(prop, len(path), honest)), Propose)
    assert hub.hub.metrics.accept_lengths[len(path) + 1] == 1


def card(harness, who: bytes):
    return harness.ask(who, DrafterCard(drafter="d", depth=4, topk=2, max_nodes=8))


def test_the_verifiers_peer_table_forgets_idle_drafters_and_stays_bounded(tiny_model):
    a, b, c, d = b"drafter-a", b"drafter-b", b"drafter-c", b"drafter-d"
    harness = VerifierHarness(*tiny_model, peer_grace_s=0.2,
                              limits=replace(VERIFIER_LIMITS, max_peers=2))
    v = harness.verifier
    assert isinstance(card(harness, a), TargetCard)
    assert isinstance(card(harness, b), TargetCard)
    assert isinstance(card(harness, c), TargetCard), "the longest idle makes room"
    assert set(v.table.peers) == {b, c}
    gone = harness.ask(a, Open(ref=1, prompt_len=3, tokens=np.array([1, 2, 3], np.int32)))
    assert isinstance(gone, Error) and gone.code == ErrorCode.NO_CARD
    opened = {}
    for who in (b, c):
        opened[who] = harness.ask(who, Open(ref=2, prompt_len=3,
                                            tokens=np.array([4, 5, 6], np.int32)))
        assert isinstance(opened[who], Opened)
    full = card(harness, d)
    assert isinstance(full, Reject) and "--max-peers" in full.reason and full.retry_after_s > 0
    harness.send(b, Close(tag=opened[b].tag))
    time.sleep(0.3)
    v.housekeeping()
    assert set(v.table.peers) == {c}, "idle past the grace: forgotten; with a session: kept"
    assert isinstance(card(harness, d), TargetCard)


def test_the_hubs_peer_table_is_bounded_and_gives_an_idle_slot_to_a_newcomer():
    harness = HubHarness(NgramDrafter(), limits=SessionLimits(max_peers=1))
    try:
        hello = TargetCard(name="t", vocab_size=100)
        assert isinstance(harness.ask(T, hello), DrafterCard)
        prop = harness.ask(T, Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32)))
        refused = harness.ask(b"target-b", hello)
        assert isinstance(refused, Reject) and "--max-peers" in refused.reason
        harness.send(T, Close(tag=prop.tag))
        assert isinstance(harness.ask(b"target-b", hello), DrafterCard)
        assert set(harness.hub.table.peers) == {b"target-b"}
        assert set(harness.hub.control.targets) == {b"target-b"}, "its admission slot went too"
    finally:
        harness.close()


def test_a_long_prompt_is_prefilled_between_the_passes_of_other_sessions(tiny_model):
    """While a long prompt is prefilled, a chunk at a time, another drafter's tree is
    verified: its COMMIT leaves before the long prompt's OPENED, and both are what
    ``generate()`` gives."""
    model, tokenizer = tiny_model
    server = VerifierThread(model, tokenizer, prefill_chunk=32)
    long_prompt = [int(t) for t in np.random.default_rng(3).integers(3, 40000, 1500)]
    short_prompt = [1, 5, 9, 14, 3]
    try:
        hurried, waiting = dealer(server.address), dealer(server.address)
        for sock in (hurried, waiting):
            assert isinstance(ask(sock, DrafterCard(drafter="d", depth=4, topk=1, max_nodes=4)),
                              TargetCard)
        opened = ask(waiting, Open(ref=1, prompt_len=5, tokens=np.asarray(short_prompt,
                                                                          np.int32)))
        expected = reference(model, short_prompt, 3)
        assert int(opened.tokens[-1]) == expected[0]
        hurried.send_multipart(encode(Open(ref=2, prompt_len=len(long_prompt),
                                           tokens=np.asarray(long_prompt, np.int32))))
        waiting.send_multipart(encode(Propose(tag=opened.tag, seq=1,
                                              tokens=np.asarray(expected[1:], np.int32),
                                              parents=np.array([-1, 0], np.int32))))
        assert waiting.poll(60_000), "no COMMIT"
        commit = decode(waiting.recv_multipart())
        assert isinstance(commit, Commit) and commit.tokens.tolist()[:2] == expected[1:]
        assert not hurried.poll(0), "the long prompt's OPENED came first: it held the pass up"
        assert hurried.poll(60_000), "no OPENED"
        late = decode(hurried.recv_multipart())
        assert isinstance(late, Opened), late
        assert int(late.tokens[-1]) == reference(model, long_prompt, 1)[0]
        assert server.verifier.core.prefill_chunks >= len(long_prompt) // 32
    finally:
        server.stop()


def test_drafters_that_keep_opening_short_prompts_cannot_hold_a_long_one_up(tiny_model):
    """Short prompts go first, but not always: while one is always waiting for its prefill,
    the long prompt still gets every other slice and its OPENED comes."""
    long_drafter, short_drafter = b"long", b"short"
    harness = VerifierHarness(*tiny_model, prefill_chunk=32)
    v = harness.verifier
    for who in (long_drafter, short_drafter):
        assert isinstance(card(harness, who), TargetCard)
    long_prompt = np.arange(3, 323, dtype=np.int32)
    v.on_frames(long_drafter, wire(Open(ref=1, prompt_len=320, tokens=long_prompt)))
    (long_tag,) = v.prefills
    opened = 0
    for ref in range(2, 2000):
        if long_tag not in v.prefills:
            break
        if len(v.prefills) < 2:  # a short prompt always waits beside the long one
            v.on_frames(short_drafter, wire(Open(ref=ref, prompt_len=20, tokens=np.arange(
                5, 25, dtype=np.int32))))
            opened += 1
        asyncio.run(v.prefill_step())
    assert long_tag not in v.prefills, "the long prompt never got its chunks"
    assert opened >= 320 // 32, "the short prompts were served meanwhile"
    replies = []
    while v.outbox:
        to, reply = v.next_reply()
        if to == long_drafter:
            replies.append(decode(wire(reply)))
    assert [type(r) for r in replies] == [Opened]


class FeatureNgram(NgramDrafter):
    """An n-gram drafter that asks for features, as an EAGLE head does, and keeps them."""

    feature_layers = [-1]
    feature_size = 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_budget_counts_features_at_their_real_size(dtype):
    harness = HubHarness(FeatureNgram())
    try:
        assert isinstance(harness.ask(T, TargetCard(name="t", vocab_size=100)), DrafterCard)
        feats = torch.randn(len(REPEATING) - 1, 8).to(dtype)
        prop = harness.ask(T, Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32),
                                   features=feats))
        assert isinstance(prop, Propose), prop
        width = 4 if dtype == torch.float32 else 2
        assert harness.hub.table.budget.held == len(REPEATING) * TOKEN_BYTES + feats.numel() * width
    finally:
        harness.close()


def test_one_peer_cannot_take_the_whole_cache_from_those_who_come_after():
    """Long prompts from one connection stop at its fair share: a newcomer still opens."""
    harness = HubHarness(NgramDrafter(), limits=SessionLimits(max_cache_mb=8))
    try:
        for who in (T, b"target-b"):
            assert isinstance(harness.ask(who, TargetCard(name="t", vocab_size=100)), DrafterCard)
        long_prompt = np.arange(1000, dtype=np.int32) % 90 + 1
        opened = 0
        while True:
            reply = harness.ask(T, Open(ref=opened + 1, prompt_len=999, tokens=long_prompt))
            if isinstance(reply, Error):
                break
            opened += 1
        assert reply.code == ErrorCode.REJECTED and "fair share" in reply.message, reply
        assert opened and harness.hub.table.budget.held <= (8 << 20) // 2, "half at most, alone"
        late = harness.ask(b"target-b", Open(ref=9, prompt_len=999, tokens=long_prompt))
        assert isinstance(late, Propose), late
    finally:
        harness.close()


def test_a_peer_that_reads_nothing_cannot_grow_the_outbox():
    harness = HubHarness(NgramDrafter())
    try:
        hub = harness.hub
        ping = wire(Ping(nonce=1))
        for _ in range(QUEUED_PER_PEER + 50):
            hub.on_frames(T, ping)
        assert len(hub.outbox) == QUEUED_PER_PEER
        assert hub.errors["QUEUE_FULL"] == 50
        hub.on_frames(b"someone-else", ping)
        assert hub.outbox[-1][0] == b"someone-else", "another peer's reply still goes out"
        while hub.outbox:
            hub.next_reply()
        assert not hub.queued and hub.queued_total == 0
    finally:
        harness.close()


def test_connections_with_one_curve_key_share_one_allowance(keys):  # noqa: F811
    hub = HubThread(NgramDrafter(), security=keys.server,
                    limits=SessionLimits(max_sessions_per_peer=1))
    first = HubClient(hub.address, timeout_s=30, security=ClientSecurity(keys.allowed))
    second = HubClient(hub.address, timeout_s=30, security=ClientSecurity(keys.allowed))
    try:
        for client in (first, second):
            client.greet(TargetCard(name="same-key", vocab_size=100))
        opening = Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32))
        assert isinstance(first.request(opening, ref=1), Propose)
        with pytest.raises(HubError, match="--max-sessions-per-peer"):
            second.request(opening, ref=1)
        principals = {p.principal for p in hub.hub.table.peers.values()}
        assert len(hub.hub.table.peers) == 2 and len(principals) == 1
        assert principals.pop().startswith(b"key:")
    finally:
        first.close()
        second.close()
        hub.stop()


def test_connections_with_the_local_key_keep_an_allowance_each():
    """The local client key is every process of this user: it names no principal, so each
    connection keeps its own budgets, as without CURVE."""
    hub = HubThread(NgramDrafter(), limits=SessionLimits(max_sessions_per_peer=1))
    first, second = HubClient(hub.address, timeout_s=30), HubClient(hub.address, timeout_s=30)
    try:
        for client in (first, second):
            client.greet(TargetCard(name="local", vocab_size=100))
        opening = Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32))
        assert isinstance(first.request(opening, ref=1), Propose)
        assert isinstance(second.request(opening, ref=1), Propose)
        principals = {p.principal for p in hub.hub.table.peers.values()}
        assert len(principals) == 2 and not any(p.startswith(b"key:") for p in principals)
    finally:
        first.close()
        second.close()
        hub.stop()
