"""The draft hub: StarSD's Algorithm 1 on one ROUTER socket.

receiver -> global request buffer -> work-conserving worker (drafts in a thread) -> sender.
The receiver never waits for drafting, so a slow target never holds up the others, and
nothing a peer sends can stop the loop: bad input gets an ERROR and serving goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio

from starhub.drafters.base import Drafter, TreeShape
from starhub.metrics import HubMetrics, PrometheusCollector, serve_prometheus
from starhub.protocol import (
    Close,
    Commit,
    Error,
    ErrorCode,
    Hello,
    Message,
    Open,
    Ping,
    Pong,
    Propose,
    ProtocolError,
    Reject,
    Stats,
    Welcome,
)
from starhub.sessions import Peer, Session, SessionTable
from starhub.transport import Limits, configure_socket, decode, encode, error_for, to_torch
from starhub.tree import DraftTree

log = logging.getLogger("starhub.hub")


@dataclass
class HubConfig:
    bind: str = "tcp://127.0.0.1:5555"
    shape: TreeShape = field(default_factory=TreeShape)
    ttl_s: float = 120.0
    max_message_bytes: int = Limits().max_message_bytes
    max_targets: int = 0
    """Admission limit (N_max); 0 admits every target."""
    log_every_s: float = 10.0
    metrics_port: int = 0
    """Serve Prometheus text on 127.0.0.1:PORT/metrics; 0 serves none."""
    threads: int = 0
    """Torch threads of the drafting thread; 0 keeps torch's setting."""


@dataclass
class Request:
    """An entry of the global buffer: a session that needs a draft, and since when."""

    identity: bytes
    session: Session
    ref: int
    arrival: float


def _drafting_thread(threads: int) -> None:
    """Drafting runs on this one thread. Where the event-loop thread has also run multithreaded
    torch code (loading, say), the process holds two OpenMP teams, and once it has more
    OpenMP threads than cores libgomp throttles its spin-waits: on 2 cores that made every
    draft ~1.7x slower. ``starhub hub`` therefore loads with one thread."""
    if threads:
        torch.set_num_threads(threads)


