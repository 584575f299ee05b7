"""The target's decoding loop: prefill, OPEN, then PROPOSE -> verify -> COMMIT until done.

If the hub rejects us, never answers, or fails a session, decoding carries on alone from
the same state, so the output is the same either way; only the speed differs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from starhub.client.connection import HubClient, HubError, HubUnavailable
from starhub.client.round_stats import clip_output, count_round, mean_accept_len
from starhub.control.estimators import Ema
from starhub.cores import CoreClock
from starhub.models.devices import model_device
from starhub.models.prompts import encode_prompt  # noqa: F401  (re-exported)
from starhub.options import AUTO
from starhub.wire.messages import (
    Close,
    Commit,
    ErrorCode,
    Open,
    Propose,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import PeerEntry, PeerReport
from starhub.wire.tree import DraftTree
from targets.acceptance import Sampling
from targets.card import eos_ids, feature_dtype, measure_step, on_wire, target_card
from targets.hub_link import HubLink, check_propose
from targets.verify import TargetModel

log = logging.getLogger("starhub.target")


@dataclass
class GenerationStats:
    rounds: int = 0
    new_tokens: int = 0
    mean_accept_len: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    hub_wait_s: float = 0.0
    """Round trips to the hub: ``hub_queue_s + hub_draft_s + comm_s``."""
    hub_queue_s: float = 0.0
    hub_draft_s: float = 0.0
    comm_s: float = 0.0
    plain_rounds: int = 0
    """Rounds in which the hub found no tree worth drafting and the target decoded alone."""
    plain_tokens: int = 0
    plain_s: float = 0.0
    step_ms: float = 0.0
    """This target's measured one-token step: its standalone speed is 1000 / step_ms."""
    started_at: float = 0.0
    """Wall-clock start (time.time()), to line up several targets' runs."""
    threads: int = 0
    tree_nodes: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    accept_len_hist: dict[str, int] = field(default_factory=dict)
    standalone: bool = False
    note: str = ""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stats: GenerationStats

    def to_json(self, id_: object = None) -> dict:
        return {"id": id_, "prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                "text": self.text, "stats": asdict(self.stats)}


class SpeculativeGenerator:
    """Decodes with a hub when one is reachable and willing, and on its own otherwise."""

    _refs = itertools.count(1)

    def __init__(self, model, tokenizer, hub: str | None = None, name: str = "target",
                 timeout_s: float = 3.0, client_options: dict | None = None,
                 shared_cores: str = AUTO):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.hub = hub
        self.eos = eos_ids(model)
        self.clock = CoreClock.for_target(model_device(model).type == "cpu", bool(hub),
                                          shared_cores)
        """Times plain steps; alone (by CPU time) while the hub shares our cores."""
        self.steps = Ema(measure_step(model, clock=self.clock) if hub else None, alpha=0.1)
        """The plain step, measured at start and refined by each step taken."""
        self.wire_dtype = feature_dtype(model)
        self.link = HubLink(hub, self.card, self.clock, name, timeout_s,
                            client_options) if hub else None
        """The hub connection; ``timeout_s`` is the floor of its reply deadline."""
        if self.link is not None:
            self.link.connect()

    @property
    def client(self) -> HubClient | None:
        return self.link.client if self.link is not None else None

    @property
    def note(self) -> str:
        """Why this generator decodes without a hub, if it does."""
        return self.link.note if self.link is not None else ""

    @property
    def step_s(self) -> float:
        return self.steps.get(0.0)

    def card(self) -> TargetCard:
        return target_card(self.model, self.tokenizer, self.name, self.step_s)

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
        """Yield each round's newly committed ids; ``stats`` is filled in as it goes."""
        stats = stats if stats is not None else GenerationStats()
        client = self.link.current() if self.link is not None else None
        layers = list(self.link.card.feature_layers) if client is not None else []
        stats.started_at, stats.threads = time.time(), torch.get_num_threads()
        start = time.perf_counter()
        target = TargetModel(self.model, Sampling(temperature, top_p), seed, layers)
        first, feats = target.prefill(list(prompt_ids))
        stats.prefill_s = time.perf_counter() - start
        produced = 0

        def finishes(chunk: list[int]) -> bool:
            return produced + len(chunk) >= max_new_tokens or any(t in self.eos for t in chunk)

        rounds = self._rounds(client, target, prompt_ids, first, feats, temperature, top_p,
                              seed, stats, finishes)
        for chunk in itertools.chain([[first]], rounds):
            last = finishes(chunk)
            chunk = clip_output(chunk, max_new_tokens - produced, self.eos)
            produced += len(chunk)
            if chunk:
                yield chunk
            if last:
                break
        stats.new_tokens = produced
        stats.wall_s = time.perf_counter() - start
        stats.tokens_per_s = produced / max(stats.wall_s, 1e-9)
        stats.mean_accept_len = mean_accept_len(stats)
        stats.standalone = stats.rounds == 0 and stats.plain_rounds == 0
        stats.note = stats.note or (self.note if client is None else "")
        stats.step_ms = 1e3 * self.step_s
        self._split_hub_wait(stats)

    _peer_totals: PeerEntry | None = None

    def _split_hub_wait(self, stats: GenerationStats) -> None:
        """Split the round trips into the hub's queueing and drafting for us (its own
        account, from STATS) and communication, the rest."""
        client = self.client
        if client is None or not stats.rounds or stats.note:
            return
        try:
            reply = client.request(StatsQuery(peer=True))
        except (HubUnavailable, HubError):
            return
        body = reply.body if isinstance(reply, StatsReport) else None
        totals = body.peer if isinstance(body, PeerReport) else None
        if totals is None:
            return
        before = self._peer_totals or PeerEntry()
        self._peer_totals = totals
        stats.hub_queue_s = totals.queue_s - before.queue_s
        stats.hub_draft_s = totals.draft_s - before.draft_s
        stats.comm_s = max(0.0, stats.hub_wait_s - stats.hub_queue_s - stats.hub_draft_s)

    def _rounds(self, client: HubClient | None, target: TargetModel, prompt_ids: list[int],
                first: int, feats: torch.Tensor | None, temperature: float, top_p: float,
                seed: int, stats: GenerationStats, finishes: Callable[[list[int]], bool]
                ) -> Iterator[list[int]]:
        """Rounds with the hub while it serves us; then plain steps forever (caller stops).

        A round's COMMIT leaves as soon as its tokens are known, unless they end the request;
        the cache compaction and the caller's handling of the tokens then overlap the hub's
        drafting of the next tree. A hub that misses its deadline or sends an invalid
        PROPOSE is dropped (and reconnected in the background); one that answers ERROR for
        this session just stops serving it."""
        if client is not None:
            tag = 0
            try:
                opening = self.link.opening([*prompt_ids, first], len(prompt_ids),
                                            Sampling(temperature, top_p), seed, self.step_s,
                                            on_wire(feats, self.wire_dtype))
                client, reply = self._open(client, opening, stats)
                tag = reply.tag
                while True:
                    check_propose(reply, self.model.config.vocab_size)
                    if reply.plain:
                        commit = yield from self._plain_round(target, reply, stats, finishes)
                        if commit is None:
                            return
                        t0 = time.perf_counter()
                        client.send(commit)
                        reply = self._await(client, stats, t0, tag=tag, after=reply.seq)
                        continue
                    tree = DraftTree(reply.tokens, reply.parents, reply.dist_ids,
                                     reply.dist_probs)
                    t0 = time.perf_counter()
                    verdict = target.verify(tree)
                    verified = time.perf_counter() - t0
                    stats.verify_s += verified
                    count_round(stats, len(verdict.path), len(tree))
                    if finishes(verdict.tokens):
                        yield verdict.tokens
                        return
                    t0 = time.perf_counter()
                    client.send(Commit(tag=tag, seq=reply.seq, accepted=len(verdict.path),
                                       verify_ms=1e3 * verified, step_ms=1e3 * self.step_s,
                                       tokens=torch.tensor(verdict.tokens, dtype=torch.int32),
                                       features=on_wire(verdict.features, self.wire_dtype)))
                    target.compact()
                    yield verdict.tokens
                    reply = self._await(client, stats, t0, tag=tag, after=reply.seq)
            except HubUnavailable as exc:
                self.link.failed(str(exc))
                stats.note = str(exc)
                tag = 0
            except HubError as exc:
                log.warning("%s: %s; finishing this request on its own", self.name, exc)
                stats.note = str(exc)
            finally:
                if tag and self.link.client is client:
                    with contextlib.suppress(HubUnavailable):
                        client.send(Close(tag=tag))
        while True:
            yield [self._step(target)]

    def _step(self, target: TargetModel) -> int:
        """One plain step, timed: the step time tells the hub our standalone speed (alone,
        while the hub shares our cores)."""
        self.clock.start()
        token = target.step()
        took = self.clock.lap()[1]
        self.steps.update(took)
        return token

    def _plain_round(self, target: TargetModel, reply: Propose, stats: GenerationStats,
                     finishes: Callable[[list[int]], bool]) -> Iterator[list[int]]:
        """Decode ``reply.plain`` tokens alone, yielding each; return their COMMIT, or None
        when they end the request (the last round is never committed)."""
        start = time.perf_counter()
        tokens: list[int] = []
        feats: list[torch.Tensor] = []
        for _ in range(reply.plain):
            token = self._step(target)
            if finishes([token]):
                yield [token]
                return None
            tokens.append(token)
            if target.step_features is not None:
                feats.append(target.step_features)
            yield [token]
        took = time.perf_counter() - start
        stats.plain_rounds += 1
        stats.plain_tokens += len(tokens)
        stats.plain_s += took
        return Commit(tag=reply.tag, seq=reply.seq, accepted=0, verify_ms=1e3 * took,
                      step_ms=1e3 * self.step_s, tokens=torch.tensor(tokens, dtype=torch.int32),
                      features=on_wire(torch.cat(feats), self.wire_dtype) if feats else None)

    def _open(self, client: HubClient, msg: Open, stats: GenerationStats
              ) -> tuple[HubClient, Propose]:
        """OPEN a session. A hub that has forgotten us (it frees the slot of a target
        that held no session for a while, or it restarted) gets our card again first."""
        for attempt in range(2):
            msg.ref = next(self._refs)
            try:
                t0 = time.perf_counter()
                client.send(msg)
                return client, self._await(client, stats, t0, ref=msg.ref)
            except HubError as exc:
                if attempt or exc.error.code != ErrorCode.NO_CARD:
                    raise
                if not self.link.rejoin():
                    raise HubUnavailable(self.note) from None
                client = self.link.current()
        raise AssertionError("unreachable")

    def _await(self, client: HubClient, stats: GenerationStats, sent_at: float, tag: int = 0,
               ref: int = 0, after: int = -1) -> Propose:
        """The PROPOSE answering what we just sent; replays of earlier rounds (``seq`` not
        past ``after``) are dropped, never applied twice."""
        while True:
            reply = client.reply_for(tag=tag, ref=ref)
            if not isinstance(reply, Propose):
                raise HubUnavailable(f"expected PROPOSE, got {reply.TYPE}")
            if reply.seq > after:
                break
            log.debug("%s: dropping a stale PROPOSE (seq %d)", self.name, reply.seq)
        took = time.perf_counter() - sent_at
        stats.hub_wait_s += took
        self.link.observe(took)
        return reply

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

