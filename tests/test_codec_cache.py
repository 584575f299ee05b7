"""The codec's per-type schema cache: built once, and no looser than the rules it caches."""

import dataclasses
import enum
import functools
import math
import typing

import msgpack
import numpy as np
import pytest
import torch

from starhub.wire.codec import BFloat16Array, decode, encode, to_torch
from starhub.wire.messages import (
    MESSAGE_TYPES,
    Commit,
    Error,
    ErrorCode,
    Hello,
    Open,
    Ping,
    Pong,
    Propose,
    ProtocolError,
    Reject,
    Stats,
    Welcome,
    _check_scalar,
    array_fields,
    build,
    header_fields,
    schema,
)


def one_of_each():
    rng = np.random.default_rng(1)
    return [
        Hello(tag=1, name="t", vocab_size=100, tokenizer_fp="ab", hidden_size=8, num_layers=2,
              step_ms=41.5, observer=True),
        Welcome(drafter="eagle", feature_layers=[-1, 3], depth=0, topk=4, max_nodes=60,
                ttl_s=5.0, max_message_bytes=1 << 20),
        Reject(code=9, reason="saturated", retry_after_s=1.5),
        Open(ref=7, prompt_len=4, temperature=0.5, top_p=0.9, seed=3, step_ms=9.0,
             target_tok_s=20.0, tokens=np.arange(5, dtype=np.int32),
             features=rng.random((4, 8), dtype=np.float32)),
        Propose(tag=9, seq=2, ref=4, tokens=np.arange(60, dtype=np.int32),
                parents=np.arange(-1, 59, dtype=np.int32),
                dist_ids=np.zeros((61, 16), np.int32), dist_probs=np.ones((61, 16), np.float32)),
        Commit(tag=9, seq=2, accepted=3, verify_ms=55.0, step_ms=40.0, budget=60,
               tokens=np.array([5, 8, 1, 2], np.int32),
               features=rng.random((4, 576), dtype=np.float32)),
        Error(tag=3, ref=2, code=int(ErrorCode.STALE), message="old"),
        Ping(nonce=12),
        Pong(nonce=12),
        Stats(body={"r_q": 1.5, "peers": [1, 2]}),
    ]


def assert_same(back, msg):
    assert type(back) is type(msg)
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, np.ndarray):
            got = getattr(back, f.name)
            assert got.dtype == value.dtype and got.shape == value.shape
            np.testing.assert_array_equal(got, value)
        else:
            assert getattr(back, f.name) == value, f.name


def test_every_message_type_is_covered():
    assert {type(m).TYPE for m in one_of_each()} | {"CLOSE"} == set(MESSAGE_TYPES)


def test_every_message_type_roundtrips_equal_again_and_again():
    for _ in range(3):  # the first pass builds the schemas, the later ones use them
        for msg in one_of_each():
            assert_same(decode([bytes(f) for f in encode(msg)]), msg)
            assert_same(decode(encode(msg)), msg)  # memoryviews, as encode gives them


def test_the_schema_is_built_once_per_type_and_matches_the_dataclass():
    for cls in MESSAGE_TYPES.values():
        assert schema(cls) is schema(cls)
        fields = dataclasses.fields(cls)
        assert header_fields(cls) == [f for f in fields if not f.metadata.get("array")]
        assert array_fields(cls) == [f for f in fields if f.metadata.get("array")]
        assert isinstance(header_fields(cls), list)
        header_fields(cls).clear()  # a caller's copy: the cached schema is unharmed
        assert [n for n, _ in schema(cls).header] == [f.name for f in header_fields(cls)]


class Level(enum.IntEnum):
    HIGH = 3


VALUES = [0, 1, -1, (1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 63) - 1, True, False, 1.5,
          math.nan, math.inf, "", "x", "x" * 4096, "x" * 4097, b"x", None, {}, {"a": 1}, [],
          [1, 2], [1, "2"], [True], list(range(1025)), Level.HIGH]


def outcome(fn, value):
    """What a validator makes of ``value``: the value it keeps (NaN spelled out so that it
    compares equal) and its type, or the error it raises."""
    try:
        kept = fn(value)
    except ProtocolError as exc:
        return "error", exc.code, exc.message
    return "ok", "nan" if isinstance(kept, float) and math.isnan(kept) else kept, type(kept)


@pytest.mark.parametrize("cls", sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE),
                         ids=lambda c: c.TYPE)
