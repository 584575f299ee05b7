"""Protocol v5 messages: small typed dataclasses with strict, declarative validation.

Every message travels as one multipart ZeroMQ message (see ``transport``). The header
fields of each dataclass are checked against their annotations; array fields are checked
for dtype and rank, then each message's ``check`` enforces the lengths that must agree.
Nothing received is trusted until ``validate`` has passed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

VERSION = 5
MAX_TREE_NODES = 1024
MAX_TOKENS = 1 << 20


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    BAD_FIELD = 4
    TOO_LARGE = 5
    UNKNOWN_TAG = 6
    NOT_OWNER = 7
    NO_HELLO = 8
    REJECTED = 9
    INTERNAL = 10
    STALE = 11


class ProtocolError(Exception):
    """A message that cannot be accepted; ``code`` goes back to the peer in an ERROR."""

    def __init__(self, code: ErrorCode, message: str, tag: int = 0, ref: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.tag = tag
        self.ref = ref


def array(dtype: str | tuple[str, ...], ndim: int, optional: bool = False) -> Any:
    """Declare an array field: the header describes it, a frame of its own carries it."""
    dtypes = (dtype,) if isinstance(dtype, str) else dtype
    meta = {"array": True, "dtypes": dtypes, "ndim": ndim, "optional": optional}
    if optional:
        return field(default=None, metadata=meta)
    return field(default_factory=lambda: np.zeros((0,) * ndim, dtypes[0]), metadata=meta)


FEATURE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    tag: int = 0
    seq: int = 0

    def check(self) -> None:
        """Cross-field consistency; raise ProtocolError(BAD_FIELD) on violation."""

    def fail(self, message: str) -> typing.NoReturn:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{self.TYPE}: {message}", tag=self.tag,
                            ref=getattr(self, "ref", 0))


@dataclass
class Hello(Message):
    """A target announces itself; the hub checks that it can draft for this model."""

    TYPE: ClassVar[str] = "HELLO"
    name: str = ""
    vocab_size: int = 0
    tokenizer_fp: str = ""
    hidden_size: int = 0
    num_layers: int = 0
    step_ms: float = 0.0
    """The target's own one-token step, measured: its standalone speed (0: unknown)."""
    observer: bool = False
    """Only watching (``starhub status``, the benchmark): no admission, no sessions; the
    server answers with its own introduction and shows this peer per-peer STATS."""

    def check(self) -> None:
        if self.vocab_size <= 0 and not self.observer:
            self.fail("vocab_size must be positive")
        _check_ms(self, "step_ms", self.step_ms)


@dataclass
class Welcome(Message):
    """The hub's answer to HELLO: what it drafts and which features it needs."""

    TYPE: ClassVar[str] = "WELCOME"
    drafter: str = ""
    feature_layers: list[int] = field(default_factory=list)
    depth: int = 0
    """Tree depth, or 0 when the hub chooses it round by round (``--depth auto``)."""
    topk: int = 0
    max_nodes: int = 0
    ttl_s: float = 0.0
    max_message_bytes: int = 0


@dataclass
class Reject(Message):
    TYPE: ClassVar[str] = "REJECT"
    code: int = 0
    reason: str = ""
    """``saturated`` when admission would slow a target below its standalone speed."""
    retry_after_s: float = 0.0
    """When asking again may succeed; 0: it will not."""


