"""A client's connection to a server (a hub, or an edge verifier): one DEALER socket, sends
that never block, and replies awaited with a timeout, stale ones dropped. A server that
refuses us, goes silent or sends nonsense is reported as ``LinkDown``.

``HubClient`` is the star target's: the card handshake and request/reply by tag or ref."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from starhub.wire.codec import Limits, configure_socket, decode, encode
from starhub.wire.messages import (
    DrafterCard,
    Error,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Reject,
    TargetCard,
)
from starhub.wire.security import ClientSecurity, Handshakes, prepare_client

log = logging.getLogger("starhub.target")
_reported: set[tuple[str, str]] = set()
"""Refusals logged already: (address, cause)."""


class LinkDown(RuntimeError):
    """No answers from this server for now; ``retry_after_s`` > 0 when it said to ask again.
    ``rejected``: it turned us away (with ``retry_after_s`` 0: for good)."""

    def __init__(self, message: str, retry_after_s: float = 0.0, rejected: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rejected = rejected


class HubUnavailable(LinkDown):
    """No drafts from this hub for now."""


class HubError(RuntimeError):
    """The hub answered with ERROR for one of our sessions."""

    def __init__(self, err: Error):
        super().__init__(f"hub error {err.code}: {err.message}")
        self.error = err


class Connection:
    """One DEALER socket connected to ``address``. ``server`` names the far side and
    ``prefix`` starts our random identity ("t" a target, "d" a drafter). ``security``: how
    to connect (None: this process's default, ``use_client_security``)."""

    server = "server"
    down = LinkDown
    """What ``send`` and ``recv`` raise."""

    def __init__(self, address: str, timeout_s: float = 30.0, limits: Limits = Limits(),
                 security: ClientSecurity | None = None, prefix: str = "t",
                 role: str = "client"):
        self.address = address
        self.timeout_s = timeout_s
        self.limits = limits
        self.role = role
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        configure_socket(self.sock, limits)
        try:
            # a random identity, CURVE keys with this address's server key
            used = prepare_client(self.sock, prefix, security, address)
        except Exception:
            self.sock.close(0)
            raise
        self.handshakes = Handshakes(self.sock, used, address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.handshakes.monitor, zmq.POLLIN)
        self.sock.connect(address)

    def refused(self) -> None:
        """Raise ``down`` naming the likely cause if the server refused our handshake."""
        cause = self.handshakes.failure()
        if cause is None:
            return
        message = f"the {self.server} at {self.address} refused this {self.role}: {cause}"
        if (self.address, cause) not in _reported:  # once per process, not per reconnection
            _reported.add((self.address, cause))
            log.error("%s", message)
        raise self.down(message)

    def send(self, msg: Message) -> None:
        try:  # never block: a connection the server refused (CURVE) leaves no pipe to queue on
            self.sock.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.refused()
            raise self.down(f"cannot send to the {self.server} at {self.address}: it refused "
                            f"the connection (are this {self.role}'s CURVE keys allowed?)"
                            ) from None
        except zmq.ZMQError as exc:  # e.g. the connection was closed meanwhile
            raise self.down(f"cannot send to the {self.server} at {self.address}: {exc}") \
                from None

    def recv(self, timeout_s: float | None = None) -> Message:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        try:
            self.refused()  # refused already: say so now, not after the timeout
            while True:  # the monitor wakes us when a handshake ends; a refusal is raised
                ready = dict(self.poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
                if self.sock in ready:
                    break
                self.refused()
                if time.monotonic() >= deadline:
                    raise self.down(f"no reply from the {self.server} at {self.address} "
                                    f"within {timeout:.3g}s")
            frames = self.sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:  # e.g. the connection was closed meanwhile
            raise self.down(f"cannot read from the {self.server} at {self.address}: {exc}") \
                from None
        try:
            return decode(frames, self.limits)
        except ProtocolError as exc:
            raise self.down(f"the {self.server} sent an invalid message: {exc.message}") \
                from None

    def wait_for(self, wanted: Callable[[Message], bool]) -> Message:
        """The next message ``wanted`` accepts within ``timeout_s``; others (stale replies)
        are dropped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.down(f"no reply from the {self.server} at {self.address} within "
                                f"{self.timeout_s:.3g}s")
            msg = self.recv(left)
            if wanted(msg):
                return msg
            log.debug("dropping an unrelated %s for tag %d", msg.TYPE, msg.tag)

    def close(self, linger_ms: int = 0) -> None:
        """Close now; ``linger_ms``: how long messages still queued may take to leave."""
        self.handshakes.close()
        self.sock.close(linger_ms)


class HubClient(Connection):
    server = "hub"
    down = HubUnavailable

    def __init__(self, address: str, timeout_s: float = 30.0, limits: Limits = Limits(),
                 security: ClientSecurity | None = None):
        super().__init__(address, timeout_s, limits, security, prefix="t", role="target")
        self.drafter_card: DrafterCard | None = None

    def greet(self, card: TargetCard) -> DrafterCard:
        self.send(card)
        reply = self.recv()
        if isinstance(reply, Reject):
            raise HubUnavailable(f"the hub rejected this target: {reply.reason}",
                                 retry_after_s=reply.retry_after_s, rejected=True)
        if not isinstance(reply, DrafterCard):
            raise HubUnavailable(f"expected DRAFTER_CARD, got {reply.TYPE}: "
                                 f"{getattr(reply, 'message', '')}")
        problem = reply.unfit_for(card)  # checked before anything indexes by it
        if problem:
            raise HubUnavailable(f"the hub's DRAFTER_CARD asks for what this target cannot "
                                 f"send: {problem}", rejected=True)
        self.drafter_card = reply
        return reply

    def request(self, msg: Message, tag: int = 0, ref: int = 0) -> Message:
        """Send ``msg`` and wait for the reply that belongs to it."""
        self.send(msg)
        return self.reply_for(tag, ref)

    def reply_for(self, tag: int = 0, ref: int = 0) -> Message:
        """Wait for the reply to an earlier request for ``tag`` or ``ref``, dropping stale
        ones."""
        def ours(reply: Message) -> bool:
            return isinstance(reply, Error) and (reply.tag in (0, tag) or reply.ref == ref)

        def wanted(reply: Message) -> bool:
            return (ours(reply) or bool(tag and reply.tag == tag)
                    or bool(ref and getattr(reply, "ref", 0) == ref) or (not tag and not ref))

        reply = self.wait_for(wanted)
        if ours(reply):
            raise HubError(reply)
        return reply

    def ping(self) -> float:
        start = time.monotonic()
        reply = self.request(Ping(nonce=1))
        if not isinstance(reply, Pong):
            raise HubUnavailable(f"expected PONG, got {reply.TYPE}")
        return time.monotonic() - start
