"""Protocol v9 messages: msgspec Structs, one tagged union keyed on ``type``.

Every message travels as one multipart ZeroMQ message (see ``codec``): a msgpack header
holding the Struct's fields, then one raw frame per array. The types and constraints
below (ranges, string and list lengths) are enforced by msgspec while the header is
decoded; array fields name their allowed dtypes and rank with ``Array``; ``check`` adds
what relates one field to another. Nothing received is trusted until both have passed.

The handshake names its messages by what they carry, so that both topologies use them
with one meaning: a ``TargetCard`` describes a target (the star's target introduces
itself with one; the edge's verifier answers a drafter with one), a ``DrafterCard``
describes a drafter (the hub's answer; the edge drafter's introduction). An observer
(``starhub status``, the benchmark) sends an ``ObserverCard`` and gets the server's card.
"""

from __future__ import annotations

import enum
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from msgspec import Meta

from starhub.wire.reports import StatsBody
from starhub.wire.text import printable

VERSION = 9
MAX_TREE_NODES = 1024
MAX_TOKENS = 1 << 20
MAX_TEXT = 4096
MAX_LIST = 1024
MAX_CPUS = 8192
"""CPU ids a DRAFTER_CARD may list (a host's CPUs)."""
MAX_DIST_WIDTH = 256
"""Entries of one node's draft distribution (``Propose.dist_ids``' second dimension): the
drafters send their tree shape's ``support`` (16) of them."""


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    BAD_FIELD = 4
    TOO_LARGE = 5
    UNKNOWN_TAG = 6
    NOT_OWNER = 7
    NO_CARD = 8
    """A session message from a peer that has not introduced itself with its card."""
    REJECTED = 9
    INTERNAL = 10
    STALE = 11
    DRAINING = 12
    """The hub is shutting down: the target's sessions there are over, and its next ones
    belong on another hub of its pool (or alone)."""


class ProtocolError(Exception):
    """A message that cannot be accepted; ``code`` goes back to the peer in an ERROR."""

    def __init__(self, code: ErrorCode, message: str, tag: int = 0, ref: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.tag = tag
        self.ref = ref


@dataclass(frozen=True)
class Array:
    """An array field's allowed wire dtypes and rank: ``Annotated[np.ndarray, Array(...)]``."""

    dtypes: tuple[str, ...]
    ndim: int
    np_dtypes: frozenset[np.dtype] = frozenset()
    """The numpy dtypes of ``dtypes`` (bfloat16 has none: ``BFloat16Array``)."""
    bf16: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "np_dtypes",
                           frozenset(np.dtype(d) for d in self.dtypes if d != "bfloat16"))
        object.__setattr__(self, "bf16", "bfloat16" in self.dtypes)


class BFloat16Array(np.ndarray):
    """A uint16 view that remembers it holds bfloat16 bits (numpy has no bfloat16)."""


FEATURE_DTYPES = ("float16", "bfloat16", "float32")

Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Ms = Annotated[float, Meta(ge=0, lt=1e7)]
"""A duration in milliseconds: finite, non-negative."""
Budget = Annotated[int, Meta(ge=0, le=MAX_TREE_NODES)]
"""Nodes of a tree (0: no advice)."""
Probability = Annotated[float, Meta(ge=0, le=1)]
"""A probability: finite, in [0, 1]."""
TEMPERATURE = Meta(ge=0)
"""A sampling temperature (0: greedy); checked finite as well."""
TOP_P = Meta(gt=0, le=1)
TOK_S = Meta(ge=0, lt=1e6)
"""A speed a session asks for, in tokens per second (0: none)."""
Tokens = Annotated[np.ndarray, Array(("int32",), 1)]
Features = Annotated[np.ndarray, Array(FEATURE_DTYPES, 2)]


def _no_tokens() -> np.ndarray:
    return np.zeros(0, np.int32)