class Hub:
    def __init__(self, drafter: Drafter, config: HubConfig | None = None):
        self.drafter = drafter
        self.config = config or HubConfig()
        self.limits = Limits(self.config.max_message_bytes)
        self.table = SessionTable(self.config.ttl_s)
        self.metrics = HubMetrics()
        self.buffer: collections.deque[Request] = collections.deque()
        self.outbox: asyncio.Queue[tuple[bytes, Message]] = asyncio.Queue()
        self._work = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter",
                                            initializer=_drafting_thread,
                                            initargs=(self.config.threads,))
        self.bound: str | None = None
        self.ready = asyncio.Event()

    async def serve(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        configure_socket(sock, self.limits)
        sock.bind(self.config.bind)
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("hub listening on %s, drafter=%s, %s", self.bound, self.drafter.name,
                 self.config.shape)
        server = None
        if self.config.metrics_port:
            server, _ = serve_prometheus(PrometheusCollector(self.stats, self.metrics.counters),
                                         self.config.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", self.config.metrics_port)
        self.ready.set()
        tasks = [asyncio.create_task(coro) for coro in (
            self.receiver(sock), self.worker(), self.sender(sock), self.housekeeping())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            sock.close(0)
            self._executor.shutdown(wait=False, cancel_futures=True)
            if server is not None:
                server.shutdown()
                server.server_close()

    async def receiver(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                self.handle(identity, decode(frames[1:], self.limits))
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
        if isinstance(msg, Hello):
            self.handle_hello(identity, msg)
        elif isinstance(msg, Ping):
            self.reply(identity, Pong(nonce=msg.nonce))
        elif isinstance(msg, Stats):
            self.reply(identity, Stats(body=self.stats_reply(identity, msg.body)))
        elif isinstance(msg, Open):
            self.handle_open(identity, msg)
        elif isinstance(msg, Commit):
            self.handle_commit(identity, msg)
        elif isinstance(msg, Close):
            self.table.get(msg.tag, identity)
            self.table.close(msg.tag)
        else:
            raise ProtocolError(ErrorCode.BAD_TYPE, f"a hub does not accept {msg.TYPE}",
                                tag=msg.tag)

    def handle_hello(self, identity: bytes, msg: Hello) -> None:
        reason = self.drafter.check_target(msg)
        peers = self.table.peers
        if reason is None and self.config.max_targets and identity not in peers \
                and len(peers) >= self.config.max_targets:
            reason = (f"hub is at its admission limit of {self.config.max_targets} targets; "
                      f"decode on your own")
        if reason is not None:
            log.info("rejecting %s (%s): %s", msg.name, identity.hex()[:8], reason)
            self.reply(identity, Reject(code=int(ErrorCode.REJECTED), reason=reason))
            return
        self.metrics.peer(identity, msg.name)
        known = peers.get(identity)
        peers[identity] = Peer(identity, msg.name, msg.vocab_size, msg.hidden_size,
                               msg.num_layers, known.sessions if known else set())
        log.info("target %s (%s) joined; %d connected", msg.name, identity.hex()[:8], len(peers))
        shape = self.config.shape
        self.reply(identity, Welcome(drafter=self.drafter.name,
                                     feature_layers=list(self.drafter.feature_layers),
                                     depth=shape.depth, topk=shape.topk,
                                     max_nodes=shape.max_nodes, ttl_s=self.config.ttl_s,
                                     max_message_bytes=self.limits.max_message_bytes))

    def _peer(self, identity: bytes, msg: Message) -> Peer:
        peer = self.table.peers.get(identity)
        if peer is None:
            raise ProtocolError(ErrorCode.NO_HELLO, f"send HELLO before {msg.TYPE}",
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

    def handle_open(self, identity: bytes, msg: Open) -> None:
        peer = self._peer(identity, msg)
        self._check_ids(peer, msg)
        features = [to_torch(msg.features)] if msg.features is not None else []
        session = self.table.open(identity, msg, features)
        self.metrics.sessions_opened += 1
        self.enqueue(identity, session, msg.ref)

    def handle_commit(self, identity: bytes, msg: Commit) -> None:
        peer = self._peer(identity, msg)
        session = self.table.get(msg.tag, identity)
        if session.busy or msg.seq != session.seq:
            raise ProtocolError(ErrorCode.STALE,
                                f"COMMIT seq {msg.seq} does not answer the outstanding "
                                f"PROPOSE (seq {session.seq}, busy={session.busy})", tag=msg.tag)
        if msg.accepted > session.last_tree_size:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"COMMIT accepts {msg.accepted} nodes of a "
                                f"{session.last_tree_size}-node tree", tag=msg.tag)
        self._check_ids(peer, msg)
        session.ctx.tokens.extend(msg.tokens.tolist())
        if msg.features is not None:
            session.ctx.features.append(to_torch(msg.features))
        session.seq += 1
        self.metrics.committed(msg.accepted, len(msg.tokens), identity)
        self.enqueue(identity, session, 0)

    def enqueue(self, identity: bytes, session: Session, ref: int) -> None:
        session.busy = True
        now = time.monotonic()
        self.metrics.arrived(session.tag, identity, now)
        self.buffer.append(Request(identity, session, ref, now))
        self._work.set()

    async def worker(self) -> None:
        """Work-conserving: whenever the buffer holds a request, draft it (FIFO)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.buffer:
                self._work.clear()
                await self._work.wait()
                continue
            req = self.buffer.popleft()
            session = req.session
            if self.table.sessions.get(session.tag) is not session:
                continue
            started = time.monotonic()
            self.metrics.draft_started(req.arrival, started, len(self.table))
            try:
                tree = await loop.run_in_executor(self._executor, self.drafter.propose,
                                                  session.ctx, self.config.shape)
            except Exception as exc:
                log.exception("drafting failed for tag %d", session.tag)
                self.table.close(session.tag)
                self.reply(req.identity, Error(tag=session.tag, ref=req.ref,
                                               code=int(ErrorCode.INTERNAL),
                                               message=f"drafting failed: {exc}"))
                continue
            self.metrics.draft_finished(started, time.monotonic(), tree.depth, len(tree),
                                        req.arrival, session.tag, req.identity)
            session.busy = False
            if self.table.sessions.get(session.tag) is not session:
                continue
            session.last_tree_size = len(tree)
            self.reply(req.identity, self.propose_message(session, tree, req.ref))

    @staticmethod
    def propose_message(session: Session, tree: DraftTree, ref: int) -> Propose:
        return Propose(tag=session.tag, seq=session.seq, ref=ref, tokens=tree.tokens,
                       parents=tree.parents, dist_ids=tree.dist_ids, dist_probs=tree.dist_probs)

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
                self.table.close(tag)
                self.metrics.sessions_expired += 1
                log.info("session %d expired after %.0fs without messages", tag,
                         self.config.ttl_s)
            now = time.monotonic()
            if self.config.log_every_s and now - last_log >= self.config.log_every_s:
                last_log = now
                if self.metrics.rounds:
                    log.info(self.metrics.summary_line(len(self.table), len(self.table.peers)))

    def stats(self) -> dict:
        snap = self.metrics.snapshot(len(self.table), len(self.table.peers))
        snap.update(drafter=self.drafter.name, depth=self.config.shape.depth,
                    topk=self.config.shape.topk, max_nodes=self.config.shape.max_nodes,
                    queue=len(self.buffer), threads=torch.get_num_threads())
        return snap

    def stats_reply(self, identity: bytes, request: dict) -> dict:
        """STATS body: the snapshot; ``{"peer": true}`` asks for the sender's own totals
        (its time split), ``{"counters": true}`` adds raw totals for windowed rates."""
        if request.get("peer"):
            totals = self.metrics.peers.get(identity)
            return {"peer": totals.to_dict() if totals else {}}
        body = self.stats()
        if request.get("counters"):
            body["counters"] = self.metrics.counters(peers=bool(request.get("peers")))
        return body


def run_hub(drafter: Drafter, config: HubConfig) -> None:
    """Serve until interrupted, on uvloop where available."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(Hub(drafter, config).serve())
