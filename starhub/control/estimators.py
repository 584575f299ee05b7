"""Running estimates the control plane is built from: exponential moving averages (per
observation, and over time for a quantity that holds between observations), acceptance
by tree depth with hierarchical priors (its cost curves are ``starhub.fit``), and the
backoff that keeps an estimate of trees fresh while plain decoding wins."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import accumulate

from starhub.options import MAX_AUTO_DEPTH


@dataclass
class Ema:
    """An exponential moving average. A starting ``value`` counts as ``prior`` observations:
    until there have been about ``1/alpha`` of them it is a plain mean of the prior and the
    observations, so a few rounds move it as far as they should. By default it weighs as
    much as the average's memory from the start."""
    value: float | None = None
    alpha: float = 0.1
    prior: float = math.inf
    seen: int = 0

    def update(self, x: float) -> float:
        self.seen += 1
        if self.value is None:
            self.value = x
        else:
            step = max(self.alpha, 1.0 / (self.seen + self.prior))
            self.value += step * (x - self.value)
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass
class TimeAverage:
    """A level that holds between observations (a batch's row count, say), averaged over
    about the last ``window_s`` seconds. Weighted by time, not by observation: a lull with
    no observations in it still counts for its length."""
    window_s: float
    value: float | None = None
    held: float = 0.0
    since: float = 0.0

    def update(self, x: float, now: float) -> None:
        """The level is ``x`` from ``now`` on."""
        self.value = self.get(x, now)
        self.held, self.since = x, now

    def get(self, default: float, now: float) -> float:
        if self.value is None:
            return default
        weight = 1.0 - math.exp(-max(now - self.since, 0.0) / self.window_s)
        return self.value + weight * (self.held - self.value)


@dataclass
class ProbeBackoff:
    """When to try trees again while plain decoding wins: what is known of trees moves
    only while trees run, so one low reading would otherwise hold plain for good. After
    a choice of trees the next probe comes after ``first`` plain choices; each probe
    doubles the gap, up to ``most``."""
    first: int = 2
    most: int = 8
    streak: int = 0
    gap: int = field(init=False)

    def __post_init__(self) -> None:
        self.gap = self.first

    def trees(self) -> None:
        """Trees were chosen: the gap starts over."""
        self.streak, self.gap = 0, self.first

    def plain(self) -> bool:
        """Plain was chosen; True when this one is to probe trees instead."""
        self.streak += 1
        if self.streak <= self.gap:
            return False
        self.streak, self.gap = 0, min(2 * self.gap, self.most)
        return True