@dataclass
class Open(Message):
    """Start a session. ``tokens`` is the prompt plus the first token the target chose.

    ``features`` holds one row per prompt token, so row i pairs with token i+1.
    """

    TYPE: ClassVar[str] = "OPEN"
    ref: int = 0
    prompt_len: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    step_ms: float = 0.0
    target_tok_s: float = 0.0
    """Edge: the speed this session asks the verifier for (0: none); deadlines follow."""
    budget: int = 0
    """Edge, the verifier's reply: the nodes of the first tree (0: the drafter's own)."""
    tokens: np.ndarray = array("int32", 1)
    features: np.ndarray | None = array(FEATURE_DTYPES, 2, optional=True)

    def check(self) -> None:
        n = len(self.tokens)
        _check_ms(self, "step_ms", self.step_ms)
        if not 0 <= self.budget <= MAX_TREE_NODES:
            self.fail(f"budget must lie in [0, {MAX_TREE_NODES}], got {self.budget}")
        if not 0 <= self.target_tok_s < 1e6:
            self.fail(f"target_tok_s must lie in [0, 1e6), got {self.target_tok_s}")
        if n < 1 or n > MAX_TOKENS:
            self.fail(f"tokens must hold 1..{MAX_TOKENS} ids, got {n}")
        if not 0 < self.prompt_len < n + 1:
            self.fail(f"prompt_len {self.prompt_len} out of range for {n} tokens")
        if not 0 <= self.temperature < math.inf or not 0 < self.top_p <= 1:
            self.fail("temperature must be finite and >= 0, and top_p in (0, 1]")
        if self.features is not None and self.features.shape[0] != n - 1:
            self.fail(f"features need {n - 1} rows (one per token before the last), "
                      f"got {self.features.shape[0]}")
        _check_finite(self, self.features)


@dataclass
class Propose(Message):
    """A draft tree. ``parents[i]`` is -1 for children of the last committed token.

    Siblings appear in the order they were drawn; for sampling, row 0 of ``dist_*`` is the
    draft distribution at the root and row i+1 the one at node i. ``plain`` > 0 carries no
    tree: the target decodes that many tokens on its own, then commits them.
    """

    TYPE: ClassVar[str] = "PROPOSE"
    ref: int = 0
    plain: int = 0
    tokens: np.ndarray = array("int32", 1)
    parents: np.ndarray = array("int32", 1)
    dist_ids: np.ndarray | None = array("int32", 2, optional=True)
    dist_probs: np.ndarray | None = array("float32", 2, optional=True)

    def check(self) -> None:
        n = len(self.tokens)
        if n > MAX_TREE_NODES:
            self.fail(f"{n} nodes exceed the limit of {MAX_TREE_NODES}")
        if not 0 <= self.plain <= MAX_TREE_NODES + 1 or (self.plain and n):
            self.fail(f"plain={self.plain}: a plain round carries 1..{MAX_TREE_NODES + 1} "
                      f"tokens to decode and no tree")
        if len(self.parents) != n:
            self.fail(f"parents has {len(self.parents)} entries for {n} tokens")
        # ndarray methods rather than np.any/np.all: the same test without their dispatch
        if n and ((self.parents < -1) | (self.parents >= np.arange(n))).any():
            self.fail("every parent index must be -1 or an earlier node")
        if (self.dist_ids is None) != (self.dist_probs is None):
            self.fail("dist_ids and dist_probs come together")
        if self.dist_ids is not None:
            if self.dist_ids.shape != self.dist_probs.shape or self.dist_ids.shape[0] != n + 1:
                self.fail(f"dist arrays must both be [{n + 1}, k]")
            if not np.isfinite(self.dist_probs).all() or (self.dist_probs < 0).any():
                self.fail("dist_probs must be finite and non-negative")


