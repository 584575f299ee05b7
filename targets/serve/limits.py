"""What the HTTP server grants one client: a deadline for a request's headers, for its
body, and for each write of its response, and a cap on open connections. Without them a
client that sends its headers a byte at a time, a body shorter than its Content-Length, or
never reads its stream holds a connection (and, reading a stream, a request's place) for
as long as it likes.

uvicorn's HTTP/1.1 protocol (h11) times out only an idle keep-alive connection, and any
byte that arrives resets that timer; ``GuardedH11`` adds a deadline that runs from the
connection's start (or its last response) to the end of the next request's headers, which
no trickle of bytes extends."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
"""A request's headers must arrive within this, from the connection's start or the end
of the connection's last response."""
BODY_TIMEOUT_S = 30.0
"""A request's whole body must arrive within this of its headers (``app._read_body``)."""
WRITE_TIMEOUT_S = 30.0
"""A client that reads nothing of a response for this long is dropped: its request is
cancelled and its place given back."""


def max_connections(max_concurrency: int) -> int:
    """Open connections past which uvicorn answers 503: room for every request in flight,
    the clients polling /health and /metrics, and those turned away with a 429."""
    return 4 * max_concurrency + 32


class GuardedH11(H11Protocol):
    """``H11Protocol`` with a deadline for each request's headers (``HEADER_TIMEOUT_S``;
    ``header_timeout_s`` on the class for a server that needs another)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._waiting_after: object = None
        """The request cycle that was current when the wait for headers began."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_after:  # a request's headers have come
            self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._waiting_after = self.cycle
        self._header_deadline = self.loop.call_later(self.header_timeout_s,
                                                     self._headers_late)

    def _stop_waiting(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()
