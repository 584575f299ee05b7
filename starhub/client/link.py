"""A target's link to its hub: how long to wait for a reply, and how to come back after the
hub died, hung, restarted or turned us away, without ever making decoding wait for it.

A reply is due within ``max(floor_s, factor × typical round trip)``: a hub that misses that
is treated as gone, and the caller finishes on its own. Reconnecting (a fresh TARGET_CARD) then
happens on a background thread with doubling backoff; the decoding thread adopts the new
connection at its next request. Attempts are cheap (one TARGET_CARD), so the backoff stops
growing at ``max_backoff_s``. A hub that REJECTs us is asked again after its
``retry_after_s`` the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from starhub.client.connection import HubClient, HubUnavailable
from starhub.wire.messages import DrafterCard, TargetCard

log = logging.getLogger("starhub.target")


class HubLink:
    def __init__(self, address: str, hello: Callable[[], TargetCard], name: str = "target",
                 floor_s: float = 3.0, factor: float = 10.0, max_backoff_s: float = 5.0,
                 client_options: dict | None = None):
        self.address = address
        self.hello = hello
        self.name = name
        self.floor_s = floor_s
        self.factor = factor
        self.max_backoff_s = max_backoff_s
        self.client_options = client_options or {}
        self.client: HubClient | None = None
        self.welcome: DrafterCard | None = None
        self.note = ""
        """Why there is no connection now, if there is none."""
        self.rtt_s = 0.0
        self._lock = threading.Lock()
        self._ready: tuple[HubClient, DrafterCard] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.reconnects = 0

    # -- deadlines --------------------------------------------------------------------
    @property
    def deadline_s(self) -> float:
        """How long a reply may take before the hub counts as gone."""
        return max(self.floor_s, self.factor * self.rtt_s)

    def observe(self, seconds: float) -> None:
        """A round trip that came back: the hub's typical pace, for the deadline."""
        self.rtt_s = seconds if not self.rtt_s else self.rtt_s + 0.1 * (seconds - self.rtt_s)

    # -- connection -------------------------------------------------------------------
    def connect(self) -> bool:
        """Send our TARGET_CARD now, on this thread (at start-up, or when the hub forgot us)."""
        self.close_client()
        outcome = self._attempt()
        if isinstance(outcome, tuple):
            self.client, self.welcome = outcome
            self.note = ""
            return True
        self._retry_later(outcome)
        return False

    def current(self) -> HubClient | None:
        """The connection to use for the next request, adopting one made in the background."""
        with self._lock:
            if self._ready is not None:
                self.close_client()
                self.client, self.welcome = self._ready
                self._ready = None
                self.note = ""
                self.reconnects += 1
                log.info("%s: back in touch with the hub at %s", self.name, self.address)
        if self.client is not None:
            self.client.timeout_s = self.deadline_s
        return self.client

    def failed(self, reason: str) -> None:
        """The hub missed a deadline or sent nonsense: drop it, reconnect in the background."""
        log.warning("%s: %s; decoding on its own and reconnecting in the background",
                    self.name, reason)
        self.close_client()
        self._retry_later(HubUnavailable(reason))

    def _attempt(self) -> tuple[HubClient, DrafterCard] | HubUnavailable:
        client = HubClient(self.address, timeout_s=max(self.floor_s, 5.0),
                           **self.client_options)
        try:
            return client, client.hello(self.hello())
        except HubUnavailable as exc:
            client.close()
            return exc

    def _retry_later(self, exc: HubUnavailable) -> None:
        self.note = str(exc)
        if exc.rejected and exc.retry_after_s <= 0:
            log.warning("%s: %s; decoding on its own", self.name, exc)
            return
        if self._thread is not None and self._thread.is_alive():
            return
        first = exc.retry_after_s if exc.retry_after_s > 0 else 0.5
        self._thread = threading.Thread(target=self._reconnect, args=(first,), daemon=True,
                                        name=f"{self.name}-reconnect")
        self._thread.start()

    def _reconnect(self, wait: float) -> None:
        backoff = 0.5
        while not self._closed.wait(wait):
            outcome = self._attempt()
            if isinstance(outcome, tuple):
                with self._lock:
                    self._ready = outcome
                return
            if outcome.retry_after_s > 0:
                wait = outcome.retry_after_s
            elif outcome.rejected:
                log.warning("%s: %s; decoding on its own", self.name, outcome)
                return
            else:
                backoff = min(2 * backoff, self.max_backoff_s)
                wait = backoff
            log.debug("%s: hub still unavailable (%s); next try in %.1fs", self.name,
                      outcome, wait)

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
