"""Continuous batching for the EAGLE drafter: the state a session keeps in the head, and
the bookkeeping of one run of packed passes that sessions join and leave between layers.

``EagleDrafter`` owns the model work (catching sessions up, one packed pass per layer);
``DraftBatch`` decides what goes into each pass and hands trees over as they finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from starhub.drafters.base import DraftContext, TreeShape
from starhub.models.kvcache import KVCache, Segment
from starhub.wire.tree import (
    DraftTree,
    Frontier,
    Grower,
    Ranked,
    TreeFeed,
    grow_greedy,
    grow_sampled,
    grow_together,
    rank,
)

if TYPE_CHECKING:
    from starhub.drafters.eagle import EagleDrafter

Job = tuple[DraftContext, TreeShape]
Finished = Callable[[int, "DraftTree | Exception", float, float], None]


@dataclass
class HeadState:
    """What a session keeps in the head between rounds."""

    cache: KVCache = field(default_factory=KVCache)
    pairs: int = 0
    """Committed pairs already in ``cache``."""
    root_hidden: torch.Tensor | None = None
    """The head's output at the last committed pair: the feature the next tree grows from."""
    root_logits: torch.Tensor | None = None


class Growth:
    """One tree growing in a packed pass: which cache its nodes go into, where, and the head
    outputs that feed each node's children."""

    def __init__(self, cache: KVCache, base: int, hidden: dict[int, torch.Tensor]):
        self.cache = cache
        self.feed = TreeFeed(base)
        self.hidden = hidden


@dataclass
class CatchUp:
    """Committed (token, feature) pairs of sessions to feed: the rows, and per session its
    state and the pair count it reaches."""

    feats: list[torch.Tensor] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    rows: list[tuple[HeadState, int]] = field(default_factory=list)
    jobs: list[int] = field(default_factory=list)
    """The batch's job numbers of the sessions it feeds."""

    @staticmethod
    def merge(parts: list[CatchUp]) -> CatchUp:
        out = CatchUp()
        for part in parts:
            for name in ("feats", "ids", "positions", "segments", "rows", "jobs"):
                getattr(out, name).extend(getattr(part, name))
        return out


