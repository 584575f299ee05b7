"""What one forward pass of the target's engine costs: the one model every decision on the
target side is made from (the serving gate's trees-or-plain verdict, the node floor and
plain steps a COMMIT reports, the edge scheduler's order and the passes it waits for,
the size of a prefill chunk).

``PassCost`` learns from the passes the engine runs (``BatchStats`` and their seconds), as
two least-squares fits (``starhub.fit``) that each forget as they go:

- plain passes, one token fed a row: ``c0 + c1·rows + c2·sum(cached)``;
- passes that verify trees (plain rows among them included):
  ``c0 + c1·fed + c2·sum(cached·fed) + c3·trees``, pricing each fed token, the attention
  it pays against its cache, and what a tree row costs beyond its tokens (its mask, the
  scattered attention).

Each fit learns only from its own kind of pass, so a spell of one kind moves neither the
other's fit (see the gate's notes in ``docs/benchmarks.md``). Where the hub computes on the
target's cores, passes are fitted by their time alone (CPU time, ``starhub.cores``) and
``slowdown`` holds what running beside the hub adds to a tree pass (wall over alone).
Each pass is predicted before it joins a fit, so ``mape`` is the error on passes the model
had not seen. No prediction falls below the fastest of the last few hundred plain passes:
every pass reads every weight, and a line through passes whose kernels differ by their rows (one
row and two rows may each run on a kernel of their own, ``starhub.models.loading``) can
otherwise reach zero a few rows out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starhub.control.estimators import Ema
from starhub.fit import LinearFit
from starhub.wire.tree import DraftTree

FORGET = 0.99
"""Each fit weighs its passes as if it kept about the last hundred."""
DEFAULT_STEP_S = 0.02
"""A plain step's prior where the target has not timed one."""
ERROR_WINDOW = 256


@dataclass
class BatchStats:
    """What one pass fed: the cost model's inputs."""

    rows: int
    new_tokens: int
    """Tokens fed: each row's root plus its tree nodes."""
    cached_tokens: int
    """Cache entries the rows attend to, summed over rows."""
    cached_x_new: int
    """Sum over rows of cached length times new tokens: the attention work."""

    @classmethod
    def of(cls, work: Sequence[tuple[int, DraftTree]], cached: Callable[[int], int]
           ) -> BatchStats:
        """A pass over ``work`` (session, tree) pairs, each session holding ``cached(sid)``
        entries and feeding its root and its tree's nodes."""
        new = [len(tree) + 1 for _, tree in work]
        held = [cached(sid) for sid, _ in work]
        return cls(len(work), sum(new), sum(held),
                   sum(c * n for c, n in zip(held, new, strict=True)))


class PassCost:
    """A pass's seconds by its shape, learned from the passes run (module docstring)."""

    def __init__(self, step_s: float = 0.0):
        step = step_s if step_s > 0 else DEFAULT_STEP_S
        self.plain = LinearFit([step, 0.0, 0.0], forget=FORGET)
        """Passes without trees: what plain batching costs."""
        self.trees = LinearFit([step, 0.0, 0.0, 0.0], forget=FORGET)
        """Passes with trees: what a tree pass costs."""
        self.mean = Ema(alpha=0.2)
        """A pass's wall seconds, on average, whatever its shape."""
        self.slowdown = Ema(1.0, alpha=0.1)
        """Wall over alone time of the passes that verified trees: what the hub's compute
        next to ours adds to them (1 where it runs elsewhere)."""
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self.plain_recent: deque[float] = deque(maxlen=ERROR_WINDOW)
        """The last plain passes' times with the cores to themselves: the fastest is a floor
        under every prediction."""

    def observe(self, stats: BatchStats, alone_s: float, wall_s: float | None = None,
                trees: int = 0) -> None:
        """A pass's time with the cores to itself, and as it ran (default: the same);
        ``trees``: the rows that verified a tree."""
        wall = alone_s if wall_s is None else wall_s
        fit = self.trees if trees else self.plain
        if fit.samples >= 8 and alone_s > 0:
            self.errors.append(abs(self.predict(stats, trees) - alone_s) / alone_s)
        if alone_s > 0 and not trees:
            self.plain_recent.append(alone_s)
        if trees:
            self.trees.update(self._tree_x(stats, trees), alone_s)
            if alone_s > 0:
                self.slowdown.update(max(wall / alone_s, 1.0))
        else:
            self.plain.update([1.0, stats.new_tokens, stats.cached_x_new], alone_s)
        self.mean.update(wall)

    @staticmethod
    def _tree_x(stats: BatchStats, trees: int) -> list[float]:
        return [1.0, stats.new_tokens, stats.cached_x_new, trees]

    def anchor(self) -> None:
        """Make what the fits know now their priors: where later passes stop telling a
        fit's terms apart (a long spell of one-row passes, the passes that told them
        forgotten), the fit falls back to these, not to its first guess."""
        for fit in (self.trees, self.plain):
            fit.prior = list(fit.weights)

    def predict(self, stats: BatchStats, trees: int = 0) -> float:
        """A pass of this shape with the cores to itself; never below the fastest recent
        plain pass."""
        if trees or not self.plain.samples:
            fitted = self.trees.predict(self._tree_x(stats, trees))
        else:
            fitted = self.plain.predict([1.0, stats.new_tokens, stats.cached_x_new])
        return max(fitted, min(self.plain_recent, default=0.0))

    def plain_s(self, cached: Sequence[int]) -> float:
        """A plain pass over sessions of these cache lengths: one token fed each; by the
        tree fit (no trees) until a plain pass has run."""
        n, total = len(cached), sum(cached)
        return self.predict(BatchStats(n, n, total, total))

    def node_s(self, cached: int) -> float:
        """What one fed token and its attention add to a pass, for a session holding
        ``cached`` tokens, with the cores to itself; 0 until passes have told it."""
        w = self.trees.weights
        return max(w[1] + w[2] * cached, 0.0)

    def row_s(self) -> float:
        """What a tree row costs a pass beyond its tokens."""
        return max(self.trees.weights[3], 0.0)

    @property
    def pass_s(self) -> float:
        """A pass's wall seconds, on average (0 before the first)."""
        return self.mean.get(0.0)

    @property
    def mape(self) -> float | None:
        return sum(self.errors) / len(self.errors) if self.errors else None

    def report_ms(self) -> list[float]:
        """The tree fit's terms in milliseconds, for a stats report."""
        return [round(1e3 * w, 6) for w in self.trees.weights]
