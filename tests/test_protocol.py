import msgpack
import msgspec
import numpy as np
import pytest
import torch

from starhub.wire.codec import Limits, decode, encode, to_torch
from starhub.wire.messages import (
    MAX_TREE_NODES,
    VERSION,
    Close,
    Commit,
    DrafterCard,
    ErrorCode,
    Open,
    Opened,
    Propose,
    ProtocolError,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import PeerEntry, PeerReport


def roundtrip(msg, limits=Limits()):
    return decode([bytes(f) for f in encode(msg)], limits)


def test_every_message_roundtrips_with_its_arrays():
    feats = np.random.rand(4, 8).astype(np.float16)
    msgs = [
        TargetCard(name="t", vocab_size=100, tokenizer_fp="ab", hidden_size=8, num_layers=2,
                   step_ms=41.5),
        Reject(code=9, reason="saturated", retry_after_s=1.0),
        DrafterCard(drafter="ngram", feature_layers=[-1], depth=3, topk=2, max_nodes=8, ttl_s=5.0,
                    max_message_bytes=1000),
        Open(ref=7, prompt_len=4, temperature=0.5, top_p=0.9, seed=3,
             tokens=np.arange(5, dtype=np.int32), features=feats),
        Propose(tag=9, seq=2, tokens=np.array([5, 6, 7], np.int32),
                parents=np.array([-1, 0, 0], np.int32),
                dist_ids=np.zeros((4, 2), np.int32), dist_probs=np.ones((4, 2), np.float32)),
        Commit(tag=9, seq=2, accepted=1, verify_ms=55.0, step_ms=40.0,
               tokens=np.array([5, 8], np.int32)),
        Propose(tag=9, seq=3, plain=16),
        Commit(tag=9, seq=3, accepted=0, tokens=np.arange(16, dtype=np.int32)),
        Close(tag=9),
        StatsQuery(counters=True),
        StatsReport(body=PeerReport(peer=PeerEntry(name="t", rounds=3, draft_s=0.5))),
    ]
    for msg in msgs:
        back = roundtrip(msg)
        assert type(back) is type(msg)
        for name, value in msgspec.structs.asdict(msg).items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(getattr(back, name), value)
            else:
                assert getattr(back, name) == value


def test_bfloat16_features_travel_as_raw_bits():
    feats = torch.randn(3, 8).to(torch.bfloat16)
    msg = Commit(tag=1, accepted=2, tokens=np.array([1, 2, 3], np.int32), features=feats)
    back = roundtrip(msg)
    assert torch.equal(to_torch(back.features), feats)


def frames_with(header_changes=None, drop=None, arrays=None):
    frames = [bytes(f) for f in encode(Commit(tag=5, seq=0, accepted=0,
                                              tokens=np.array([3], np.int32)))]
    header = msgpack.unpackb(frames[0])
    header.update(header_changes or {})
    if drop:
        del header[drop]
    frames[0] = msgpack.packb(header)
    return frames if arrays is None else [frames[0], *arrays]


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1garbage"], ErrorCode.BAD_FRAME),
    ([msgpack.packb([1, 2])], ErrorCode.BAD_FRAME),
    (frames_with({"v": VERSION + 1}), ErrorCode.BAD_VERSION),
    (frames_with({"type": "LAUNCH"}), ErrorCode.BAD_TYPE),
    (frames_with(drop="accepted"), ErrorCode.BAD_FIELD),
    (frames_with({"accepted": "one"}), ErrorCode.BAD_FIELD),
    (frames_with({"accepted": True}), ErrorCode.BAD_FIELD),
    (frames_with(arrays=[]), ErrorCode.BAD_FRAME),
    (frames_with(arrays=[b"\x00" * 7]), ErrorCode.BAD_FRAME),
    (frames_with({"tokens": ["object", [1], 1]}), ErrorCode.BAD_FIELD),
    (frames_with({"accepted": 3}), ErrorCode.BAD_FIELD),
    (frames_with({"verify_ms": float("nan")}), ErrorCode.BAD_FIELD),
    (frames_with({"step_ms": -1.0}), ErrorCode.BAD_FIELD),
    (frames_with({"floor": 1.5}), ErrorCode.BAD_FIELD),
    (frames_with({"floor": float("nan")}), ErrorCode.BAD_FIELD),
])
def test_malformed_messages_raise_protocol_errors_with_codes(frames, code):
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code
    assert info.value.message


def test_oversized_message_is_refused_before_parsing():
    msg = Open(ref=1, prompt_len=1, tokens=np.zeros(2000, np.int32))
    with pytest.raises(ProtocolError) as info:
        roundtrip(msg, Limits(max_message_bytes=4096))
    assert info.value.code == ErrorCode.TOO_LARGE


def test_tree_with_forward_parent_is_rejected():
    msg = Propose(tag=1, tokens=np.array([1, 2], np.int32), parents=np.array([1, -1], np.int32))
    with pytest.raises(ProtocolError, match="earlier node"):
        roundtrip(msg)


def test_a_plain_round_carries_no_tree():
    msg = Propose(tag=1, plain=4, tokens=np.array([1], np.int32), parents=np.array([-1], np.int32))
    with pytest.raises(ProtocolError, match="plain"):
        roundtrip(msg)
    with pytest.raises(ProtocolError, match="plain"):
        roundtrip(Propose(tag=1, plain=-2))


def test_open_features_must_pair_with_tokens():
    msg = Open(ref=1, prompt_len=3, tokens=np.arange(4, dtype=np.int32),
               features=np.zeros((4, 8), np.float16))
    with pytest.raises(ProtocolError, match="features need 3 rows"):
        roundtrip(msg)


def test_errors_carry_the_tag_they_concern():
    frames = frames_with({"accepted": 9})
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.tag == 5


def test_opened_carries_a_session_start_with_the_rules_of_open():
    feats = np.zeros((4, 8), np.float16)
    back = roundtrip(Opened(tag=3, ref=1, budget=12, tokens=np.arange(5, dtype=np.int32),
                            features=feats))
    assert (back.tag, back.ref, back.budget, len(back.tokens)) == (3, 1, 12, 5)
    with pytest.raises(ProtocolError, match="features need 4 rows") as info:
        roundtrip(Opened(tag=3, ref=1, tokens=np.arange(5, dtype=np.int32), features=feats[:3]))
    assert info.value.code == ErrorCode.BAD_FIELD and info.value.tag == 3
    with pytest.raises(ProtocolError) as info:
        roundtrip(Opened(tag=3, budget=MAX_TREE_NODES + 1, tokens=np.arange(2, dtype=np.int32)))
    assert info.value.code == ErrorCode.BAD_FIELD


def test_a_closed_connection_reports_the_link_down_instead_of_raising_zmq_errors():
    from starhub.client.connection import HubClient, HubUnavailable
    from starhub.wire.messages import Ping

    client = HubClient("tcp://127.0.0.1:9", timeout_s=0.1)
    client.close()
    with pytest.raises(HubUnavailable):
        client.send(Ping(nonce=1))
    with pytest.raises(HubUnavailable):
        client.recv(0)