class Framed(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True,
             gc=False):
    """Anything sent as a msgpack header plus raw array frames: the wire's messages and the
    hub's link to its drafting process. ``v`` is the protocol version."""

    TYPE: ClassVar[str] = ""
    ARRAYS: ClassVar[tuple[tuple[str, Array], ...]] = ()
    """The array fields with their ``Array`` rule; filled in once per class below."""
    v: int = VERSION

    def check(self) -> None:
        """Each array's dtype and rank, then ``check_fields``; raise ProtocolError."""
        for name, rule in self.ARRAYS:
            arr = getattr(self, name)
            if arr is None:
                continue
            if arr.dtype not in rule.np_dtypes and not (rule.bf16 and type(arr) is BFloat16Array):
                self.fail(f"{name} must be {'/'.join(rule.dtypes)}")
            if arr.ndim != rule.ndim:
                self.fail(f"{name} must have {rule.ndim} dimensions")
        self.check_fields()

    def check_fields(self) -> None:
        """Cross-field consistency; raise ProtocolError(BAD_FIELD) on violation."""

    def fail(self, message: str) -> typing.NoReturn:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{self.TYPE}: {message}",
                            tag=getattr(self, "tag", 0), ref=getattr(self, "ref", 0))


class Message(Framed):
    """A wire message: ``tag`` names the session, ``seq`` its round."""

    tag: int = 0
    seq: int = 0


class TargetCard(Message, tag="TARGET_CARD"):
    """A target describes itself; a drafter checks that it can draft for this model."""

    name: Text = ""
    vocab_size: int = 0
    tokenizer_fp: Text = ""
    hidden_size: int = 0
    num_layers: int = 0
    step_ms: Ms = 0.0
    """The target's own one-token step, measured: its standalone speed (0: unknown)."""

    def __post_init__(self) -> None:  # shown in logs and `starhub status`
        self.name = printable(self.name)

    def check_fields(self) -> None:
        if self.vocab_size <= 0:
            self.fail("vocab_size must be positive")


class DrafterCard(Message, tag="DRAFTER_CARD"):
    """A drafter describes itself: what it drafts and which features it needs."""

    drafter: Text = ""
    feature_layers: Annotated[list[int], Meta(max_length=MAX_LIST)] = msgspec.field(
        default_factory=list)
    depth: int = 0
    """Tree depth, or 0 when the drafter chooses it round by round (``--depth auto``)."""
    topk: int = 0
    max_nodes: int = 0
    ttl_s: float = 0.0
    max_message_bytes: int = 0
    host: Text = ""
    """The drafter's host (``starhub.cores.host_id``; empty: not said)."""
    cpus: Annotated[list[int], Meta(max_length=MAX_CPUS)] = msgspec.field(default_factory=list)
    """The CPUs the drafter may compute on: with ``host``, whether a target shares them."""

    def __post_init__(self) -> None:  # shown in logs and `starhub status`
        self.drafter = printable(self.drafter)

    def unfit_for(self, target: TargetCard) -> str | None:
        """Why ``target`` cannot send the features this card asks for, or None. A target has
        ``num_layers + 1`` hidden states (the embeddings, then each layer's output; negative
        indices count from the end), and no use for more indices than that."""
        states = target.num_layers + 1
        bad = [i for i in self.feature_layers if not -states <= i < states]
        if bad:
            return f"feature layers {bad} do not exist in a {target.num_layers}-layer target"
        if len(self.feature_layers) > states:
            return (f"{len(self.feature_layers)} feature layers asked of a target with "
                    f"{states} hidden states")
        return None


class ObserverCard(Message, tag="OBSERVER_CARD"):
    """Only watching (``starhub status``, the benchmark): no admission, no sessions; the
    server answers with its own card and shows this peer per-peer STATS."""

    name: Text = ""

    def __post_init__(self) -> None:  # shown in logs
        self.name = printable(self.name)


class Reject(Message, tag="REJECT"):
    code: int = 0
    reason: Text = ""
    """``saturated`` when admission would slow a target below its standalone speed."""
    retry_after_s: float = 0.0
    """When asking again may succeed; 0: it will not."""


