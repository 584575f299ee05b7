"""Running estimates the control plane is built from: a weighted least-squares cost curve,
an exponential moving average, and acceptance by tree depth with hierarchical priors."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import accumulate

from starhub.options import MAX_AUTO_DEPTH


@dataclass
class LinearFit:
    """``y ≈ w·x`` by exponentially weighted least squares, pulled toward a prior ``w0``.

    ``forget`` sets the memory (about ``1 / (1 - forget)`` samples) so the fit follows a
    machine whose speed drifts; the prior keeps directions the data never spans sane.
    The hub updates and asks its fits every round on its event loop, so the sums are
    plain floats and the weights are solved for only when asked after an update.
    """

    prior: list[float]
    forget: float = 0.97
    strength: float = 0.5
    samples: int = 0

    def __post_init__(self) -> None:
        self.prior = [float(w) for w in self.prior]
        n = len(self.prior)
        self.a = [[0.0] * n for _ in range(n)]
        self.b = [0.0] * n
        self._w: list[float] | None = list(self.prior)

    def update(self, x, y: float) -> None:
        f = self.forget
        for i, xi in enumerate(x):
            self.b[i] = f * self.b[i] + xi * y
            row = self.a[i]
            for j, xj in enumerate(x):
                row[j] = f * row[j] + xi * xj
        self.samples += 1
        self._w = None

    def predict(self, x) -> float:
        return sum(xi * wi for xi, wi in zip(x, self.weights, strict=True))

    @property
    def weights(self) -> list[float]:
        if self._w is None:
            s = self.strength
            a = [[v + s * (i == j) for j, v in enumerate(row)] for i, row in enumerate(self.a)]
            self._w = _solve(a, [b + s * w for b, w in zip(self.b, self.prior, strict=True)])
        return self._w


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a⁻¹b`` for the 2- and 3-unknown systems above, by elimination with partial
    pivoting: numpy's call overhead is some 20 times the arithmetic at this size, and the
    hub solves on its event loop every round. ``a`` is positive definite (a ridge term is
    added), so no pivot is zero."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    w = [0.0] * n
    for r in range(n - 1, -1, -1):
        w[r] = (m[r][n] - sum(m[r][j] * w[j] for j in range(r + 1, n))) / m[r][r]
    return w


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
        self.hits = [0.0] * (MAX_AUTO_DEPTH + 1)
        self.trials = [0.0] * (MAX_AUTO_DEPTH + 1)

    def observe(self, depth: int, accepted: int) -> None:
        """A round that drafted ``depth`` layers and had ``accepted`` nodes accepted."""
        depth = min(depth, MAX_AUTO_DEPTH)
        reached, hit = min(accepted + 1, depth), min(accepted, depth)
        f = self.forget
        self.trials = [f * t + (1 <= k <= reached) for k, t in enumerate(self.trials)]
        self.hits = [f * h + (1 <= k <= hit) for k, h in enumerate(self.hits)]
        if self.parent is not None:
            self.parent.observe(depth, accepted)

    def betas(self) -> list[float]:
        """``beta_k`` for k = 1..MAX_AUTO_DEPTH (index 0 unused, 1.0).

        Deep nodes are tried less often, so each depth's prior carries what shallower data
        says: the parent's ``beta_k`` scaled by how this curve compares with the parent's
        one layer up (at the hub, which has no parent, the previous layer's estimate)."""
        parent = self.parent.betas() if self.parent is not None else None
        out = [1.0] * (MAX_AUTO_DEPTH + 1)
        for k in range(1, MAX_AUTO_DEPTH + 1):
            if parent is None:
                prior = out[k - 1] if k > 1 else self.prior
            else:
                prior = parent[k] * out[k - 1] / max(parent[k - 1], 1e-6)
            prior = min(max(prior, 0.0), 1.0)
            out[k] = (self.hits[k] + self.pseudo * prior) / (self.trials[k] + self.pseudo)
        return out

    def expected_tokens(self) -> list[float]:
        """``E(d)`` for d = 0..MAX_AUTO_DEPTH: committed tokens a round, the bonus included."""
        return [1.0, *(1.0 + e for e in accumulate(self.by_depth(None)))]

    def by_depth(self, digits: int | None = 4) -> list[float]:
        """Unconditional acceptance of the node at depth k, as the metrics report it."""
        reach = list(accumulate(self.betas()[1:], operator.mul))
        return reach if digits is None else [round(r, digits) for r in reach]
