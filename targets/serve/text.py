"""Token ids to the text a client sees: incremental detokenization with stop strings.

The text is always the tokenizer's decoding of every id so far (special tokens skipped),
so the streamed pieces add up to exactly what a non-streamed response holds. A piece is
held back while it ends in a partial character or could be the start of a stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = stops or []
        self.ids: list[int] = []
        self.text = ""
        self.shown = 0
        """Characters of ``text`` already handed out."""
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        """Take new ids; return the text that may be shown now. Once a stop string appears,
        ``stopped`` is set and the text ends before it."""
        if self.stopped or not tokens:
            return ""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return ""
        self.text = text
        hold = 0
        for stop in self.stops:
            at = text.find(stop, max(0, self.shown - len(stop) + 1))
            if at >= 0:
                self.text, self.stopped = text[:at], True
                return self._take(len(self.text))
            hold = max(hold, len(stop) - 1)
        return self._take(max(self.shown, len(text) - hold))

    def flush(self) -> str:
        """The rest, when the request has ended."""
        return "" if self.shown >= len(self.text) else self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return piece
