"""A client's link to its server (the star target's hub, the edge drafter's verifier): the
connection in use, the handshake that makes a new one, how long to wait for a reply, and one
backoff for coming back after the server died, hung, restarted or turned us away.

A reply is due within ``max(floor_s, factor × typical round trip)``. The star target never
lets decoding wait for its hub: a hub that misses that deadline is treated as gone, the
target finishes on its own, and ``failed`` reconnects on a background thread; the decoding
thread adopts the new connection at its next request (``current``). Attempts are cheap
(one handshake), so the backoff stops growing at ``max_s``. A server that turns us away is
asked again after its ``retry_after_s`` the same way. The edge drafter cannot decode
without its verifier: it ``open``s in the foreground and waits ``backoff.delay`` between its
own attempts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from starhub.client.connection import Connection, LinkDown
from starhub.wire.messages import Message

log = logging.getLogger("starhub.client")


@dataclass(frozen=True)
class Backoff:
    """Doubling waits between attempts: ``first_s``, twice that, ... up to ``max_s``."""

    first_s: float = 0.5
    max_s: float = 5.0

    def delay(self, attempt: int) -> float:
        """The wait before retry number ``attempt`` (0: the first retry)."""
        return min(self.first_s * 2 ** attempt, self.max_s)


class Link:
    """``greet`` makes a connection and shakes hands on it, returning the connection and
    the server's card (a hub's DRAFTER_CARD, a verifier's TARGET_CARD), or raises ``LinkDown``."""

    def __init__(self, address: str, greet: Callable[[], tuple[Connection, Message]],
                 name: str = "client", floor_s: float = 3.0, factor: float = 10.0,
                 backoff: Backoff = Backoff()):
        self.address = address
        self.greet = greet
        self.name = name
        self.floor_s = floor_s
        self.factor = factor
        self.backoff = backoff
        self.client: Connection | None = None
        self.card: Message | None = None
        """What the server said about itself in the handshake."""
        self.note = ""
        """Why there is no connection now, if there is none."""
        self.rtt_s = 0.0
        self._lock = threading.Lock()
        self._ready: tuple[Connection, Message] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.reconnects = 0

    # -- deadlines --------------------------------------------------------------------
    @property
    def deadline_s(self) -> float:
        """How long a reply may take before the server counts as gone."""
        return max(self.floor_s, self.factor * self.rtt_s)

    def observe(self, seconds: float) -> None:
        """A round trip that came back: the server's typical pace, for the deadline."""
        self.rtt_s = seconds if not self.rtt_s else self.rtt_s + 0.1 * (seconds - self.rtt_s)

    # -- connection -------------------------------------------------------------------
    def open(self) -> Message:
        """Shake hands now, on this thread; the server's card, or ``LinkDown``."""
        self.close_client()
        self.client, self.card = self.greet()
        self.note = ""
        return self.card

    def connect(self) -> bool:
        """``open``, and on failure retry in the background (at start-up, or when the
        server forgot us)."""
        try:
            self.open()
            return True
        except LinkDown as exc:
            self._retry_later(exc)
            return False

    def current(self) -> Connection | None:
        """The connection to use for the next request, adopting one made in the background."""
        with self._lock:
            if self._ready is not None:
                self.close_client()
                self.client, self.card = self._ready
                self._ready = None
                self.note = ""
                self.reconnects += 1
                log.info("%s: back in touch with %s", self.name, self.address)
        if self.client is not None:
            self.client.timeout_s = self.deadline_s
        return self.client

    def failed(self, reason: str) -> None:
        """The server missed a deadline or sent nonsense: drop it, reconnect in the
        background."""
        log.warning("%s: %s; decoding on its own and reconnecting in the background",
                    self.name, reason)
        self.close_client()
        self._retry_later(LinkDown(reason))

    def _attempt(self) -> tuple[Connection, Message] | LinkDown:
        try:
            return self.greet()
        except LinkDown as exc:
            return exc

    def _retry_later(self, exc: LinkDown) -> None:
        self.note = str(exc)
        if exc.rejected and exc.retry_after_s <= 0:  # for good: a deployment that cannot work
            log.error("%s: %s; decoding on its own", self.name, exc)
            return
        if self._thread is not None and self._thread.is_alive():
            return
        first = exc.retry_after_s if exc.retry_after_s > 0 else self.backoff.delay(0)
        self._thread = threading.Thread(target=self._reconnect, args=(first,), daemon=True,
                                        name=f"{self.name}-reconnect")
        self._thread.start()

    def _reconnect(self, wait: float) -> None:
        failures = 0
        while not self._closed.wait(wait):
            outcome = self._attempt()
            if isinstance(outcome, tuple):
                with self._lock:
                    self._ready = outcome
                return
            if outcome.retry_after_s > 0:
                wait = outcome.retry_after_s
            elif outcome.rejected:
                log.error("%s: %s; decoding on its own", self.name, outcome)
                return
            else:
                failures += 1
                wait = self.backoff.delay(failures)
            log.debug("%s: %s still unavailable (%s); next try in %.1fs", self.name,
                      self.address, outcome, wait)

    def close_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> None:
        self._closed.set()
        self.close_client()
        with self._lock:
            if self._ready is not None:
                self._ready[0].close()
                self._ready = None
