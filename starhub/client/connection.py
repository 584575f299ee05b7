"""A target's connection to a hub: one DEALER socket, handshake, and request/reply with
timeouts. A hub that rejects us or goes silent is reported as HubUnavailable, and the
caller decodes on its own."""

from __future__ import annotations

import logging
import time

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
from starhub.wire.security import ClientCurve, prepare_client

log = logging.getLogger("starhub.target")


class HubUnavailable(RuntimeError):
    """No drafts from this hub for now; ``retry_after_s`` > 0 when it said to ask again.
    ``rejected``: the hub answered REJECT (with ``retry_after_s`` 0: for good)."""

    def __init__(self, message: str, retry_after_s: float = 0.0, rejected: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rejected = rejected


class HubError(RuntimeError):
    """The hub answered with ERROR for one of our sessions."""

    def __init__(self, err: Error):
        super().__init__(f"hub error {err.code}: {err.message}")
        self.error = err


class HubClient:
    def __init__(self, address: str, timeout_s: float = 30.0,
                 limits: Limits = Limits(), curve: ClientCurve | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.limits = limits
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        configure_socket(self.sock, limits)
        prepare_client(self.sock, "t", curve)  # random identity; CURVE keys if any
        self.sock.connect(address)
        self.welcome: DrafterCard | None = None

    def send(self, msg: Message) -> None:
        try:  # never block: a connection the hub refused (CURVE) leaves no pipe to queue on
            self.sock.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise HubUnavailable(f"cannot send to the hub at {self.address}: it refused the "
                                 f"connection (are this target's CURVE keys allowed?)") from None

    def recv(self, timeout_s: float | None = None) -> Message:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self.sock.poll(int(timeout * 1000)):
            raise HubUnavailable(f"no reply from the hub at {self.address} within {timeout:.0f}s")
        frames = self.sock.recv_multipart(copy=False)
        try:
            return decode(frames, self.limits)
        except ProtocolError as exc:
            raise HubUnavailable(f"the hub sent an invalid message: {exc.message}") from None

    def hello(self, hello: TargetCard) -> DrafterCard:
        self.send(hello)
        reply = self.recv()
        if isinstance(reply, Reject):
            raise HubUnavailable(f"the hub rejected this target: {reply.reason}",
                                 retry_after_s=reply.retry_after_s, rejected=True)
        if not isinstance(reply, DrafterCard):
            raise HubUnavailable(f"expected DRAFTER_CARD, got {reply.TYPE}: "
                                 f"{getattr(reply, 'message', '')}")
        self.welcome = reply
        return reply

    def request(self, msg: Message, tag: int = 0, ref: int = 0) -> Message:
        """Send ``msg`` and wait for the reply that belongs to it."""
        self.send(msg)
        return self.reply_for(tag, ref)

    def reply_for(self, tag: int = 0, ref: int = 0) -> Message:
        """Wait for the reply to an earlier request for ``tag`` or ``ref``, dropping stale
        ones."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HubUnavailable(f"no reply from the hub at {self.address} within "
                                     f"{self.timeout_s:.0f}s")
            reply = self.recv(left)
            if isinstance(reply, Error) and (reply.tag in (0, tag) or reply.ref == ref):
                raise HubError(reply)
            if (tag and reply.tag == tag) or (ref and getattr(reply, "ref", 0) == ref):
                return reply
            if not tag and not ref:
                return reply
            log.debug("dropping unrelated %s for tag %d", reply.TYPE, reply.tag)

    def ping(self) -> float:
        start = time.monotonic()
        reply = self.request(Ping(nonce=1))
        if not isinstance(reply, Pong):
            raise HubUnavailable(f"expected PONG, got {reply.TYPE}")
        return time.monotonic() - start

    def close(self) -> None:
        self.sock.close(0)
