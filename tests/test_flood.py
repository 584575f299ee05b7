"""A peer that keeps a server's socket full cannot hold up everyone else: while a flood of
malformed messages is still being answered, a real session's round goes through.

The server is held still while the whole flood and the round queue up in its socket, so
the socket is full when it reads on: only the server's own limit on what it takes before
its other work runs (one message between the hub's other tasks, at most ``RECEIVE_BATCH``
between two of the verifier's passes) lets the round through before the flood is done."""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from starhub.wire.codec import decode, encode
from starhub.wire.messages import Commit, DrafterCard, Open, Ping, Pong, Propose, TargetCard
from starhub.wire.security import prepare_client
from tests.test_edge import VerifierThread

FLOOD = 5000
HOLD = 424242
"""The nonce of the PING that holds the server still."""


def dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    prepare_client(sock, "flood")  # random identity; this user's local keys
    sock.connect(address)
    return sock


def ask(sock: zmq.Socket, msg):
    sock.send_multipart(encode(msg))
    assert sock.poll(60_000), "no reply"
    return decode(sock.recv_multipart())


def flood(address: str) -> zmq.Socket:
    sock = dealer(address)
    for i in range(FLOOD):
        sock.send_multipart([b"\xc1" + i.to_bytes(4, "little")])
    return sock


def flood_before(server, good: zmq.Socket, address: str, msg):
    """Hold ``server`` inside a PING from ``good`` while a flood and then ``msg`` queue up;
    let it go on; return the reply to ``msg``."""
    held, release = threading.Event(), threading.Event()
    handle = server.handle

    def holding(identity, message):
        if isinstance(message, Ping) and message.nonce == HOLD:
            held.set()
            release.wait(30)
        handle(identity, message)

    server.handle = holding
    good.send_multipart(encode(Ping(nonce=HOLD)))
    assert held.wait(30)
    flooder = flood(address)
    good.send_multipart(encode(msg))
    time.sleep(1.0)  # the flood crosses into the server's socket
    release.set()
    assert isinstance(decode(good.recv_multipart()), Pong)
    assert good.poll(60_000), "no reply"
    reply = decode(good.recv_multipart())
    flooder.close(0)
    return reply


def test_a_flooding_peer_does_not_hold_up_the_hubs_other_sessions(ngram_hub):
    good = dealer(ngram_hub.address)
    assert isinstance(ask(good, TargetCard(name="good", vocab_size=100)), DrafterCard)
    prop = ask(good, Open(ref=1, prompt_len=4, tokens=np.array([5, 6, 5, 6, 5], np.int32)))
    reply = flood_before(ngram_hub.hub, good, ngram_hub.address,
                         Commit(tag=prop.tag, seq=prop.seq, accepted=0,  # no node holds 9
                                tokens=np.array([9], np.int32)))
    answered = sum(ngram_hub.hub.metrics.errors.values())
    assert isinstance(reply, Propose)
    assert answered < FLOOD, "the round waited for the whole flood"
    good.close(0)


def test_a_flooding_peer_does_not_hold_up_verification(tiny_model):
    v = VerifierThread(*tiny_model, ttl_s=30.0)
    try:
        good = dealer(v.address)
        assert isinstance(ask(good, DrafterCard(drafter="good")), TargetCard)
        opened = ask(good, Open(ref=1, prompt_len=3, tokens=np.array([1, 2, 3], np.int32)))
        reply = flood_before(v.verifier, good, v.address,
                             Propose(tag=opened.tag, seq=1, tokens=np.array([5], np.int32),
                                     parents=np.array([-1], np.int32)))
        answered = sum(v.verifier.stats.errors.values())
        assert isinstance(reply, Commit)
        assert answered < FLOOD, "verification waited for the whole flood"
        good.close(0)
    finally:
        v.stop()