class Open(Message, tag="OPEN"):
    """Start a session. ``tokens`` is the prompt plus the first token the target chose.

    ``features`` holds one row per prompt token, so row i pairs with token i+1.
    """

    ref: int = 0
    prompt_len: int = 0
    temperature: Annotated[float, TEMPERATURE] = 0.0
    top_p: Annotated[float, TOP_P] = 1.0
    seed: int = 0
    step_ms: Ms = 0.0
    target_tok_s: Annotated[float, TOK_S] = 0.0
    """Edge: the speed this session asks the verifier for (0: none); deadlines follow."""
    shares_cores: bool = False
    """Star: the target computes on the hub's cores, and ``step_ms`` is its step with the
    cores to itself (``starhub.cores``)."""
    batched: bool = False
    """Star: the target verifies this session in passes shared with its other sessions (a
    serving target), so a COMMIT's ``verify_ms`` is a whole pass's time, not this tree's."""
    tokens: Tokens = msgspec.field(default_factory=_no_tokens)
    features: Features | None = None

    def check_fields(self) -> None:
        _check_prefix(self, self.tokens, self.features)
        if not 0 < self.prompt_len < len(self.tokens) + 1:
            self.fail(f"prompt_len {self.prompt_len} out of range for {len(self.tokens)} tokens")
        if self.temperature == math.inf:
            self.fail("temperature must be finite")


class Opened(Message, tag="OPENED"):
    """Edge: the verifier's answer to OPEN (in the star, the first PROPOSE answers). It
    names the session (``tag``) and carries what a star target's OPEN carries: the prompt
    plus the first token the target chose, and one feature row per prompt token. ``budget``
    is the nodes of the first tree (0: the drafter's own), ``step_ms`` the verifier's step.
    """

    ref: int = 0
    budget: Budget = 0
    step_ms: Ms = 0.0
    tokens: Tokens = msgspec.field(default_factory=_no_tokens)
    features: Features | None = None

    def check_fields(self) -> None:
        _check_prefix(self, self.tokens, self.features)


class Propose(Message, tag="PROPOSE"):
    """A draft tree. ``parents[i]`` is -1 for children of the last committed token.

    Siblings appear in the order they were drawn; for sampling, row 0 of ``dist_*`` is the
    draft distribution at the root and row i+1 the one at node i. ``plain`` > 0 carries no
    tree: the target decodes that many tokens on its own, then commits them. ``leave``:
    the hub is over its admission limit and would rather lose this target; a target of a
    pool opens its next sessions on a hub with room (alone, it stays).
    """

    ref: int = 0
    leave: bool = False
    plain: Annotated[int, Meta(ge=0, le=MAX_TREE_NODES + 1)] = 0
    tokens: Tokens = msgspec.field(default_factory=_no_tokens)
    parents: Tokens = msgspec.field(default_factory=_no_tokens)
    dist_ids: Annotated[np.ndarray, Array(("int32",), 2)] | None = None
    dist_probs: Annotated[np.ndarray, Array(("float32",), 2)] | None = None

    def check_fields(self) -> None:
        n = len(self.tokens)
        if n > MAX_TREE_NODES:
            self.fail(f"{n} nodes exceed the limit of {MAX_TREE_NODES}")
        if self.plain and n:
            self.fail(f"plain={self.plain}: a plain round carries 1..{MAX_TREE_NODES + 1} "
                      f"tokens to decode and no tree")
        if len(self.parents) != n:
            self.fail(f"parents has {len(self.parents)} entries for {n} tokens")
        # -1 <= parents[i] < i as one comparison: parents + 1 read unsigned (-2 and below
        # become huge) against i; ndarray methods rather than np.any for less dispatch
        if n and ((self.parents + 1).view(np.uint32) > _ARANGE[:n]).any():
            self.fail("every parent index must be -1 or an earlier node")
        if (self.dist_ids is None) != (self.dist_probs is None):
            self.fail("dist_ids and dist_probs come together")
        if self.dist_ids is not None:
            if self.dist_ids.shape != self.dist_probs.shape or self.dist_ids.shape[0] != n + 1:
                self.fail(f"dist arrays must both be [{n + 1}, k]")
            if self.dist_ids.shape[1] > MAX_DIST_WIDTH:
                self.fail(f"dist arrays may hold {MAX_DIST_WIDTH} entries per node, got "
                          f"{self.dist_ids.shape[1]}")
            if not np.isfinite(self.dist_probs).all() or (self.dist_probs < 0).any():
                self.fail("dist_probs must be finite and non-negative")


