"""Every message type round-trips, again and again; each kind of bad input, after good
messages as before them, gets the error code that names it."""

import math
import types
import typing

import msgpack
import numpy as np
import pytest
import torch

from starhub.wire.codec import BFloat16Array, decode, encode, to_torch
from starhub.wire.messages import (
    MAX_LIST,
    MAX_TEXT,
    MESSAGE_TYPES,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    ObserverCard,
    Open,
    Opened,
    Ping,
    Pong,
    Propose,
    ProtocolError,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import MAX_KEYS, SchedulerReport, SessionEntry, VerifierReport
from starhub.wire.text import MAX_NAME


def one_of_each():
    rng = np.random.default_rng(1)
    return [
        TargetCard(tag=1, name="t", vocab_size=100, tokenizer_fp="ab", hidden_size=8,
                   num_layers=2, step_ms=41.5),
        ObserverCard(tag=2, name="status"),
        DrafterCard(drafter="eagle", feature_layers=[-1, 3], depth=0, topk=4, max_nodes=60,
                    ttl_s=5.0, max_message_bytes=1 << 20),
        Reject(code=9, reason="saturated", retry_after_s=1.5),
        Open(ref=7, prompt_len=4, temperature=0.5, top_p=0.9, seed=3, step_ms=9.0,
             target_tok_s=20.0, tokens=np.arange(5, dtype=np.int32),
             features=rng.random((4, 8), dtype=np.float32)),
        Opened(tag=5, ref=7, budget=60, step_ms=9.0, tokens=np.arange(5, dtype=np.int32),
               features=torch.randn(4, 8).bfloat16()),
        Propose(tag=9, seq=2, ref=4, tokens=np.arange(60, dtype=np.int32),
                parents=np.arange(-1, 59, dtype=np.int32),
                dist_ids=np.zeros((61, 16), np.int32), dist_probs=np.ones((61, 16), np.float32)),
        Commit(tag=9, seq=2, accepted=3, verify_ms=55.0, step_ms=40.0, budget=60,
               tokens=np.array([5, 8, 1, 2], np.int32),
               features=rng.random((4, 576), dtype=np.float32)),
        Error(tag=3, ref=2, code=int(ErrorCode.STALE), message="old"),
        Ping(nonce=12),
        Pong(nonce=12),
        StatsQuery(peer=True),
        StatsReport(body=verifier_report()),
    ]


def verifier_report() -> VerifierReport:
    """A verifier's STATS with every nested part, one session included."""
    return VerifierReport(
        schedule="goodspeed", budget=64, max_batch=0, sessions=1, drafters=1, cached_tokens=9,
        steps=4, rounds=4, committed=9, accepted=5, opened=1, closed=0, expired=0, wall_s=2.5,
        verify_s=0.4, gather_s=0.01, prefill_s=0.1, mean_batch=1.0, verify_ms_per_step=100.0,
        fed_per_step=3.0, batch_hist={"1": 4}, slo_rounds=0, slo_late=0, errors={},
        threads=2, step_ms=40.0,
        scheduler=SchedulerReport(policy="goodspeed", budget=64, max_batch=0,
                                  time_model_ms=[30.0, 1.5], time_model_mape=None,
                                  sessions={"7": SessionEntry(alpha=0.5, goodput=2.0, nodes=8,
                                                              rounds=4, late=0)}))


def assert_same(back, msg):
    assert type(back) is type(msg)
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(to_torch(getattr(back, name)), value)
        elif isinstance(value, np.ndarray):
            got = getattr(back, name)
            assert got.dtype == value.dtype and got.shape == value.shape
            np.testing.assert_array_equal(got, value)
        else:
            assert getattr(back, name) == value, name


def test_every_message_type_is_covered():
    assert {type(m).TYPE for m in one_of_each()} | {"CLOSE"} == set(MESSAGE_TYPES)


def test_every_message_type_roundtrips_equal_again_and_again():
    for _ in range(3):  # a decoder keeps no state from one message to the next
        for msg in one_of_each():
            assert_same(decode([bytes(f) for f in encode(msg)]), msg)
            assert_same(decode(encode(msg)), msg)  # memoryviews, as encode gives them


FIELD_RULES_WRONG = {
    int: [True, 1.5, "1", None, [1], {}],
    float: [True, "1.5", None, [1.0], {}],
    str: [7, 1.5, True, None, b"x", ["x"]],
    bool: [0, 1, "true", None, 1.5],
    list: ["x", 7, None, {"a": 1}, ["x"], [True], [1.5]],
    dict: [7, "x", None, [1], True],
    types.UnionType: [7, "x", None, [1], True, {}, {"role": "nobody"}],
}
"""For each kind of header field, values msgpack can carry that are not of that kind."""


def header_hints(cls) -> dict:
    """The header's own fields (not the version, not the arrays) and their plain types."""
    arrays = {name for name, _ in cls.ARRAYS}
    hints = typing.get_type_hints(cls)  # Annotated's constraints stripped
    return {name: hints[name] for name in cls.__struct_fields__
            if name != "v" and name not in arrays}


@pytest.mark.parametrize("msg", one_of_each(), ids=lambda m: m.TYPE)
def test_a_header_field_of_the_wrong_type_or_missing_is_a_bad_field(msg):
    frames = [bytes(f) for f in encode(msg)]
    for name, hint in header_hints(type(msg)).items():
        kind = typing.get_origin(hint) or hint
        for value in [*FIELD_RULES_WRONG[kind], _DROP]:
            with pytest.raises(ProtocolError) as info:
                decode(with_header(frames, **{name: value}))
            assert info.value.code == ErrorCode.BAD_FIELD, (name, value)
            assert info.value.tag == (0 if name == "tag" else msg.tag), (name, value)
        assert isinstance(decode(frames), type(msg))


def test_integers_span_msgpack_and_text_and_lists_are_bounded():
    for nonce in (0, -(1 << 63), (1 << 64) - 1):
        assert decode(encode(Ping(nonce=nonce))).nonce == nonce
    name = "x" * MAX_TEXT
    assert decode(encode(Error(message=name))).message == name
    shown = decode(encode(TargetCard(name=name, vocab_size=1))).name
    assert name.startswith(shown.rstrip(".…")) and len(shown) <= MAX_NAME  # names are cut
    layers = list(range(MAX_LIST))
    assert decode(encode(DrafterCard(feature_layers=layers))).feature_layers == layers
    for msg in (Error(message=name + "x"), DrafterCard(feature_layers=[*layers, 0])):
        with pytest.raises(ProtocolError) as info:
            decode(encode(msg))
        assert info.value.code == ErrorCode.BAD_FIELD


def test_an_unknown_header_field_is_a_bad_field():
    frames = [bytes(f) for f in encode(Ping(nonce=3))]
    with pytest.raises(ProtocolError) as info:
        decode(with_header(frames, evil=1))
    assert info.value.code == ErrorCode.BAD_FIELD


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
        "unknown array": with_header([*good, b"\x00" * 4], extra=["int32", [1], 3]),
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


@pytest.mark.parametrize("body", [
    {"role": "hub"},  # a hub's report without its fields
    {"role": "peer", "peer": {"name": 7}},
    {"role": "peer", "peer": {"name": "x" * (MAX_TEXT + 1)}},
    {"role": "peer", "peer": {"name": "t"}, "r_q": 1.5},  # a field no peer report has
    {"r_q": 1.5},  # the untyped body of protocol v5
])
def test_a_stats_report_body_of_the_wrong_shape_or_size_is_a_bad_field(body):
    frames = [bytes(f) for f in encode(StatsReport(tag=3, body=verifier_report()))]
    with pytest.raises(ProtocolError) as info:
        decode(with_header(frames, body=body))
    assert info.value.code == ErrorCode.BAD_FIELD and info.value.tag == 3


def test_a_stats_report_may_not_make_its_reader_hold_unbounded_maps():
    header = msgpack.unpackb(encode(StatsReport(body=verifier_report()))[0])
    header["body"]["batch_hist"] = {str(k): 1 for k in range(MAX_KEYS + 1)}
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(header)])
    assert info.value.code == ErrorCode.BAD_FIELD
    header["body"]["batch_hist"] = {str(k): 1 for k in range(MAX_KEYS)}
    assert len(decode([msgpack.packb(header)]).body.batch_hist) == MAX_KEYS
