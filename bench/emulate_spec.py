"""What an emulated run stands for: ``--emulate`` specs and real runs' acceptance traces."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.model import StarModel, expected_accepted

VOCAB = 32000
PROMPT_LEN = 16
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
KEYS = ("t_s", "t_v", "t_c", "t_step", "beta", "depth", "trace")


@dataclass
class EmulateSpec:
    """``t_s=1.4ms,t_v=25ms,t_c=1ms,t_step=25ms,beta=0.8,depth=6[,trace=run.json]``; times
    in seconds. ``beta=LO..HI`` gives each emulated target its own acceptance, drawn
    uniformly from the range with a fixed seed."""

    t_s: float = 1.4e-3
    t_v: float = 25e-3
    t_c: float = 1e-3
    t_step: float | None = None
    """A target's plain one-token step; None: the same as ``t_v``."""
    beta: float = 0.8
    beta_hi: float | None = None
    """Upper end of ``beta=LO..HI``; None for one beta shared by every target."""
    depth: int = 6
    trace: str | None = None
    accept_hist: dict[int, int] = field(default_factory=dict)
    """Committed length (accepted + bonus) -> count, from ``trace``; empty draws by beta."""

    @classmethod
    def parse(cls, text: str) -> EmulateSpec:
        spec = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--emulate: '{item}' is not key=value")
            if key in ("t_s", "t_v", "t_c", "t_step"):
                setattr(spec, key, _seconds(key, value))
            elif key == "beta":
                lo, dots, hi = value.partition("..")
                spec.beta, spec.beta_hi = float(lo), float(hi) if dots else None
                if not 0 <= spec.beta <= (spec.beta_hi if dots else spec.beta) <= 1:
                    raise ValueError("--emulate: beta must lie in [0, 1] (LO..HI with LO <= HI)")
            elif key == "depth":
                spec.depth = int(value)
                if spec.depth < 1:
                    raise ValueError("--emulate: depth must be at least 1")
            elif key == "trace":
                spec.trace = value
                spec.accept_hist = load_trace(value)
            else:
                raise ValueError(f"--emulate: unknown key '{key}' ({', '.join(KEYS)})")
        if spec.t_s <= 0:
            raise ValueError("--emulate: t_s must be positive")
        if spec.t_step is not None and spec.t_step <= 0:
            raise ValueError("--emulate: t_step must be positive")
        return spec

    @property
    def step(self) -> float:
        return self.t_v if self.t_step is None else self.t_step

    def text(self) -> str:
        if self.trace:
            accept = f"trace={self.trace}"
        elif self.beta_hi is not None:
            accept = f"beta={self.beta:g}..{self.beta_hi:g}"
        else:
            accept = f"beta={self.beta:g}"
        step = f"t_step={self.t_step * 1e3:g}ms," if self.t_step is not None else ""
        return (f"t_s={self.t_s * 1e3:g}ms,t_v={self.t_v * 1e3:g}ms,t_c={self.t_c * 1e3:g}ms,"
                f"{step}{accept},depth={self.depth}")

    def target_beta(self, index: int, seed: int = 0) -> float:
        """Target ``index``'s own acceptance: the same for every row of a run."""
        if self.beta_hi is None:
            return self.beta
        return random.Random(f"{seed}:{index}").uniform(self.beta, self.beta_hi)

    @property
    def tau(self) -> float:
        """Expected committed tokens per round, the bonus token included."""
        if self.accept_hist:
            clipped: dict[int, int] = {}
            for k, v in self.accept_hist.items():
                clipped[min(k, self.depth + 1)] = clipped.get(min(k, self.depth + 1), 0) + v
            return sum(k * v for k, v in clipped.items()) / max(sum(clipped.values()), 1)
        if self.beta_hi is None:
            return 1 + expected_accepted(self.beta, self.depth)
        grid = [self.beta + (self.beta_hi - self.beta) * i / 100 for i in range(101)]
        return 1 + sum(expected_accepted(b, self.depth) for b in grid) / len(grid)

    def model(self) -> StarModel:
        return StarModel(t_s=self.t_s, depth=self.depth, t_c=self.t_c, t_v=self.t_v,
                         tau=self.tau)

    def sampler(self, rng: random.Random,
                beta: float | None = None) -> Callable[..., int]:
        """``draw(depth)``: accepted draft tokens of a round that drafted ``depth`` (the
        bonus token not counted); ``beta`` overrides the spec's."""
        if self.accept_hist:
            lengths = list(self.accept_hist)
            weights = [self.accept_hist[k] for k in lengths]
            return lambda depth=self.depth: max(0, min(rng.choices(lengths, weights)[0] - 1,
                                                       depth))
        beta = self.beta if beta is None else beta

        def by_token(depth: int = self.depth) -> int:
            n = 0
            while n < depth and rng.random() < beta:
                n += 1
            return n

        return by_token


def _seconds(key: str, value: str) -> float:
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us)?\s*", value)
    if not match:
        raise ValueError(f"--emulate: {key}={value} is not a time such as 1.4ms")
    return float(match.group(1)) * _UNITS[match.group(2) or "ms"]


def load_trace(path: str) -> dict[int, int]:
    """Accepted-length histogram of a real run: a benchmark JSON (its star rows summed) or
    any JSON object with an ``accept_len_hist``."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows", [data]) if isinstance(data, dict) else data
    hist: dict[int, int] = {}
    for row in rows:
        if row.get("mode", "star") == "star" and not row.get("emulated"):
            for k, v in (row.get("accept_len_hist") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + int(v)
    if not hist:
        raise ValueError(f"{path} holds no accept_len_hist from a real star run")
    return hist
