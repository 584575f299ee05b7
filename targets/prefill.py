"""Chunked prefill, for every target that prefills prompts between other sessions' passes
(the core's requests, the edge verifier's OPENs): a prompt's passes paused between decoder
layers, whose prompt runs next, and when.

A prompt is prefilled in chunks of ``CHUNK`` tokens, a size whose passes use the cores well
at any context length (smaller ones make attention over a long cache slow), and each chunk's
pass pauses after every decoder layer. So a prefill runs in slices of a layer or more, and
the passes of the sessions that decode run between two slices: a long prompt holds them up
by about one layer of one chunk, not by a chunk or the whole prompt.

Turns go to the prompt with the fewest tokens left, so that a short prompt is not queued
behind a long one, and to the oldest, in turn, so that a stream of short prompts cannot
hold a long one up for ever. While other sessions decode, a slice runs when none of them
has a pass to run (the hub is drafting their trees), and otherwise once their passes since
the last slice have taken ``1 / SHARE - 1`` times as long as it did."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

CHUNK = 256
"""Prompt tokens a chunk takes, unless set."""

SLICE_S = 0.05
"""How long a slice of a prefill runs while no other session decodes (at most a chunk):
long enough that the turns between slices cost nothing, short enough that a request that
comes meanwhile is taken in soon."""

SHARE = 0.25
"""The least share of the engine's time a prefill gets while other sessions' passes are
ready one after another."""


class ChunkedPrefill(Generic[R]):
    """A prompt's prefill, run a slice at a time (``run``). ``steps`` yields None after each
    decoder layer and the prompt tokens cached so far at each chunk's end, and returns the
    prefill's result."""

    def __init__(self, steps: Generator[int | None, None, R], tokens: int):
        self._steps = steps
        self.tokens = tokens
        self.fed = 0
        """Prompt tokens in the cache so far."""
        self.chunks = 0
        """Chunks done so far."""
        self.result: R | None = None

    @property
    def left(self) -> int:
        return self.tokens - self.fed

    @property
    def done(self) -> bool:
        return self.fed == self.tokens

    def run(self, slice_s: float = 0.0) -> R | None:
        """Run one decoder layer, then more until ``slice_s`` seconds have passed or the
        chunk has ended; the result once the last chunk is done, else None."""
        end = time.perf_counter() + slice_s
        while True:
            try:
                fed = next(self._steps)
            except StopIteration as stop:
                self.fed, self.result = self.tokens, stop.value
                self.chunks += 1
                return stop.value
            if fed is not None:  # a chunk's end
                self.fed = fed
                self.chunks += 1
                return None
            if time.perf_counter() >= end:
                return None


class PrefillTurns:
    def __init__(self) -> None:
        self.oldest_turn = False
        """Whether the next turn goes to the oldest prompt."""

    def pick(self, waiting: Sequence[T], left: Callable[[T], int]) -> T:
        """The prompt to prefill a slice of now, of ``waiting`` (oldest first), each with
        ``left(prompt)`` tokens still to prefill."""
        self.oldest_turn = not self.oldest_turn
        return waiting[0] if self.oldest_turn else min(waiting, key=left)


class PrefillShare:
    """When a slice of a prefill is due, and how long it runs."""

    def __init__(self) -> None:
        self.took = 0.0
        """How long the last slice ran."""
        self.ended = 0.0
        """When it ended (``time.perf_counter``)."""

    def due(self, others: bool, ready: bool) -> bool:
        """Whether a slice runs now: ``others``, whether other sessions decode; ``ready``,
        whether one of them has a pass to run now."""
        if not others or not ready:
            return True
        return time.perf_counter() - self.ended >= self.took * (1 / SHARE - 1)

    @staticmethod
    def slice_s(others: bool) -> float:
        """How long the slice runs: one layer while other sessions decode."""
        return 0.0 if others else SLICE_S

    def ran(self, started: float) -> None:
        """A slice ran from ``started`` to now."""
        self.ended = time.perf_counter()
        self.took = self.ended - started
