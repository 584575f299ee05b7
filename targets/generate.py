"""The star target's front end (``starhub target``, ``attach()``): each prompt is a request
of the target core (``targets.batcher``), which owns the model, the hub link and the
rounds. Prompts asked for one after another decode one at a time, as the star's targets do;
prompts asked for from several threads at once share its passes.

If the hub rejects us, never answers, or fails a session, decoding carries on alone from
the same state, so the output is the same either way; only the speed differs.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from dataclasses import fields

from starhub.client.connection import HubClient
from starhub.models.prompts import encode_prompt  # noqa: F401  (re-exported)
from starhub.options import AUTO
from starhub.wire.messages import TargetCard
from starhub.wire.reports import PeerEntry
from targets.acceptance import Sampling
from targets.batcher import Batcher, Event, Request
from targets.stats import GenerationResult, GenerationStats

WAIT_S = 600.0
"""The longest wait for the core's next event: past it the core counts as stuck."""


class SpeculativeGenerator:
    """Decodes with a hub when one is reachable and willing, and on its own otherwise."""

    def __init__(self, model, tokenizer, hub: str | Sequence[str] | None = None,
                 name: str = "target", timeout_s: float = 3.0,
                 client_options: dict | None = None, shared_cores: str = AUTO):
        self.tokenizer = tokenizer
        self.core = Batcher(model, tokenizer, hub, name=name, timeout_s=timeout_s,
                            client_options=client_options, shared_cores=shared_cores,
                            decode_ahead=False)
        self.core.start()
        self._peer_totals: PeerEntry | None = None
        self._peer_hub = ""
        """The hub ``_peer_totals`` came from (a pool's target may move between requests)."""

    @property
    def link(self):
        return self.core.link

    @property
    def client(self) -> HubClient | None:
        return self.link.client if self.link is not None else None

    @property
    def note(self) -> str:
        """Why this generator decodes without a hub, if it does."""
        return self.link.note if self.link is not None else ""

    @property
    def step_s(self) -> float:
        return self.core.step_s

    def card(self) -> TargetCard:
        return self.core.card()

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> GenerationResult:
        stats = GenerationStats()
        output: list[int] = []
        for chunk in self.stream_ids(prompt_ids, max_new_tokens, temperature, top_p, seed, stats):
            output.extend(chunk)
        text = self.tokenizer.decode(output, skip_special_tokens=True)
        return GenerationResult(list(prompt_ids), output, text, stats)

    def stream_ids(self, prompt_ids: list[int], max_new_tokens: int = 128,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                   stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """Yield each round's newly committed ids; ``stats`` is filled in at the end.
        Leaving early cancels the request (its hub session closes)."""
        stats = stats if stats is not None else GenerationStats()
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        rid = self.core.submit(Request(prompt=list(prompt_ids), max_tokens=max_new_tokens,
                                       sampling=Sampling(temperature, top_p), seed=seed,
                                       sink=inbox.put))
        done = False
        try:
            while not done:
                try:
                    event = inbox.get(timeout=WAIT_S)
                except queue.Empty:
                    raise RuntimeError(f"the target core sent nothing for {WAIT_S:.0f} s"
                                       ) from None
                done = bool(event.done)
                if event.done == "error":
                    raise RuntimeError(event.error)
                if event.stats is not None:
                    for f in fields(GenerationStats):
                        setattr(stats, f.name, getattr(event.stats, f.name))
                    self._split_hub_wait(stats)
                if event.tokens:
                    yield event.tokens
        finally:
            if not done:
                self.core.cancel(rid)

    def _split_hub_wait(self, stats: GenerationStats) -> None:
        """Split the round trips into the hub's queueing and drafting for us (its own
        account, from STATS) and communication, the rest."""
        if not stats.rounds or stats.note:
            return
        totals = self.core.hub_totals()
        if totals is None:
            return
        before = self._peer_totals or PeerEntry()
        self._peer_totals = totals
        if stats.hub != self._peer_hub:  # a hub of a pool it had not used: its own count
            self._peer_hub, before = stats.hub, PeerEntry()
        stats.hub_queue_s = totals.queue_s - before.queue_s
        stats.hub_draft_s = totals.draft_s - before.draft_s
        stats.comm_s = max(0.0, stats.hub_wait_s - stats.hub_queue_s - stats.hub_draft_s)

    def close(self) -> None:
        self.core.stop()
