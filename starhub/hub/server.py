"""The draft hub: StarSD's Algorithm 1 on one ROUTER socket.

receiver -> global request buffer -> work-conserving worker (``starhub.hub.worker``: drafts
batches in a thread, pre-drafts when idle) -> sender. The loop and the session table are the
servers' shared ones (``starhub.server.loop``, ``starhub.server.sessions``); this module
says what each message means to a hub. The receiver never waits for drafting, so a slow
target never holds up the others.
The controller (``starhub.control.plane``) admits targets at their TARGET_CARD and shapes
every round before it enters the buffer; a round it makes plain is answered at once and
never drafted. While a lost drafting process restarts (``starhub.hub.supervision``), no
target is admitted and no session opened.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import torch

from starhub.control.plane import AUTO, Controller
from starhub.cores import cpu_ids, host_id
from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.hub.config import HubConfig
from starhub.hub.metrics import HubMetrics, PrometheusCollector, serve_prometheus
from starhub.hub.sessions import DraftSession, TargetPeer
from starhub.hub.worker import DraftWorker, Request
from starhub.server.isolation import Observers, hub_view
from starhub.server.loop import Server, peer_name
from starhub.server.sessions import SessionTable, check_ids
from starhub.wire.codec import Limits
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
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
from starhub.wire.reports import Counters, HubReport, PeerReport
from starhub.wire.tree import accepted_path

log = logging.getLogger("starhub.hub")

TOKEN_BYTES = 1024
"""What the hub holds per session token besides the features it was sent: the id (in the
hub and in its drafting process), the lookup index's entries, and the drafting state grown
from it (the EAGLE head's KV cache). Measured with the embedded model's head: each further
4,096-token session grew the hub and its drafting process by about 1 kB a token all told,
its features (1.1 kB a token) being dropped once the head has read them; counting them at
their size on top covers the time they are held."""


class Hub(Server):
    role = "hub"
    log = log

    def __init__(self, drafter: Drafter, config: HubConfig | None = None):
        self.drafter = drafter
        self.config = config or HubConfig()
        self.metrics = HubMetrics()
        self.table: SessionTable[DraftSession, TargetPeer] = SessionTable(
            self.config.ttl_s, self.config.limits)
        super().__init__(self.table, Limits(self.config.max_message_bytes),
                         self.metrics.errors)
        self.sweep_s = min(1.0, self.config.ttl_s / 4)
        self.observers = Observers()
        self.control = Controller(self.config.control(calibrated=drafter.calibrated))
        self.worker = DraftWorker(drafter, self.config, self.table, self.metrics, self.control,
                                  self.reply, self.close)
        self.ready = asyncio.Event()
        self.accepting = True
        """False once shutting down (``starhub.hub.shutdown``): no new targets or sessions."""
        self._last_log = time.monotonic()
        self._logged: tuple = ()
        """What the last summary line counted: an idle hub logs it once, not every time."""

    async def serve(self) -> None:
        sock, release = self.bind(self.config.bind, self.config.security)
        log.info("hub listening on %s, drafter=%s, %s", self.bound, self.drafter.name,
                 self.config.shape)
        server = None
        if self.config.metrics_port:
            server, _ = serve_prometheus(PrometheusCollector(self.stats, self.metrics.counters),
                                         self.config.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", self.config.metrics_port)
        await self.worker.call(self.calibrate)
        self.ready.set()
        try:
            await self.run(sock, self.worker.run())
        finally:
            sock.close(self.linger_ms)
            release()
            self.worker.shutdown()
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

    def handle(self, identity: bytes, msg: Message) -> None:
        """Route one valid message. Anything that needs drafting goes to the buffer."""
        if not self.accepting and isinstance(msg, TargetCard | ObserverCard | Open):
            raise ProtocolError(ErrorCode.DRAINING, "the hub is shutting down", tag=msg.tag,
                                ref=getattr(msg, "ref", 0))
        if isinstance(msg, TargetCard):
            self.handle_target_card(identity, msg)
        elif isinstance(msg, ObserverCard):
            self.observers.add(identity)
            self.reply(identity, self.drafter_card())
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
            self.table.use(msg.tag, identity)
            self.close(msg.tag)
        else:
            raise ProtocolError(ErrorCode.BAD_TYPE, f"a hub does not accept {msg.TYPE}",
                                tag=msg.tag)

    def handle_target_card(self, identity: bytes, msg: TargetCard) -> None:
        reason = self.drafter.check_target(msg)
        retry = 0.0
        if reason is None and not self.worker.supervisor.healthy:
            reason, retry = self.worker.supervisor.unavailable, self.config.retry_after_s
        elif reason is None:
            reason = self.room_for(identity) or self.control.join(
                identity, msg.name, msg.step_ms / 1e3, time.monotonic())
            retry = self.config.retry_after_s
        if reason is not None:
            log.log(logging.DEBUG if reason.startswith("saturated") else logging.INFO,
                    "rejecting %s (%s): %s", msg.name, peer_name(identity), reason)
            self.reply(identity, Reject(code=int(ErrorCode.REJECTED), reason=reason,
                                        retry_after_s=retry))
            return
        self.metrics.peer(identity, msg.name)
        self.table.join(TargetPeer(identity=identity, principal=self.principal, name=msg.name,
                                   vocab_size=msg.vocab_size, hidden_size=msg.hidden_size,
                                   num_layers=msg.num_layers))
        log.info("target %s (%s) joined; %d admitted", msg.name, peer_name(identity),
                 len(self.table.peers))
        self.reply(identity, self.drafter_card())

    def drafter_card(self) -> DrafterCard:
        shape = self.config.shape
        return DrafterCard(drafter=self.drafter.name,
                           feature_layers=list(self.drafter.feature_layers),
                           depth=0 if self.config.adaptive else shape.depth, topk=shape.topk,
                           max_nodes=shape.max_nodes, ttl_s=self.config.ttl_s,
                           max_message_bytes=self.limits.max_message_bytes,
                           host=host_id(), cpus=cpu_ids())

    def close(self, tag: int) -> None:
        self.table.close(tag)
        self.control.close(tag)

    def forgot(self, peer: TargetPeer, why: str) -> None:
        """A target the table let go gives its admission slot back."""
        self.control.leave(peer.identity)
        self.metrics.forget(peer.identity)
        log.info("target %s (%s) left (%s); %d admitted", peer.name, peer_name(peer.identity),
                 why, len(self.table.peers))

    def _check_payload(self, peer: TargetPeer, msg: Open | Commit) -> None:
        """Token ids in the target's vocabulary; features where the drafter needs them."""
        check_ids(msg.tokens, peer.vocab_size, msg)
        if self.drafter.feature_layers and msg.features is None:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{msg.TYPE}: drafter '{self.drafter.name}' needs features",
                                tag=msg.tag, ref=getattr(msg, "ref", 0))
        width = self.drafter.feature_size
        if width and msg.features is not None and msg.features.shape[1] != width:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg.TYPE}: features must be {width} "
                                f"wide, got {msg.features.shape[1]}", tag=msg.tag,
                                ref=getattr(msg, "ref", 0))

    def held_bytes(self, msg: Open | Commit) -> int:
        """What an OPEN or COMMIT makes the hub hold: each token at ``TOKEN_BYTES``, and the
        features at their real size where the drafter keeps them."""
        feats = msg.features if self.drafter.feature_layers else None
        return len(msg.tokens) * TOKEN_BYTES + (feats.nbytes if feats is not None else 0)

    def handle_open(self, identity: bytes, msg: Open) -> None:
        peer = self.table.peer(identity, msg, "TARGET_CARD")
        if not self.worker.supervisor.healthy:
            raise ProtocolError(ErrorCode.REJECTED, self.worker.supervisor.unavailable,
                                ref=msg.ref)
        self.table.check_open(identity, len(msg.tokens), self.held_bytes(msg), msg.ref)
        self._check_payload(peer, msg)
        keep = msg.features is not None and self.drafter.feature_layers
        ctx = DraftContext(tokens=msg.tokens.tolist(), temperature=msg.temperature,
                           features=[msg.features] if keep else [], seed=msg.seed)
        session = self.table.add(DraftSession(tag=self.table.new_tag(), owner=identity, ctx=ctx,
                                              prompt_len=msg.prompt_len), len(msg.tokens),
                                 self.held_bytes(msg))
        self.control.open(session.tag, identity, msg.step_ms / 1e3, msg.shares_cores,
                          msg.batched)
        self.metrics.sessions_opened += 1
        self.enqueue(identity, session, msg.ref)

    def handle_commit(self, identity: bytes, msg: Commit) -> None:
        peer = self.table.peer(identity, msg, "TARGET_CARD")
        session = self.table.use(msg.tag, identity)
        if session.busy or msg.seq != session.seq:
            raise ProtocolError(ErrorCode.STALE,
                                f"COMMIT seq {msg.seq} does not answer the outstanding "
                                f"PROPOSE (seq {session.seq}, busy={session.busy})", tag=msg.tag)
        plain = session.choice.plain
        if plain and (msg.accepted or len(msg.tokens) > plain):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"COMMIT after a plain round of {plain} tokens carries "
                                f"{len(msg.tokens)} with {msg.accepted} accepted", tag=msg.tag)
        if not plain:
            self._check_accepted(session, msg)
        self._check_payload(peer, msg)
        held = self.held_bytes(msg)
        self.table.check_grow(session.tag, len(msg.tokens), held)
        now = time.monotonic()
        session.ctx.tokens.extend(msg.tokens.tolist())
        self.table.grew(session.tag, len(msg.tokens), held)
        if msg.features is not None and self.drafter.feature_layers:
            session.ctx.features.append(msg.features)  # the drafting thread copies it
        session.seq += 1
        returned = now - session.proposed_at if session.proposed_at is not None else None
        self.control.observe_commit(session.tag, msg.accepted, session.last_tree_depth,
                                    session.last_tree_size, msg.verify_ms / 1e3, returned,
                                    msg.step_ms / 1e3, msg.floor)
        self.metrics.committed(msg.accepted, len(msg.tokens), identity, plain=bool(plain),
                               looked_up=self._looked_up(session, msg))
        self.enqueue(identity, session, 0, tuple(msg.tokens.tolist()))

    @staticmethod
    def _check_accepted(session: DraftSession, msg: Commit) -> None:
        """A tree's COMMIT must be what walking that tree gives: its tokens follow
        ``accepted`` nodes from the root, then one token that no child there holds (the
        target's own). The count the controller learns acceptance from is then the hub's
        own, not the target's word."""
        tree = session.out_tree
        path = accepted_path(tree.tokens, tree.parents, msg.tokens) if tree is not None else []
        if len(path) != msg.accepted or len(msg.tokens) != msg.accepted + 1:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"COMMIT says {msg.accepted} of the {session.last_tree_size} "
                                f"nodes were accepted, but its {len(msg.tokens)} tokens walk "
                                f"{len(path)} nodes down the tree (a COMMIT carries the "
                                f"accepted path, then one token no child there holds)",
                                tag=msg.tag)

    @staticmethod
    def _looked_up(session: DraftSession, msg: Commit) -> int | None:
        """Accepted nodes that ``--lookup`` grafted (None: the tree had no graft)."""
        if not session.grafted or session.out_tree is None:
            return None
        tree = session.out_tree
        path = accepted_path(tree.tokens, tree.parents, msg.tokens[:msg.accepted])
        return sum(node >= session.grafted for node in path)

    def enqueue(self, identity: bytes, session: DraftSession, ref: int,
                committed: tuple[int, ...] = ()) -> None:
        """Ask the controller for this round's shape: a plain round is answered at once,
        a tree goes to the global buffer."""
        choice = self.control.choose(session.tag)
        session.choice = choice
        self.metrics.chose(choice.label)
        log.debug("session %d round %d: %s%s%s", session.tag, session.seq, choice.label,
                  f" floor {choice.floor:.3f}" if choice.floor else "",
                  " (probe)" if choice.probe else "")
        now = time.monotonic()
        if choice.plain:
            self.metrics.returned(session.tag, now)
            session.proposed_at = now
            session.out_tree = None
            self.reply(identity, Propose(tag=session.tag, seq=session.seq, ref=ref,
                                         leave=identity in self.control.unwanted,
                                         plain=choice.plain))
            return
        session.busy = True
        self.metrics.arrived(session.tag, identity, now)
        self.worker.submit(Request(identity, session, ref, now, committed))

    def housekeeping(self) -> None:
        """Release sessions idle past their TTL; log a one-line summary now and then, when
        something has changed since the last."""
        self.metrics.sessions_expired += self.expire()
        self.drop_idle_peers(self.config.peer_grace_s)
        self.review_targets()
        now = time.monotonic()
        if self.config.log_every_s and now - self._last_log >= self.config.log_every_s:
            self._last_log = now
            state = (self.metrics.rounds, self.metrics.plain_rounds, len(self.table),
                     len(self.table.peers), self.control.rejections)
            if state != self._logged and (self.metrics.rounds or self.metrics.plain_rounds):
                self._logged = state
                log.info("%s admitted=%d n_max=%s rejections=%d",
                         self.metrics.summary_line(len(self.table), len(self.table.peers)),
                         len(self.table.peers), self.control.n_max(), self.control.rejections)

    def review_targets(self) -> None:
        """Ask the control plane which targets it would rather lose; log when that changes."""
        before = len(self.control.unwanted)
        after = len(self.control.review(time.monotonic()))
        if after == before:
            return
        if not after:
            log.info("within the admission limit again: no target is asked to move")
            return
        limit = self.control.config.max_targets
        log.info("%d targets admitted, over the limit of %s: asking %d to move to another "
                 "hub of their pool", len(self.control.targets),
                 f"N_max={self.control.n_max()}" if limit == AUTO else limit, after)

    def stats(self, detail: bool = True) -> HubReport:
        """The report; without ``detail``, no per-target entries are even made (a hub with
        a thousand targets answers an aggregate STATS several times a second)."""
        snap = self.metrics.snapshot(len(self.table), len(self.table.peers))
        control = self.control.snapshot(time.monotonic(), targets=detail)
        snap.update(drafter=self.drafter.name,
                    depth=AUTO if self.config.adaptive else self.config.shape.depth,
                    topk=self.config.shape.topk, max_nodes=self.config.shape.max_nodes,
                    queue=len(self.worker.buffer),
                    threads=self.config.threads or torch.get_num_threads(),
                    max_targets=self.config.max_targets, admitted=control.admitted,
                    n_max=control.n_max, n_full=control.n_full,
                    cached_tokens=self.table.budget.cached,
                    rejections=control.rejections, control=control,
                    drafting=self.worker.supervisor.report())
        return msgspec.convert(snap, HubReport)

    def stats_reply(self, identity: bytes, request: StatsQuery) -> HubReport | PeerReport:
        """STATS_REPORT body: the snapshot; ``peer`` asks for the sender's own totals (its
        time split), ``counters`` adds raw totals for windowed rates. Other targets' entries
        only go to a peer that sent a card (``starhub.server.isolation``)."""
        if request.peer:
            totals = self.metrics.totals_of(identity)
            return PeerReport(peer=msgspec.structs.replace(totals) if totals else None)
        detail = identity in self.table.peers or identity in self.observers
        body = self.stats(detail)
        if request.counters:
            body.counters = msgspec.convert(
                self.metrics.counters(peers=request.peers and detail), Counters)
        return hub_view(body, detail)

