"""The draft hub: StarSD's Algorithm 1 on one ROUTER socket.

receiver -> global request buffer -> work-conserving worker (``starhub.hub.worker``: drafts
batches in a thread, pre-drafts when idle) -> sender.
The receiver never waits for drafting, so a slow target never holds up the others, and
nothing a peer sends can stop the loop: bad input gets an ERROR and serving goes on.
The controller (``starhub.control.plane``) admits targets at their TARGET_CARD and shapes
every round before it enters the buffer; a round it makes plain is answered at once and
never drafted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq
import zmq.asyncio

from starhub.control.plane import AUTO, Controller
from starhub.drafters.base import Drafter, TreeShape
from starhub.hub.config import HubConfig, Request, drafting_thread
from starhub.hub.metrics import HubMetrics, PrometheusCollector, serve_prometheus
from starhub.hub.sessions import Peer, Session, SessionTable
from starhub.hub.worker import DraftWorker
from starhub.server.isolation import Observers, hub_view
from starhub.server.limits import SessionBudget
from starhub.wire.codec import Limits, configure_socket, decode, encode, error_for
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Message,
    ObserverCard,
    Open,
    Ping,
    Pong,
    Propose,
    ProtocolError,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.security import bind_server
from starhub.wire.tree import accepted_path

log = logging.getLogger("starhub.hub")


class Hub:
    def __init__(self, drafter: Drafter, config: HubConfig | None = None):
        self.drafter = drafter
        self.config = config or HubConfig()
        self.limits = Limits(self.config.max_message_bytes)
        self.table = SessionTable(self.config.ttl_s)
        self.budget = SessionBudget(self.config.limits)
        self.metrics = HubMetrics()
        self.observers = Observers()
        self.control = Controller(self.config.control())
        self.buffer: collections.deque[Request] = collections.deque()
        self.outbox: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue()
        self._work = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter",
                                            initializer=drafting_thread,
                                            initargs=(self.config.threads,))
        self.bound: str | None = None
        self.ready = asyncio.Event()
        self.accepting = True
        """False once shutting down (``starhub.hub.shutdown``): no new targets or sessions."""
        self.linger_ms = 0

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        configure_socket(sock, self.limits)
        release = bind_server(sock, self.config.bind, self.config.security)
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("hub listening on %s, drafter=%s, %s", self.bound, self.drafter.name,
                 self.config.shape)
        server = None
        if self.config.metrics_port:
            server, _ = serve_prometheus(PrometheusCollector(self.stats, self.metrics.counters),
                                         self.config.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", self.config.metrics_port)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.calibrate)
        self.ready.set()
        tasks = [asyncio.create_task(coro) for coro in (
            self.receiver(sock), DraftWorker(self).run(), self.sender(sock),
            self.housekeeping())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            sock.close(self.linger_ms)
            release()
            self._executor.shutdown(wait=False, cancel_futures=True)
            if server is not None:
                server.shutdown()
                server.server_close()

    def calibrate(self) -> None:
        """Time each tree shape the controller may choose once, so that its first
        admission and shape decisions rest on this machine's drafting speed."""
        config = self.control.config
        for depth, nodes in config.shapes():
            shape = TreeShape(depth, config.topk, nodes, self.config.shape.support)
            for rep in range(2):
                ctx = self.drafter.probe_context()
                start = time.perf_counter()
                try:
                    self.drafter.propose(ctx, shape)
                except Exception as exc:
                    log.warning("could not time a depth-%d draft: %s", depth, exc)
                    return
                if rep:
                    self.control.observe_draft(depth, nodes, time.perf_counter() - start)

    async def receiver(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.on_frames(frames[0].bytes, frames[1:])
            # A ready message completes the await without yielding: without this, a peer
            # that keeps the socket full would starve the worker and the sender.
            await asyncio.sleep(0)

    def on_frames(self, identity: bytes, frames: list) -> None:
        """Decode and route one message; whatever is wrong with it becomes an ERROR reply."""
        try:
            self.handle(identity, decode(frames, self.limits))
        except ProtocolError as exc:
            self.metrics.errors[exc.code.name] += 1
            log.warning("peer %s: %s", identity.hex()[:8], exc.message)
            self.reply(identity, error_for(exc))
        except Exception:
            log.exception("internal error handling a message from %s", identity.hex()[:8])
            self.metrics.errors["INTERNAL"] += 1
            self.reply(identity, Error(code=int(ErrorCode.INTERNAL),
                                       message="internal error; see the hub's log"))

    def handle(self, identity: bytes, msg: Message) -> None:
        """Route one valid message. Anything that needs drafting goes to the buffer."""
        if not self.accepting and isinstance(msg, TargetCard | ObserverCard | Open):
            raise ProtocolError(ErrorCode.REJECTED, "the hub is shutting down", tag=msg.tag,
                                ref=getattr(msg, "ref", 0))
        if isinstance(msg, TargetCard):
            self.handle_hello(identity, msg)
        elif isinstance(msg, ObserverCard):
            self.observers.add(identity)
            self.reply(identity, self.welcome())
        elif isinstance(msg, Ping):
            self.reply(identity, Pong(nonce=msg.nonce))
        elif isinstance(msg, StatsQuery):
            self.reply(identity, StatsReport(body=self.stats_reply(identity, msg)))
        elif isinstance(msg, Open):
            self.handle_open(identity, msg)
        elif isinstance(msg, Commit):
            self.handle_commit(identity, msg)
        elif isinstance(msg, Close):
            if not self.accepting and msg.tag not in self.table.sessions:
                return  # the shutdown closed it first: this CLOSE crossed our ERROR
            self.table.get(msg.tag, identity)
            self.close(msg.tag)
        else:
            raise ProtocolError(ErrorCode.BAD_TYPE, f"a hub does not accept {msg.TYPE}",
                                tag=msg.tag)

    def handle_hello(self, identity: bytes, msg: TargetCard) -> None:
        reason = self.drafter.check_target(msg)
        retry = 0.0
        peers = self.table.peers
        if reason is None:
            reason = self.control.join(identity, msg.name, msg.step_ms / 1e3, time.monotonic())
            retry = self.config.retry_after_s
        if reason is not None:
            log.log(logging.DEBUG if reason == "saturated" else logging.INFO,
                    "rejecting %s (%s): %s", msg.name, identity.hex()[:8], reason)
            self.reply(identity, Reject(code=int(ErrorCode.REJECTED), reason=reason,
                                        retry_after_s=retry))
            return
        self.metrics.peer(identity, msg.name)
        known = peers.get(identity)
        peers[identity] = Peer(identity, msg.name, msg.vocab_size, msg.hidden_size,
                               msg.num_layers, known.sessions if known else set())
        if known is not None:
            peers[identity].idle_since = known.idle_since
        log.info("target %s (%s) joined; %d admitted", msg.name, identity.hex()[:8], len(peers))
        self.reply(identity, self.welcome())

    def welcome(self) -> DrafterCard:
        shape = self.config.shape
        return DrafterCard(drafter=self.drafter.name,
                           feature_layers=list(self.drafter.feature_layers),
                           depth=0 if self.config.adaptive else shape.depth, topk=shape.topk,
                           max_nodes=shape.max_nodes, ttl_s=self.config.ttl_s,
                           max_message_bytes=self.limits.max_message_bytes)

    def close(self, tag: int) -> None:
        self.table.close(tag)
        self.control.close(tag)
        self.budget.closed(tag)

    def free_idle_slots(self) -> None:
        """A peer whose last session ended a grace period ago gives its slot back."""
        for identity in self.table.idle_peers(self.config.peer_grace_s):
            peer = self.table.peers.pop(identity)
            self.control.leave(identity)
            self.metrics.forget(identity)
            log.info("target %s (%s) left; %d admitted", peer.name, identity.hex()[:8],
                     len(self.table.peers))

    def _peer(self, identity: bytes, msg: Message) -> Peer:
        peer = self.table.peers.get(identity)
        if peer is None:
            raise ProtocolError(ErrorCode.NO_CARD, f"send TARGET_CARD before {msg.TYPE}",
                                tag=msg.tag, ref=getattr(msg, "ref", 0))
        return peer

    def _check_ids(self, peer: Peer, msg: Open | Commit) -> None:
        if len(msg.tokens) and (msg.tokens.min() < 0 or msg.tokens.max() >= peer.vocab_size):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{msg.TYPE}: token ids must lie in [0, {peer.vocab_size})",
                                tag=msg.tag, ref=getattr(msg, "ref", 0))
        if self.drafter.feature_layers and msg.features is None:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{msg.TYPE}: drafter '{self.drafter.name}' needs features",
                                tag=msg.tag, ref=getattr(msg, "ref", 0))
        width = self.drafter.feature_size
        if width and msg.features is not None and msg.features.shape[1] != width:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg.TYPE}: features must be {width} "
                                f"wide, got {msg.features.shape[1]}", tag=msg.tag,
                                ref=getattr(msg, "ref", 0))

    def handle_open(self, identity: bytes, msg: Open) -> None:
        peer = self._peer(identity, msg)
        self.budget.check_open(identity, len(msg.tokens), msg.ref)
        self._check_ids(peer, msg)
        keep = msg.features is not None and self.drafter.feature_layers
        session = self.table.open(identity, msg, [msg.features] if keep else [])
        self.budget.opened(session.tag, identity, len(msg.tokens))
        self.control.open(session.tag, identity, msg.step_ms / 1e3)
        self.metrics.sessions_opened += 1
        self.enqueue(identity, session, msg.ref)

    def handle_commit(self, identity: bytes, msg: Commit) -> None:
        peer = self._peer(identity, msg)
        session = self.table.get(msg.tag, identity)
        if session.busy or msg.seq != session.seq:
            raise ProtocolError(ErrorCode.STALE,
                                f"COMMIT seq {msg.seq} does not answer the outstanding "
                                f"PROPOSE (seq {session.seq}, busy={session.busy})", tag=msg.tag)
        plain = session.choice.plain
        if plain and (msg.accepted or len(msg.tokens) > plain):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"COMMIT after a plain round of {plain} tokens carries "
                                f"{len(msg.tokens)} with {msg.accepted} accepted", tag=msg.tag)
        if not plain and (msg.accepted > session.last_tree_size
                          or len(msg.tokens) != msg.accepted + 1):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"COMMIT accepts {msg.accepted} nodes of a "
                                f"{session.last_tree_size}-node tree with {len(msg.tokens)} "
                                f"tokens", tag=msg.tag)
        self._check_ids(peer, msg)
        self.budget.check_grow(session.tag, len(msg.tokens))
        now = time.monotonic()
        session.ctx.tokens.extend(msg.tokens.tolist())
        self.budget.grew(session.tag, len(msg.tokens))
        if msg.features is not None and self.drafter.feature_layers:
            session.ctx.features.append(msg.features)  # the drafting thread copies it
        session.seq += 1
        returned = now - session.proposed_at if session.proposed_at is not None else None
        self.control.observe_commit(session.tag, msg.accepted, session.last_tree_depth,
                                    session.last_tree_size, msg.verify_ms / 1e3, returned,
                                    msg.step_ms / 1e3)
        self.metrics.committed(msg.accepted, len(msg.tokens), identity, plain=bool(plain),
                               looked_up=self._looked_up(session, msg))
        self.enqueue(identity, session, 0, tuple(msg.tokens.tolist()))

    @staticmethod
    def _looked_up(session: Session, msg: Commit) -> int | None:
        """Accepted nodes that ``--lookup`` grafted (None: the tree had no graft)."""
        if not session.grafted or session.out_tree is None:
            return None
        tree = session.out_tree
        path = accepted_path(tree.tokens, tree.parents, msg.tokens[:msg.accepted])
        return sum(node >= session.grafted for node in path)

    def enqueue(self, identity: bytes, session: Session, ref: int,
                committed: tuple[int, ...] = ()) -> None:
        """Ask the controller for this round's shape: a plain round is answered at once,
        a tree goes to the global buffer."""
        choice = self.control.choose(session.tag)
        session.choice = choice
        self.metrics.chose(choice.label)
        log.debug("session %d round %d: %s%s", session.tag, session.seq, choice.label,
                  " (probe)" if choice.probe else "")
        now = time.monotonic()
        if choice.plain:
            self.metrics.returned(session.tag, now)
            session.proposed_at = now
            session.out_tree = None
            self.reply(identity, Propose(tag=session.tag, seq=session.seq, ref=ref,
                                         plain=choice.plain))
            return
        session.busy = True
        self.metrics.arrived(session.tag, identity, now)
        self.buffer.append(Request(identity, session, ref, now, committed))
        self._work.set()

    def reply(self, identity: bytes, msg: Message) -> None:
        self.outbox.put_nowait((identity, msg))

    async def sender(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            identity, msg = await self.outbox.get()
            try:
                await sock.send_multipart([identity, *encode(msg)], copy=False)
            except zmq.ZMQError as exc:
                log.warning("could not send %s to %s: %s", msg.TYPE, identity.hex()[:8], exc)

    async def housekeeping(self) -> None:
        """Release sessions idle past their TTL; log a one-line summary now and then."""
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(min(1.0, self.config.ttl_s / 4))
            for tag in self.table.expired():
                self.close(tag)
                self.metrics.sessions_expired += 1
                log.info("session %d expired after %.0fs without messages", tag,
                         self.config.ttl_s)
            self.free_idle_slots()
            now = time.monotonic()
            if self.config.log_every_s and now - last_log >= self.config.log_every_s:
                last_log = now
                if self.metrics.rounds or self.metrics.plain_rounds:
                    log.info("%s admitted=%d n_max=%s rejections=%d",
                             self.metrics.summary_line(len(self.table), len(self.table.peers)),
                             len(self.table.peers), self.control.n_max(),
                             self.control.rejections)

    def stats(self) -> dict:
        snap = self.metrics.snapshot(len(self.table), len(self.table.peers))
        control = self.control.snapshot(time.monotonic())
        snap.update(drafter=self.drafter.name,
                    depth=AUTO if self.config.adaptive else self.config.shape.depth,
                    topk=self.config.shape.topk, max_nodes=self.config.shape.max_nodes,
                    queue=len(self.buffer), threads=self.config.threads or torch.get_num_threads(),
                    max_targets=self.config.max_targets, admitted=control["admitted"],
                    n_max=control["n_max"], n_full=control["n_full"],
                    cached_tokens=self.budget.cached,
                    rejections=control["rejections"], control=control)
        return snap

    def stats_reply(self, identity: bytes, request: StatsQuery) -> dict:
        """STATS_REPORT body: the snapshot; ``peer`` asks for the sender's own totals (its
        time split), ``counters`` adds raw totals for windowed rates. Other targets' entries
        only go to a peer that sent a card (``starhub.server.isolation``)."""
        if request.peer:
            totals = self.metrics.totals_of(identity)
            return {"peer": totals.to_dict() if totals else {}}
        body = self.stats()
        if request.counters:
            body["counters"] = self.metrics.counters(peers=request.peers)
        return hub_view(body, identity in self.table.peers or identity in self.observers)

