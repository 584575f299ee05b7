"""The edge verifier: one process holding the target model, verifying many drafters' trees
in batched forward passes (``targets.engine``), shared out by ``targets.schedule``.

The handshake uses the star's cards, each with its one meaning: a drafter introduces
itself with its DRAFTER_CARD (its drafter, the feature layers it needs, its tree shape), and
the verifier answers with the TARGET_CARD of its target (vocabulary, tokenizer, sizes, step
time), so the drafter checks the target exactly as a hub does. A drafter then OPENs a
session with its prompt; the verifier prefills it, a chunk between two passes so that a
long prompt never holds the other sessions up for long, and answers OPENED with the prompt,
the first token and the prompt's features: what a star target sends its hub. Each PROPOSE is
answered by a COMMIT with the accepted tokens, the bonus token, their features and the
next draft budget ``S_i``. CLOSE ends a session; silence past ``ttl_s`` does too.

The event loop (``starhub.server.loop``, the hub's too) only does I/O and scheduling; the
target's ``EngineCore`` (``targets.core``, the star's core's too) runs every pass and prefill
slice on one engine thread. Each pass starts with every message that has arrived and
verifies what the scheduler picks: it never waits for a slow drafter, drafters draft while
others verify, and messages are read, timed and answered while a pass runs. Sessions live
in the servers' shared table (``starhub.server.sessions``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import torch
import zmq.asyncio

from starhub.server.isolation import Observers, verifier_view
from starhub.server.limits import check_tree
from starhub.server.loop import Server, peer_name
from starhub.server.sessions import SessionTable, check_ids
from starhub.wire.codec import Limits
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Message,
    ObserverCard,
    Open,
    Opened,
    Ping,
    Pong,
    Propose,
    ProtocolError,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import VerifierReport
from starhub.wire.tree import DraftTree
from targets.acceptance import Sampling
from targets.card import feature_dtype, measure_step, on_wire, target_card
from targets.cohort import waits
from targets.core import EngineCore
from targets.cost import PassCost
from targets.engine import VerifyEngine, measure_budget
from targets.phase import Phase, PhaseLog
from targets.schedule import Scheduler, Waiting
from targets.verifier_state import (
    DrafterPeer,
    EdgeSession,
    Pending,
    Prefill,
    VerifierConfig,
    VerifierStats,
)

log = logging.getLogger("starhub.verifier")

TOKEN_BYTES = 64
"""What the verifier holds per session token besides its KV cache: its id, in lists."""
RETRY_AFTER_S = 1.0
"""Told to a drafter turned away because every peer slot holds sessions."""
RECEIVE_BATCH = 1024
"""Messages taken between two passes at most: a peer that keeps the socket full cannot
hold verification up."""


class Verifier(Server):
    """The server loop around an engine: ``VerifyEngine`` for a real model (``for_model``),
    or any object with its methods (the benchmark's emulated engine)."""

    role = "verifier"
    log = log

    def __init__(self, engine, card: TargetCard, config: VerifierConfig,
                 feature_dtype: torch.dtype = torch.float16):
        self.engine = engine
        self.card = card
        self.step_s = card.step_ms / 1e3
        self.core = EngineCore(engine, PassCost(self.step_s))
        """Runs the passes and prefill slices (on ``model_thread``) and learns their cost."""
        self.feature_dtype = feature_dtype
        self.config = config
        self.stats = VerifierStats()
        self.table: SessionTable[EdgeSession, DrafterPeer] = SessionTable(config.ttl_s,
                                                                          config.limits)
        super().__init__(self.table, Limits(config.max_message_bytes), self.stats.errors)
        # no grant larger than a chain the tree checks would pass: a chain drafter's tree
        # of S nodes is S deep
        self.scheduler = Scheduler(config.schedule, config.budget, config.max_batch,
                                   config.nodes, cap=min(config.max_nodes, config.max_depth),
                                   seed=config.seed, cost=self.core.cost)
        self.observers = Observers()
        self.pending: dict[int, Pending] = {}
        self.prefills: dict[int, Prefill] = {}
        """OPENs whose prompts are being prefilled, a slice between two passes, in the
        order they came."""
        self.model_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="verifier-engine",
            initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        """Where every pass and prefill chunk runs: the event loop only does I/O."""
        self.running: set[int] = set()
        """Sessions whose rows (or prefill chunk) the engine thread is running now: one
        closed meanwhile is forgotten by the engine after the pass (``on_engine``)."""
        self.phases = PhaseLog(log, "verifier")
        """Each session's changes of ``phase``, at DEBUG."""

    @classmethod
    def for_model(cls, model, tokenizer, config: VerifierConfig,
                  name: str = "verifier") -> Verifier:
        card = target_card(model, tokenizer, name, measure_step(model))
        if not config.budget:
            config = replace(config, budget=max(measure_budget(model), 2))
        return cls(VerifyEngine(model), card, config, feature_dtype(model))

    def phase(self, tag: int) -> Phase:
        """A session's phase (``targets.phase``), read from where it is held: its prompt
        being prefilled, its tree waiting for a pass or in the one running, or neither."""
        if tag in self.prefills:
            return Phase.PREFILLING
        if tag in self.pending or tag in self.running:
            return Phase.TREE
        return Phase.WAITING if tag in self.table.sessions else Phase.DONE

    # -- the loop ---------------------------------------------------------------------
    def serve(self, ready: Callable[[str], None] = lambda address: None,
              stop: Callable[[], bool] = lambda: False) -> None:
        """Serve until ``stop()`` is true; ``ready`` is told the bound address."""
        asyncio.run(self._serve(ready, stop))

    async def _serve(self, ready: Callable[[str], None], stop: Callable[[], bool]) -> None:
        sock, release = self.bind(self.config.bind, self.config.security)
        log.info("verifier on %s: schedule %s, budget %d tokens, max batch %s, step %.1f ms",
                 self.bound, self.config.schedule, self.config.budget,
                 self.config.max_batch or "auto", 1e3 * self.step_s)
        ready(self.bound)
        try:
            await self.run(sock, self.passes(sock), stop=stop)
        finally:
            self.model_thread.shutdown(wait=False, cancel_futures=True)
            sock.close(0)
            release()

    async def passes(self, sock: zmq.asyncio.Socket) -> None:
        """Verify what is waiting, one pass at a time; each pass starts with every message
        that arrived during the last one. Between two passes, a slice of a prompt's
        prefill runs (``targets.prefill``), so that a long prompt holds the others up by
        about a layer of a chunk's pass at a time."""
        while True:
            await self.receive_ready(sock, RECEIVE_BATCH)
            slice_s = self.core.prefill_slice(list(self.prefills), self._left,
                                              bool(self.scheduler.sessions), bool(self.pending))
            if slice_s is not None:
                await self.prefill_step(slice_s)
                await self.receive_ready(sock, RECEIVE_BATCH)
            if not self.pending:
                if not self.prefills:
                    self.arrived.clear()
                    await self.arrived.wait()
                continue
            if not self.prefills:  # no waiting for more rows while a prompt waits
                waited = time.perf_counter()
                await self.gather()
                self.stats.gather_s += time.perf_counter() - waited
            await self.step()

    async def on_engine(self, tags: list[int], fn: Callable, *args):
        """Run ``fn`` on the engine thread for the sessions ``tags``; a session closed
        meanwhile is forgotten by the engine only once ``fn`` is done with it."""
        self.running.update(tags)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn,
                                                                    *args)
        finally:
            self.running.difference_update(tags)
            for tag in tags:
                if tag not in self.table.sessions:  # closed during the pass
                    self.engine.close(tag)

    async def gather(self) -> None:
        """Wait briefly for the proposals expected within ``gather_fraction`` of a pass
        (``targets.cohort``), so that they share this pass; nobody is waited for once the
        waiting rows fill a pass."""
        def due() -> list[float]:
            return [s.committed_at + s.turnaround.value for t, s in self.table.sessions.items()
                    if t not in self.pending and s.committed_at and s.turnaround.value]

        for wait in waits(time.monotonic(), self.scheduler.pass_s,
                          self.config.gather_fraction, due, time.monotonic):
            if self.scheduler.full([p.waiting for p in self.pending.values()]):
                return
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), wait)
            except TimeoutError:
                return

    def housekeeping(self) -> None:
        self.stats.expired += self.expire()
        self.drop_idle_peers(self.config.peer_grace_s)

    # -- messages ---------------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        """Route one valid message; a PROPOSE waits for a pass (``step``)."""
        if isinstance(msg, DrafterCard):
            self.handle_drafter_card(identity, msg)
        elif isinstance(msg, Open):
            self.handle_open(identity, msg)
        elif isinstance(msg, Propose):
            self.handle_propose(identity, msg)
        elif isinstance(msg, Close):
            self.table.get(msg.tag, identity)
            self.close(msg.tag)
        elif isinstance(msg, Ping):
            self.reply(identity, Pong(nonce=msg.nonce))
        elif isinstance(msg, ObserverCard):  # `starhub status`, the benchmark
            self.observers.add(identity)
            self.reply(identity, self.card)
        elif isinstance(msg, StatsQuery):
            detail = identity in self.table.peers or identity in self.observers
            self.reply(identity, StatsReport(body=verifier_view(self.snapshot(), detail)))
        else:
            raise ProtocolError(ErrorCode.BAD_TYPE,
                                f"a verifier does not accept {msg.TYPE}: drafters send "
                                f"DRAFTER_CARD, OPEN, PROPOSE and CLOSE (is this a hub's address?)",
                                tag=msg.tag)

    def handle_drafter_card(self, identity: bytes, msg: DrafterCard) -> None:
        reason = msg.unfit_for(self.card)
        if reason:
            self.reply(identity, Reject(code=int(ErrorCode.BAD_FIELD), reason=reason))
            return
        reason = self.room_for(identity)
        if reason:
            self.reply(identity, Reject(code=int(ErrorCode.REJECTED), reason=reason,
                                        retry_after_s=RETRY_AFTER_S))
            return
        self.table.join(DrafterPeer(identity=identity, principal=self.principal, card=msg))
        log.info("drafter %s (%s) joined", peer_name(identity), msg.drafter or "?")
        self.reply(identity, self.card)

    def held_bytes(self, tokens: int) -> int:
        """What ``tokens`` more make the verifier hold: the target's KV cache for each at its
        real size (``VerifyEngine.token_bytes``), and their ids."""
        return tokens * (self.engine.token_bytes + TOKEN_BYTES)

    def handle_open(self, identity: bytes, msg: Open) -> None:
        peer = self.table.peer(identity, msg, "DRAFTER_CARD")
        self.table.check_open(identity, len(msg.tokens), self.held_bytes(len(msg.tokens) + 1),
                              msg.ref)
        check_ids(msg.tokens, self.card.vocab_size, msg)
        prompt = msg.tokens.tolist()
        tag = self.table.new_tag()
        sampling = Sampling(msg.temperature, msg.top_p)
        chunks = self.engine.open_chunks(tag, prompt, self.config.prefill_chunk, sampling,
                                         msg.seed, list(peer.card.feature_layers))
        now = time.monotonic()
        # busy while prefilling: it does not expire, and it holds its budget from now on
        self.table.add(EdgeSession(tag=tag, owner=identity, greedy=sampling.greedy,
                                   opened_at=now, last_seen=now, busy=True), len(prompt) + 1,
                       self.held_bytes(len(prompt) + 1))
        self.prefills[tag] = Prefill(identity, msg.ref, prompt, chunks, msg.target_tok_s)
        self.phases.note(tag, Phase.PREFILLING)

    def _left(self, tag: int) -> int:
        """Prompt tokens a prefilling session has still to run."""
        return self.prefills[tag].chunks.left

    async def prefill_step(self, slice_s: float = 0.0) -> None:
        """A slice of a prompt's prefill (``EngineCore.prefill_turn`` says whose;
        ``slice_s``: ``prefill_slice``), its OPENED once the prompt is done."""
        tag = self.core.prefill_turn(list(self.prefills), self._left)
        job = self.prefills[tag]
        started = time.perf_counter()
        try:
            done = await self.on_engine([tag], self.core.prefill, job.chunks, slice_s)
        except Exception:
            log.exception("prefilling a %d-token prompt failed", len(job.prompt))
            self.close(tag)
            self.reply(job.identity, Error(ref=job.ref, code=int(ErrorCode.INTERNAL),
                                           message="prefill failed; see the verifier log"))
            return
        self.stats.prefill_s += time.perf_counter() - started
        if done is None or tag not in self.prefills:  # not done, or closed meanwhile
            return
        del self.prefills[tag]
        first, feats = done
        now = time.monotonic()
        session = self.table.sessions[tag]
        session.busy, session.last_seen = False, now
        self.scheduler.open(tag, now, job.target_tok_s)
        self.stats.opened += 1
        self.reply(job.identity, Opened(
            tag=tag, ref=job.ref, step_ms=1e3 * self.step_s,
            budget=self.scheduler.nodes_for(tag),
            tokens=torch.tensor([*job.prompt, first], dtype=torch.int32),
            features=on_wire(feats, self.feature_dtype)))
        self.phases.note(tag, self.phase(tag))

    def handle_propose(self, identity: bytes, msg: Propose) -> None:
        session = self.table.get(msg.tag, identity)
        if msg.tag in self.prefills:
            raise ProtocolError(ErrorCode.STALE, "this session is not open yet", tag=msg.tag)
        if msg.tag in self.pending:
            raise ProtocolError(ErrorCode.STALE, "a PROPOSE for this session is already waiting",
                                tag=msg.tag)
        if msg.tag in self.running:
            raise ProtocolError(ErrorCode.STALE, "this session's last PROPOSE is being verified",
                                tag=msg.tag)
        if msg.plain:
            raise ProtocolError(ErrorCode.BAD_FIELD, "a verifier takes trees, not plain rounds",
                                tag=msg.tag)
        check_tree(msg.parents, self.config.max_nodes, self.config.max_depth, msg.tag)
        self.table.check_grow(msg.tag, len(msg.tokens) + 1, self.held_bytes(len(msg.tokens) + 1))
        check_ids(msg.tokens, self.card.vocab_size, msg)
        if msg.dist_ids is not None:
            check_ids(msg.dist_ids.reshape(-1), self.card.vocab_size, msg)
        now = time.monotonic()
        session.last_seen = now
        if session.committed_at:  # read as it comes, passes or not
            session.turnaround.update(now - session.committed_at)
        tree = DraftTree(msg.tokens, msg.parents, msg.dist_ids, msg.dist_probs)
        waiting = Waiting(msg.tag, len(tree), self.engine.cached(msg.tag), now,
                          self.scheduler.deadline(msg.tag, now))
        self.pending[msg.tag] = Pending(waiting, tree, msg.seq)
        self.phases.note(msg.tag, Phase.TREE)

    def close(self, tag: int) -> None:
        if self.table.close(tag) is not None:
            self.stats.closed += 1
        self.pending.pop(tag, None)
        self.prefills.pop(tag, None)
        self.scheduler.close(tag)
        if tag not in self.running:  # else once the pass is done with it (``on_engine``)
            self.engine.close(tag)
        self.phases.note(tag, Phase.DONE)

    # -- verification -----------------------------------------------------------------
    async def step(self) -> None:
        """Verify one batch the scheduler picks from what is waiting; COMMIT each row of a
        session still open."""
        picked = self.scheduler.pick([p.waiting for p in self.pending.values()],
                                     time.monotonic())
        batch = [self.pending.pop(w.sid) for w in picked]
        work = [(p.waiting.sid, p.tree) for p in batch]
        try:
            # taught to the cost model here: the scheduler reads it on this thread
            done = await self.on_engine([sid for sid, _ in work],
                                        partial(self.core.verify, work, learn=False))
        except Exception:
            log.exception("verification failed; closing the batch's sessions")
            for p in batch:
                session = self.table.sessions.get(p.waiting.sid)
                if session is not None:
                    self.reply(session.owner, Error(
                        tag=p.waiting.sid, code=int(ErrorCode.INTERNAL),
                        message="verification failed; see the verifier log"))
                self.close(p.waiting.sid)
            return
        self.core.learn(done)
        verdicts, cost, took = done.verdicts, done.stats, done.took
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pass of %d rows feeding %s took %.1f ms; %d left waiting", len(batch),
                      [p.waiting.fed for p in batch], 1e3 * took, len(self.pending))
        done_at = time.monotonic()
        st = self.stats
        st.steps += 1
        st.rows += len(batch)
        st.fed += cost.new_tokens
        st.verify_s += took
        st.batch_hist[len(batch)] += 1
        rows = [(p, verdict) for p, verdict in zip(batch, verdicts, strict=True)
                if p.waiting.sid in self.table.sessions]  # not closed during the pass
        for p, verdict in rows:
            sid = p.waiting.sid
            session = self.table.sessions[sid]
            accepted = len(verdict.path)
            self.scheduler.observe(sid, p.tree.depth, accepted, len(verdict.tokens), done_at,
                                   p.waiting.deadline)
            session.rounds += 1
            session.committed += len(verdict.tokens)
            self.table.grew(sid, len(verdict.tokens), self.held_bytes(len(verdict.tokens)))
            session.committed_at = done_at
            st.rounds += 1
            st.accepted += accepted
            st.committed += len(verdict.tokens)
            if math.isfinite(p.waiting.deadline):
                st.deadlined += 1
                st.late += done_at > p.waiting.deadline
        # budgets only once the whole pass is observed: the S_i these rows draft next come
        # from one split, so their next trees fit one pass together
        for p, verdict in rows:
            sid = p.waiting.sid
            self.reply(self.table.sessions[sid].owner, Commit(
                tag=sid, seq=p.seq, accepted=len(verdict.path), verify_ms=1e3 * took,
                step_ms=1e3 * self.step_s, budget=self.scheduler.nodes_for(sid),
                tokens=torch.tensor(verdict.tokens, dtype=torch.int32),
                features=on_wire(verdict.features, self.feature_dtype)))
            self.phases.note(sid, self.phase(sid))

    def snapshot(self) -> VerifierReport:
        st = self.stats
        wall = time.monotonic() - st.started
        return VerifierReport(
            schedule=self.config.schedule, budget=self.config.budget,
            max_batch=self.config.max_batch, sessions=len(self.table),
            drafters=len(self.table.peers), cached_tokens=self.table.budget.cached,
            steps=st.steps, rounds=st.rounds, committed=st.committed, accepted=st.accepted,
            opened=st.opened, closed=st.closed, expired=st.expired, wall_s=wall,
            verify_s=st.verify_s, gather_s=st.gather_s, prefill_s=st.prefill_s,
            mean_batch=st.rows / st.steps if st.steps else 0.0,
            verify_ms_per_step=1e3 * st.verify_s / st.steps if st.steps else 0.0,
            fed_per_step=st.fed / st.steps if st.steps else 0.0,
            batch_hist={str(k): v for k, v in sorted(st.batch_hist.items())},
            slo_rounds=st.deadlined, slo_late=st.late, errors=dict(st.errors),
            threads=torch.get_num_threads(), step_ms=1e3 * self.step_s,
            scheduler=self.scheduler.snapshot())
