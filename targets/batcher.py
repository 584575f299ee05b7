"""The target core: continuous batching under every star-side front end (``starhub
target`` and ``attach()`` through ``targets.generate``, ``starhub serve`` through
``targets.serve.app``). Every request in flight is a session of one ``VerifyEngine`` and,
while a hub serves this process, a session of its own at the hub.

One engine thread owns the model (through an ``EngineCore``, ``targets.core``, which runs
its passes and prefill slices) and the hub connection. Each turn of its loop:

1. takes in new requests and drops cancelled ones (their hub session is CLOSEd at once);
2. runs a slice of a new prompt's prefill (``targets.prefill``: the shortest and the
   oldest prompt in turn; while other requests decode, one decoder layer whenever none
   of them has a pass to run, and otherwise a share of the time); a finished prefill
   emits the first token and OPENs the request's hub session, so a long prompt never
   holds the others up for more than a slice (one layer, or up to 50 ms); where plain
   batching serves the batch faster (``gate``), the batch decodes plain instead, and its
   requests open hub sessions when a later verdict says trees (a newcomer's, or one on the
   rows a finished request leaves), carrying what they decoded meanwhile. A request
   decodes plain from its OPEN until its first tree comes, never idle for the hub
   (``decode_ahead``; the star target's wait for it);
3. reads the hub's replies: a PROPOSE gives a request its tree (or a number of plain steps),
   or, where it decoded on meanwhile, is settled by the tokens it decoded since
   (``_catch_up``); an ERROR, or a hub past its deadline, sends the request on alone;
4. verifies, in one forward pass, every request that has something to verify: a hub tree,
   or a plain step (an empty tree) when the hub said plain or there is no hub. A request
   joins or leaves between passes, and a pass never waits for a batch to fill, only,
   briefly, for the rest of the trees the hub is drafting for the requests of the last pass;
5. emits each request's new tokens, then COMMITs them to the hub, or CLOSEs the session
   when the request is done.

The hub drafts the trees of all our sessions in one batch, as it does for many targets.
Whatever the hub does, each request's tokens are the target's own (``targets.verify``), so
the output is the same with or without it, whatever else is in the batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import torch

from starhub.client.connection import HubClient, HubUnavailable
from starhub.client.round_stats import clip_output, count_round, mean_accept_len
from starhub.cores import CoreClock
from starhub.models.devices import model_device
from starhub.options import AUTO
from starhub.wire.messages import (
    Close,
    Commit,
    Error,
    ErrorCode,
    Message,
    Open,
    Propose,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import PeerEntry, PeerReport
from starhub.wire.tree import DraftTree, accepted_path, subtree
from targets.acceptance import Sampling
from targets.calibration import ROWS, TREE_NODES, calibrate
from targets.card import eos_ids, feature_dtype, measure_step, on_wire, target_card
from targets.cohort import waits
from targets.core import EngineCore
from targets.cost import PassCost
from targets.engine import VerifyEngine
from targets.gate import BATCH_MARGIN, COALESCE, PRIOR_TAU, Decision, SpeculationGate
from targets.hub_link import HubLink, check_propose
from targets.phase import Phase, PhaseLog
from targets.prefill import ChunkedPrefill
from targets.stats import GenerationStats
from targets.verify import TokenLogprob, Verdict

log = logging.getLogger("starhub.target")

EMPTY_TREE = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32))
"""A plain step in a batched pass: the root alone, whose next token is the bonus."""

Sink = Callable[["Event"], None]


@dataclass
class Event:
    """What the engine thread tells a request: new ``tokens``, then one with ``done`` set
    (``stop``: end of sequence; ``length``: max_tokens; ``error``: see ``error``)."""

    tokens: list[int] = field(default_factory=list)
    done: str = ""
    error: str = ""
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per token, where the request asked for them."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt tokens' (None for the first), in the first event of an ``echo``."""


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    logprobs: int | None = None
    """None: no log-probabilities; else each token's, and this many of the likeliest."""
    echo: bool = False
    """With ``logprobs``: the prompt tokens' too, in the first event."""
    sink: Sink = print
    """Called on the engine thread with each ``Event``: it must not block."""
    rid: int = 0


