"""Hub-side round accounting, in the names DESIGN.md's metric table uses."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class HubMetrics:
    started: float = field(default_factory=time.monotonic)
    rounds: int = 0
    draft_s: float = 0.0
    draft_layers: int = 0
    wait_s: float = 0.0
    idle_s: float = 0.0
    idle_gaps: int = 0
    commits: int = 0
    committed_tokens: int = 0
    proposed_nodes: int = 0
    accept_lengths: Counter = field(default_factory=Counter)
    accepted_at_depth: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    sessions_opened: int = 0
    sessions_expired: int = 0
    _busy_until: float | None = None

    def draft_started(self, arrival: float, now: float) -> None:
        self.wait_s += now - arrival
        if self._busy_until is not None:
            self.idle_s += max(0.0, now - self._busy_until)
            self.idle_gaps += 1

    def draft_finished(self, started: float, now: float, layers: int, nodes: int) -> None:
        self.rounds += 1
        self.draft_s += now - started
        self.draft_layers += max(layers, 1)
        self.proposed_nodes += nodes
        self._busy_until = now

    def committed(self, accepted: int, tokens: int) -> None:
        self.commits += 1
        self.committed_tokens += tokens
        self.accept_lengths[accepted + 1] += 1
        for k in range(1, accepted + 1):
            self.accepted_at_depth[k] += 1

    def snapshot(self, active_sessions: int = 0, peers: int = 0) -> dict:
        wall = max(time.monotonic() - self.started, 1e-9)
        rounds = max(self.rounds, 1)
        commits = max(self.commits, 1)
        depth_max = max(self.accepted_at_depth, default=0)
        return {
            "wall_s": wall,
            "rounds": self.rounds,
            "t_s_ms": 1e3 * self.draft_s / max(self.draft_layers, 1),
            "t_draft_ms": 1e3 * self.draft_s / rounds,
            "t_wait_ms": 1e3 * self.wait_s / rounds,
            "t_idle_ms": 1e3 * self.idle_s / max(self.idle_gaps, 1),
            "r_q": self.rounds / wall,
            "load": min(1.0, self.draft_s / wall),
            "mean_accept_len": self.committed_tokens / commits if self.commits else 0.0,
            "accept_rate_by_depth": [self.accepted_at_depth[k] / commits
                                     for k in range(1, depth_max + 1)],
            "accept_len_hist": {str(k): v for k, v in sorted(self.accept_lengths.items())},
            "proposed_nodes_mean": self.proposed_nodes / rounds,
            "active_sessions": active_sessions,
            "peers": peers,
            "sessions_opened": self.sessions_opened,
            "sessions_expired": self.sessions_expired,
            "errors": dict(self.errors),
        }

    def summary_line(self, active_sessions: int, peers: int) -> str:
        s = self.snapshot(active_sessions, peers)
        return (f"peers={peers} sessions={active_sessions} rounds={s['rounds']} "
                f"r_q={s['r_q']:.1f}/s load={s['load']:.2f} t_s={s['t_s_ms']:.1f}ms "
                f"wait={s['t_wait_ms']:.1f}ms idle={s['t_idle_ms']:.1f}ms "
                f"tau={s['mean_accept_len']:.2f}")
