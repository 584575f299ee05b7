"""Hub-side round accounting, in the metric names of docs/architecture.md.

The hub's wall time splits into drafting, idle (the buffer is empty: no request has
arrived since the last draft finished) and scheduling (a request is there but drafting has
not started yet: event-loop and thread hand-off overhead). Rates are taken over the active
window, from the first request to the latest event, so a hub that waited minutes for its
first target still reports the speed it served at.

``t_idle_ms`` follows the analytical model's ``T_idle`` (docs/architecture.md), the idle
gap per *iteration*, where an iteration gives every active session one draft: total idle
time divided by ``sum over rounds of 1 / active sessions``. With N targets below
saturation the hub idles ``Z - (N-1)·S`` once per N requests, so the mean per gap
(``t_idle_gap_ms``) would be N times smaller than the model's quantity; both are reported.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import msgspec

from starhub.wire.reports import HubReport, PeerEntry

SCALARS = ("rounds", "draft_s", "draft_layers", "wait_s", "idle_s", "sched_s", "idle_gaps",
           "iterations", "return_s", "returns", "commits", "committed_tokens", "proposed_nodes",
           "plain_rounds", "plain_tokens", "batches", "batched", "batch_s", "predraft_hits",
           "predraft_misses", "predraft_s", "critical_draft_s", "lookup_rounds",
           "lookup_tokens")
"""Counters that add up over time; two ``counters()`` readings give any window's rates."""

_PENDING_LIMIT = 1 << 16
DEPARTED_LIMIT = 256
"""Totals kept for peers that have left, so memory stays bounded as targets come and go."""


