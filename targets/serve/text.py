"""Token ids to the text a client sees: incremental detokenization with stop strings.

The text is the tokenizer's decoding of every id so far (special tokens skipped), so the
streamed pieces add up to exactly what a non-streamed response holds. It is built a push
at a time at constant work per token: each push decodes only its new ids with the ids of
the push before as context, and keeps what that decoding adds to the context's own (as
vLLM does); where the two disagree on the context, the whole is decoded again. A piece is
held back while it ends in a partial character or could be the start of a stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = stops or []
        self.ids: list[int] = []
        self.text = ""
        self.context = 0
        """Where the ids that the next push decodes as context begin."""
        self.read = 0
        """The ids that ``text`` holds the decoding of."""
        self.shown = 0
        """Characters of ``text`` already handed out."""
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        """Take new ids; return the text that may be shown now. Once a stop string appears,
        ``stopped`` is set and the text ends before it."""
        if self.stopped or not tokens:
            return ""
        self.ids.extend(tokens)
        text = self._decode_new()
        if text is None:  # a character split across tokens: wait for the rest
            return ""
        self.text = text
        if (at := self._first_stop(text)) is not None:
            self._stop(text, at)
            return self._take(len(self.text))
        hold = max((len(stop) - 1 for stop in self.stops), default=0)
        return self._take(max(self.shown, len(text) - hold))

    def _stop(self, text: str, at: int) -> None:
        """End the text where a stop string starts, and keep only the ids up to the one that
        completed it: a round can commit several tokens, and those after the stop string
        were never part of the answer (``usage`` and ``token_ids`` count what is kept)."""
        self.text, self.stopped = text[:at], True
        stop = min((s for s in self.stops if text.startswith(s, at)), key=len)
        keep = len(self.ids)
        while keep > 1 and self._decode(keep - 1).startswith(text[:at] + stop):
            keep -= 1
        del self.ids[keep:]

    def _decode_new(self) -> str | None:
        """The text of every id, from ``text`` and a decoding of the new ids beside the
        context; None while it ends in a partial character."""
        decode = self.tokenizer.decode
        window = decode(self.ids[self.context:], skip_special_tokens=True)
        if window.endswith("\ufffd"):
            return None
        known = decode(self.ids[self.context:self.read], skip_special_tokens=True)
        if window.startswith(known):
            text = self.text + window[len(known):]
        else:  # the new ids changed how the context reads: decode everything
            text = decode(self.ids, skip_special_tokens=True)
        self.context, self.read = self.read, len(self.ids)
        return text

    def _decode(self, count: int) -> str:
        return self.tokenizer.decode(self.ids[:count], skip_special_tokens=True)

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in the text not yet shown (or None)."""
        hits = [at for stop in self.stops
                if (at := text.find(stop, max(0, self.shown - len(stop) + 1))) >= 0]
        return min(hits, default=None)

    def flush(self) -> str:
        """The rest, when the request has ended: the decoding of every id, a trailing
        partial character included, up to a stop string if one appears."""
        if not self.stopped and self.ids:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if (at := self._first_stop(self.text)) is not None:
                self._stop(self.text, at)
        return "" if self.shown >= len(self.text) else self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return piece