@dataclass
class Commit(Message):
    """The tokens a round added: accepted tree nodes then the bonus token, or after a plain
    round the tokens the target decoded alone (``accepted`` 0).

    ``features`` carries one row per new token, for the token before it and the accepted
    ones: the bonus token's own feature is not known until the next verification.
    ``verify_ms`` is the target's time for this round's verification (or plain steps) and
    ``step_ms`` its latest one-token step: the hub's load model learns from both.
    ``budget`` (edge) is the verifier's grant for the next tree: at most that many nodes
    (0: no advice).
    """

    TYPE: ClassVar[str] = "COMMIT"
    accepted: int = 0
    verify_ms: float = 0.0
    step_ms: float = 0.0
    budget: int = 0
    tokens: np.ndarray = array("int32", 1)
    features: np.ndarray | None = array(FEATURE_DTYPES, 2, optional=True)

    def check(self) -> None:
        n = len(self.tokens)
        if not 1 <= n <= MAX_TREE_NODES + 1:
            self.fail(f"tokens must hold 1..{MAX_TREE_NODES + 1} ids, got {n}")
        if not 0 <= self.accepted <= n - 1:
            self.fail(f"accepted={self.accepted} disagrees with {n} tokens")
        _check_ms(self, "verify_ms", self.verify_ms)
        _check_ms(self, "step_ms", self.step_ms)
        if not 0 <= self.budget <= MAX_TREE_NODES:
            self.fail(f"budget must lie in [0, {MAX_TREE_NODES}], got {self.budget}")
        if self.features is not None and self.features.shape[0] != n:
            self.fail(f"features need {n} rows, got {self.features.shape[0]}")
        _check_finite(self, self.features)


@dataclass
class Close(Message):
    TYPE: ClassVar[str] = "CLOSE"


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "ERROR"
    ref: int = 0
    code: int = 0
    message: str = ""


@dataclass
class Ping(Message):
    TYPE: ClassVar[str] = "PING"
    nonce: int = 0


@dataclass
class Pong(Message):
    TYPE: ClassVar[str] = "PONG"
    nonce: int = 0


@dataclass
class Stats(Message):
    """Ask for (empty ``body``) or deliver (filled ``body``) the hub's metrics snapshot."""

    TYPE: ClassVar[str] = "STATS"
    body: dict = field(default_factory=dict)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Reject, Open, Propose, Commit, Close, Error, Ping, Pong, Stats)
}

_SCALARS = {int: (int,), float: (int, float), str: (str,), bool: (bool,), dict: (dict,)}
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
_MAX_STR = 4096


@dataclass(frozen=True)
class _ArraySpec:
    name: str
    dtypes: tuple[str, ...]
    ndim: int
    optional: bool
    np_dtypes: frozenset[np.dtype]
    """The numpy dtypes whose arrays pass at once; any other goes through the full check."""


@dataclass(frozen=True)
class Schema:
    """Everything ``build`` and ``encode`` derive from a message class, worked out once.

    ``header`` pairs each header field's name with its validator, ``arrays`` describes the
    array fields; both keep the dataclass's field order.
    """

    cls: type[Message]
    header_fields: tuple[dataclasses.Field, ...]
    array_fields: tuple[dataclasses.Field, ...]
    header: tuple[tuple[str, typing.Callable[[Any], Any]], ...]
    header_names: tuple[str, ...]
    arrays: tuple[_ArraySpec, ...]
    array_names: frozenset[str]


@functools.cache
def schema(cls: type[Message]) -> Schema:
    """The class's schema, built on first use: ``typing.get_type_hints`` (the costly part)
    and ``dataclasses.fields`` run once per class instead of once per message."""
    fields = dataclasses.fields(cls)
    header_fs = tuple(f for f in fields if not f.metadata.get("array"))
    array_fs = tuple(f for f in fields if f.metadata.get("array"))
    hints = typing.get_type_hints(cls)
    arrays = tuple(
        _ArraySpec(f.name, tuple(f.metadata["dtypes"]), f.metadata["ndim"], f.metadata["optional"],
                   frozenset(np.dtype(d) for d in f.metadata["dtypes"] if d != "bfloat16"))
        for f in array_fs)
    return Schema(cls=cls, header_fields=header_fs, array_fields=array_fs,
                  header=tuple((f.name, _scalar_checker(cls.TYPE, f.name, hints[f.name]))
                               for f in header_fs),
                  header_names=tuple(f.name for f in header_fs), arrays=arrays,
                  array_names=frozenset(f.name for f in array_fs))


def array_fields(cls: type[Message]) -> list[dataclasses.Field]:
    return list(schema(cls).array_fields)


def header_fields(cls: type[Message]) -> list[dataclasses.Field]:
    return list(schema(cls).header_fields)