@dataclass
class HubMetrics:
    started: float = field(default_factory=time.monotonic)
    first_arrival: float | None = None
    last_event: float = 0.0
    rounds: int = 0
    draft_s: float = 0.0
    draft_layers: int = 0
    wait_s: float = 0.0
    idle_s: float = 0.0
    sched_s: float = 0.0
    idle_gaps: int = 0
    iterations: float = 0.0
    return_s: float = 0.0
    returns: int = 0
    commits: int = 0
    committed_tokens: int = 0
    proposed_nodes: int = 0
    plain_rounds: int = 0
    plain_tokens: int = 0
    batches: int = 0
    """Drafting passes, each over one or more sessions (``--batch``)."""
    batched: float = 0.0
    batch_s: float = 0.0
    predraft_hits: int = 0
    """Rounds answered at once by a tree pre-drafted while the target verified."""
    predraft_misses: int = 0
    predraft_s: float = 0.0
    critical_draft_s: float = 0.0
    """Drafting between a COMMIT and its PROPOSE: what the target waited on (0 for a hit)."""
    lookup_rounds: int = 0
    """Tree rounds whose tree had a ``--lookup`` branch grafted on."""
    lookup_tokens: int = 0
    """Accepted tokens that only the grafted branch held."""
    choices: Counter = field(default_factory=Counter)
    """Rounds by the controller's choice: ``d{depth}n{nodes}`` or ``plain``."""
    accept_lengths: Counter = field(default_factory=Counter)
    accepted_at_depth: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    sessions_opened: int = 0
    sessions_expired: int = 0
    peers: dict[bytes, PeerEntry] = field(default_factory=dict)
    departed: OrderedDict = field(default_factory=OrderedDict)
    _busy_until: float | None = None
    _proposed_at: dict[int, float] = field(default_factory=dict)

    def peer(self, identity: bytes, name: str = "") -> PeerEntry:
        totals = self.peers.get(identity)
        if totals is None and identity in self.departed:
            totals = self.peers[identity] = self.departed.pop(identity)
        if totals is None:
            totals = self.peers[identity] = PeerEntry(name=name or identity.hex()[:8])
        elif name:
            totals.name = name
        return totals

    def forget(self, identity: bytes) -> None:
        """A peer left: keep its totals among the last ``DEPARTED_LIMIT`` departed."""
        totals = self.peers.pop(identity, None)
        if totals is not None:
            self.departed[identity] = totals
            while len(self.departed) > DEPARTED_LIMIT:
                self.departed.popitem(last=False)

    def totals_of(self, identity: bytes) -> PeerEntry | None:
        return self.peers.get(identity) or self.departed.get(identity)

    def chose(self, label: str) -> None:
        self.choices[label] += 1

    def returned(self, key: int, now: float) -> None:
        """A COMMIT came back: closes the return time Z of ``key``'s last draft, if any."""
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_event = now
        sent = self._proposed_at.pop(key, None)
        if sent is not None:
            self.return_s += now - sent
            self.returns += 1

    def arrived(self, key: int, identity: bytes, now: float) -> None:
        """A request entered the buffer; closes the return time Z of ``key``'s last draft."""
        self.returned(key, now)
        totals = self.peer(identity)
        if not totals.first:
            totals.first = now
        totals.last = now

    def draft_started(self, arrival: float, now: float, active: int = 1,
                      first: bool = True) -> None:
        """A request's draft begins; ``first`` is false for the later requests of a batch,
        whose start closes no idle gap of its own."""
        self.wait_s += now - arrival
        self.iterations += 1.0 / max(active, 1)
        if first and self._busy_until is not None:
            free = max(arrival, self._busy_until)
            self.idle_s += free - self._busy_until
            self.sched_s += max(0.0, now - free)
            self.idle_gaps += 1

    def draft_finished(self, started: float, now: float, layers: int, nodes: int,
                       arrival: float | None = None, key: int = 0,
                       identity: bytes = b"", share: float = 1.0) -> None:
        """One session's draft is done; drafted in a batch of ``share`` sessions, it counts
        that fraction of the batch's time toward the hub's busy time."""
        self.rounds += 1
        self.critical_draft_s += now - started
        self.draft_s += (now - started) / share
        self.draft_layers += max(layers, 1)
        self.proposed_nodes += nodes
        self._busy_until = self.last_event = now
        if key:
            if len(self._proposed_at) >= _PENDING_LIMIT:
                self._proposed_at.clear()
            self._proposed_at[key] = now
        if identity:
            totals = self.peer(identity)
            totals.rounds += 1
            totals.draft_s += (now - started) / share
            totals.queue_s += started - (started if arrival is None else arrival)

    def batch(self, size: float, seconds: float) -> None:
        self.batches += 1
        self.batched += size
        self.batch_s += seconds

    def predraft(self, hit: bool | None, seconds: float = 0.0) -> None:
        """A greedy tree round found (``hit``) or missed a pre-drafted tree; None records
        only the time spent pre-drafting."""
        if hit is not None:
            self.predraft_hits += hit
            self.predraft_misses += not hit
        self.predraft_s += seconds

    def committed(self, accepted: int, tokens: int, identity: bytes = b"",
                  plain: bool = False, looked_up: int | None = None) -> None:
        """A COMMIT; a plain round's tokens count toward throughput, not toward tau.
        ``looked_up``: of the accepted nodes, those a ``--lookup`` graft added (None: no
        graft)."""
        if looked_up is not None:
            self.lookup_rounds += 1
            self.lookup_tokens += looked_up
        if plain:
            self.plain_rounds += 1
            self.plain_tokens += tokens
        else:
            self.commits += 1
            self.committed_tokens += tokens
            self.accept_lengths[accepted + 1] += 1
            for k in range(1, accepted + 1):
                self.accepted_at_depth[k] += 1
        if identity:
            totals = self.peer(identity)
            totals.commits += 1
            totals.tokens += tokens

    def counters(self, peers: bool = True) -> dict:
        """Raw totals and the clock; ``derive`` turns two of these into a window's metrics.
        ``peers`` adds each target's totals (up to 512), which only whole-run rates need."""
        now = time.monotonic()
        out: dict = {k: getattr(self, k) for k in SCALARS}
        out.update(now=now, t0=self.first_arrival or now, t1=self.last_event or now,
                   accept_len_hist=_str_keys(self.accept_lengths),
                   accepted_at_depth=_str_keys(self.accepted_at_depth),
                   choices=dict(self.choices),
                   peers=[list(msgspec.structs.astuple(totals))
                          for totals in [*self.departed.values(), *self.peers.values()][-512:]]
                   if peers else [])
        return out

    def snapshot(self, active_sessions: int = 0, peers: int = 0) -> dict:
        snap = derive(None, self.counters())
        snap.update(active_sessions=active_sessions, peers=peers,
                    sessions_opened=self.sessions_opened,
                    sessions_expired=self.sessions_expired, errors=dict(self.errors))
        return snap

    def summary_line(self, active_sessions: int, peers: int) -> str:
        s = self.snapshot(active_sessions, peers)
        return (f"peers={peers} sessions={active_sessions} rounds={s['rounds']} "
                f"r_q={s['r_q']:.1f}/s r_p={s['r_p']:.1f}/s load={s['load']:.2f} "
                f"t_s={s['t_s_ms']:.2f}ms wait={s['t_wait_ms']:.1f}ms "
                f"idle={s['t_idle_ms']:.1f}ms tau={s['mean_accept_len']:.2f} "
                f"tok/s={s['system_tok_s']:.1f} plain_rounds={s['plain_rounds']}")


def _str_keys(counter: Counter) -> dict[str, int]:
    return {str(k): v for k, v in sorted(dict(counter).items())}


def _delta(c0: dict | None, c1: dict, key: str) -> float:
    return c1[key] - (c0[key] if c0 is not None else 0)