@dataclass(eq=False)
class Slot:
    """A request in flight: equal to itself only. Its repr leaves out its tensors (a
    history's repr takes milliseconds a token)."""

    req: Request
    stats: GenerationStats
    prefill: ChunkedPrefill | None = None
    """Its prompt's prefill, once begun."""
    decoding: bool = False
    client: HubClient | None = None
    """The connection its hub session lives on (None: it decodes alone)."""
    tag: int = 0
    ref: int = 0
    seq: int = -1
    waiting_since: float | None = None
    """When it sent what the hub must answer (OPEN or COMMIT), until the answer comes."""
    busy_mark: float = 0.0
    """The engine's busy seconds (``EngineCore.busy_s``) when it sent that."""
    cohort: int = 0
    """The pass whose COMMIT it waits on: the hub drafts a pass's trees together."""
    opening: Open | None = field(default=None, repr=False)
    """Its OPEN, until the hub answers it: sent again (once) if the hub had forgotten us."""
    reopened: bool = False
    tree: DraftTree | None = field(default=None, repr=False)
    plain_left: int = 0
    plain_tokens: list[int] = field(default_factory=list)
    plain_feats: list[torch.Tensor] = field(repr=False, default_factory=list)
    plain_started: float = 0.0
    ahead: bool = False
    """It decodes plain while its hub session catches up: from its OPEN until the hub's
    proposals reach what it decoded meanwhile, which ``plain_tokens`` and ``plain_feats``
    hold (``Batcher._catch_up``). A request never idles for the hub's prefill."""
    lag: Propose | None = field(default=None, repr=False)
    """The hub's proposal for where the request was, while it is ``ahead``."""
    output: list[int] = field(default_factory=list)
    """The tokens emitted so far (a mid-stream OPEN carries them)."""
    history: list[torch.Tensor] | None = field(default=None, repr=False)
    """The features of every token fed so far (the prompt's, then each pass's), as sent to
    the hub, while it may draft for the request: with them the request can open a hub
    session mid-stream after decoding plain (``Batcher._take_up_trees``). None once no
    hub can (it was lost, or the request began without one). They grow with the request, as
    its cache does, by the drafter's hidden states a token (on the embedded model, 1 KiB
    where the cache takes 23 to 46)."""

    @property
    def produced(self) -> int:
        return len(self.output)

    released: bool = False

    @property
    def phase(self) -> Phase:
        """Its phase, read from its fields in this one order (a tree to verify outranks
        the rest, as ``_catch_up`` may leave one while the request decodes ahead)."""
        if self.released:
            return Phase.DONE
        if not self.decoding:
            return Phase.PREFILLING
        if self.tree is not None:
            return Phase.TREE
        if self.plain_left:
            return Phase.PLAIN_ROUND
        if self.ahead:
            return Phase.AHEAD
        return Phase.ALONE if self.client is None else Phase.WAITING

    @property
    def ready(self) -> bool:
        """Has something to verify in the next pass."""
        return self.phase in (Phase.TREE, Phase.PLAIN_ROUND, Phase.AHEAD, Phase.ALONE)


@dataclass
class BatcherStats:
    """Totals since start, read by the server's metrics (plain ints: reads need no lock)."""

    passes: int = 0
    rows: int = 0
    """Requests verified, summed over passes: ``rows / passes`` is the mean verify batch."""
    rounds: int = 0
    """Rounds that verified a hub tree."""
    committed: int = 0
    """Tokens those rounds produced, bonus included: ``committed / rounds`` is τ."""
    plain_steps: int = 0
    caught_up: int = 0
    """Hub proposals that came after their request had decoded on (``Batcher._catch_up``):
    the tokens it decoded settled them, or the nodes below those were verified."""
    gated: int = 0
    """Requests sent on alone because plain batching served their batch faster."""
    tokens: int = 0
    running: int = 0
    waiting: int = 0
    last_batch: int = 0


