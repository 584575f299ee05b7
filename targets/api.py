"""``attach()``: speculative decoding for a model you have already loaded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from targets.generate import SpeculativeGenerator, encode_prompt
from targets.stats import GenerationResult


class Attached:
    """A loaded HF model and tokenizer, served drafts by a hub, or by the best hub of a pool
    (``hub``: a list, or addresses separated by commas)."""

    def __init__(self, model, tokenizer, hub: str | Sequence[str], name: str = "api",
                 timeout_s: float = 3.0, chat_template: bool = True,
                 shared_cores: str = "auto"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._gen = SpeculativeGenerator(model, tokenizer, hub, name=name, timeout_s=timeout_s,
                                         shared_cores=shared_cores)

    @property
    def connected(self) -> bool:
        return self._gen.client is not None

    def _ids(self, prompt_or_ids: str | list[int]) -> list[int]:
        if isinstance(prompt_or_ids, str):
            return encode_prompt(self.tokenizer, prompt_or_ids, self.chat_template)
        return [int(t) for t in prompt_or_ids]

    def generate(self, prompt_or_ids: str | list[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> GenerationResult:
        """Text, ids and stats; ids are what ``model.generate`` returns after the prompt."""
        return self._gen.generate(self._ids(prompt_or_ids), max_new_tokens, temperature,
                                  top_p, seed)

    def stream(self, prompt_or_ids: str | list[int], max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> Iterator[str]:
        """Yield text pieces as rounds commit them."""
        ids: list[int] = []
        shown = ""
        for chunk in self._gen.stream_ids(self._ids(prompt_or_ids), max_new_tokens,
                                          temperature, top_p, seed):
            ids.extend(chunk)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def attach(model, tokenizer, hub: str | Sequence[str] = "tcp://127.0.0.1:5555",
           **kwargs) -> Attached:
    return Attached(model, tokenizer, hub, **kwargs)
