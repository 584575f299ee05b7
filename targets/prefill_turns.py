"""Which waiting prompt's prefill gets the next chunk, for every target that prefills a
chunk between two passes (the core's requests, the edge verifier's OPENs): in turn the
prompt with the fewest tokens left, so that a short prompt is not queued behind a long one,
and the oldest, so that a stream of short prompts cannot hold a long one up for ever."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class PrefillTurns:
    def __init__(self) -> None:
        self.oldest_turn = False
        """Whether the next chunk goes to the oldest prompt."""

    def pick(self, waiting: Sequence[T], left: Callable[[T], int]) -> T:
        """The prompt to prefill a chunk of now, of ``waiting`` (oldest first), each with
        ``left(prompt)`` tokens still to prefill."""
        self.oldest_turn = not self.oldest_turn
        return waiting[0] if self.oldest_turn else min(waiting, key=left)
