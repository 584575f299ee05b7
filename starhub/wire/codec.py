"""Wire framing: a msgpack header frame followed by one raw frame per array.

msgspec encodes a message's Struct as the header; each array field is written there as
``[dtype, shape, frame]`` and its bytes go, zero-copy, in frame ``frame`` of the multipart
message (as vLLM v1's engine messages do). Arrays are received as read-only views.
Nothing is unpickled, and every size is checked before a byte is interpreted: the whole
message and its header against ``Limits``, each array's dtype against a whitelist and its
shape times itemsize against its frame.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Union

import msgspec
import numpy as np
import torch
import zmq

from starhub.wire.messages import (
    MESSAGES,
    VERSION,
    BFloat16Array,
    Error,
    ErrorCode,
    Framed,
    Message,
    ProtocolError,
)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 64 << 10
MAX_ARRAYS = 8
MAX_RANK = 4
MAX_ERROR_TEXT = 1024

_WIRE_DTYPES = {"int32", "int64", "float16", "float32", "bfloat16"}
_NP_DTYPES = {name: np.dtype(np.uint16 if name == "bfloat16" else name) for name in _WIRE_DTYPES}
_DTYPE_NAMES: dict[np.dtype, str] = {}


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def to_wire(value: np.ndarray | torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of an array or CPU tensor, bfloat16 kept as raw bits."""
    if isinstance(value, torch.Tensor):
        t = value
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.uint16).numpy().view(BFloat16Array)
        return t.numpy()
    if isinstance(value, np.ndarray) and value.flags.c_contiguous:
        return value  # as it is: a BFloat16Array stays one
    return np.ascontiguousarray(value)


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """Wrap a received array as a tensor; copies because received buffers are read-only."""
    if type(arr) is BFloat16Array:
        return torch.from_numpy(np.array(arr.view(np.uint16)).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def _dtype_name(arr: np.ndarray) -> str:
    if type(arr) is BFloat16Array:
        return "bfloat16"
    dtype = arr.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # ``dtype.name`` is slow; the few dtypes sent are remembered
        name = dtype.name
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def array_frame(value: np.ndarray | torch.Tensor) -> tuple[str, list[int], Any]:
    """An array's wire dtype name, its shape and its raw bytes as one frame (no copy for a
    contiguous CPU array)."""
    arr = to_wire(value)
    return _dtype_name(arr), list(arr.shape), memoryview(arr).cast("B") if arr.size else b""


def frame_array(dtype: str, shape: list[int], buf: Any) -> np.ndarray:
    """The array a frame holds (read-only, no copy); ``dtype`` is a wire dtype name."""
    return (BFloat16Array if dtype == "bfloat16" else np.ndarray)(shape, _NP_DTYPES[dtype], buf)


# -- the hooks that put arrays in frames of their own -----------------------------------------

class _Frames(threading.local):
    """The frames of the message being encoded or decoded on this thread."""

    out: list[Any] | None = None
    views: list[memoryview] = []
    used = 0
    """A bit per received frame that an array has claimed."""


_frames = _Frames()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | torch.Tensor):
        dtype, shape, frame = array_frame(obj)
        out = _frames.out
        out.append(frame)
        return (dtype, shape, len(out) - 1)
    raise NotImplementedError(f"cannot send {type(obj).__name__}")


def _dec_hook(cls: type, obj: Any) -> Any:
    """An array from its ``[dtype, shape, frame]`` in the header and the frame it names."""
    if cls is not np.ndarray:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"cannot receive {cls.__name__}")
    if type(obj) is not list or len(obj) != 3:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"bad array spec {obj!r:.80}")
    dtype, shape, index = obj
    np_dtype = _NP_DTYPES.get(dtype) if type(dtype) is str else None
    if np_dtype is None or type(shape) is not list or len(shape) > MAX_RANK:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"bad array spec {obj!r:.80}")
    size = np_dtype.itemsize  # Python ints: no int64 wrap-around
    for dim in shape:
        if type(dim) is not int or not 0 <= dim < 1 << 31:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"bad array shape {shape!r:.80}")
        size *= dim
    frames = _frames
    views, used = frames.views, frames.used
    if type(index) is not int or not 0 < index < len(views) or used >> index & 1:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {dtype}{shape} names frame "
                                                 f"{index!r:.20}, not a free one of "
                                                 f"{len(views)}")
    frames.used = used | 1 << index
    buf = views[index]
    if size != buf.nbytes:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"array {dtype}{shape} needs {size} bytes, "
                                                 f"frame {index} has {buf.nbytes}")
    return (BFloat16Array if dtype == "bfloat16" else np.ndarray)(shape, np_dtype, buf)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(msg: Framed) -> list[Any]:
    """Frames for one message: the header first, then each present array's raw bytes."""
    frames: list[Any] = [b""]
    _frames.out = frames
    try:
        frames[0] = _encoder.encode(msg)
    finally:
        _frames.out = None
    return frames