class Batcher:
    """Serves ``Request``s on ``model`` from one engine thread, with drafts from the hub at
    ``hub`` when there is one (``None``: decode alone, still batched)."""

    _refs = itertools.count(1)

    def __init__(self, model, tokenizer, hub: str | Sequence[str] | None = None,
                 name: str = "serve", timeout_s: float = 3.0, prefill_chunk: int = 0,
                 client_options: dict | None = None, speculate: str = "auto",
                 shared_cores: str = AUTO, decode_ahead: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.hub = hub
        self.name = name
        self.prefill_chunk = prefill_chunk
        """Prompt tokens a prefill pass takes (0: ``targets.prefill.CHUNK``)."""
        self.decode_ahead = decode_ahead
        """Whether a request decodes plain from its OPEN until its first tree comes (a
        server's requests never idle for the hub), or waits for that tree (the star
        target's: its hub's control plane judges its rounds from the first)."""
        self.client_options = client_options or {}
        self.eos = eos_ids(model)
        self.wire_dtype = feature_dtype(model)
        self.vocab_size = model.config.vocab_size
        self.clock = CoreClock.for_target(model_device(model).type == "cpu", bool(hub),
                                          shared_cores)
        """Times passes, and alone (by CPU time) while the hub shares our cores: the gate
        weighs trees as they run against plain passes as they would run without the hub."""
        self._gate_open: bool | None = None
        """The gate's last verdict on a batch of more than one request (``_log_verdict``)."""
        self.step_s = measure_step(model, clock=self.clock) if hub else 0.0
        self.core = EngineCore(VerifyEngine(model), PassCost(self.step_s), self.clock)
        """Runs the passes and prefill slices, and learns what a pass costs here from them."""
        self.engine, self.cost = self.core.engine, self.core.cost
        self.gate = SpeculationGate(self.cost, margin=BATCH_MARGIN if speculate == "auto" else 0) \
            if hub else None
        """Whether a request should use the hub at today's batch (``--speculate``)."""
        if self.gate is not None:
            self._calibrate()
        self.stats = BatcherStats()
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._cancelled: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._questions: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._asked: list[Future] = []
        """Callers of ``hub_totals`` whose STATS_QUERY the hub has yet to answer."""
        self._asked_on: HubClient | None = None
        """The connection that STATS_QUERY went on."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._slots: dict[int, Slot] = {}
        self._new: list[Slot] = []
        """Requests whose prompts are prefilled, a slice a turn, oldest first."""
        self._rids = itertools.count(1)
        self._phases = PhaseLog(log, name, "request", arrows=2)
        """Each request's phase at the end of the last turn (``_log_phases``)."""
        self._rows_seen = 0
        self.failed = ""
        """Why the engine thread stopped, if it failed: the server then refuses requests."""
        self.link = HubLink(hub, self.card, self.clock, name, timeout_s,
                            client_options) if hub else None
        if self.link is not None:
            self.link.connect()
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)

    def _calibrate(self) -> None:
        """Time passes over throwaway sessions for the cost model (``targets.calibration``)."""
        start = time.perf_counter()
        timed = calibrate(self.core, self.vocab_size)
        widths = "/".join(map(str, ROWS))
        log.info("%s: passes at %s rows take %s ms plain, %s ms with %d-node trees "
                 "(timed in %.1f s)", self.name, widths,
                 "/".join(f"{1e3 * timed[r, 0]:.0f}" for r in ROWS),
                 "/".join(f"{1e3 * timed[r, TREE_NODES[-1]]:.0f}" for r in ROWS),
                 TREE_NODES[-1], time.perf_counter() - start)

    # -- the outside's side (any thread) ----------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> int:
        """Queue a request; its events go to ``req.sink``. Returns its id, for ``cancel``.
        A request that finds the engine stopped gets its error event at once."""
        req.rid = next(self._rids)
        if self._thread.ident is not None and not self._thread.is_alive():
            req.sink(Event(done="error", error=self.failed or "the server is shutting down"))
            return req.rid
        self._inbox.put(req)
        self._wake.set()
        return req.rid

    def cancel(self, rid: int) -> None:
        """Stop a request (its client went away): its sessions here and at the hub end at
        the engine thread's next turn; it gets no more events."""
        self._cancelled.put(rid)
        self._wake.set()

    def hub_totals(self, timeout_s: float = 2.0) -> PeerEntry | None:
        """This process's totals by the hub's own account (rounds, and the time it spent
        queueing and drafting for us), asked on the engine thread's connection; None when
        no hub answers in ``timeout_s``."""
        if self.link is None or not self._thread.is_alive():
            return None
        answer: Future = Future()
        self._questions.put(answer)
        self._wake.set()
        try:
            return answer.result(timeout_s)
        except FutureTimeout:
            answer.cancel()
            return None

    @property
    def hub_connected(self) -> bool:
        return self.link is not None and self.link.client is not None

    def card(self) -> TargetCard:
        """What this target tells a hub about itself."""
        return target_card(self.model, self.tokenizer, self.name, self.step_s)

    @property
    def pass_s(self) -> float:
        """A pass's seconds, on average (a guess before the first)."""
        return self.cost.mean.get(0.05)

    @property
    def active(self) -> int:
        return len(self._slots)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self.link is not None:
            self.link.close()

    # -- the hub connection -----------------------------------------------------------
    def _client(self) -> HubClient | None:
        """The connection new sessions open on. A move to another hub of the pool is
        taken up when no session is open or a new request is about to begin (a session
        boundary); sessions on the hub moved away from finish there (``HubLink.retiring``),
        and that connection closes when the last one ends. Sessions on a connection the
        link dropped go on alone."""
        if self.link is None:
            return None
        move = all(s.client is None for s in self._slots.values()) or any(
            s.prefill is None for s in self._new)  # idle, or a request about to begin
        client = self.link.current(move)
        kept = {client, *self.link.retiring}
        for slot in self._slots.values():
            if slot.client is not None and slot.client not in kept:
                self._alone(slot, "the hub connection was replaced")
        self.link.retire({s.client for s in self._slots.values()})
        if self._asked and self._asked_on is not client:  # asked a hub we no longer use
            for answer in self._asked:
                _answer(answer, None)
            self._asked = []
        return client

    def _send(self, slot: Slot, msg: Message) -> bool:
        try:
            slot.client.send(msg)
            return True
        except HubUnavailable as exc:
            self._lost(str(exc), slot.client)
            return False

    def _lost(self, reason: str, client: HubClient | None = None) -> None:
        """A hub missed a deadline or broke the protocol on ``client`` (None: the link's
        connection): the requests whose sessions it holds go on alone. Where it is the
        link's, the requests keeping features for a later session stop, and the link
        reconnects in the background for the requests that come next; where it is a hub
        moved away from (``HubLink.retiring``), that connection is closed."""
        link = self.link
        if link is None:
            return
        if client is not None and client is not link.client:  # moved away from, or dropped
            for slot in self._slots.values():
                if slot.client is client:
                    self._alone(slot, reason, close=False)
            link.retire({s.client for s in self._slots.values()})
            return
        if link.client is not None:
            link.failed(reason)
        for slot in self._slots.values():
            if (slot.client is not None and slot.client not in link.retiring) or (
                    slot.client is None and slot.history is not None):
                self._alone(slot, reason, close=False)

    def _alone(self, slot: Slot, reason: str, close: bool = True, keep: bool = False) -> None:
        """The request decodes on its own from here; its hub session is closed if it had
        one and the connection still stands. ``keep``: it keeps its features, so that it
        can open a hub session again (``_take_up_trees``); otherwise it never uses the hub
        again."""
        if slot.client is not None and close and slot.tag:
            with contextlib.suppress(HubUnavailable):
                slot.client.send(Close(tag=slot.tag))
        log.debug("%s: request %d goes on alone: %s", self.name, slot.req.rid, reason)
        slot.stats.note = slot.stats.note or reason
        if slot.plain_left:  # the hub's plain round: finish it as plain steps
            slot.plain_left = 0
        slot.client, slot.tag, slot.tree, slot.waiting_since = None, 0, None, None
        slot.opening, slot.ahead, slot.lag = None, False, None
        if not keep:
            self._features_off(slot)
        slot.plain_tokens, slot.plain_feats = [], []

    def _features_off(self, slot: Slot) -> None:
        """No hub reads this request's features any more: its passes stop keeping them
        (a prefill still under way too: it checks before each chunk)."""
        slot.history = None
        target = self.engine.sessions.get(slot.req.rid)
        if target is not None:
            target.feature_layers = []

    def _read_hub(self, client: HubClient | None, wait_s: float) -> None:
        """Take every reply that has come (waiting up to ``wait_s`` for the first on
        ``client``), on the hubs moved away from too."""
        for old in list(self.link.retiring) if self.link is not None else []:
            self._read_from(old, 0)
        self._read_from(client, wait_s)

    def _read_from(self, client: HubClient | None, wait_s: float) -> None:
        if client is None:
            if wait_s > 0:
                self._wake.wait(wait_s)
            return
        timeout = wait_s
        while not client.sock.closed:  # closed: dropped since this turn began
            try:
                if not client.sock.poll(int(timeout * 1000)):
                    return
                msg = client.recv(0)
            except HubUnavailable as exc:
                self._lost(str(exc), client)
                return
            self._on_reply(msg, client)
            timeout = 0

    def _ask_totals(self, client: HubClient | None) -> None:
        """Send one STATS_QUERY for the ``hub_totals`` callers that came since the last."""
        new = []
        while True:
            try:
                new.append(self._questions.get_nowait())
            except queue.Empty:
                break
        if not new:
            return
        if client is None or client.sock.closed:
            for answer in new:
                _answer(answer, None)
            return
        if not self._asked:
            with contextlib.suppress(HubUnavailable):
                client.send(StatsQuery(peer=True))
            self._asked_on = client
        self._asked += new

    def _on_totals(self, msg: StatsReport) -> None:
        totals = msg.body.peer if isinstance(msg.body, PeerReport) else None
        asked, self._asked = self._asked, []
        for answer in asked:
            _answer(answer, totals)

    def _on_reply(self, msg: Message, client: HubClient) -> None:
        if isinstance(msg, StatsReport):
            if client is self._asked_on:  # not an old hub's answer to an older question
                self._on_totals(msg)
            return
        slot = self._slot_for(msg, client)
        if slot is None:  # its request ended, or went on alone, while the hub drafted
            # an answer to an OPEN brings a session we never knew the tag of: end it too;
            # one to a COMMIT (ref 0) finds its session already CLOSEd by ``_release`` or
            # ``_alone``, and a second CLOSE would only earn an ERROR
            if isinstance(msg, Propose) and msg.ref and not client.sock.closed:
                with contextlib.suppress(HubUnavailable):
                    client.send(Close(tag=msg.tag))
            return
        if isinstance(msg, Error):
            if msg.code == ErrorCode.NO_CARD and client is self.link.client:
                self._rejoin()
            elif msg.code in (ErrorCode.NO_CARD, ErrorCode.DRAINING):  # its next sessions
                # go to another hub (a hub moved away from: its sessions there go alone)
                self._lost(f"the hub {client.address} is shutting down"
                           if msg.code == ErrorCode.DRAINING else
                           f"the hub {client.address} no longer knows this target", client)
            else:
                self._alone(slot, f"hub error {msg.code}: {msg.message}")
            return
        if not isinstance(msg, Propose):
            self._lost(f"expected PROPOSE, got {msg.TYPE}", client)
            return
        if msg.seq <= slot.seq:
            return  # a replay of an earlier round: never applied twice
        try:
            check_propose(msg, self.vocab_size)
        except HubUnavailable as exc:
            self._lost(str(exc), client)
            return
        if msg.leave and client is self.link.client:
            self.link.told(client.address)
        if slot.waiting_since is not None and self.link is not None:
            took = time.perf_counter() - slot.waiting_since
            slot.stats.hub_wait_s += took
            self.link.observe(took)
            if not msg.plain and slot.opening is None:  # a round, not the hub's prefill;
                # what it kept the engine from doing: the passes it ran for other requests
                # meanwhile were not lost
                self.gate.observe_round_trip(max(took - (self.core.busy_s - slot.busy_mark), 0.0))
            elif not msg.plain and slot.produced > 1:  # a mid-stream OPEN (``_take_up_trees``)
                self.gate.observe_open_wait(took)
        slot.tag, slot.seq, slot.waiting_since, slot.opening = msg.tag, msg.seq, None, None
        if slot.ahead:
            slot.lag = msg
            self._catch_up(slot)
        elif msg.plain:
            slot.plain_left, slot.plain_started = msg.plain, time.perf_counter()
        else:
            slot.tree = DraftTree(msg.tokens, msg.parents, msg.dist_ids, msg.dist_probs)

    def _rejoin(self) -> None:
        """The hub no longer knows us (it frees the slot of a target that held no session
        for a while, or it restarted): our card again, on a new connection, then every
        OPEN it refused once more. Sessions it had are gone: their requests go on alone."""
        forgot = self.link.client
        reopen = [s for s in self._slots.values()
                  if s.client is forgot and s.opening is not None]
        for slot in self._slots.values():
            if slot.client is forgot and slot.opening is None:
                self._alone(slot, "the hub no longer knows this target", close=False)
        if not self.link.rejoin():  # on failure it retries in the background
            for slot in reopen:
                self._alone(slot, self.link.note, close=False)
            return
        for slot in reopen:
            if self.link.client is None or slot.reopened:  # lost again, or asked twice
                self._alone(slot, "the hub forgot this target again", close=False)
                continue
            slot.client, slot.ref, slot.reopened = self.link.client, next(self._refs), True
            slot.opening.ref, slot.waiting_since = slot.ref, time.perf_counter()
            self._send(slot, slot.opening)

    def _slot_for(self, msg: Message, client: HubClient) -> Slot | None:
        """The request ``msg`` answers; tags are each hub's own, so among the sessions on
        ``client`` only."""
        for slot in self._slots.values():
            if slot.client is not client:
                continue
            if (msg.tag and msg.tag == slot.tag) or (
                    getattr(msg, "ref", 0) and msg.ref == slot.ref and not slot.tag):
                return slot
        return None

    def _overdue(self) -> bool:
        if self.link is None:
            return False
        now, deadline = time.perf_counter(), self.link.deadline_s
        late = [s for s in self._slots.values()
                if s.waiting_since is not None and now - s.waiting_since > deadline]
        for client in {s.client for s in late}:
            self._lost(f"no reply from the hub {client.address} within {deadline:.3g}s",
                       client)
        return bool(late)

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            while not self._stop.is_set():
                self._turn()
        except Exception as exc:  # a bug or out of memory, not a peer: fail loudly
            log.exception("%s: the engine thread failed", self.name)
            reason = self.failed = f"the engine failed: {type(exc).__name__}: {exc}"
        finally:
            self._intake()
            for slot in list(self._slots.values()):
                self._finish(slot, "error", reason)
            self._ask_totals(None)
            for answer in self._asked:
                _answer(answer, None)

    def _turn(self) -> None:
        self._intake()
        client = self._client()
        self._ask_totals(client)
        self._read_hub(client, 0)
        self._overdue()
        slice_s = self.core.prefill_slice(self._new, _left,
                                          any(s.decoding for s in self._slots.values()),
                                          any(s.ready for s in self._slots.values()))
        if slice_s is not None:
            self._prefill_one(client, slice_s)
        if client is not None:
            self._take_up_trees(client)
        work = [s for s in self._slots.values() if s.ready]
        waiting = [s for s in self._slots.values() if s.waiting_since is not None]
        if work and waiting:
            work = self._coalesce(client, work, waiting)
        if work:
            self._pass(work)
        elif waiting and not self._new:
            self._read_hub(client, 0.002)
        elif not self._new:
            self._wake.wait(0.05)
            self._wake.clear()
        if log.isEnabledFor(logging.DEBUG):
            self._log_phases()
        self.stats.running = sum(s.decoding for s in self._slots.values())
        self.stats.waiting = len(self._new)
        if self.gate is not None:
            self.gate.observe_batch(self.stats.running)

    def _log_phases(self) -> None:
        """Each request's phase at the end of a turn, where it changed (at DEBUG)."""
        for rid, slot in self._slots.items():
            self._phases.note(rid, slot.phase)

    def _intake(self) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                break
            slot = Slot(req=req, stats=GenerationStats(started_at=time.time(),
                                                       threads=torch.get_num_threads()))
            self._slots[req.rid] = slot
            self._new.append(slot)
            self._phases.note(req.rid, Phase.PREFILLING)
        while True:
            try:
                rid = self._cancelled.get_nowait()
            except queue.Empty:
                break
            slot = self._slots.get(rid)
            if slot is not None:
                self._release(slot)

    def _prefill_one(self, client: HubClient | None, slice_s: float) -> None:
        """A slice of a new prompt's prefill (``EngineCore.prefill_turn`` says whose;
        ``slice_s``: ``prefill_slice``); when it ends the prompt, the request starts
        decoding and OPENs its hub session."""
        slot = self.core.prefill_turn(self._new, _left)
        req = slot.req
        start = time.perf_counter()
        if client is not None and client.sock.closed:  # dropped earlier in this turn
            client = None
        if slot.prefill is None:
            layers = list(self.link.card.feature_layers) if client is not None else []
            slot.prefill = self.engine.open_chunks(req.rid, req.prompt, self.prefill_chunk,
                                                   req.sampling, req.seed, layers,
                                                   req.logprobs, req.echo)
            slot.client, slot.history = client, [] if client is not None else None
            if client is None and self.link is not None:
                slot.stats.note = self.link.note  # why it decodes with no hub
        done = self.core.prefill(slot.prefill, slice_s)
        slot.stats.prefill_s += time.perf_counter() - start
        if done is None:
            return
        first, feats = done
        self._new.remove(slot)
        slot.prefill, slot.decoding = None, True
        if slot.history is not None and feats is not None:
            slot.history.append(on_wire(feats, self.wire_dtype))
        opened_on, slot.client = slot.client, None
        session = self.engine.sessions[req.rid]
        first_logprob = session.first_logprob
        if self._emit(slot, [first], None if first_logprob is None else [first_logprob],
                      session.prompt_logprobs if session.echo else None) \
                or opened_on is None:
            return  # no hub, or sent plain with the batch while it prefilled
        if opened_on in self.link.retiring and self.link.client is not None \
                and tuple(self.link.card.feature_layers) == tuple(session.feature_layers):
            opened_on = self.link.client  # moved to another hub of the pool meanwhile
        if opened_on is not self.link.client or opened_on.sock.closed:
            self._features_off(slot)  # dropped or replaced while prefilling
            slot.stats.note = slot.stats.note or "the hub connection was lost while it prefilled"
            return
        self._judge(opened_on, slot)

    def _judge(self, client: HubClient, newcomer: Slot) -> None:
        """Trees or plain for the batch a newcomer (its prefill just done) joins
        (``SpeculationGate.verdict``): every request that can use the hub as using it,
        those that cannot as plain rows beside them. Where trees pay, the newcomer and the
        requests decoding plain open hub sessions (each decodes on until its first tree
        comes, ``_catch_up``), but for those with too few tokens left to see a tree. Where
        plain pays, the whole batch decodes plain, the requests still prefilling too (the
        verdict counted them), since a tree among plain rows would slow every row's pass
        and hold its own request back for the hub's round trip."""
        using, parked, alone = self._split()
        parked = [s for s in parked if s is not newcomer]
        cached = self.engine.cached
        decision = self.gate.verdict([cached(s.req.rid) for s in using + parked + [newcomer]],
                                     len(self._new), plain=[cached(s.req.rid) for s in alone])
        self._log_verdict(decision, len(alone))
        if decision.trees:
            self._open(newcomer, client)
            self._take_up(parked, client, decision.rows)
            return
        prefilling = [s for s in self._new if s.client is not None]
        for slot in using + prefilling:
            self._alone(slot, "plain batching serves this batch faster", keep=True)
        self.stats.gated += len(using) + len(prefilling) + 1

    def _take_up_trees(self, client: HubClient) -> None:
        """When a request leaves, nothing queued, the requests decoding plain are judged
        again at the batch left (``SpeculationGate.verdict`` at today's batch, not the
        recent average: the arrivals that built it have not come): where trees pay they
        take up the hub mid-stream with what they decoded meanwhile, each with tokens
        enough to go for trees once its first comes (``SpeculationGate.rejoin_pays``).
        One left alone always does (a lone newcomer always uses the hub), and the hub's
        control plane judges its rounds. Rows using the hub are not sent plain here: a
        batch that shrinks only gains from its trees."""
        rows = sum(s.decoding for s in self._slots.values())
        shrank, self._rows_seen = rows < self._rows_seen, rows
        if self._new or not shrank or client.sock.closed:
            return
        using, parked, alone = self._split()
        if not parked:
            return
        cached = self.engine.cached
        decision = self.gate.verdict([cached(s.req.rid) for s in using + parked],
                                     plain=[cached(s.req.rid) for s in alone], current=True)
        if decision.trees:
            self._take_up(parked, client, decision.rows)

    def _take_up(self, parked: list[Slot], client: HubClient, rows: int) -> None:
        """Requests decoding plain open hub sessions, in a batch of ``rows`` where trees
        pay, but for those with too few tokens left to see a tree
        (``SpeculationGate.rejoin_pays``)."""
        for slot in parked:
            if self.gate.rejoin_pays(self.engine.cached(slot.req.rid),
                                     slot.req.max_tokens - slot.produced):
                log.debug("%s: request %d takes up the hub at %d rows", self.name,
                          slot.req.rid, rows)
                self._open(slot, client)

    def _open(self, slot: Slot, client: HubClient) -> None:
        """OPEN the request's hub session with everything it has decoded so far. A session
        it had before was closed: the new one's rounds count from the start again."""
        req = slot.req
        slot.client, slot.ref = client, next(self._refs)
        slot.stats.hub = client.address
        slot.seq, slot.reopened = -1, False
        slot.waiting_since, slot.busy_mark = time.perf_counter(), self.core.busy_s
        slot.cohort, slot.ahead, slot.lag = -1, self.decode_ahead, None
        slot.plain_tokens, slot.plain_feats = [], []
        slot.opening = self.link.opening([*req.prompt, *slot.output], len(req.prompt),
                                         req.sampling, req.seed, self.step_s,
                                         torch.cat(slot.history) if slot.history else None,
                                         slot.ref, batched=True)
        self._send(slot, slot.opening)

    def _log_verdict(self, decision: Decision, plain_rows: int) -> None:
        """The gate's verdict on a batch, at INFO when it differs from its last verdict on
        one (a lone request always uses the hub: under changing load, logging each lone
        verdict too would flip the log between the two every second)."""
        changed = not decision.lone and decision.trees != self._gate_open
        if changed:
            self._gate_open = decision.trees
        if not changed and not log.isEnabledFor(logging.DEBUG):
            return
        gate = self.gate
        log.log(logging.INFO if changed else logging.DEBUG,
                "%s: at %d requests decoding (%d plain), %s (trees %.1f tok/s at τ %.2f "
                "and a %.0f ms round trip, tree passes %.2fx slower beside the hub; "
                "plain %.1f tok/s)", self.name, decision.rows, plain_rows,
                "a lone request uses the hub, which judges its rounds" if decision.lone
                else "requests use the hub" if decision.trees else
                "requests decode plain, batched",
                decision.tree_tok_s, gate.tau.get(PRIOR_TAU),
                1e3 * gate.round_trip.get(0.0), self.cost.slowdown.get(1.0), decision.plain_tok_s)

    def _coalesce(self, client: HubClient | None, work: list[Slot], waiting: list[Slot]
                  ) -> list[Slot]:
        """Wait a little (``targets.cohort``, at most ``COALESCE`` of a pass) for the trees
        the hub is still drafting for the requests verified with these in the last pass,
        so that they stay in one batch: the hub drafts a pass's trees together, but the
        first COMMIT can start a batch of its own."""
        last = self.core.passes
        trip = self.gate.round_trip.get(0.0) if self.gate is not None else 0.0

        def due() -> list[float]:  # the hub's turnaround, and the passes run meanwhile
            return [s.waiting_since + trip + self.core.busy_s - s.busy_mark
                    for s in self._slots.values()
                    if s.waiting_since is not None and s.cohort == last]

        for wait in waits(time.perf_counter(), self.pass_s, COALESCE, due, time.perf_counter):
            if self._stop.is_set():
                break
            self._read_hub(client, wait)
        return [s for s in self._slots.values() if s.ready]

    def _pass(self, work: list[Slot]) -> None:
        """Verify every ready request in one forward pass, then emit and answer the hub."""
        trees = [s.tree if s.tree is not None else EMPTY_TREE for s in work]
        batch = [(s.req.rid, t) for s, t in zip(work, trees, strict=True)]
        n_trees = sum(s.tree is not None for s in work)
        done = self.core.verify(batch, n_trees)
        verdicts, took = done.verdicts, done.took
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: pass of %d rows (%d trees, %d fed): %.1f ms, %.1f alone", self.name,
                      len(work), n_trees, done.stats.new_tokens, 1e3 * took, 1e3 * done.alone)
        self.stats.passes += 1
        self.stats.rows += len(work)
        self.stats.last_batch = len(work)
        commits = any(s.tree is not None or s.plain_left for s in work)
        steps, tok_s = self._commit_rates() if commits else ({}, 0.0)  # only COMMITs report them
        for slot, tree, verdict in zip(work, trees, verdicts, strict=True):
            slot.stats.verify_s += took
            verdict.features = on_wire(verdict.features, self.wire_dtype)  # as the hub reads
            if slot.history is not None and verdict.features is not None:
                slot.history.append(verdict.features)
            step_s = steps.get(slot.req.rid, self.step_s)
            phase = slot.phase
            if phase is Phase.TREE:
                self._after_tree(slot, tree, verdict, took, step_s, tok_s)
            elif phase is Phase.PLAIN_ROUND:
                self._after_plain_step(slot, verdict, step_s, tok_s)
            elif phase is Phase.AHEAD:
                self._ahead_step(slot, verdict)
            else:  # ALONE
                self.stats.plain_steps += 1
                self._emit(slot, verdict.tokens, verdict.logprobs)

    def _after_tree(self, slot: Slot, tree: DraftTree, verdict: Verdict, took: float,
                    step_s: float, tok_s: float) -> None:
        """A verified tree; one that was the rest of a proposal below the tokens the
        request decoded ahead of it (``_catch_up``) COMMITs those tokens first."""
        slot.tree = None
        ahead, feats = slot.plain_tokens, slot.plain_feats
        whole = DraftTree(slot.lag.tokens, slot.lag.parents) if slot.lag is not None else tree
        slot.plain_tokens, slot.plain_feats, slot.lag = [], [], None
        tokens = ahead + verdict.tokens
        accepted = len(ahead) + len(verdict.path)
        self._count_round(slot, accepted, whole)
        if verdict.features is not None:
            feats = [*feats, verdict.features]
        commit = Commit(tag=slot.tag, seq=slot.seq, accepted=accepted, verify_ms=1e3 * took,
                        step_ms=1e3 * step_s, floor=self._floor(slot, tok_s),
                        tokens=torch.tensor(tokens, dtype=torch.int32),
                        features=torch.cat(feats) if feats else None)
        if self._emit(slot, verdict.tokens, verdict.logprobs):
            return
        self._commit(slot, commit)

    def _count_round(self, slot: Slot, accepted: int, tree: DraftTree) -> None:
        """A hub tree settled, ``accepted`` of its nodes kept (and a bonus token), on the
        request's figures, the gate's and the server's."""
        count_round(slot.stats, accepted, len(tree))
        slot.stats.max_depth = max(slot.stats.max_depth, tree.depth)
        self.gate.observe_round(len(tree), accepted + 1)
        self.stats.rounds += 1
        self.stats.committed += accepted + 1

    def _ahead_step(self, slot: Slot, verdict: Verdict) -> None:
        """A plain step of a request decoding ahead of its hub session; the hub's proposal,
        if one is waiting for a token more (``_catch_up``), is walked again."""
        if not self._keep_decoded(slot, verdict) and slot.lag is not None:
            self._catch_up(slot)

    def _keep_decoded(self, slot: Slot, verdict: Verdict) -> bool:
        """A plain step whose token and feature row wait in ``plain_tokens`` and
        ``plain_feats`` for a COMMIT; True when it ends the request."""
        self.stats.plain_steps += 1
        slot.plain_tokens.extend(verdict.tokens)
        if verdict.features is not None:
            slot.plain_feats.append(verdict.features)
        return self._emit(slot, verdict.tokens, verdict.logprobs)

    def _catch_up(self, slot: Slot) -> None:
        """The hub's proposal (``slot.lag``) is for where the request was when it OPENed or
        last COMMITted; since then it decoded ``plain_tokens`` on its own. Its tokens are the
        same however it gets them (``targets.acceptance``), so those tokens walk the
        proposal as verifying it would:

        - a plain round of k steps: the first k are its tokens (fewer: it goes on as one);
        - a tree that they leave: the nodes they follow are accepted and the first token
          off the tree is the bonus;
        - a tree with a path holding all of them: the next pass verifies the nodes below
          (a path that ends in a leaf waits for one more plain step).

        What a walk settles is COMMITted at once; the request decodes ahead while tokens
        the hub does not know remain, and waits for its next proposal as usual once none
        do."""
        msg, done = slot.lag, slot.plain_tokens
        if done:
            self.stats.caught_up += 1
        if msg.plain and len(done) < msg.plain:
            slot.plain_left, slot.plain_started = msg.plain - len(done), time.perf_counter()
            slot.ahead, slot.lag = False, None
            return
        if msg.plain:
            accepted, n = 0, msg.plain
        else:
            path = accepted_path(msg.tokens, msg.parents, done)
            proposal = DraftTree(msg.tokens, msg.parents)
            if len(path) == len(done):
                below = subtree(proposal, path[-1] if path else -1)
                if len(below):
                    slot.tree, slot.ahead = below, False
                return
            accepted, n = len(path), len(path) + 1
            self._count_round(slot, accepted, proposal)
        slot.lag, slot.ahead = None, len(done) > n
        steps, tok_s = self._commit_rates()
        self._commit_decoded(slot, accepted, n, self.pass_s,
                             steps.get(slot.req.rid, self.step_s), tok_s)

    def _commit_decoded(self, slot: Slot, accepted: int, n: int, verify_s: float,
                        step_s: float, tok_s: float) -> None:
        """COMMIT the first ``n`` tokens the request decoded on its own (``plain_tokens``),
        ``accepted`` of them nodes of the hub's proposal (0 after a plain round), with the
        time they took (``verify_s``) and the rates of ``_commit_rates``."""
        tokens, feats = slot.plain_tokens[:n], slot.plain_feats[:n]
        del slot.plain_tokens[:n], slot.plain_feats[:n]
        self._commit(slot, Commit(
            tag=slot.tag, seq=slot.seq, accepted=accepted, verify_ms=1e3 * verify_s,
            step_ms=1e3 * step_s, floor=self._floor(slot, tok_s),
            tokens=torch.tensor(tokens, dtype=torch.int32),
            features=torch.cat(feats) if feats else None))

    def _after_plain_step(self, slot: Slot, verdict: Verdict, step_s: float,
                          tok_s: float) -> None:
        """One of the plain steps the hub asked for; the last one COMMITs them all.
        ``step_s``, ``tok_s``: this pass's ``_commit_rates``, the step the hub must beat
        and the batch's rate that sets the floor advised for the next tree."""
        slot.plain_left -= 1
        if self._keep_decoded(slot, verdict) or slot.plain_left:
            return
        took = time.perf_counter() - slot.plain_started
        slot.stats.plain_rounds += 1
        slot.stats.plain_tokens += len(slot.plain_tokens)
        slot.stats.plain_s += took
        self._commit_decoded(slot, 0, len(slot.plain_tokens), took, step_s, tok_s)

    def _split(self) -> tuple[list[Slot], list[Slot], list[Slot]]:
        """The requests decoding: (those using the hub, those decoding plain that can open
        a hub session, those that cannot)."""
        using, parked, alone = [], [], []
        for s in self._slots.values():
            if s.decoding:
                (using if s.client is not None else parked if s.history is not None
                 else alone).append(s)
        return using, parked, alone

    def _commit_rates(self) -> tuple[dict[int, float], float]:
        """What this pass's COMMITs report, from one read of the batch:

        - each request's plain step (by request id): what it waits per token if it decodes
          plain in today's batch while the others using the hub keep their trees, the
          step the hub must beat, as it verifies our trees in passes as wide as this
          batch (``SpeculationGate.steps_beside``);
        - the tokens a second this batch commits with trees for the requests using the
          hub (beside those decoding plain), by the gate's model, which sets the floor."""
        using, parked, alone = self._split()
        hub = [self.engine.cached(s.req.rid) for s in using]
        alone = [self.engine.cached(s.req.rid) for s in parked + alone]
        steps = {s.req.rid: step or self.step_s
                 for s, step in zip(using, self.gate.steps_beside(hub, alone), strict=True)}
        return steps, self.gate.rates(hub, alone)[0]

    def _floor(self, slot: Slot, tok_s: float) -> float:
        """The floor this request's next tree is advised: its nodes below it would slow
        the batch more than they add (``SpeculationGate.floor``)."""
        return self.gate.floor(self.engine.cached(slot.req.rid), tok_s)

    def _commit(self, slot: Slot, commit: Commit) -> None:
        slot.waiting_since, slot.busy_mark = time.perf_counter(), self.core.busy_s
        slot.cohort = self.core.passes
        self._send(slot, commit)

    def _emit(self, slot: Slot, tokens: list[int],
              logprobs: list[TokenLogprob] | None = None,
              prompt_logprobs: list[TokenLogprob | None] | None = None) -> bool:
        """Hand the request its new tokens (and their log-probabilities, where it asked
        for them; the prompt's with the first, for an ``echo``); True when they end it (it
        is then released)."""
        req = slot.req
        ends = slot.produced + len(tokens) >= req.max_tokens or any(t in self.eos
                                                                   for t in tokens)
        tokens = clip_output(tokens, req.max_tokens - slot.produced, self.eos)
        logprobs = logprobs[:len(tokens)] if logprobs is not None else None
        slot.output.extend(tokens)
        self.stats.tokens += len(tokens)
        if tokens and not ends:
            req.sink(Event(tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs))
        if ends:
            reason = "stop" if tokens and tokens[-1] in self.eos else "length"
            self._finish(slot, reason, tokens=tokens, logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs)
        return ends

    def _finish(self, slot: Slot, reason: str, error: str = "",
                tokens: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        stats = slot.stats
        stats.new_tokens = slot.produced
        stats.wall_s = time.time() - stats.started_at
        stats.tokens_per_s = slot.produced / max(stats.wall_s, 1e-9)
        stats.mean_accept_len = mean_accept_len(stats)
        stats.standalone = stats.rounds == 0 and stats.plain_rounds == 0
        stats.step_ms = 1e3 * self.step_s
        self._release(slot)
        slot.req.sink(Event(tokens=tokens or [], done=reason, error=error, stats=stats,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs))

    def _release(self, slot: Slot) -> None:
        """Free the request here and at the hub."""
        if slot.client is not None and slot.tag:
            with contextlib.suppress(HubUnavailable):
                slot.client.send(Close(tag=slot.tag))
        slot.client, slot.released = None, True
        self._slots.pop(slot.req.rid, None)
        if slot in self._new:
            self._new.remove(slot)
        self.engine.close(slot.req.rid)
        self._phases.note(slot.req.rid, Phase.DONE)


def _left(slot: Slot) -> int:
    """Prompt tokens a request has left to prefill."""
    return slot.prefill.left if slot.prefill is not None else len(slot.req.prompt)


def _answer(question: Future, value: object) -> None:
    """Answer a caller's question unless it stopped waiting."""
    if not question.done():
        question.set_result(value)
