"""The loop both servers run on one ROUTER socket: receive -> decode -> the server's handler,
whatever is wrong with a message answered with ERROR; replies queued in an outbox and sent
as they come; a housekeeping timer. The hub and the edge verifier subclass ``Server`` and
keep only their handlers (``handle``), their housekeeping and their own tasks (the hub's
drafting worker, the verifier's passes).

Nothing a peer sends can stop the loop: bad input gets an ERROR and serving goes on. Every
bad message is answered and counted, but only a few are logged (``BadInputLog``), so that a
flood of them cannot fill the disk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine

import numpy as np
import torch
import zmq
import zmq.asyncio

from starhub.server.limits import fair_share
from starhub.server.sessions import SessionTable
from starhub.wire.codec import Limits, configure_socket, decode, encode, error_for
from starhub.wire.messages import Error, ErrorCode, Message, ProtocolError
from starhub.wire.security import ServerSecurity, bind_server

STOP_POLL_S = 0.1
"""How often ``run``'s ``stop`` callable is asked."""
BAD_INPUT_WINDOW_S = 60.0
BAD_INPUT_PER_PEER = 5
BAD_INPUT_TOTAL = 50
"""Bad messages logged in one window: from one peer, and from all peers together."""
BAD_INPUT_PEERS = 4096
"""Peers counted one by one in a window; more than that all count as over their share."""
QUEUED_PER_PEER = 256
"""Replies waiting in the outbox for one peer at most; past it (or past its bytes, twice
the message cap) further replies to that peer are dropped and counted (``QUEUE_FULL``)."""
QUEUED_MESSAGES = 8
"""The outbox's bytes over all peers: this many times the message cap at most, with fair
shares; a peer with nothing queued always gets its reply in."""
HEADER_BYTES = 256
"""What a reply costs in the outbox besides its arrays (a generous header)."""


