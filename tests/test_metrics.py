"""Hub metrics: the accounting on a known timeline, windows, STATS, the Prometheus
endpoint, and the target's time split."""

from __future__ import annotations

import socket
import urllib.request

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from starhub.client.connection import HubClient
from starhub.drafters.ngram import NgramDrafter
from starhub.hub.metrics import HubMetrics, derive
from starhub.wire.messages import Commit, Open, Propose, StatsQuery, TargetCard
from tests.conftest import HubThread

S, Z = 0.010, 0.025


def two_targets_below_saturation(m: HubMetrics, iterations: int, t0: float = 100.0) -> float:
    """Two targets, drafting S each back to back, each returning Z after its draft:
    the idle gap per iteration is Z - S, in one gap of two."""
    t = t0
    for _ in range(iterations):
        for key, who in ((1, b"a"), (2, b"b")):
            m.arrived(key, who, t)
            m.draft_started(t, t, active=2)
            m.draft_finished(t, t + S, layers=5, nodes=8, arrival=t, key=key, identity=who)
            t += S
            if key == 2:
                t += Z - S
            m.committed(2, 3, who)
    return t


def test_idle_time_is_per_iteration_as_in_the_model():
    m = HubMetrics()
    end = two_targets_below_saturation(m, 50)
    snap = derive(None, m.counters())
    assert snap["t_idle_ms"] == pytest.approx(1e3 * (Z - S), rel=0.03)
    assert snap["t_idle_gap_ms"] == pytest.approx(1e3 * (Z - S) / 2, rel=0.03)
    assert snap["t_s_ms"] == pytest.approx(1e3 * S / 5)
    assert snap["t_wait_ms"] == pytest.approx(0.0)
    assert snap["z_ms"] == pytest.approx(1e3 * Z, rel=0.03)
    assert snap["rounds"] == 100
    assert snap["wall_s"] == pytest.approx(end - 100.0 - (Z - S), rel=1e-6)
    assert snap["load"] == pytest.approx(2 * S / (S + Z), rel=0.03)
    assert snap["r_q"] == pytest.approx(2 / (S + Z), rel=0.03)
    assert snap["r_p"] == pytest.approx(1 / (S + Z), rel=0.05)
    assert snap["mean_accept_len"] == 3.0
    assert snap["accept_rate_by_depth"] == [1.0, 1.0]
    assert snap["accept_len_hist"] == {"3": 100}
    assert snap["system_tok_s"] == pytest.approx(3 * snap["r_q"], rel=0.03)
    split = snap["hub_split"]
    assert split["draft"] + split["idle"] + split["sched"] == pytest.approx(1.0, rel=0.03)


