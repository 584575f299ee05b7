"""The model's side of every target front end: the one place a target runs its model.

A front end decides what each of its sessions has to verify and what the verdicts become:
the ``Batcher`` for the star's requests (``starhub target``, ``attach()``, ``starhub
serve``), the edge ``Verifier`` for its drafters' sessions. The core runs it, on the front
end's engine thread:

- a prompt's prefill, a slice at a time between passes (``prefill``), its share of the
  time and its turn chosen by one rule (``prefill_slice``, ``prefill_turn``,
  ``targets.prefill``);
- one batched pass over the rows the front end picked (``verify``, ``targets.engine``),
  timed by the target's clock (``starhub.cores.CoreClock``) and taught to its one cost
  model (``targets.cost.PassCost``), which the front end's scheduling and the COMMITs read.

The core counts the time its engine thread is busy (``busy_s``): a peer's turnaround is
what passed since a COMMIT less the passes run meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from starhub.cores import CoreClock
from starhub.wire.tree import DraftTree
from targets.cost import BatchStats, PassCost
from targets.prefill import ChunkedPrefill, PrefillShare, PrefillTurns
from targets.verify import Verdict

K = TypeVar("K")
Prefilled = tuple[int, torch.Tensor | None]
"""A finished prefill: the first token and the prompt's features (None: none kept)."""


@dataclass
class Pass:
    """One batched pass: its verdicts (one per row), its shape, and its seconds as it ran
    (``took``) and with the cores to itself (``alone``, the same unless a hub shares them)."""

    verdicts: list[Verdict]
    stats: BatchStats
    took: float
    alone: float


class EngineCore:
    """Runs passes and prefill slices on ``engine`` (a ``VerifyEngine``, or any object with
    its methods: the edge benchmark's emulated engine) and learns ``cost`` from them."""

    def __init__(self, engine, cost: PassCost, clock: CoreClock | None = None):
        self.engine = engine
        self.cost = cost
        self.clock = clock or CoreClock()
        self.turns = PrefillTurns()
        self.share = PrefillShare()
        self.busy_s = 0.0
        """Seconds spent in passes and prefill slices."""
        self.passes = 0
        self.prefill_chunks = 0

    # -- prefill ----------------------------------------------------------------------
    def prefill_slice(self, waiting: Sequence[K], left: Callable[[K], int], others: bool,
                      ready: bool) -> float | None:
        """How long a slice of the prefills ``waiting`` (``left``: a prompt's tokens still to
        prefill) runs now, None for not now or none waiting (``PrefillShare.next_slice``:
        ``others``, whether other sessions decode; ``ready``, whether one has a pass to run
        now)."""
        if not waiting:
            return None
        return self.share.next_slice(others, ready, min(map(left, waiting)))

    def prefill_turn(self, waiting: Sequence[K], left: Callable[[K], int]) -> K:
        """Whose prompt of ``waiting`` (oldest first; ``left``: its tokens still to prefill)
        the slice goes to (``PrefillTurns``)."""
        return self.turns.pick(waiting, left)

    def prefill(self, job: ChunkedPrefill[Prefilled], slice_s: float) -> Prefilled | None:
        """Run a slice of ``job`` (``ChunkedPrefill.run``); its result once the prompt is
        done, else None."""
        started, chunks = time.perf_counter(), job.chunks
        done = job.run(slice_s)
        self.busy_s += self.share.ran(started)
        self.prefill_chunks += job.chunks - chunks
        return done

    # -- passes -----------------------------------------------------------------------
    def verify(self, work: list[tuple[int, DraftTree]], trees: int | None = None,
               learn: bool = True) -> Pass:
        """Verify each (session, tree) pair in one pass; ``trees``: the rows that verify a
        tree rather than step plain (an empty tree), all where None. ``learn``: teach the
        cost model now; a front end whose model is read on another thread teaches it there
        (``learn(pass)``)."""
        stats = self.engine.cost(work)
        self.clock.start()
        verdicts = self.engine.verify(work)
        took, alone = self.clock.lap()
        self.busy_s += took
        self.passes += 1
        done = Pass(verdicts, stats, took, alone)
        if learn:
            self.learn(done, trees)
        return done

    def learn(self, done: Pass, trees: int | None = None) -> None:
        """Teach the cost model a pass (``trees`` as in ``verify``)."""
        self.cost.observe(done.stats, done.alone, done.took,
                          done.stats.rows if trees is None else trees)
