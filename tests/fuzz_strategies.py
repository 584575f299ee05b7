"""Hypothesis strategies for hostile input: frames that no decoder may accept.

Each strategy yields the frames of one message (header frame first) that must raise a
``ProtocolError``: random bytes, truncated or missing frames, wrong types in header fields,
bad versions, unknown types, huge or inconsistent array specs, and well-framed messages
whose values break a message's own rules (forward parents, oversized trees, NaN features,
features of the wrong shape or dtype, ...). Handler-level attacks, which need a server's
state (its tags, its vocabulary), are built in the tests from the same pieces.

The ``ci`` profile (the default) keeps every fuzz test to a few seconds; set
``STARHUB_FUZZ_PROFILE=long`` for a deeper local run.
"""

from __future__ import annotations

import os
import typing

import msgpack
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from starhub.wire.codec import encode
from starhub.wire.messages import (
    MAX_DIST_WIDTH,
    MAX_TREE_NODES,
    MESSAGE_TYPES,
    VERSION,
    Close,
    Commit,
    DrafterCard,
    Error,
    Message,
    ObserverCard,
    Open,
    Opened,
    Ping,
    Pong,
    Propose,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import PeerEntry, PeerReport

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=5000, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("STARHUB_FUZZ_PROFILE", "ci"))

VOCAB = 1000
"""The vocabulary the fuzzed servers' peers announce."""

Frames = list[bytes]


def frames_of(msg: Message) -> Frames:
    return [bytes(f) for f in encode(msg)]


# -- valid messages, the raw material of mutations ------------------------------------------
I64 = (-(1 << 63), (1 << 64) - 1)
"""The integers a header may carry (msgpack's range)."""
anyint = st.integers(*I64)
ints = st.integers(0, 1 << 40)
small = st.integers(0, 50)
ms = st.floats(0, 1e6, allow_nan=False)
text = st.text(max_size=40)


@st.composite
def token_arrays(draw, min_size: int = 1, max_size: int = 40) -> np.ndarray:
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=min_size, max_size=max_size))
    return np.asarray(ids, np.int32)


@st.composite
def valid_trees(draw) -> Propose:
    n = draw(st.integers(0, 24))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    k = draw(st.integers(1, 3))
    sampled = draw(st.booleans())
    return Propose(tag=draw(ints), seq=draw(small), ref=draw(small),
                   tokens=draw(token_arrays(n, n)), parents=np.asarray(parents, np.int32),
                   dist_ids=np.zeros((n + 1, k), np.int32) if sampled else None,
                   dist_probs=np.full((n + 1, k), 1 / k, np.float32) if sampled else None)


@st.composite
def valid_opens(draw) -> Open:
    tokens = draw(token_arrays(2, 40))
    feats = draw(st.booleans())
    return Open(ref=draw(small), prompt_len=len(tokens) - 1, temperature=draw(st.floats(0, 2)),
                top_p=draw(st.floats(0.01, 1)), seed=draw(ints), step_ms=draw(ms),
                tokens=tokens,
                features=np.zeros((len(tokens) - 1, 8), np.float16) if feats else None)


@st.composite
def valid_openeds(draw) -> Opened:
    tokens = draw(token_arrays(2, 40))
    feats = draw(st.booleans())
    return Opened(tag=draw(ints), ref=draw(small), budget=draw(small), step_ms=draw(ms),
                  tokens=tokens,
                  features=np.zeros((len(tokens) - 1, 8), np.float16) if feats else None)


@st.composite
def valid_commits(draw) -> Commit:
    tokens = draw(token_arrays(1, 12))
    feats = draw(st.booleans())
    return Commit(tag=draw(ints), seq=draw(small), accepted=draw(st.integers(0, len(tokens) - 1)),
                  verify_ms=draw(ms), step_ms=draw(ms), tokens=tokens,
                  features=np.zeros((len(tokens), 8), np.float16) if feats else None)


valid_messages = st.one_of(
    st.builds(TargetCard, name=text, vocab_size=st.integers(1, 1 << 20), tokenizer_fp=text,
              hidden_size=small, num_layers=small, step_ms=ms),
    st.builds(DrafterCard, drafter=text, feature_layers=st.lists(st.integers(-3, 3), max_size=3),
              depth=small, topk=small, max_nodes=small, ttl_s=ms, max_message_bytes=ints),
    st.builds(ObserverCard, name=text),
    st.builds(Reject, code=small, reason=text, retry_after_s=ms),
    valid_opens(), valid_openeds(), valid_trees(), valid_commits(),
    st.builds(Close, tag=ints), st.builds(Error, tag=ints, code=small, message=text),
    st.builds(Ping, nonce=ints), st.builds(Pong, nonce=ints),
    st.builds(StatsQuery, peer=st.booleans(), counters=st.booleans(), peers=st.booleans()),
    st.builds(StatsReport, body=st.builds(PeerReport, peer=st.none() | st.builds(
        PeerEntry, name=text, rounds=small, queue_s=ms, draft_s=ms, commits=small,
        tokens=small, first=ms, last=ms))),
)