def test_queueing_is_wait_not_idle_and_windows_subtract():
    m = HubMetrics()
    m.arrived(1, b"a", 0.0)
    m.arrived(2, b"b", 0.0)
    m.draft_started(0.0, 0.0, active=2)
    m.draft_finished(0.0, 1.0, 4, 4, arrival=0.0, key=1, identity=b"a")
    m.draft_started(0.0, 1.25, active=2)
    m.draft_finished(1.25, 2.0, 4, 4, arrival=0.0, key=2, identity=b"b")
    c0 = m.counters()
    m.arrived(1, b"a", 3.0)
    m.draft_started(3.0, 3.0, active=2)
    m.draft_finished(3.0, 4.0, 2, 2, arrival=3.0, key=1, identity=b"a")
    m.committed(0, 1, b"a")
    whole = derive(None, m.counters())
    assert whole["t_wait_ms"] == pytest.approx(1e3 * 1.25 / 3)
    assert whole["hub_split"]["sched"] * whole["wall_s"] == pytest.approx(0.25)
    assert whole["hub_split"]["idle"] * whole["wall_s"] == pytest.approx(1.0)
    assert whole["t_idle_ms"] == pytest.approx(1e3 * 1.0 / 1.5)
    assert whole["z_ms"] == pytest.approx(2000.0)
    c1 = dict(m.counters(), now=c0["now"] + 2.0)
    window = derive(c0, c1, targets=2)
    assert window["rounds"] == 1 and window["tokens"] == 1
    assert window["wall_s"] == pytest.approx(2.0)
    assert window["r_q"] == pytest.approx(0.5)
    assert window["r_p"] == pytest.approx(0.25)
    assert window["accept_len_hist"] == {"1": 1}
    assert m.peers[b"a"].queue_s == 0.0 and m.peers[b"b"].queue_s == pytest.approx(1.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def metered_hub():
    port = free_port()
    hub = HubThread(NgramDrafter(), metrics_port=port, ttl_s=30.0)
    yield hub, port
    hub.stop()


def drive_rounds(address: str, rounds: int = 3) -> HubClient:
    import numpy as np

    client = HubClient(address, timeout_s=10)
    client.greet(TargetCard(name="probe", vocab_size=1000))
    prompt = np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32)
    reply = client.request(Open(ref=7, prompt_len=7, tokens=prompt), ref=7)
    for _ in range(rounds):
        assert isinstance(reply, Propose)
        # the first node, then a token no child of it holds: what walking the tree gives
        kids = {int(t) for t, p in zip(reply.tokens, reply.parents, strict=True) if p == 0}
        tokens = np.append(reply.tokens[:1], min({3, 4} - kids)).astype(np.int32)
        reply = client.request(Commit(tag=reply.tag, seq=reply.seq, accepted=len(tokens) - 1,
                                      tokens=tokens), tag=reply.tag)
    return client


