"""Chunked prefill, for every target that prefills a chunk between two passes (the core's
requests, the edge verifier's OPENs): whose prompt the next chunk goes to, and how many of
its tokens.

Turns go to the prompt with the fewest tokens left, so that a short prompt is not queued
behind a long one, and to the oldest, in turn, so that a stream of short prompts cannot
hold a long one up for ever. A chunk takes about one pass's worth of tokens while other
work waits for passes, so that a long prompt holds it up by about a pass a turn, and the
most while nothing else waits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

CHUNK = (16, 64, 256)
"""Prompt tokens a chunk takes: the least, the first guess and the most, when sized to
take about one pass."""


class PrefillTurns:
    def __init__(self) -> None:
        self.oldest_turn = False
        """Whether the next chunk goes to the oldest prompt."""

    def pick(self, waiting: Sequence[T], left: Callable[[T], int]) -> T:
        """The prompt to prefill a chunk of now, of ``waiting`` (oldest first), each with
        ``left(prompt)`` tokens still to prefill."""
        self.oldest_turn = not self.oldest_turn
        return waiting[0] if self.oldest_turn else min(waiting, key=left)


class ChunkSize:
    """The next chunk's tokens: ``fixed`` where it is set (not 0); otherwise the most while
    nothing else waits for passes, and about one pass's worth while something does,
    learned from the chunks timed."""

    def __init__(self, fixed: int = 0):
        self.fixed = fixed
        self.chunk = fixed or CHUNK[1]

    def now(self, alone: bool) -> int:
        """The next chunk's size; ``alone``: no other work waits for passes."""
        if self.fixed:
            return self.fixed
        return CHUNK[2] if alone else self.chunk

    def observe(self, fed: int, size: int, took_s: float, pass_s: float) -> None:
        """A chunk of ``size`` asked, ``fed`` tokens fed in ``took_s``: the pass-sized chunk
        moves towards taking ``pass_s`` (by at most half or twice a chunk)."""
        if self.fixed or size != self.chunk or fed < size or took_s <= 0 or pass_s <= 0:
            return
        least, _, most = CHUNK
        ratio = min(2.0, max(0.5, pass_s / took_s))
        self.chunk = int(min(most, max(least, self.chunk * ratio)))
