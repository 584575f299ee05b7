"""Property-based fuzzing of ``codec.decode``: whatever arrives, the decoder raises a
``ProtocolError`` with a code (never another exception), and the ERROR that reports it is a
valid message a peer can decode."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from starhub.wire.codec import MAX_HEADER_BYTES, Limits, decode, encode, error_for
from starhub.wire.messages import VERSION, Error, ErrorCode, Open, ProtocolError
from tests import fuzz_strategies as fz


def rejected(frames: list[bytes], limits: Limits = Limits()) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    exc = info.value
    assert isinstance(exc.code, ErrorCode) and exc.message
    reply = decode([bytes(f) for f in encode(error_for(exc))])
    assert isinstance(reply, Error) and reply.code == exc.code
    return exc


@given(fz.valid_messages)
def test_valid_messages_roundtrip(msg):
    back = decode(fz.frames_of(msg))
    assert type(back) is type(msg) and back.tag == msg.tag


@given(fz.random_bytes)
def test_random_bytes_are_refused(frames):
    rejected(frames)


@given(fz.truncated())
def test_truncated_dropped_or_extra_frames_are_refused(frames):
    rejected(frames)


@given(fz.wrong_types())
def test_header_fields_of_the_wrong_type_or_missing_are_refused(frames):
    assert rejected(frames).code in (ErrorCode.BAD_FIELD, ErrorCode.BAD_FRAME)


@given(fz.bad_envelopes())
def test_bad_versions_and_unknown_types_are_refused(frames):
    assert rejected(frames).code in (ErrorCode.BAD_VERSION, ErrorCode.BAD_TYPE,
                                     ErrorCode.BAD_FRAME)


@given(fz.bad_array_specs())
def test_lying_array_specs_and_huge_shapes_are_refused(frames):
    assert rejected(frames).code in (ErrorCode.BAD_FIELD, ErrorCode.BAD_FRAME)


@given(fz.bad_opens().map(fz.frames_of))
def test_opens_that_break_their_rules_are_refused(frames):
    assert rejected(frames).code == ErrorCode.BAD_FIELD


@given(fz.bad_trees().map(fz.frames_of))
def test_trees_with_forward_parents_oversized_or_bad_dists_are_refused(frames):
    assert rejected(frames).code == ErrorCode.BAD_FIELD


@given(fz.bad_commits().map(fz.frames_of))
def test_commits_that_break_their_rules_are_refused(frames):
    assert rejected(frames).code == ErrorCode.BAD_FIELD


@given(fz.valid_messages, st.integers(1, 200))
def test_messages_past_the_size_limit_are_refused_before_parsing(msg, under):
    frames = fz.frames_of(msg)
    limit = max(sum(map(len, frames)) - under, 0)  # always below the message's size
    assert rejected(frames, Limits(limit)).code == ErrorCode.TOO_LARGE


def test_a_header_past_its_own_limit_is_refused():
    header = {"v": VERSION, "type": "PING", "tag": 0, "seq": 0, "nonce": 0,
              "pad": "x" * MAX_HEADER_BYTES}
    assert rejected([msgpack.packb(header)]).code == ErrorCode.TOO_LARGE


def test_a_shape_whose_size_overflows_int64_is_a_protocol_error():
    """4 dims of 2**30 elements: their product wraps to 0 in int64 arithmetic."""
    frames = fz.frames_of(Open(prompt_len=1, tokens=np.array([1, 2], np.int32)))
    header = msgpack.unpackb(frames[0])
    header["tokens"] = ["int32", [1 << 30] * 4, 1]
    assert rejected([msgpack.packb(header), b""]).code == ErrorCode.BAD_FRAME


def test_an_unhashable_message_type_is_a_protocol_error():
    header = {"v": VERSION, "type": ["PING"], "tag": 0, "seq": 0}
    assert rejected([msgpack.packb(header)]).code == ErrorCode.BAD_TYPE


def test_nan_temperature_is_refused():
    msg = Open(prompt_len=1, temperature=float("nan"), tokens=np.array([1, 2], np.int32))
    assert "temperature" in rejected(fz.frames_of(msg)).message


def test_an_error_about_a_huge_field_stays_decodable():
    header = {"v": VERSION, "type": "X" * 10_000, "tag": 0, "seq": 0}
    assert rejected([msgpack.packb(header)]).code == ErrorCode.BAD_TYPE