class BadInputLog:
    """Logs bad input at a bounded rate: in each window of ``window_s``, up to ``per_peer``
    lines for one peer and ``total`` for all; the rest are counted, and one line when the
    window ends says how many messages from how many peers went unlogged."""

    def __init__(self, log: logging.Logger, window_s: float = BAD_INPUT_WINDOW_S,
                 per_peer: int = BAD_INPUT_PER_PEER, total: int = BAD_INPUT_TOTAL,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.window_s, self.per_peer, self.total = log, window_s, per_peer, total
        self.clock = clock
        self.start = clock()
        self.logged: Counter[bytes] = Counter()
        self.held: Counter[bytes] = Counter()
        self.held_over = 0
        """Held back from peers past ``BAD_INPUT_PEERS`` in this window."""

    def record(self, identity: bytes, level: int, message: str, *args,
               exc_info: bool = False) -> None:
        """Log ``message % args`` about a message from ``identity``, if its share allows."""
        self.roll()
        if sum(self.logged.values()) < self.total and self.logged[identity] < self.per_peer:
            self.logged[identity] += 1
            self.log.log(level, message, *args, exc_info=exc_info)
        elif identity in self.held or len(self.held) < BAD_INPUT_PEERS:
            self.held[identity] += 1
        else:
            self.held_over += 1

    def roll(self) -> None:
        """Once the window is over: the count of what went unlogged, and a new window."""
        now = self.clock()
        if now - self.start < self.window_s:
            return
        held = sum(self.held.values()) + self.held_over
        if held:
            peers = len(self.held) + (1 if self.held_over else 0)
            worst, most = self.held.most_common(1)[0] if self.held else (b"", 0)
            self.log.warning("%d more bad messages from %s%d peer%s in the last %.0fs were "
                             "answered with an ERROR but not logged (most from %s: %d)", held,
                             "over " if self.held_over else "", peers,
                             "" if peers == 1 else "s", now - self.start, peer_name(worst),
                             most)
        self.start = now
        self.logged.clear()
        self.held.clear()
        self.held_over = 0


class Server:
    """One ROUTER socket's loop over one session ``table``. Subclasses set ``role`` and
    ``log`` and implement ``handle`` and ``close``; ``housekeeping`` runs every
    ``sweep_s``."""

    role = "server"
    log = logging.getLogger("starhub.server")
    sweep_s = 1.0

    def __init__(self, table: SessionTable, limits: Limits, errors: Counter):
        self.table = table
        self.limits = limits
        self.errors = errors
        """ERROR replies by code, where the server counts them."""
        self.outbox: collections.deque[tuple[bytes, Message]] = collections.deque()
        self.queued: Counter[bytes] = Counter()
        self.queued_bytes: Counter[bytes] = Counter()
        """Replies in the outbox per peer, and their bytes (``reply_bytes``)."""
        self.queued_total = 0
        self.principal = b""
        """Whom the message being handled counts against: its sender's CURVE key, or its
        connection (``principal_of``)."""
        self._outgoing = asyncio.Event()
        self.arrived = asyncio.Event()
        """Set after each message the receiver takes."""
        self.bound = ""
        self.linger_ms = 0
        self.bad_input = BadInputLog(self.log)

    # -- what a subclass provides -------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        raise NotImplementedError

    def close(self, tag: int) -> None:
        """Forget session ``tag`` (the table's entry and whatever the server holds for it)."""
        raise NotImplementedError

    def forgot(self, peer, why: str) -> None:
        """A peer the table no longer holds (idle past its grace, or pushed out to make
        room): whatever else the server keeps for it goes too."""
        self.log.info("%s forgotten (%s); %d peers", peer_name(peer.identity), why,
                      len(self.table.peers))

    def room_for(self, identity: bytes) -> str | None:
        """Before a card joins the table: room for one more peer (``SessionTable.make_room``),
        or why there is none."""
        try:
            gone = self.table.make_room(identity, self.principal)
        except ProtocolError as exc:
            return exc.message
        for peer in gone:
            self.forgot(peer, "idle the longest, to make room")
        return None

    def drop_idle_peers(self, grace_s: float) -> None:
        """Forget the peers that have held no session for ``grace_s``."""
        for peer in self.table.drop_idle(grace_s):
            self.forgot(peer, f"no session for {grace_s:g}s")

    def housekeeping(self) -> None:
        """Every ``sweep_s``: expire sessions, free slots, log."""
        self.expire()

    def expire(self) -> int:
        """Close the sessions silent past the TTL; how many there were."""
        tags = self.table.expired()
        for tag in tags:
            self.log.info("session %x expired after %.0fs without messages", tag,
                          self.table.ttl_s)
            self.close(tag)
        return len(tags)

    # -- messages -----------------------------------------------------------------------
    def on_frames(self, identity: bytes, frames: list) -> None:
        """Decode and route one message; whatever is wrong with it becomes an ERROR reply."""
        self.principal = principal_of(identity, frames)
        try:
            self.handle(identity, decode(frames, self.limits))
        except ProtocolError as exc:
            self.errors[exc.code.name] += 1
            # a peer forgotten after idling sends its card again on this error: routine
            level = logging.INFO if exc.code == ErrorCode.NO_CARD else logging.WARNING
            self.bad_input.record(identity, level, "peer %s: %s", peer_name(identity),
                                  exc.message)
            self.reply(identity, error_for(exc))
        except Exception:
            self.bad_input.record(identity, logging.ERROR, "internal error handling a message "
                                  "from %s", peer_name(identity), exc_info=True)
            self.errors["INTERNAL"] += 1
            self.reply(identity, Error(code=int(ErrorCode.INTERNAL),
                                       message=f"internal error; see the {self.role}'s log"))

    def reply(self, identity: bytes, msg: Message) -> None:
        """Queue ``msg`` for ``identity``, unless that peer already has its share of the
        outbox waiting (then it is dropped, counted and logged at a bounded rate)."""
        size = reply_bytes(msg)
        held = self.queued_bytes[identity]
        cap = QUEUED_MESSAGES * self.limits.max_message_bytes
        if held and (self.queued[identity] >= QUEUED_PER_PEER
                     or held + size > 2 * self.limits.max_message_bytes
                     or fair_share(held, size, self.queued_total, cap, len(self.queued))):
            self.errors["QUEUE_FULL"] += 1
            self.bad_input.record(identity, logging.WARNING, "dropped a %s for %s: %d replies "
                                  "(%d bytes) wait for it already", msg.TYPE,
                                  peer_name(identity), self.queued[identity], held)
            return
        self.outbox.append((identity, msg))
        self.queued[identity] += 1
        self.queued_bytes[identity] += size
        self.queued_total += size
        self._outgoing.set()

    def next_reply(self) -> tuple[bytes, Message]:
        """Take the oldest reply from the outbox (the sender, or a test in its place)."""
        identity, msg = self.outbox.popleft()
        size = reply_bytes(msg)
        self.queued_total -= size
        self.queued_bytes[identity] -= size
        self.queued[identity] -= 1
        if not self.queued[identity]:
            del self.queued[identity], self.queued_bytes[identity]
        return identity, msg

    # -- the loop -----------------------------------------------------------------------
    def bind(self, address: str, security: ServerSecurity) -> tuple[zmq.asyncio.Socket,
                                                                     Callable[[], None]]:
        """The ROUTER socket, bound; the callable releases what binding it took."""
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        configure_socket(sock, self.limits)
        release = bind_server(sock, address, security)
        self.bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock, release

    async def run(self, sock: zmq.asyncio.Socket, *tasks: Coroutine,
                  stop: Callable[[], bool] | None = None) -> None:
        """Receive, send and sweep on ``sock`` beside ``tasks`` until cancelled, or until
        ``stop()`` is true."""
        coros = [self.receiver(sock), self.sender(sock), self.sweeper(), *tasks]
        if stop is not None:
            coros.append(_until(stop))
        running = [asyncio.create_task(c) for c in coros]
        try:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a task that failed fails the server
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def receiver(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            self.on_frames(frames[0].bytes, frames[1:])
            self.arrived.set()
            # A ready message completes the await without yielding: without this, a peer
            # that keeps the socket full would starve the other tasks.
            await asyncio.sleep(0)

    async def receive_ready(self, sock: zmq.asyncio.Socket, most: int) -> None:
        """Handle up to ``most`` messages that are already there, without waiting."""
        for _ in range(most):
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.on_frames(frames[0].bytes, frames[1:])

    async def sender(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            while not self.outbox:
                self._outgoing.clear()
                await self._outgoing.wait()
            identity, msg = self.next_reply()
            try:
                await sock.send_multipart([identity, *encode(msg)], copy=False)
            except zmq.ZMQError as exc:
                self.log.warning("could not send %s to %s: %s", msg.TYPE, peer_name(identity),
                                 exc)

    async def sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.bad_input.roll()
            self.housekeeping()


async def _until(stop: Callable[[], bool]) -> None:
    while not stop():
        await asyncio.sleep(STOP_POLL_S)


def principal_of(identity: bytes, frames: list) -> bytes:
    """Whom a message counts against: the CURVE key its connection authenticated with (the
    ZAP User-Id on its frames: ``starhub.wire.security``), else the connection itself."""
    try:
        user = frames[-1].get("User-Id")
    except (AttributeError, IndexError, zmq.ZMQError):  # no CURVE (or no frames): none
        return identity
    return b"key:" + user.encode() if user else identity


def reply_bytes(msg: Message) -> int:
    """What a reply holds in the outbox: its arrays' bytes and a header."""
    size = HEADER_BYTES
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, np.ndarray):
            size += value.nbytes
        elif isinstance(value, torch.Tensor):
            size += value.numel() * value.element_size()
    return size


def peer_name(identity: bytes) -> str:
    """A peer's identity for a log line: printable ones as text, random ones in hex."""
    if identity.isascii() and identity.decode("ascii").isprintable():
        return identity.decode("ascii")[:32]
    return identity.hex()[:8]