class Commit(Message, tag="COMMIT"):
    """The tokens a round added: accepted tree nodes then the bonus token, or after a plain
    round the tokens the target decoded alone (``accepted`` 0).

    ``features`` carries one row per new token, for the token before it and the accepted
    ones: the bonus token's own feature is not known until the next verification.
    ``verify_ms`` is the target's time for this round's verification (or plain steps) and
    ``step_ms`` its latest one-token step: the hub's load model learns from both.
    ``budget`` (edge) is the verifier's grant for the next tree: at most that many nodes
    (0: no advice). ``floor`` (a serving target) is the least draft path probability worth
    a node of the next tree in the target's batched passes (0: no advice).
    """

    accepted: Annotated[int, Meta(ge=0)] = 0
    verify_ms: Ms = 0.0
    step_ms: Ms = 0.0
    budget: Budget = 0
    floor: Probability = 0.0
    tokens: Tokens = msgspec.field(default_factory=_no_tokens)
    features: Features | None = None

    def check_fields(self) -> None:
        n = len(self.tokens)
        if not 1 <= n <= MAX_TREE_NODES + 1:
            self.fail(f"tokens must hold 1..{MAX_TREE_NODES + 1} ids, got {n}")
        if self.accepted > n - 1:
            self.fail(f"accepted={self.accepted} disagrees with {n} tokens")
        if self.features is not None and self.features.shape[0] != n:
            self.fail(f"features need {n} rows, got {self.features.shape[0]}")
        _check_finite(self, self.features)


class Close(Message, tag="CLOSE"):
    pass


class Error(Message, tag="ERROR"):
    ref: int = 0
    code: int = 0
    message: Text = ""


class Ping(Message, tag="PING"):
    nonce: int = 0


class Pong(Message, tag="PONG"):
    nonce: int = 0


class StatsQuery(Message, tag="STATS_QUERY"):
    """Ask for the server's metrics. ``peer``: only the sender's own totals (its time
    split); ``counters``: add raw totals for windowed rates, ``peers`` per peer too."""

    peer: bool = False
    counters: bool = False
    peers: bool = False


class StatsReport(Message, tag="STATS_REPORT", kw_only=True):
    """The answer to STATS_QUERY: a hub's report, a verifier's, or (``peer``) the
    sender's own totals; ``starhub.wire.reports`` types and bounds each."""

    body: StatsBody


MESSAGES: tuple[type[Message], ...] = (
    TargetCard, DrafterCard, ObserverCard, Reject, Open, Opened, Propose, Commit, Close,
    Error, Ping, Pong, StatsQuery, StatsReport)


def describe(*classes: type[Framed]) -> None:
    """Fill in ``TYPE`` (the wire's tag) and ``ARRAYS`` (from the annotations) of each
    class, once at import; ``codec.Decoder`` relies on both."""
    for cls in classes:
        cls.TYPE = cls.__struct_config__.tag
        hints = typing.get_type_hints(cls, include_extras=True)
        cls.ARRAYS = tuple((name, rule) for name in cls.__struct_fields__
                           if (rule := _array_rule(hints[name])) is not None)


def _array_rule(hint: Any) -> Array | None:
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Array)), None)
    return next((r for arg in typing.get_args(hint) if (r := _array_rule(arg))), None)


describe(*MESSAGES)
MESSAGE_TYPES: dict[str, type[Message]] = {cls.TYPE: cls for cls in MESSAGES}


_ARANGE = np.arange(MAX_TREE_NODES + 1, dtype=np.uint32)


def _check_prefix(msg: Framed, tokens: np.ndarray, features: np.ndarray | None) -> None:
    """A session's start: 1..MAX_TOKENS tokens, and a feature row for each but the last."""
    n = len(tokens)
    if n < 1 or n > MAX_TOKENS:
        msg.fail(f"tokens must hold 1..{MAX_TOKENS} ids, got {n}")
    if features is not None and features.shape[0] != n - 1:
        msg.fail(f"features need {n - 1} rows (one per token before the last), "
                 f"got {features.shape[0]}")
    _check_finite(msg, features)


def _check_finite(msg: Framed, features: np.ndarray | None) -> None:
    """NaN or infinite features would poison a drafter's state for the rest of a session."""
    if features is None or not features.size:
        return
    if type(features) is BFloat16Array:  # raw bfloat16 bits: all-ones exponent
        bits = features.view(dtype=np.uint16, type=np.ndarray)  # plain: subclass ufuncs are slow
        finite = not ((bits & 0x7F80) == 0x7F80).any()
    else:
        finite = bool(np.isfinite(features).all())
    if not finite:
        msg.fail("features must be finite")