def test_cached_validators_agree_with_the_rules(cls):
    """Fast paths for plain values must accept and reject exactly what the rules do."""
    hints = typing.get_type_hints(cls)
    for name, check in schema(cls).header:
        for value in VALUES:
            rule = functools.partial(_check_scalar, cls.TYPE, name, hints[name])
            want = outcome(rule, value)
            assert outcome(check, value) == want, (name, value)


def good_commit_frames():
    msg = Commit(tag=5, seq=1, accepted=1, tokens=np.array([3, 4], np.int32),
                 features=np.ones((2, 8), np.float32))
    return [bytes(f) for f in encode(msg)]


def with_header(frames, **changes):
    header = msgpack.unpackb(frames[0])
    for key, value in changes.items():
        if value is _DROP:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header), *frames[1:]]


_DROP = object()


def bad_commits():
    good = good_commit_frames()
    nan = np.ones((2, 8), np.float32)
    nan[1, 3] = np.nan
    bf16_inf = torch.ones(2, 8).bfloat16()
    bf16_inf[0, 0] = math.inf
    tokens = np.array([3, 4], np.int32)
    return {
        "string tag": with_header(good, tag="5"),
        "bool seq": with_header(good, seq=True),
        "float accepted": with_header(good, accepted=1.0),
        "list budget": with_header(good, budget=[1]),
        "dict step": with_header(good, step_ms={}),
        "missing field": with_header(good, budget=_DROP),
        "negative step": with_header(good, step_ms=-1.0),
        "NaN features": [bytes(f) for f in encode(Commit(accepted=1, tokens=tokens,
                                                         features=nan))],
        "inf bf16 features": [bytes(f) for f in encode(Commit(accepted=1, tokens=tokens,
                                                              features=bf16_inf))],
        "int64 tokens": [bytes(f) for f in encode(Commit(accepted=1,
                                                         tokens=tokens.astype(np.int64)))],
        "int32 features": [bytes(f) for f in encode(Commit(accepted=1, tokens=tokens,
                                                           features=np.ones((2, 8), np.int32)))],
        "1-d features": [bytes(f) for f in encode(Commit(accepted=1, tokens=tokens,
                                                         features=np.ones(16, np.float32)))],
        "unknown array": with_header([*good, b"\x00" * 4],
                                     arrays=[*msgpack.unpackb(good[0])["arrays"],
                                             ["extra", "int32", [1]]]),
        "accepted past tokens": with_header(good, accepted=2),
    }


@pytest.mark.parametrize("name", list(bad_commits()))
def test_a_malformed_message_after_good_ones_is_still_rejected(name):
    good, bad = good_commit_frames(), bad_commits()[name]
    for _ in range(2):
        assert isinstance(decode(good), Commit)
        with pytest.raises(ProtocolError) as info:
            decode(bad)
        assert info.value.code == ErrorCode.BAD_FIELD
        assert info.value.tag in (0, 5)
    assert isinstance(decode(good), Commit)


def test_a_byte_swapped_array_still_passes_by_its_dtype_name():
    """``build`` checks dtype names, so int32 in either byte order passes, as it always has."""
    header = {"tag": 1, "seq": 0, "ref": 0, "plain": 0}
    arrays = {"tokens": np.array([7, 8], ">i4"), "parents": np.array([-1, 0], ">i4")}
    msg = build(Propose, header, arrays)
    assert msg.tokens.tolist() == [7, 8]
    with pytest.raises(ProtocolError):
        build(Propose, header, {**arrays, "tokens": np.array([7, 8], ">i8")})


def test_a_decoded_bfloat16_message_encodes_again_as_bfloat16():
    feats = torch.randn(2, 8).bfloat16()
    msg = Commit(tag=1, accepted=1, tokens=np.array([1, 2], np.int32), features=feats)
    back = decode([bytes(f) for f in encode(msg)])
    assert isinstance(back.features, BFloat16Array)
    again = decode([bytes(f) for f in encode(back)])
    assert torch.equal(to_torch(again.features), feats)


def test_the_codec_benchmark_runs_and_writes_json(tmp_path, capsys):
    import json

    from bench.codec import main

    out = tmp_path / "codec.json"
    assert main(["--number", "2", "--repeat", "1", "--loopback", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"PROPOSE-60", "COMMIT-4+features", "loopback COMMIT->PROPOSE"} <= set(doc["rows"])
    assert doc["torch_threads"] >= 1
    assert "torch threads" in capsys.readouterr().out