def test_prometheus_endpoint_serves_valid_text(metered_hub):
    hub, port = metered_hub
    drive_rounds(hub.address).close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("system_tok_s", "per_target_tok_s", "t_s_ms", "t_wait_ms", "t_idle_ms", "r_q",
                 "r_p", "load", "mean_accept_len"):
        assert f"starhub_{name}" in families, name
    assert families["starhub_rounds"].samples[0].value == 4
    hist = families["starhub_accept_len"]
    counts = {s.labels.get("le"): s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert counts["+Inf"] == 3
    assert {s.labels["activity"] for s in families["starhub_hub_seconds"].samples} \
        == {"draft", "idle", "sched", "queue"}
    assert "python_gc_objects_collected" not in families
    hub.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_stats_request_returns_the_metrics(ngram_hub):
    client = drive_rounds(ngram_hub.address, rounds=2)
    body = client.request(StatsQuery()).body
    for name in ("system_tok_s", "t_idle_ms", "r_q", "r_p", "load", "mean_accept_len",
                 "accept_rate_by_depth", "accept_len_hist", "threads"):
        assert name in msgspec.to_builtins(body)
    assert body.rounds == 3 and body.peers == 1
    own = client.request(StatsQuery(peer=True)).body.peer
    assert own.name == "probe" and own.rounds == 3 and own.commits == 2
    counters = client.request(StatsQuery(counters=True)).body.counters
    assert counters.rounds == 3 and counters.peers == []
    client.close()


def test_target_splits_its_round_trips(tiny_model, ngram_hub):
    from targets.generate import SpeculativeGenerator

    model, tok = tiny_model
    gen = SpeculativeGenerator(model, tok, ngram_hub.address, name="split")
    stats = [gen.generate(tok("a b a b a b", add_special_tokens=False)["input_ids"], 12).stats
             for _ in range(2)]
    gen.close()
    for s in stats:
        assert s.rounds > 0 and s.threads >= 1 and s.started_at > 0
        assert s.hub_draft_s > 0 and s.comm_s > 0
        assert s.hub_queue_s + s.hub_draft_s + s.comm_s == pytest.approx(s.hub_wait_s, rel=1e-6)
    assert stats[1].hub_draft_s < stats[0].hub_draft_s + stats[1].hub_wait_s


def test_departed_peers_totals_stay_bounded():
    from starhub.hub.metrics import DEPARTED_LIMIT, HubMetrics

    metrics = HubMetrics()
    for i in range(DEPARTED_LIMIT + 50):
        who = i.to_bytes(4, "big")
        metrics.committed(1, 2, who)
        metrics.forget(who)
    assert not metrics.peers and len(metrics.departed) == DEPARTED_LIMIT
    last = (DEPARTED_LIMIT + 49).to_bytes(4, "big")
    assert metrics.totals_of(last).tokens == 2
    assert len(metrics.counters()["peers"]) <= 512


def test_a_hub_with_more_targets_than_one_header_holds_still_reports_them():
    """Every reader refuses a header over MAX_HEADER_BYTES: a hub with a thousand targets
    lists the latest of them that fit, and its counts stay whole."""
    from starhub.wire.codec import MAX_HEADER_BYTES, encode
    from starhub.wire.messages import DrafterCard, ObserverCard, StatsReport
    from tests.servers import HubHarness

    hub = HubHarness(NgramDrafter())
    try:
        count = 1000
        for i in range(count):
            name = f"target-{i:04d}-" + "x" * 52
            assert isinstance(hub.ask(name.encode(), TargetCard(name=name, vocab_size=100)),
                              DrafterCard)
        hub.ask(b"observer", ObserverCard(name="status"))
        report = hub.ask(b"observer", StatsQuery(counters=True, peers=True)).body
        assert len(encode(StatsReport(body=report))[0]) <= MAX_HEADER_BYTES
        assert report.admitted == report.peers == count
        assert 0 < len(report.control.targets) < count
        assert 0 < len(report.counters.peers) < count
        assert report.control.targets[-1].name == f"target-{count - 1:04d}-" + "x" * 52
    finally:
        hub.close()


def test_a_verifier_report_with_more_sessions_than_one_header_holds_lists_the_latest():
    from starhub.server.isolation import verifier_view
    from starhub.wire.codec import MAX_HEADER_BYTES, decode, encode
    from starhub.wire.messages import StatsReport
    from starhub.wire.reports import SchedulerReport, SessionEntry, VerifierReport

    fields = {f.name: 0 for f in msgspec.structs.fields(VerifierReport) if f.required}
    sessions = {str(10**15 + i): SessionEntry(alpha=0.5, goodput=1.25, nodes=10, rounds=1000,
                                              late=3) for i in range(4000)}
    fields.update(schedule="goodspeed", batch_hist={}, errors={}, sessions=len(sessions),
                  scheduler=SchedulerReport(policy="goodspeed", budget=64, max_batch=0,
                                            time_model_ms=[], time_model_mape=None,
                                            sessions=sessions))
    view = verifier_view(VerifierReport(**fields), detail=True)
    frames = encode(StatsReport(body=view))
    assert len(frames[0]) <= MAX_HEADER_BYTES
    assert decode(frames).body.sessions == 4000
    kept = view.scheduler.sessions
    assert 0 < len(kept) < 4000 and list(kept)[-1] == str(10**15 + 3999)


def test_an_idle_hub_logs_its_summary_once_and_again_only_after_a_change(caplog):
    import logging
    import time

    from starhub.hub.config import HubConfig
    from starhub.hub.server import Hub

    hub = Hub(NgramDrafter(), HubConfig(log_every_s=0.001))

    def lines() -> int:
        return sum("rounds=" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO, logger="starhub.hub"):
        hub.housekeeping()
        assert lines() == 0, "nothing drafted yet: nothing to say"
        hub.metrics.rounds = 3
        for _ in range(4):
            time.sleep(0.005)
            hub.housekeeping()
        assert lines() == 1
        hub.metrics.rounds = 4
        time.sleep(0.005)
        hub.housekeeping()
        assert lines() == 2