def _hist_delta(c0: dict | None, c1: dict, key: str) -> dict[int, int]:
    before = c0[key] if c0 is not None else {}
    out = {int(k): v - before.get(k, 0) for k, v in c1[key].items()}
    return {k: v for k, v in sorted(out.items()) if v}


def derive(c0: dict | None, c1: dict, targets: int | None = None) -> dict:
    """Every metric of docs/architecture.md's table over the window between two
    ``counters()`` readings.

    Without ``c0`` the window is the hub's active window. Per-target rates need the
    number of targets: given, or the peers that committed in the window.
    """
    d = {k: _delta(c0, c1, k) for k in SCALARS}
    wall = max((c1["now"] - c0["now"]) if c0 is not None else c1["t1"] - c1["t0"], 1e-9)
    rounds, commits = max(d["rounds"], 1), max(d["commits"], 1)
    hist = _hist_delta(c0, c1, "accept_len_hist")
    at_depth = _hist_delta(c0, c1, "accepted_at_depth")
    peer_rates = _peer_rates(c0, c1)
    n = targets or len(peer_rates) or 1
    system = (d["committed_tokens"] + d["plain_tokens"]) / wall
    if c0 is None and peer_rates and not targets:
        per_target = sum(tok for tok, _ in peer_rates) / len(peer_rates)
        r_p = sum(rp for _, rp in peer_rates) / len(peer_rates)
    else:
        per_target, r_p = system / n, d["rounds"] / wall / n
    return {
        "wall_s": wall,
        "rounds": d["rounds"],
        "commits": d["commits"],
        "tokens": d["committed_tokens"] + d["plain_tokens"],
        "plain_rounds": d["plain_rounds"],
        "plain_tokens": d["plain_tokens"],
        "choices": _choice_delta(c0, c1),
        "system_tok_s": system,
        "per_target_tok_s": per_target,
        "t_s_ms": 1e3 * d["draft_s"] / max(d["draft_layers"], 1),
        "t_draft_ms": 1e3 * d["draft_s"] / rounds,
        "t_wait_ms": 1e3 * d["wait_s"] / rounds,
        "t_idle_ms": 1e3 * d["idle_s"] / max(d["iterations"], 1e-9),
        "t_idle_gap_ms": 1e3 * d["idle_s"] / max(d["idle_gaps"], 1),
        "t_sched_ms": 1e3 * d["sched_s"] / max(d["idle_gaps"], 1),
        "z_ms": 1e3 * d["return_s"] / max(d["returns"], 1),
        "r_q": d["rounds"] / wall,
        "r_p": r_p,
        "load": min(1.0, d["draft_s"] / wall),
        "hub_split": {"draft": d["draft_s"] / wall, "idle": d["idle_s"] / wall,
                      "sched": d["sched_s"] / wall, "queue_s_per_round": d["wait_s"] / rounds},
        "mean_accept_len": d["committed_tokens"] / commits if d["commits"] else 0.0,
        "accept_rate_by_depth": [at_depth.get(k, 0) / commits
                                 for k in range(1, max(at_depth, default=0) + 1)],
        "accept_len_hist": {str(k): v for k, v in hist.items()},
        "proposed_nodes_mean": d["proposed_nodes"] / rounds,
        "batch_mean": d["batched"] / max(d["batches"], 1),
        "draft_ms_per_batch": 1e3 * d["batch_s"] / max(d["batches"], 1),
        "draft_ms_per_session": 1e3 * d["batch_s"] / max(d["batched"], 1),
        "critical_draft_ms": 1e3 * d["critical_draft_s"] / rounds,
        "predraft_hits": d["predraft_hits"],
        "predraft_hit_rate": d["predraft_hits"] / max(d["predraft_hits"] + d["predraft_misses"],
                                                      1),
        "predraft_load": d["predraft_s"] / wall,
        "lookup_round_share": d["lookup_rounds"] / max(d["commits"], 1),
        "lookup_token_share": d["lookup_tokens"] / max(d["committed_tokens"], 1),
    }


def _choice_delta(c0: dict | None, c1: dict) -> dict[str, int]:
    before = c0.get("choices", {}) if c0 is not None else {}
    out = {k: v - before.get(k, 0) for k, v in c1.get("choices", {}).items()}
    return {k: v for k, v in sorted(out.items()) if v}


def _peer_rates(c0: dict | None, c1: dict) -> list[tuple[float, float]]:
    """(tokens/s, rounds/s) of each peer that committed, over its own active window; every
    draft sent is one verification round, the last of a session (never committed) too."""
    if c0 is not None:
        return []
    out = []
    for _name, rounds, _q, _d, commits, tokens, first, last in c1.get("peers", []):
        if commits and last > first:
            out.append((tokens / (last - first), rounds / (last - first)))
    return out


