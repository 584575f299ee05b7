"""Wire framing: a msgpack header frame followed by one raw frame per array.

Arrays are sent zero-copy from their buffers and received as read-only views; nothing
is unpickled, and every size is checked before a byte is interpreted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from starhub.wire.messages import (
    MESSAGE_TYPES,
    VERSION,
    Error,
    ErrorCode,
    Message,
    ProtocolError,
    _int_or0,
    build,
    schema,
)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_HEADER_BYTES = 64 << 10
MAX_ARRAYS = 8

_WIRE_DTYPES = {"int32", "int64", "float16", "float32", "bfloat16"}
_NP_DTYPES = {name: np.dtype(np.uint16 if name == "bfloat16" else name) for name in _WIRE_DTYPES}
_DTYPE_NAMES: dict[np.dtype, str] = {}


class BFloat16Array(np.ndarray):
    """A uint16 view that remembers it holds bfloat16 bits (numpy has no bfloat16)."""

    is_bf16 = True


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


def to_wire(value: np.ndarray | torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of an array or CPU tensor, bfloat16 kept as raw bits."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16).view(BFloat16Array)
        return t.numpy()
    if isinstance(value, np.ndarray) and value.flags.c_contiguous:
        return value  # as it is: a BFloat16Array stays one
    return np.ascontiguousarray(value)


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """Wrap a received array as a tensor; copies because received buffers are read-only."""
    if getattr(arr, "is_bf16", False):
        return torch.from_numpy(np.array(arr.view(np.uint16)).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def _dtype_name(arr: np.ndarray) -> str:
    if getattr(arr, "is_bf16", False):
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
    frame = memoryview(arr.view(np.uint8).reshape(-1)) if arr.size else b""
    return _dtype_name(arr), list(arr.shape), frame


def frame_array(dtype: str, shape: list[int], buf: Any) -> np.ndarray:
    """The array a frame holds (read-only, no copy); ``dtype`` is a wire dtype name."""
    arr = np.frombuffer(buf, dtype=_NP_DTYPES[dtype]).reshape(shape)
    return arr.view(BFloat16Array) if dtype == "bfloat16" else arr


def encode(msg: Message) -> list[Any]:
    """Frames for one message: header first, then each present array's raw bytes."""
    sch = schema(type(msg))
    header: dict[str, Any] = {"v": VERSION, "type": msg.TYPE}
    for name in sch.header_names:
        header[name] = getattr(msg, name)
    specs, frames = [], []
    for spec in sch.arrays:
        value = getattr(msg, spec.name)
        if value is None:
            continue
        dtype, shape, frame = array_frame(value)
        specs.append([spec.name, dtype, shape])
        frames.append(frame)
    header["arrays"] = specs
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _frame_bytes(frame: Any) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    return memoryview(frame)


def decode(frames: list[Any], limits: Limits = Limits()) -> Message:
    """Parse and validate one message; any problem raises ProtocolError with a clear reason."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
    views = [_frame_bytes(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"message of {total} bytes exceeds the limit of "
                            f"{limits.max_message_bytes}")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header exceeds {MAX_HEADER_BYTES} bytes")
    try:
        header = msgpack.unpackb(views[0], raw=False, strict_map_key=True, use_list=True,
                                 max_str_len=MAX_HEADER_BYTES, max_bin_len=0,
                                 max_array_len=4096, max_map_len=256, max_ext_len=0)
    except Exception as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "header must be a msgpack map")
    tag = _int_or0(header.get("tag"))
    ref = _int_or0(header.get("ref"))
    version = header.get("v")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {version!r:.40} is not supported (this side speaks "
                            f"v{VERSION})", tag=tag, ref=ref)
    name = header.get("type")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.BAD_TYPE, f"unknown message type {name!r:.80}",
                            tag=tag, ref=ref)
    arrays = _decode_arrays(cls.TYPE, header.get("arrays", []), views[1:])
    try:
        return build(cls, header, arrays)
    except ProtocolError as exc:
        exc.tag, exc.ref = exc.tag or tag, exc.ref or ref
        raise


def _decode_arrays(msg_type: str, specs: Any, frames: list[memoryview]) -> dict[str, np.ndarray]:
    if not isinstance(specs, list) or len(specs) > MAX_ARRAYS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}: 'arrays' must be a short list")
    if len(specs) != len(frames):
        raise ProtocolError(ErrorCode.BAD_FRAME,
                            f"{msg_type}: header describes {len(specs)} arrays but "
                            f"{len(frames)} frames follow")
    arrays: dict[str, np.ndarray] = {}
    for spec, buf in zip(specs, frames, strict=True):
        if (not isinstance(spec, list) or len(spec) != 3 or not isinstance(spec[0], str)
                or spec[1] not in _WIRE_DTYPES or not isinstance(spec[2], list)
                or not all(isinstance(d, int) and 0 <= d < 1 << 31 for d in spec[2])
                or len(spec[2]) > 4):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}: bad array spec {spec!r:.80}")
        name, dtype, shape = spec
        if name in arrays:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}: array '{name}' given twice")
        np_dtype = _NP_DTYPES[dtype]
        expected = math.prod(shape) * np_dtype.itemsize  # Python ints: no int64 wrap-around
        if expected != buf.nbytes:
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"{msg_type}: array '{name}' {dtype}{shape} needs {expected} "
                                f"bytes, frame has {buf.nbytes}")
        arrays[name] = frame_array(dtype, shape, buf)
    return arrays


MAX_ERROR_TEXT = 1024


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
