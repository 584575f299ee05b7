"""Bad input never stops the hub: each case gets an ERROR, and a healthy session running
alongside keeps receiving proposals."""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np
import pytest
import zmq

from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    VERSION,
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Ping,
    Pong,
    Propose,
    StatsQuery,
    TargetCard,
)
from starhub.wire.security import prepare_client


class Peer:
    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        prepare_client(self.sock, "peer")  # random identity; this user's local keys
        self.sock.connect(address)

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def send_raw(self, frames) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0):
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the hub"
        return decode(self.sock.recv_multipart())

    def greet(self) -> DrafterCard:
        self.send(TargetCard(name="peer", vocab_size=1000))
        reply = self.recv()
        assert isinstance(reply, DrafterCard)
        return reply

    def open(self, tokens) -> Propose:
        self.send(Open(ref=1, prompt_len=len(tokens) - 1,
                       tokens=np.asarray(tokens, np.int32)))
        reply = self.recv()
        assert isinstance(reply, Propose), reply
        return reply

    def close(self) -> None:
        self.sock.close(0)


def expect_error(peer: Peer, code: ErrorCode) -> Error:
    reply = peer.recv()
    assert isinstance(reply, Error), reply
    assert reply.code == code, reply
    assert reply.message
    return reply


REPEATING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


@pytest.fixture
def healthy(ngram_hub):
    peer = Peer(ngram_hub.address)
    peer.greet()
    prop = peer.open(REPEATING)
    yield peer, prop
    peer.close()


def test_each_malformed_message_gets_an_error_and_the_hub_keeps_serving(ngram_hub, healthy):
    good, prop = healthy
    bad = Peer(ngram_hub.address)
    other = Peer(ngram_hub.address)
    other.greet()

    bad.send_raw([os.urandom(64)])
    expect_error(bad, ErrorCode.BAD_FRAME)

    bad.send_raw([msgpack.packb({"v": VERSION + 7, "type": "PING", "tag": 0, "seq": 0})])
    expect_error(bad, ErrorCode.BAD_VERSION)

    bad.send_raw([msgpack.packb({"v": VERSION, "type": "TARGET_CARD", "tag": 0, "seq": 0})])
    expect_error(bad, ErrorCode.BAD_FIELD)

    bad.send_raw([msgpack.packb({"v": VERSION, "type": "SHUTDOWN", "tag": 0, "seq": 0})])
    expect_error(bad, ErrorCode.BAD_TYPE)

    bad.send(Open(ref=3, prompt_len=1, tokens=np.array([1, 2], np.int32)))
    assert expect_error(bad, ErrorCode.NO_CARD).ref == 3

    bad.greet()
    bad.send(Commit(tag=123456, seq=0, accepted=0, tokens=np.array([1], np.int32)))
    assert expect_error(bad, ErrorCode.UNKNOWN_TAG).tag == 123456

    other.send(Commit(tag=prop.tag, seq=prop.seq, accepted=0, tokens=np.array([9], np.int32)))
    expect_error(other, ErrorCode.NOT_OWNER)
    other.send(Close(tag=prop.tag))
    expect_error(other, ErrorCode.NOT_OWNER)

    bad.send(Open(ref=4, prompt_len=1, tokens=np.zeros(20_000, np.int32)))
    expect_error(bad, ErrorCode.TOO_LARGE)

    huge = Peer(ngram_hub.address)
    huge.send_raw([os.urandom(1 << 20)])
    assert not huge.sock.poll(300), "a frame past the hard cap must drop the peer silently"
    huge.close()

    bad.send(Open(ref=5, prompt_len=1, tokens=np.array([1, 5000], np.int32)))
    expect_error(bad, ErrorCode.BAD_FIELD)

    assert ngram_hub.alive
    tokens = list(REPEATING)
    for _ in range(5):
        accepted = len(prop.tokens) and 1
        # the first node, then a token no child of it holds: what walking the tree gives
        kids = {int(t) for t, p in zip(prop.tokens, prop.parents, strict=True)
                if p == accepted - 1}
        new = [int(t) for t in prop.tokens[:accepted]] + [min({8, 9} - kids)]
        good.send(Commit(tag=prop.tag, seq=prop.seq, accepted=accepted,
                         tokens=np.asarray(new, np.int32)))
        tokens += new
        reply = good.recv()
        assert isinstance(reply, Propose) and reply.tag == prop.tag
        assert reply.seq == prop.seq + 1
        prop = reply
    good.send(Ping(nonce=42))
    assert good.recv() == Pong(nonce=42)
    bad.close()
    other.close()


def test_a_stale_commit_is_refused_without_harming_the_session(ngram_hub, healthy):
    good, prop = healthy
    good.send(Commit(tag=prop.tag, seq=prop.seq + 3, accepted=0, tokens=np.array([1], np.int32)))
    expect_error(good, ErrorCode.STALE)
    good.send(Commit(tag=prop.tag, seq=prop.seq, accepted=0, tokens=np.array([1], np.int32)))
    assert isinstance(good.recv(), Propose)


def test_a_vanished_peer_does_not_disturb_others(ngram_hub, healthy):
    good, prop = healthy
    ghost = Peer(ngram_hub.address)
    ghost.greet()
    ghost.send(Open(ref=1, prompt_len=2, tokens=np.array([1, 2, 3], np.int32)))
    ghost.close()
    good.send(Commit(tag=prop.tag, seq=prop.seq, accepted=0, tokens=np.array([5], np.int32)))
    assert isinstance(good.recv(), Propose)
    assert ngram_hub.alive


def test_sessions_are_released_after_their_ttl():
    from starhub.drafters.ngram import NgramDrafter
    from tests.conftest import HubThread

    hub = HubThread(NgramDrafter(), ttl_s=0.3)
    try:
        peer = Peer(hub.address)
        peer.greet()
        prop = peer.open([1, 2, 3])
        time.sleep(1.2)
        peer.send(StatsQuery())
        stats = peer.recv()
        assert stats.body.active_sessions == 0
        assert stats.body.sessions_expired == 1
        peer.send(Commit(tag=prop.tag, seq=prop.seq, accepted=0, tokens=np.array([4], np.int32)))
        expect_error(peer, ErrorCode.UNKNOWN_TAG)
        peer.close()
    finally:
        hub.stop()


def test_close_releases_the_session(ngram_hub, healthy):
    good, prop = healthy
    good.send(Close(tag=prop.tag))
    good.send(StatsQuery())
    assert good.recv().body.active_sessions == 0


def test_admission_limit_rejects_extra_targets():
    from starhub.drafters.ngram import NgramDrafter
    from starhub.wire.messages import Reject
    from tests.conftest import HubThread

    hub = HubThread(NgramDrafter(), max_targets=1)
    try:
        first, second = Peer(hub.address), Peer(hub.address)
        first.greet()
        second.send(TargetCard(name="late", vocab_size=1000))
        reply = second.recv()
        assert isinstance(reply, Reject) and "admission limit" in reply.reason
        first.close()
        second.close()
    finally:
        hub.stop()