def _check_scalar(msg_type: str, name: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or len(value) > 1024:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}.{name} must be a short list")
        return [_check_scalar(msg_type, name, item, v) for v in value]
    allowed = _SCALARS[hint]
    if isinstance(value, bool) and hint is not bool or not isinstance(value, allowed):
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"{msg_type}.{name} must be {hint.__name__}, "
                            f"got {type(value).__name__}")
    if hint is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}.{name} out of range")
    if hint is str and len(value) > _MAX_STR:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{msg_type}.{name} longer than {_MAX_STR}")
    return float(value) if hint is float else value


def _scalar_checker(msg_type: str, name: str, hint: Any) -> typing.Callable[[Any], Any]:
    """A validator for one header field: a fast path for the plain values msgpack yields,
    and ``_check_scalar`` (the rules, and their error messages) for anything else."""
    def slow(value: Any) -> Any:
        return _check_scalar(msg_type, name, hint, value)

    if typing.get_origin(hint) is list or hint not in _SCALARS:
        return slow
    lo, hi = _INT_RANGE
    if hint is int:
        def check(value: Any) -> Any:
            return value if type(value) is int and lo <= value <= hi else slow(value)
    elif hint is float:
        def check(value: Any) -> Any:
            return value if type(value) is float else slow(value)
    elif hint is str:
        def check(value: Any) -> Any:
            return value if type(value) is str and len(value) <= _MAX_STR else slow(value)
    else:  # bool, dict: exactly that type, no range
        def check(value: Any, exact: type = hint) -> Any:
            return value if type(value) is exact else slow(value)
    return check


def build(cls: type[Message], header: dict, arrays: dict[str, np.ndarray]) -> Message:
    """Construct a message from decoded parts, validating every field."""
    sch = schema(cls)
    kwargs: dict[str, Any] = {}
    for name, check in sch.header:
        if name not in header:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.TYPE} is missing field '{name}'",
                                tag=_int_or0(header.get("tag")))
        kwargs[name] = check(header[name])
    for spec in sch.arrays:
        arr = arrays.get(spec.name)
        if arr is None:
            if not spec.optional:
                raise ProtocolError(ErrorCode.BAD_FIELD,
                                    f"{cls.TYPE} is missing array '{spec.name}'",
                                    tag=kwargs.get("tag", 0))
        elif (arr.dtype not in spec.np_dtypes and not _is_bf16(arr, spec.dtypes)
              and arr.dtype.name not in spec.dtypes):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{cls.TYPE}.{spec.name} must be {'/'.join(spec.dtypes)}")
        elif arr.ndim != spec.ndim:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{cls.TYPE}.{spec.name} must have {spec.ndim} dimensions")
        kwargs[spec.name] = arr
    if not sch.array_names.issuperset(arrays):
        extra = set(arrays) - sch.array_names
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.TYPE} has unknown arrays {sorted(extra)}")
    msg = cls(**kwargs)
    msg.check()
    return msg


def _check_ms(msg: Message, name: str, value: float) -> None:
    if not 0 <= value < 1e7:
        msg.fail(f"{name} must be a finite duration in [0, 1e7) ms, got {value}")


def _check_finite(msg: Message, features: np.ndarray | None) -> None:
    """NaN or infinite features would poison a drafter's state for the rest of a session."""
    if features is None or not features.size:
        return
    if getattr(features, "is_bf16", False):  # raw bfloat16 bits: all-ones exponent
        bits = features.view(dtype=np.uint16, type=np.ndarray)  # plain: subclass ufuncs are slow
        finite = not ((bits & 0x7F80) == 0x7F80).any()
    else:
        finite = bool(np.isfinite(features).all())
    if not finite:
        msg.fail("features must be finite")


def _is_bf16(arr: np.ndarray, dtypes: tuple[str, ...]) -> bool:
    return "bfloat16" in dtypes and getattr(arr, "is_bf16", False)


def _int_or0(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