def _header(frames: Frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _pack(header: dict, rest: Frames) -> Frames:
    return [msgpack.packb(header, use_bin_type=True), *rest]


# -- framing attacks ---------------------------------------------------------------------
random_bytes = st.lists(st.binary(max_size=300), max_size=4)


@st.composite
def truncated(draw) -> Frames:
    """A valid message with one frame cut short, or a frame dropped, or one frame added."""
    frames = frames_of(draw(valid_messages))
    cut = [i for i, f in enumerate(frames) if f]
    how = draw(st.sampled_from(["cut", "drop", "add"]))
    if how == "drop":
        del frames[draw(st.integers(0, len(frames) - 1))]
    elif how == "add":
        frames.insert(draw(st.integers(1, len(frames))), draw(st.binary(max_size=64)))
    else:
        i = draw(st.sampled_from(cut))
        frames[i] = frames[i][:draw(st.integers(0, len(frames[i]) - 1))]
    return frames


def _wrong_type(hint) -> st.SearchStrategy:
    """Values msgpack can carry that are not of the annotated type."""
    junk = [st.none(), st.lists(anyint, max_size=3), st.dictionaries(text, anyint,
                                                                            max_size=2),
            st.binary(min_size=1, max_size=8)]
    if typing.get_origin(hint) is list:
        return st.one_of(anyint, text, st.lists(text, min_size=1, max_size=3),
                         st.dictionaries(text, anyint, max_size=2), st.none())
    if hint is int:
        return st.one_of(st.booleans(), st.floats(), text, *junk)
    if hint is float:
        return st.one_of(st.booleans(), text, *junk)
    if hint is str:
        return st.one_of(anyint, st.floats(), st.booleans(), *junk)
    return st.one_of(anyint, text, st.lists(anyint, max_size=3), st.none())


def header_fields(cls: type[Message]) -> list[str]:
    """The fields a message carries in its header itself: all but the version and arrays."""
    arrays = {name for name, _ in cls.ARRAYS}
    return [name for name in cls.__struct_fields__ if name != "v" and name not in arrays]


@st.composite
def wrong_types(draw) -> Frames:
    """A valid message with one header field of the wrong type, or missing."""
    msg = draw(valid_messages)
    frames = frames_of(msg)
    header = _header(frames)
    hints = typing.get_type_hints(type(msg))  # without Annotated's constraints
    name = draw(st.sampled_from(header_fields(type(msg))))
    if draw(st.booleans()):
        del header[name]
    else:
        header[name] = draw(_wrong_type(hints[name]))
    return _pack(header, frames[1:])


@st.composite
def bad_envelopes(draw) -> Frames:
    """Bad versions, unknown or mistyped message types, headers that are not maps."""
    frames = frames_of(draw(valid_messages))
    header = _header(frames)
    how = draw(st.sampled_from(["version", "no-version", "type", "no-type", "not-a-map"]))
    if how == "version":
        header["v"] = draw(st.one_of(anyint.filter(lambda v: v != VERSION),
                                     st.just(float(VERSION)), st.just(str(VERSION)),
                                     st.just(True), st.none(), st.lists(anyint)))
    elif how == "no-version":
        del header["v"]
    elif how == "type":
        header["type"] = draw(st.one_of(text.filter(lambda t: t not in MESSAGE_TYPES),
                                        anyint, st.none(), st.lists(text, max_size=2),
                                        st.dictionaries(text, text, max_size=2)))
    elif how == "no-type":
        del header["type"]
    else:
        return [msgpack.packb(draw(st.one_of(st.lists(anyint, max_size=4), anyint,
                                             text, st.none()))), *frames[1:]]
    return _pack(header, frames[1:])


dims = st.integers(0, (1 << 31) - 1)


@st.composite
def bad_array_specs(draw) -> Frames:
    """Array specs (``[dtype, shape, frame]`` in an array field) that lie: huge or odd
    shapes, unknown dtypes, frames that are missing or taken twice, bad specs, too many
    frames, arrays under names the message does not have."""
    msg = draw(st.one_of(valid_opens(), valid_openeds(), valid_trees(), valid_commits()))
    frames = frames_of(msg)
    header = _header(frames)
    present = [name for name, _ in type(msg).ARRAYS if header[name] is not None]
    spec = header[draw(st.sampled_from(present))]  # every one of these carries tokens
    how = draw(st.sampled_from(["huge", "rank", "dtype", "frame", "twice", "junk", "many",
                                "unknown"]))
    if how == "huge":
        spec[1] = draw(st.lists(dims, min_size=1, max_size=4).filter(
            lambda s: np.prod(s, dtype=object) > 1 << 12))
    elif how == "rank":
        spec[1] = draw(st.lists(st.integers(0, 3), min_size=5, max_size=8)
                       | st.lists(st.integers(I64[0], -1) | st.floats() | text,
                                  min_size=1, max_size=3))
    elif how == "dtype":
        spec[0] = draw(st.one_of(st.sampled_from(["object", "uint8", "float64", "complex64",
                                                  "O", "<U8", "V4"]), anyint, st.none()))
    elif how == "frame":
        spec[2] = draw(st.one_of(st.integers(I64[0], 0), st.integers(len(frames), I64[1]),
                                 text, st.none(), st.floats()))
    elif how == "twice":
        other = [name for name, _ in type(msg).ARRAYS if header[name] is not spec]
        header[draw(st.sampled_from(other))] = list(spec)
    elif how == "junk":
        header["tokens"] = draw(st.one_of(anyint, text, st.dictionaries(text, text),
                                          st.none(), st.lists(anyint | text | st.none(),
                                                              min_size=1, max_size=3)))
    elif how == "many":
        frames.extend([frames[-1]] * draw(st.integers(9, 20)))
    else:
        header[draw(text.filter(lambda t: t not in header))] = list(spec)
    return _pack(header, frames[1:])


# -- well-framed messages that break their own rules ------------------------------------
non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
bad_ms = st.one_of(non_finite, st.floats(-1e300, -1e-9),
                   st.floats(1e7, 1e300))


def _bad_features(rows: int) -> st.SearchStrategy:
    """Features that no decoder may take: NaN or infinite values, wrong rows, rank, dtype."""
    good_width = st.integers(1, 8)
    return st.one_of(
        st.builds(lambda w, r, v: _with(np.zeros((max(rows, 1), w), np.float16), r, v),
                  good_width, st.integers(0, 1 << 20), non_finite),
        st.builds(lambda w, d: np.zeros((rows + d, w), np.float16), good_width,
                  st.integers(1, 3) | st.integers(-rows, -1) if rows else st.integers(1, 3)),
        st.builds(lambda w: np.zeros((rows, w, 2), np.float16), good_width),
        st.builds(lambda: np.zeros(rows, np.float16)),
        st.builds(lambda w, dt: np.zeros((rows, w), dt), good_width,
                  st.sampled_from([np.int32, np.int64, np.float64, np.uint8])),
    )


def _with(arr: np.ndarray, flat_index: int, value: float) -> np.ndarray:
    arr.reshape(-1)[flat_index % arr.size] = value
    return arr


@st.composite
def bad_opens(draw) -> Open:
    msg = draw(valid_opens())
    n = len(msg.tokens)
    how = draw(st.sampled_from(["prompt_len", "temperature", "top_p", "step_ms", "speed",
                                "empty", "features"]))
    if how == "prompt_len":
        msg.prompt_len = draw(st.integers(I64[0], 0) | st.integers(n + 1, I64[1]))
    elif how == "temperature":
        msg.temperature = draw(non_finite | st.floats(max_value=-1e-9))
    elif how == "top_p":
        msg.top_p = draw(non_finite | st.floats(max_value=0) | st.floats(min_value=1.0001))
    elif how == "step_ms":
        msg.step_ms = draw(bad_ms)
    elif how == "speed":
        msg.target_tok_s = draw(non_finite | st.floats(max_value=-1e-9)
                                | st.floats(min_value=1e6))
    elif how == "empty":
        msg.tokens, msg.prompt_len = np.zeros(0, np.int32), 1
    else:
        msg.features = draw(_bad_features(n - 1))
    return msg


@st.composite
def bad_trees(draw) -> Propose:
    msg = draw(valid_trees())
    n = len(msg.tokens)
    how = draw(st.sampled_from(["forward", "below", "parents_len", "oversized", "plain",
                                "plain_range", "dist_shape", "dist_half", "dist_wide",
                                "dist_values"]))
    if how in ("forward", "below") and n == 0:
        msg.tokens, msg.parents, n = np.array([1], np.int32), np.array([-1], np.int32), 1
        msg.dist_ids = msg.dist_probs = None
    if how == "forward":
        i = draw(st.integers(0, n - 1))
        msg.parents = msg.parents.copy()
        msg.parents[i] = draw(st.integers(i, 1 << 30))
    elif how == "below":
        msg.parents = msg.parents.copy()
        msg.parents[draw(st.integers(0, n - 1))] = draw(st.integers(-(1 << 31), -2))
    elif how == "parents_len":
        msg.parents = np.concatenate([msg.parents, np.full(draw(st.integers(1, 3)), -1,
                                                             np.int32)])
    elif how == "oversized":
        size = draw(st.integers(MAX_TREE_NODES + 1, MAX_TREE_NODES + 64))
        msg.tokens = np.ones(size, np.int32)
        msg.parents = np.arange(-1, size - 1, dtype=np.int32)
        msg.dist_ids = msg.dist_probs = None
    elif how == "plain":
        msg.plain = draw(st.integers(1, MAX_TREE_NODES))
        if n == 0:
            msg.tokens, msg.parents = np.array([1], np.int32), np.array([-1], np.int32)
    elif how == "plain_range":
        msg.tokens = msg.parents = np.zeros(0, np.int32)
        msg.dist_ids = msg.dist_probs = None
        msg.plain = draw(st.integers(I64[0], -1) | st.integers(MAX_TREE_NODES + 2, I64[1]))
    elif how == "dist_shape":
        k = draw(st.integers(1, 3))
        msg.dist_ids = np.zeros((n + 1 + draw(st.integers(1, 3)), k), np.int32)
        msg.dist_probs = np.zeros((n + 1, k + draw(st.integers(0, 2))), np.float32)
    elif how == "dist_wide":
        k = draw(st.integers(MAX_DIST_WIDTH + 1, 4 * MAX_DIST_WIDTH))
        msg.dist_ids = np.zeros((n + 1, k), np.int32)
        msg.dist_probs = np.full((n + 1, k), 1 / k, np.float32)
    elif how == "dist_half":
        if draw(st.booleans()):
            msg.dist_ids, msg.dist_probs = np.zeros((n + 1, 1), np.int32), None
        else:
            msg.dist_ids, msg.dist_probs = None, np.zeros((n + 1, 1), np.float32)
    else:
        k = draw(st.integers(1, 3))
        msg.dist_ids = np.zeros((n + 1, k), np.int32)
        probs = np.full((n + 1, k), 0.5, np.float32)
        probs.reshape(-1)[draw(st.integers(0, probs.size - 1))] = draw(
            non_finite | st.floats(-1e30, -1e-6).map(float))
        msg.dist_probs = probs
    return msg


@st.composite
def bad_commits(draw) -> Commit:
    msg = draw(valid_commits())
    n = len(msg.tokens)
    how = draw(st.sampled_from(["empty", "too_many", "accepted", "verify_ms", "step_ms",
                                "budget", "features"]))
    if how == "empty":
        msg.tokens, msg.accepted, msg.features = np.zeros(0, np.int32), 0, None
    elif how == "too_many":
        msg.tokens = np.ones(draw(st.integers(MAX_TREE_NODES + 2, MAX_TREE_NODES + 64)),
                             np.int32)
        msg.features = None
    elif how == "accepted":
        msg.accepted = draw(st.integers(I64[0], -1) | st.integers(n, I64[1]))
    elif how == "verify_ms":
        msg.verify_ms = draw(bad_ms)
    elif how == "step_ms":
        msg.step_ms = draw(bad_ms)
    elif how == "budget":
        msg.budget = draw(st.integers(I64[0], -1) | st.integers(MAX_TREE_NODES + 1, I64[1]))
    else:
        msg.features = draw(_bad_features(n))
    return msg


bad_cards = st.one_of(
    st.builds(TargetCard, name=text, vocab_size=st.integers(I64[0], 0)),
    st.builds(TargetCard, name=text, vocab_size=st.integers(1, 1 << 20), step_ms=bad_ms),
)

broken_rules = st.one_of(bad_opens(), bad_trees(), bad_commits(), bad_cards).map(frames_of)

malformed = st.one_of(random_bytes, truncated(), wrong_types(), bad_envelopes(),
                      bad_array_specs(), broken_rules)
"""Every kind of frames above: none of them is a message."""
