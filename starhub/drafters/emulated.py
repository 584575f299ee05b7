"""A drafter that costs time but no CPU: it sleeps ``depth · t_s`` and proposes a chain.

Stands in for an accelerator's drafting so the hub's real loop, sockets and metrics can be
measured at any N on a small machine. Sleeps overshoot by a roughly constant amount (on a
busy machine, waking and taking the interpreter back), so each sleep is shortened by a
running estimate of that overshoot, and it counts from the call's start: the mean draft
time, making the chain included, then matches the model's ``S(d)`` without spinning.
"""

from __future__ import annotations

import time

import numpy as np

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.wire.tree import DraftTree


class CalibratedSleep:
    """``time.sleep`` whose mean duration matches the request, learned from past sleeps."""

    def __init__(self, smoothing: float = 0.05):
        self.overshoot = 0.0
        self.smoothing = smoothing

    def __call__(self, seconds: float, since: float | None = None) -> float:
        """Wait so that ``seconds`` pass from ``since`` (a ``time.perf_counter`` reading;
        default now): the work done since then is part of the time."""
        start = time.perf_counter() if since is None else since
        time.sleep(max(0.0, seconds - (time.perf_counter() - start) - self.overshoot))
        took = time.perf_counter() - start
        self.overshoot += self.smoothing * (took - seconds)
        self.overshoot = min(max(self.overshoot, 0.0), seconds / 2)
        return took


class EmulatedDrafter(Drafter):
    name = "emulated"
    lookup_branches = False

    def __init__(self, t_s: float, vocab_size: int = 32000):
        self.t_s = t_s
        self.vocab_size = vocab_size
        self.sleep = CalibratedSleep()

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        """The chain, in ``depth · t_s`` all told: making it is part of the time."""
        start = time.perf_counter()
        depth = max(shape.depth, 1)
        first = ctx.tokens[-1] if ctx.tokens else 0
        tokens = (first + 1 + np.arange(depth, dtype=np.int64)) % self.vocab_size
        tree = DraftTree(tokens.astype(np.int32), np.arange(-1, depth - 1, dtype=np.int32))
        self.sleep(depth * self.t_s, since=start)
        return tree