class DraftBatch:
    """One run of packed passes. Jobs are numbered in the order they arrive: the first
    ones, then whatever ``admit()`` returns between layers. A job that joins catches up
    inside the next layer's pass (when trees already wait for one) and grows from the
    layer after; ``finished(k, result, seconds, batch)`` hears of job k as soon as its
    tree (or error) is ready, with its share of the time of the passes it took part in
    and the mean number of sessions in them."""

    def __init__(self, drafter: EagleDrafter, admit: Callable[[], list[Job]] | None = None,
                 finished: Finished | None = None):
        self.drafter = drafter
        self.admit = admit
        self.finished = finished
        self.results: list[DraftTree | Exception | None] = []
        self.jobs: list[Job] = []
        self.cost: list[float] = []
        self.shared: list[list[int]] = []  # per job: passes, and sessions in them
        self.owners: list[int] = []  # grower -> job
        self.ranked: list[int] = []  # grower -> top-k it is sent ranked, 0: raw logits
        self.growths: list[Growth] = []
        self.growing = 0
        self.queued: list[CatchUp] = []  # admitted; their pairs ride the next pass
        self.ready: list[Grower] = []  # caught up; they join at the next layer
        self.mark = time.perf_counter()

    def run(self, jobs: list[Job]) -> list[DraftTree | Exception]:
        grow_together(self.alone(self.enqueue(jobs)), self.expand,
                      admit=self.more if self.admit else None, finished=self.done)
        return self.results  # type: ignore[return-value]

    def charge(self, jobs: list[int]) -> None:
        """Split the time since the last charge among the jobs it was spent on."""
        now = time.perf_counter()
        for k in jobs:
            self.cost[k] += (now - self.mark) / len(jobs)
            self.shared[k][0] += 1
            self.shared[k][1] += len(jobs)
        self.mark = now

    def report(self, k: int, result: DraftTree | Exception) -> None:
        self.results[k] = result
        if self.finished is not None:
            passes, rows = self.shared[k]
            self.finished(k, result, self.cost[k], rows / passes if passes else 1.0)

    def enqueue(self, new: list[Job]) -> CatchUp:
        """Number the new jobs; their catch-up inputs (errors reported at once)."""
        first = len(self.results)
        self.results.extend([None] * len(new))
        self.jobs.extend(new)
        self.cost.extend([0.0] * len(new))
        self.shared.extend([0, 0] for _ in new)
        errors, catch = self.drafter._catch_up_inputs([ctx for ctx, _ in new])
        catch.jobs = [k for k, err in enumerate(errors, first) if err is None]
        for k, err in enumerate(errors, first):
            if err is not None:
                self.report(k, err)
        return catch

    def start(self, jobs: list[int]) -> list[Grower]:
        """Growers for jobs whose sessions have caught up."""
        drafter = self.drafter
        scores = [self.jobs[k][0].coupled(drafter.head.vocab_size, drafter._target_index())
                  for k in jobs]
        plain = [k for k, score in zip(jobs, scores, strict=True)
                 if self.jobs[k][0].greedy and score is None]
        roots = iter(self.rank([self.jobs[k][0].state.root_logits[None] for k in plain],
                               [self.jobs[k][1].topk for k in plain]))
        growers = []
        for k, score in zip(jobs, scores, strict=True):
            ctx, shape = self.jobs[k]
            state: HeadState = ctx.state
            self.growths.append(Growth(state.cache, state.pairs, {-1: state.root_hidden}))
            self.owners.append(k)
            self.ranked.append(shape.topk if k in plain else 0)
            if k in plain:
                growers.append(grow_greedy(next(roots), shape.depth, shape.topk,
                                           shape.max_nodes))
            elif score is not None:
                growers.append(grow_greedy(state.root_logits, shape.depth, shape.topk,
                                           shape.max_nodes, score))
            else:
                growers.append(grow_sampled(state.root_logits, shape.depth, shape.topk,
                                            shape.max_nodes, ctx.temperature, shape.support,
                                            ctx.generator))
        self.growing += len(growers)
        return growers

    def alone(self, catch: CatchUp) -> list[Grower]:
        """Catch up in a pass of their own (nothing is growing to ride with)."""
        if catch.segments:
            self.drafter._pass([], catch)
        self.charge(catch.jobs)
        return self.start(catch.jobs)

    def more(self) -> list[Grower]:
        """Between layers: the caught-up jobs join; newly admitted ones queue for the
        next pass, or catch up at once if no tree is waiting for a pass."""
        joining, self.ready = self.ready, []
        new = self.admit()
        if new:
            catch = self.enqueue(new)
            if self.growing > len(joining):
                self.queued.append(catch)
            else:
                joining += self.alone(catch)
        return joining

    def expand(self, asks: list[tuple[int, Frontier]]) -> list[torch.Tensor | Ranked]:
        catch = CatchUp.merge(self.queued)
        self.queued = []
        out = self.drafter._pass([(self.growths[j], frontier) for j, frontier in asks], catch)
        plain = [i for i, (j, _) in enumerate(asks) if self.ranked[j]]
        for i, ranked in zip(plain, self.rank([out[i] for i in plain],
                                              [self.ranked[asks[i][0]] for i in plain]),
                             strict=True):
            out[i] = ranked
        self.charge([self.owners[j] for j, _ in asks] + catch.jobs)
        self.ready.extend(self.start(catch.jobs))
        return out

    @staticmethod
    def rank(logits: list[torch.Tensor], topk: list[int]) -> list[Ranked]:
        """Each greedy tree's rows ranked, all trees' in one top-k."""
        if not logits:
            return []
        return rank(torch.cat(logits), max(topk)).split([len(rows) for rows in logits])

    def done(self, j: int, tree: DraftTree) -> None:
        self.growing -= 1
        state: HeadState = self.jobs[self.owners[j]][0].state
        state.cache.crop(state.pairs)
        self.report(self.owners[j], self.drafter._to_target_ids(tree))
