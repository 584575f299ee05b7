"""A raw ZMTP peer (plain TCP, not libzmq) against a hub and a verifier started with their
default flags: it sends one multipart message that never ends, which libzmq would hold in
memory whole (it bounds frames, not messages). Started without keys, the servers use this
user's local keys, so the peer is refused at the handshake and the servers serve on."""

from __future__ import annotations

import os
import time

import torch

from bench.fuzz_hub import rss_mb
from bench.raw_zmtp import RawPeer
from starhub.launch import spawn_hub
from targets import attach
from tests.test_edge import VerifierThread, _edge
from tests.test_edge import _reference as _edge_reference

SENT_MB = 384
"""What the peer tries to send: more than the bound, so that a server that takes it fails."""
BOUND_MB = 256
PROMPT = [1, 5, 9, 14, 3, 1, 5, 9, 14, 3, 1, 5]


def _attack(address: str, pid: int) -> tuple[bool, float, float]:
    """Send SENT_MB of MORE frames from a raw peer; (closed by the server, MB the kernel
    took, the most the server's RSS grew while the peer stayed connected)."""
    start = peak = rss_mb(pid)
    peer = RawPeer(address, timeout_s=10.0)
    try:
        sent = peer.greet()
        if not sent.stopped:
            sent = peer.send_unending(SENT_MB << 20)
        for _ in range(20):  # the server reads what the kernel took a moment later
            peak = max(peak, rss_mb(pid))
            time.sleep(0.1)
    finally:
        peer.close()
    return sent.closed, sent.bytes / (1 << 20), peak - start


def test_default_hub_refuses_a_raw_peer_and_serves_on(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    log = tmp_path / "hub.log"
    with open(log, "w") as err, spawn_hub(["--drafter", "ngram", "--depth", "4"],
                                          log_file=err) as hub:
        closed, sent_mb, grew_mb = _attack(hub.address, hub.proc.pid)
        assert grew_mb < BOUND_MB, f"the hub held {grew_mb:.0f} MB of an unending message"
        assert closed and sent_mb < 64, f"the hub took {sent_mb:.0f} MB from a raw peer"
        assert "CURVE on with this user's local keys" in log.read_text()
        with attach(model, tokenizer, hub.address, name="after", timeout_s=30) as session:
            result = session.generate(PROMPT, max_new_tokens=16)
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
        assert result.output_ids == want[0, len(PROMPT):].tolist()
        assert result.stats.rounds > 0 and not result.stats.standalone, \
            "the tokens came through the hub's drafts"


def test_default_verifier_refuses_a_raw_peer_and_serves_on(tiny_model):
    model, tokenizer = tiny_model
    verifier = VerifierThread(model, tokenizer, budget=16)  # as `starhub verifier` binds
    try:
        closed, sent_mb, grew_mb = _attack(verifier.address, os.getpid())
        assert grew_mb < BOUND_MB, f"the verifier held {grew_mb:.0f} MB of an unending message"
        assert closed and sent_mb < 64, f"the verifier took {sent_mb:.0f} MB from a raw peer"
        edge = _edge(model, verifier.address, timeout_s=30)
        out, stats = edge.generate(PROMPT, 10)
        edge.close()
        assert out == _edge_reference(model, PROMPT, 10) and stats.rounds > 0
    finally:
        verifier.stop()
