"""A ZMTP 3.0 peer on a plain TCP socket, not libzmq, for what libzmq's own peers never send:
a multipart message that never ends.

libzmq bounds each frame (``ZMQ_MAXMSGSIZE``), not a multipart message, and holds an
unfinished one in memory (the high-water marks count whole messages only,
zeromq/libzmq#4526). A peer that gets past the handshake can therefore make a server hold
whatever it sends as long as every frame carries MORE; the only defence is to keep such a
peer from getting past the handshake (CURVE, ``starhub.wire.security``).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def greeting(mechanism: bytes = b"NULL") -> bytes:
    """Signature (0xFF, 8 bytes of padding, 0x7F), version 3.0, the mechanism padded to 20
    bytes, as-server 0, 31 bytes of filler: 64 bytes."""
    return (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0")
            + b"\0" + bytes(31))


def ready(socket_type: bytes = b"DEALER") -> bytes:
    """The NULL mechanism's READY command with one property, Socket-Type."""
    name = b"Socket-Type"
    body = (b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type))
            + socket_type)
    return bytes([COMMAND, len(body)]) + body


@dataclass
class Sent:
    bytes: int
    """What the kernel took before sending stopped or the total was reached."""
    stopped: str = ""
    """Why sending stopped early, or "" if it did not."""
    closed: bool = False
    """It stopped because the server closed (or reset) the connection."""


class RawPeer:
    """One TCP connection that greets as a NULL-mechanism DEALER and then sends frames that
    all carry MORE. Every send has a timeout, so that it never hangs."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)

    def greet(self) -> Sent:
        return self._send(greeting() + ready())

    def send_unending(self, total: int, frame: int = 1 << 20) -> Sent:
        """Frames of ``frame`` bytes, each flagged MORE (and LONG: an 8-byte length), until
        ``total`` bytes are sent; the message is never finished."""
        body = bytes(frame)
        header = bytes([MORE | LONG]) + struct.pack(">Q", frame)
        done = 0
        while done < total:
            step = self._send(header + body)
            done += step.bytes
            if step.stopped:
                return Sent(done, step.stopped, step.closed)
        return Sent(done)

    def _send(self, data: bytes) -> Sent:
        view, sent = memoryview(data), 0
        try:
            while sent < len(view):
                sent += self.sock.send(view[sent:])
        except ConnectionError as exc:  # reset, or a broken pipe: the server closed it
            return Sent(sent, f"{type(exc).__name__}: {exc}", closed=True)
        except OSError as exc:  # a send timeout: the server stopped reading
            return Sent(sent, f"{type(exc).__name__}: {exc}")
        return Sent(sent)

    def close(self) -> None:
        self.sock.close()
