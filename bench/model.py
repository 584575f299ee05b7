"""StarSD's analytical model (docs/architecture.md): what the hub should do at N targets."""

from __future__ import annotations

import math
from dataclasses import dataclass


def expected_accepted(beta: float, depth: int) -> float:
    """E[l] for per-token acceptance ``beta`` on a chain of ``depth`` drafted tokens."""
    if beta >= 1.0:
        return float(depth)
    return beta * (1 - beta ** depth) / (1 - beta)


@dataclass(frozen=True)
class StarModel:
    """Times in seconds. ``tau`` is committed tokens per round, the bonus token included."""

    t_s: float
    depth: int
    t_c: float
    t_v: float
    tau: float = 1.0

    @property
    def S(self) -> float:  # noqa: N802 - the paper's name
        return self.depth * self.t_s

    @property
    def Z(self) -> float:  # noqa: N802
        return self.t_c + self.t_v

    @property
    def n_full(self) -> int:
        return math.ceil(self.Z / self.S - 1e-9) + 1

    def t_idle(self, n: int) -> float:
        return max(0.0, self.Z - (n - 1) * self.S)

    def iteration(self, n: int) -> float:
        return n * self.S + self.t_idle(n)

    def predict(self, n: int) -> dict:
        """The model's row for N targets, in the benchmark's metric names (ms, 1/s)."""
        t = self.iteration(n)
        return {
            "n_full": self.n_full,
            "t_idle_ms": 1e3 * self.t_idle(n),
            "iteration_ms": 1e3 * t,
            "r_q": n / t,
            "r_q_sat": 1 / self.S,
            "r_p": 1 / t,
            "load": n * self.S / t,
            "system_tok_s": n * self.tau / t,
            "per_target_tok_s": self.tau / t,
        }
