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
hold a long one up for ever. While other sessions decode, a slice of one layer runs when
none of them has a pass to run (the hub is drafting their trees), and the prefill gets a
share of the time (``SHARE``, the slices in those waits included): half while a short
prompt waits, so that it joins the batch soon, and a quarter while only long ones do, so
that one long prompt cannot double every other request's token time (vLLM's long-prefill
threshold is the same idea)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

CHUNK = 256
"""Prompt tokens a chunk takes, unless set."""

SLICE_S = 0.05
"""How long a slice of a prefill runs at most (and at most to a chunk's end): long enough
that the turns between slices cost nothing, short enough that a request that comes
meanwhile is taken in soon and one that decodes is held up little."""

LONG = 2 * CHUNK
"""A prompt with more tokens than this left to prefill is a long one."""

SHARE = {"short": 0.5, "long": 0.25}
"""The share of the engine's time a prefill gets while other sessions' passes are ready
one after another: while a short prompt waits, and while only long ones do."""


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
    """When a slice of a prefill runs, and for how long: the prefill is owed a share of
    the time the engine spends on anything else (``SHARE`` of the whole), and every slice,
    those that run while nothing else could too, is paid from what it is owed."""

    def __init__(self) -> None:
        self.credit = 0.0
        """Seconds of prefill owed when the last slice ended (negative: taken ahead),
        within ``SLICE_S`` either way, so that neither side banks time for later."""
        self.ended: float | None = None
        """When the last slice ended (``time.perf_counter``)."""
        self.share = SHARE["long"]
        """The share the last slice was owed at."""

    def owed(self, now: float) -> float:
        """Seconds of prefill owed at ``now``."""
        if self.ended is None:
            return 0.0
        return self.credit + (now - self.ended) * self.share / (1 - self.share)

    def next_slice(self, others: bool, ready: bool, shortest: int) -> float | None:
        """How long a slice runs now (``ChunkedPrefill.run``), or None for not now:
        ``others``, whether other sessions decode; ``ready``, whether one of them has a pass
        to run now; ``shortest``, the fewest tokens a waiting prompt has left. ``SLICE_S``
        while none decodes; one layer while they wait (for the hub's trees); while they
        have passes to run, what the prefill is owed, at most ``SLICE_S``."""
        self.share = SHARE["short" if shortest <= LONG else "long"]
        if not others:
            return SLICE_S
        if not ready:
            return 0.0
        owed = self.owed(time.perf_counter())
        return min(SLICE_S, owed) if owed > 0 else None

    def ran(self, started: float) -> float:
        """A slice ran from ``started`` to now: how long it took."""
        now = time.perf_counter()
        owed = self.owed(started) - (now - started)
        self.credit, self.ended = min(SLICE_S, max(-SLICE_S, owed)), now
        return now - started