def _map_len(header: memoryview) -> int:
    """The entry count of the msgpack map that ``header`` starts with (a fixmap, map16 or
    map32: the decoder has read a map there)."""
    first = header[0]
    if first < 0x90:
        return first & 0x0F
    return int.from_bytes(header[1:3 if first == 0xDE else 5], "big")


def _as_int(value: Any) -> int:
    return value if type(value) is int else 0


class Decoder:
    """Decodes and validates the messages of one tagged union (the wire's, or the hub's
    link to its drafting process)."""

    def __init__(self, types: tuple[type[Framed], ...], max_arrays: int = MAX_ARRAYS):
        self.types = {cls.TYPE: cls for cls in types}
        self.max_arrays = max_arrays
        self._decoder = msgspec.msgpack.Decoder(Union[types], dec_hook=_dec_hook)  # noqa: UP007
        # every field is on the wire, none left to its default: a header has this many keys
        self._keys = {cls: len(cls.__struct_fields__) + 1 for cls in types}

    def decode(self, frames: list[Any], limits: Limits = Limits()) -> Framed:
        """Parse and validate one message; any problem raises ProtocolError with a clear
        reason."""
        if not frames:
            raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
        views = [f.buffer if type(f) is zmq.Frame else memoryview(f) for f in frames]
        total = sum([v.nbytes for v in views])
        if total > limits.max_message_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"message of {total} bytes exceeds the limit of "
                                f"{limits.max_message_bytes}")
        header = views[0]
        if header.nbytes > MAX_HEADER_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"header exceeds {MAX_HEADER_BYTES} bytes")
        if len(views) > self.max_arrays + 1:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(views) - 1} array frames exceed "
                                                     f"the limit of {self.max_arrays}")
        _frames.views, _frames.used = views, 0
        try:
            msg = self._decoder.decode(header)
        except msgspec.ValidationError as exc:
            raise self._refusal(header, ProtocolError(ErrorCode.BAD_FIELD, str(exc))) from None
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"header is not valid msgpack: {exc}") from None
        except ProtocolError as exc:  # from the array hook
            raise self._refusal(header, exc) from None
        finally:
            _frames.views = []
        if msg.v != VERSION:
            raise self._refusal(header, ProtocolError(ErrorCode.BAD_VERSION, "version"))
        if _map_len(header) != self._keys[type(msg)]:
            raise self._refusal(header, ProtocolError(
                ErrorCode.BAD_FIELD, "every field must be present, once"))
        if _frames.used != (1 << len(views)) - 2:
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"{msg.TYPE}: {len(views) - 1} frames follow, not each the "
                                f"array of a field", tag=getattr(msg, "tag", 0),
                                ref=getattr(msg, "ref", 0))
        msg.check()
        return msg

    def _refusal(self, header: memoryview, exc: ProtocolError) -> ProtocolError:
        """What is wrong first, in the order a reader meets it: not a map, the version,
        the type, then ``exc`` (the fields), each with the tag and ref it concerns."""
        try:
            raw = msgspec.msgpack.decode(header)
        except (msgspec.DecodeError, ValueError, RecursionError):
            raw = None
        if not isinstance(raw, dict):
            return ProtocolError(ErrorCode.BAD_FRAME, "header must be a msgpack map")
        tag, ref = _as_int(raw.get("tag")), _as_int(raw.get("ref"))
        version = raw.get("v")
        if type(version) is not int or version != VERSION:
            return ProtocolError(ErrorCode.BAD_VERSION,
                                 f"protocol version {version!r:.40} is not supported (this "
                                 f"side speaks v{VERSION})", tag=tag, ref=ref)
        name = raw.get("type")
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            return ProtocolError(ErrorCode.BAD_TYPE, f"unknown message type {name!r:.80}",
                                 tag=tag, ref=ref)
        return ProtocolError(exc.code, f"{cls.TYPE}: {exc.message}", tag=tag, ref=ref)


WIRE = Decoder(MESSAGES)


def decode(frames: list[Any], limits: Limits = Limits()) -> Message:
    """One wire message from its frames, validated (``Decoder.decode``)."""
    return WIRE.decode(frames, limits)  # type: ignore[return-value]


def error_for(exc: ProtocolError) -> Error:
    """The ERROR reply for ``exc``; its text is cut so that the reply always decodes."""
    return Error(tag=exc.tag, ref=exc.ref, code=int(exc.code),
                 message=exc.message[:MAX_ERROR_TEXT])


def configure_socket(sock: zmq.Socket, limits: Limits) -> None:
    """Bound memory per peer: ZeroMQ drops a peer whose frame exceeds twice the soft limit,
    while messages between the two limits get a TOO_LARGE error from ``decode``."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * limits.max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.setsockopt(zmq.SNDHWM, 10000)