GAUGES = ("system_tok_s", "per_target_tok_s", "t_s_ms", "t_wait_ms", "t_idle_ms",
          "t_idle_gap_ms", "t_sched_ms", "z_ms", "r_q", "r_p", "load", "mean_accept_len",
          "active_sessions", "peers", "queue", "admitted", "n_max", "n_full", "batch_mean",
          "critical_draft_ms", "predraft_hit_rate", "lookup_token_share")
DRAFT_KEYS = ("t_draft_ms", "batch_mean", "draft_ms_per_batch", "draft_ms_per_session",
              "critical_draft_ms", "predraft_hits", "predraft_hit_rate", "predraft_load",
              "lookup_round_share", "lookup_token_share")
"""How the hub drafted: batching, pre-drafting and lookup branches, as benchmark rows
record them."""
COUNTERS = {"rounds": "draft rounds", "commits": "verification rounds (COMMITs)",
            "tokens": "committed tokens", "sessions_opened": "sessions opened",
            "sessions_expired": "sessions released by TTL",
            "rejections": "targets refused admission (they decode on their own)",
            "plain_rounds": "rounds a target decoded on its own because no tree paid"}


class PrometheusCollector:
    """Reads a fresh hub snapshot at every scrape, so nothing is counted twice."""

    def __init__(self, snapshot: Callable[[], HubReport], counters: Callable[[], dict]):
        self.snapshot = snapshot
        self.counters = counters

    def collect(self) -> Iterator:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snap, raw = self.snapshot(), self.counters()
        for name in GAUGES:
            value = getattr(snap, name)
            if isinstance(value, int | float):
                yield GaugeMetricFamily(f"starhub_{name}", _HELP.get(name, name), value=value)
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"starhub_{name}", doc, value=getattr(snap, name))
        seconds = CounterMetricFamily("starhub_hub_seconds", "hub wall time by activity",
                                      labels=["activity"])
        for activity, key in (("draft", "draft_s"), ("idle", "idle_s"), ("sched", "sched_s"),
                              ("queue", "wait_s")):
            seconds.add_metric([activity], raw[key])
        yield seconds
        rate = GaugeMetricFamily("starhub_accept_rate", "fraction of rounds whose draft "
                                 "token at this depth was accepted", labels=["depth"])
        for k, value in enumerate(snap.accept_rate_by_depth, 1):
            rate.add_metric([str(k)], value)
        yield rate
        hist = {int(k): v for k, v in raw["accept_len_hist"].items()}
        buckets, total = [], 0
        for le in range(1, max(hist, default=1) + 1):
            total += hist.get(le, 0)
            buckets.append((str(float(le)), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily("starhub_accept_len", "committed tokens per round "
                                    "(accepted plus bonus), one sample per request",
                                    buckets=buckets,
                                    sum_value=sum(k * v for k, v in hist.items()))
        yield CounterMetricFamily("starhub_drafter_restarts", "restarts of a drafting process "
                                  "that died or hung", value=snap.drafting.restarts)
        yield GaugeMetricFamily("starhub_drafter_healthy", "1 while the drafter can serve, 0 "
                                "while it restarts (no targets admitted)",
                                value=int(snap.drafting.healthy))
        errors = CounterMetricFamily("starhub_errors", "ERROR replies by code", labels=["code"])
        for code, count in snap.errors.items():
            errors.add_metric([code], count)
        yield errors


_HELP = {
    "system_tok_s": "tokens committed per second, summed over all targets",
    "per_target_tok_s": "mean over targets of committed tokens per second",
    "t_s_ms": "drafting time per tree layer (ms)",
    "t_wait_ms": "mean time a request waits in the global buffer (ms)",
    "t_idle_ms": "hub idle time per iteration of one request per active session (ms)",
    "t_idle_gap_ms": "mean idle gap between two drafts (ms)",
    "t_sched_ms": "mean scheduling overhead between a ready request and its draft (ms)",
    "z_ms": "mean return time from a draft finishing to the session's next request (ms)",
    "r_q": "draft rounds per second",
    "r_p": "verification rounds per second per target",
    "load": "fraction of wall time the drafter is busy",
    "mean_accept_len": "committed tokens per round, bonus included",
    "admitted": "targets holding an admission slot",
    "n_max": "the load model's N_max: most typical targets that all keep standalone speed, "
             "acceptance counted two standard errors low (admission's rule)",
    "n_full": "the load model's N_full = ceil(Z/S) + 1",
    "lookup_token_share": "share of committed tokens that only a --lookup branch proposed",
}


def serve_prometheus(collector: PrometheusCollector, port: int,
                     addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` from a registry of our own, never the process-global default."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return start_http_server(port, addr=addr, registry=registry)
