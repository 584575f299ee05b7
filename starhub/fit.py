"""Online least squares, shared by the hub's control plane (its draft and verify cost
curves) and the target side's pass-cost model (``targets.cost``)."""

from __future__ import annotations

from dataclasses import dataclass


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
    """``a⁻¹b`` for the systems above (2 to 4 unknowns), by elimination with partial
    pivoting: numpy's call overhead is some 20 times the arithmetic at this size, and the
    hub solves on its event loop every round. ``a`` is positive definite (a ridge term is
    added), so no pivot is zero. It is first scaled to a unit diagonal, which changes the
    answer by rounding only and keeps features of very different sizes (tokens and their
    products) apart."""
    n = len(b)
    d = [row[i] ** -0.5 for i, row in enumerate(a)]
    w = _eliminate([[v * d[i] * d[j] for j, v in enumerate(row)] for i, row in enumerate(a)],
                   [v * d[i] for i, v in enumerate(b)])
    return [w[i] * d[i] for i in range(n)]


def _eliminate(a: list[list[float]], b: list[float]) -> list[float]:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-12:  # features the data never told apart: the ridge is all
            m[c][c] = 1e-12       # that holds them, and rounding can cancel it exactly
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    w = [0.0] * n
    for r in range(n - 1, -1, -1):
        w[r] = (m[r][n] - sum(m[r][j] * w[j] for j in range(r + 1, n))) / m[r][r]
    return w