class Acceptance:
    """Per-depth conditional acceptance ``beta_k = P(node at depth k accepted | depth k-1
    was)``, from decayed counts, shrunk toward a prior curve (the parent's) when data is
    thin: a new session starts from its target's curve, which starts from the hub's.

    Every round a session observes also reaches its target's and the hub's counts, so the
    parent a curve shrinks toward leaves that curve's own rounds out: each round counts
    once in an estimate. Counted in each, a fresh hub's first round weighed three times:
    one round that kept nothing took a new session's ``beta_1`` from 0.5 to 0.35, not 0.44.
    Each curve keeps its own contribution to its parent's counts as its parent has decayed
    it (the parent forgets per round it sees, which a busy hub does faster than any one of
    its sessions), so the parent's counts less it are exactly the others' rounds."""

    def __init__(self, parent: Acceptance | None = None, prior: float = 0.5,
                 pseudo: float = 8.0, forget: float = 0.995):
        self.parent, self.prior, self.pseudo, self.forget = parent, prior, pseudo, forget
        self.hits = [0.0] * (MAX_AUTO_DEPTH + 1)
        self.trials = [0.0] * (MAX_AUTO_DEPTH + 1)
        self.seen = 0
        """Rounds observed: the clock of this curve's decay."""
        self.up_hits = [0.0] * (MAX_AUTO_DEPTH + 1)
        self.up_trials = [0.0] * (MAX_AUTO_DEPTH + 1)
        self.up_seen = 0
        """This curve's share of its parent's counts, decayed as the parent's were when
        the parent had seen ``up_seen`` rounds."""

    def observe(self, depth: int, accepted: int) -> None:
        """A round that drafted ``depth`` layers and had ``accepted`` nodes accepted."""
        depth = min(depth, MAX_AUTO_DEPTH)
        reached, hit = min(accepted + 1, depth), min(accepted, depth)
        self.seen += 1
        self.trials = _count(self.trials, self.forget, reached)
        self.hits = _count(self.hits, self.forget, hit)
        parent = self.parent
        if parent is not None:
            parent.observe(depth, accepted)
            decay = parent.forget ** (parent.seen - self.up_seen)
            self.up_trials = _count(self.up_trials, decay, reached)
            self.up_hits = _count(self.up_hits, decay, hit)
            self.up_seen = parent.seen

    def betas(self, without: Acceptance | None = None) -> list[float]:
        """``beta_k`` for k = 1..MAX_AUTO_DEPTH (index 0 unused, 1.0); ``without``: a
        child whose rounds are left out of the counts.

        Deep nodes are tried less often, so each depth's prior carries what shallower data
        says: the parent's ``beta_k`` scaled by how this curve compares with the parent's
        one layer up (at the hub, which has no parent, the previous layer's estimate)."""
        parent = self.parent.betas(without=self) if self.parent is not None else None
        hits, trials = self.hits, self.trials
        if without is not None:
            decay = self.forget ** (self.seen - without.up_seen)
            hits = _less(hits, without.up_hits, decay)
            trials = _less(trials, without.up_trials, decay)
        out = [1.0] * (MAX_AUTO_DEPTH + 1)
        for k in range(1, MAX_AUTO_DEPTH + 1):
            if parent is None:
                prior = out[k - 1] if k > 1 else self.prior
            else:
                prior = parent[k] * out[k - 1] / max(parent[k - 1], 1e-6)
            prior = min(max(prior, 0.0), 1.0)
            out[k] = (hits[k] + self.pseudo * prior) / (trials[k] + self.pseudo)
        return out

    def expected_tokens(self) -> list[float]:
        """``E(d)`` for d = 0..MAX_AUTO_DEPTH: committed tokens a round, the bonus included."""
        return [1.0, *(1.0 + e for e in accumulate(self.by_depth(None)))]

    def rounds(self) -> float:
        """Rounds this curve has counted (decayed): every tree round tries depth 1."""
        return self.trials[1]

    def tokens_variance(self, depth: int) -> float:
        """Variance of the tokens one round of ``depth`` commits, by this curve: with
        ``A`` the accepted count, ``P(A >= k)`` is depth ``k``'s reach, so
        ``E[A^2] = sum (2k - 1) reach_k``."""
        reach = self.by_depth(None)[:min(depth, MAX_AUTO_DEPTH)]
        mean = sum(reach)
        return max(sum((2 * k + 1) * r for k, r in enumerate(reach)) - mean * mean, 0.0)

    def by_depth(self, digits: int | None = 4) -> list[float]:
        """Unconditional acceptance of the node at depth k, as the metrics report it."""
        reach = list(accumulate(self.betas()[1:], operator.mul))
        return reach if digits is None else [round(r, digits) for r in reach]


def _count(counts: list[float], decay: float, upto: int) -> list[float]:
    """Per-depth counts decayed by ``decay``, with one more at depths 1..``upto``."""
    return [decay * c + (1 <= k <= upto) for k, c in enumerate(counts)]


def _less(counts: list[float], share: list[float], decay: float) -> list[float]:
    """Per-depth counts less a child's ``share`` of them, decayed by ``decay`` since."""
    return [max(c - decay * s, 0.0) for c, s in zip(counts, share, strict=True)]
