"""Running estimates the control plane is built from: a weighted least-squares cost curve,
an exponential moving average, and acceptance by tree depth with hierarchical priors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_AUTO_DEPTH = 8
"""Deepest tree ``--depth auto`` may choose, and how deep acceptance is tracked."""


@dataclass
class LinearFit:
    """``y ≈ w·x`` by exponentially weighted least squares, pulled toward a prior ``w0``.

    ``forget`` sets the memory (about ``1 / (1 - forget)`` samples) so the fit follows a
    machine whose speed drifts; the prior keeps directions the data never spans sane.
    """

    prior: np.ndarray
    forget: float = 0.97
    strength: float = 0.5
    a: np.ndarray = field(init=False)
    b: np.ndarray = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        self.prior = np.asarray(self.prior, float)
        self.a = np.zeros((len(self.prior), len(self.prior)))
        self.b = np.zeros(len(self.prior))
        self._w = self.prior.copy()

    def update(self, x, y: float) -> None:
        x = np.asarray(x, float)
        self.a = self.forget * self.a + np.outer(x, x)
        self.b = self.forget * self.b + x * y
        self.samples += 1
        scale = self.strength * np.eye(len(x))
        self._w = np.linalg.solve(self.a + scale, self.b + scale @ self.prior)

    def predict(self, x) -> float:
        return float(np.asarray(x, float) @ self._w)

    @property
    def weights(self) -> list[float]:
        return self._w.tolist()


@dataclass
class Ema:
    value: float | None = None
    alpha: float = 0.1

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class Acceptance:
    """Per-depth conditional acceptance ``beta_k = P(node at depth k accepted | depth k-1
    was)``, from decayed counts, shrunk toward a prior curve (the parent's) when data is
    thin: a new session starts from its target's curve, which starts from the hub's."""

    def __init__(self, parent: Acceptance | None = None, prior: float = 0.5,
                 pseudo: float = 8.0, forget: float = 0.995):
        self.parent, self.prior, self.pseudo, self.forget = parent, prior, pseudo, forget
        self.hits = np.zeros(MAX_AUTO_DEPTH + 1)
        self.trials = np.zeros(MAX_AUTO_DEPTH + 1)

    def observe(self, depth: int, accepted: int) -> None:
        """A round that drafted ``depth`` layers and had ``accepted`` nodes accepted."""
        depth = min(depth, MAX_AUTO_DEPTH)
        self.hits *= self.forget
        self.trials *= self.forget
        reached = min(accepted + 1, depth)
        self.trials[1:reached + 1] += 1
        self.hits[1:min(accepted, depth) + 1] += 1
        if self.parent is not None:
            self.parent.observe(depth, accepted)

    def betas(self) -> np.ndarray:
        """``beta_k`` for k = 1..MAX_AUTO_DEPTH (index 0 unused, 1.0).

        Deep nodes are tried less often, so each depth's prior carries what shallower data
        says: the parent's ``beta_k`` scaled by how this curve compares with the parent's
        one layer up (at the hub, which has no parent, the previous layer's estimate)."""
        parent = self.parent.betas() if self.parent is not None else None
        out = np.ones(MAX_AUTO_DEPTH + 1)
        for k in range(1, MAX_AUTO_DEPTH + 1):
            if parent is None:
                prior = out[k - 1] if k > 1 else self.prior
            else:
                prior = parent[k] * out[k - 1] / max(parent[k - 1], 1e-6)
            prior = min(max(prior, 0.0), 1.0)
            out[k] = (self.hits[k] + self.pseudo * prior) / (self.trials[k] + self.pseudo)
        return out

    def expected_tokens(self) -> np.ndarray:
        """``E(d)`` for d = 0..MAX_AUTO_DEPTH: committed tokens a round, the bonus included."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.betas()[1:]))])

    def by_depth(self) -> list[float]:
        """Unconditional acceptance of the node at depth k, as the metrics report it."""
        return np.cumprod(self.betas()[1:]).round(4).tolist()
