"""Property-based fuzzing of the servers' handling of messages: the hub (with a drafter
that needs no features and with an EAGLE drafter that does) and the edge verifier.

Every hostile message, malformed or well-formed but wrong for the server's state (a tag it
does not own, a stale round, ids past the vocabulary, a tree too deep), gets exactly one
ERROR (or, for a handshake, a REJECT) and leaves the server's state as it was; afterwards
the real sessions still serve."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from starhub.drafters.eagle import EagleDrafter
from starhub.drafters.eagle_head import EAGLE
from starhub.drafters.ngram import NgramDrafter
from starhub.server.limits import SessionLimits
from starhub.wire.messages import (
    MAX_TREE_NODES,
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Message,
    Open,
    Opened,
    Propose,
    Reject,
    TargetCard,
)
from tests import fuzz_strategies as fz
from tests.servers import HubHarness, VerifierHarness, wire

OWNER, OTHER, STRANGER = b"owner", b"other", b"stranger"
REPEATING = [5, 6, 7, 8] * 3 + [5]
MAX_PROMPT = 64
SENDERS = st.sampled_from([OWNER, OTHER, STRANGER])
KNOWN = st.sampled_from([OWNER, OTHER])


def tokens(ids) -> np.ndarray:
    return np.asarray(ids, np.int32)


@st.composite
def spoiled(draw, ids: np.ndarray, vocab: int) -> np.ndarray:
    """``ids`` with one id outside the vocabulary."""
    out = ids.copy()
    out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(vocab, (1 << 31) - 1)
                                                   | st.integers(-(1 << 31), -1))
    return out


not_accepted_here = st.sampled_from([Propose, DrafterCard, Reject, Error]).flatmap(
    lambda cls: fz.valid_messages.filter(lambda m: type(m) is cls))


@st.composite
def open_attacks(draw, helloed: st.SearchStrategy, vocab: int
                 ) -> tuple[bytes, Message, ErrorCode]:
    """OPENs refused whatever the server holds: no handshake, ids past the vocabulary,
    prompts past the length limit."""
    msg = draw(fz.valid_opens())
    msg.features = None
    how = draw(st.sampled_from(["no_hello", "bad_id", "too_long"]))
    if how == "no_hello":
        return STRANGER, msg, ErrorCode.NO_CARD
    if how == "bad_id":
        msg.tokens = draw(spoiled(msg.tokens, vocab))
        return draw(helloed), msg, ErrorCode.BAD_FIELD
    n = draw(st.integers(MAX_PROMPT + 1, 4 * MAX_PROMPT))
    msg.tokens, msg.prompt_len = np.ones(n, np.int32), n - 1
    return draw(helloed), msg, ErrorCode.TOO_LARGE


# -- the hub ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub():
    h = HubHarness(NgramDrafter(), limits=SessionLimits(max_prompt_tokens=MAX_PROMPT))
    for who in (OWNER, OTHER):
        card = TargetCard(name=who.decode(), vocab_size=fz.VOCAB)
        assert isinstance(h.ask(who, card), DrafterCard)
    h.round = h.ask(OWNER, Open(ref=1, prompt_len=len(REPEATING) - 1, tokens=tokens(REPEATING)))
    assert isinstance(h.round, Propose) and len(h.round.tokens)
    yield h
    h.close()


@st.composite
def hub_attacks(draw, prop: Propose) -> tuple[bytes, Message | list[bytes], ErrorCode | None]:
    tag, seq, size = prop.tag, prop.seq, len(prop.tokens)
    how = draw(st.sampled_from(["malformed", "open", "unknown_tag", "not_owner", "no_hello",
                                "stale", "bad_accept", "bad_id", "not_for_hubs"]))
    if how == "malformed":
        return draw(SENDERS), draw(fz.malformed), None
    if how == "open":
        return draw(open_attacks(KNOWN, fz.VOCAB))
    if how == "not_for_hubs":
        return draw(SENDERS), draw(not_accepted_here), None
    accepted = draw(st.integers(0, size))
    commit = Commit(tag=tag, seq=seq, accepted=accepted, tokens=np.ones(accepted + 1, np.int32))
    if how == "unknown_tag":
        other_tag = draw(fz.ints.filter(lambda t: t != tag))
        msg = draw(st.sampled_from([Close(tag=other_tag),
                                    Commit(tag=other_tag, tokens=tokens([1]))]))
        return draw(KNOWN), msg, ErrorCode.UNKNOWN_TAG
    if how == "not_owner":
        return OTHER, draw(st.sampled_from([Close(tag=tag), commit])), ErrorCode.NOT_OWNER
    if how == "no_hello":
        return STRANGER, commit, ErrorCode.NO_CARD
    if how == "stale":
        commit.seq = draw(fz.small.filter(lambda s: s != seq))
        return OWNER, commit, ErrorCode.STALE
    if how == "bad_accept":
        if draw(st.booleans()):
            commit.accepted = draw(st.integers(size + 1, MAX_TREE_NODES))
            commit.tokens = np.ones(commit.accepted + 1, np.int32)
        else:
            n = draw(st.integers(1, MAX_TREE_NODES).filter(lambda n: n != accepted + 1))
            commit.tokens = np.ones(n, np.int32)
        return OWNER, commit, ErrorCode.BAD_FIELD
    commit.tokens = draw(spoiled(commit.tokens, fz.VOCAB))
    return OWNER, commit, ErrorCode.BAD_FIELD


def refused(replies: list[Message], code: ErrorCode | None) -> None:
    assert len(replies) == 1, replies
    (reply,) = replies
    assert isinstance(reply, Error | Reject), reply
    if isinstance(reply, Error) and code is not None:
        assert reply.code == code, reply


@given(st.data())
def test_the_hub_answers_hostile_messages_with_an_error_and_changes_nothing(hub, data):
    sender, msg, code = data.draw(hub_attacks(hub.round))
    before = hub.state()
    replies = hub.send(sender, msg)
    refused(replies, code)
    assert isinstance(replies[0], Error)
    assert hub.state() == before


def test_the_hubs_session_serves_on_after_the_fuzzing(hub):
    prop = hub.round
    reply = hub.ask(OWNER, Commit(tag=prop.tag, seq=prop.seq, accepted=0, tokens=tokens([8])))
    assert isinstance(reply, Propose) and reply.seq == prop.seq + 1
    assert hub.hub.metrics.errors.get("INTERNAL", 0) == 0


def test_features_are_not_kept_for_a_drafter_that_reads_none(hub):
    feats = np.ones((2, 8), np.float16)
    reply = hub.ask(OTHER, Open(ref=9, prompt_len=2, tokens=tokens([1, 2, 3]), features=feats))
    assert isinstance(reply, Propose)
    assert hub.hub.table.sessions[reply.tag].ctx.features == []
    hub.send(OTHER, Close(tag=reply.tag))


# -- the hub with an EAGLE drafter: features are checked against the head --------------
@pytest.fixture(scope="module")
def eagle_hub(tiny_dir):
    from tests.test_eagle_drafter import random_head

    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())
    h = HubHarness(drafter)
    vocab = drafter.head.vocab_size
    card = TargetCard(name="t", vocab_size=vocab, hidden_size=64)
    assert isinstance(h.ask(OWNER, card), DrafterCard)
    h.width = drafter.feature_size
    h.round = h.ask(OWNER, Open(ref=1, prompt_len=4, tokens=tokens([1, 2, 3, 4, 5]),
                                features=np.zeros((4, h.width), np.float16)))
    assert isinstance(h.round, Propose)
    yield h
    h.close()


@st.composite
def feature_attacks(draw, prop: Propose, width: int) -> Message | list[bytes]:
    n = draw(st.integers(2, 12))
    accepted = draw(st.integers(0, len(prop.tokens)))
    bad_width = st.integers(0, 3 * width).filter(lambda w: w != width)
    how = draw(st.sampled_from(["open_none", "open_width", "commit_none", "commit_width",
                                "open_nan", "commit_dtype"]))
    if how.startswith("open"):
        msg = Open(ref=2, prompt_len=n - 1, tokens=np.ones(n, np.int32))
        rows = n - 1
    else:
        msg = Commit(tag=prop.tag, seq=prop.seq, accepted=accepted,
                     tokens=np.ones(accepted + 1, np.int32))
        rows = accepted + 1
    if how.endswith("width"):
        msg.features = np.zeros((rows, draw(bad_width)), np.float16)
    elif how.endswith("nan"):
        msg.features = np.zeros((rows, width), np.float16)
        msg.features[draw(st.integers(0, rows - 1)), 0] = draw(fz.non_finite)
    elif how.endswith("dtype"):
        msg.features = np.zeros((rows, width), draw(st.sampled_from([np.int32, np.float64])))
    return msg


@given(st.data())
def test_an_eagle_hub_refuses_missing_misshapen_or_nan_features(eagle_hub, data):
    msg = data.draw(feature_attacks(eagle_hub.round, eagle_hub.width))
    before = eagle_hub.state()
    replies = eagle_hub.send(OWNER, msg)
    refused(replies, ErrorCode.BAD_FIELD)
    assert eagle_hub.state() == before


# -- the edge verifier -------------------------------------------------------------------
MAX_NODES, MAX_DEPTH = 32, 6


@pytest.fixture(scope="module")
def verifier(tiny_model):
    v = VerifierHarness(*tiny_model, budget=16, max_nodes=MAX_NODES, max_depth=MAX_DEPTH,
                        limits=SessionLimits(max_prompt_tokens=MAX_PROMPT, max_sessions=8))
    for who in (OWNER, OTHER):
        assert isinstance(v.ask(who, DrafterCard(drafter="fuzz")), TargetCard)
    prompt = tokens([1, 5, 9, 14, 3])
    v.greedy = v.ask(OWNER, Open(ref=1, prompt_len=5, tokens=prompt))
    v.sampled = v.ask(OWNER, Open(ref=2, prompt_len=5, temperature=0.7, tokens=prompt))
    assert isinstance(v.greedy, Opened) and isinstance(v.sampled, Opened)
    assert v.send(OWNER, Propose(tag=v.greedy.tag, seq=1, tokens=tokens([5, 6]),
                                 parents=tokens([-1, 0]))) == []
    return v


@st.composite
def verifier_attacks(draw, greedy: int, sampled: int, vocab: int):
    how = draw(st.sampled_from(["malformed", "open", "unknown_tag", "not_owner", "stale",
                                "plain", "too_many", "too_deep", "bad_id",
                                "bad_dist_id", "not_for_verifiers", "welcome"]))
    n = draw(st.integers(1, 8))
    star = Propose(tag=sampled, seq=1, tokens=np.ones(n, np.int32),
                   parents=np.full(n, -1, np.int32), dist_ids=np.ones((n + 1, 2), np.int32),
                   dist_probs=np.full((n + 1, 2), 0.5, np.float32))
    if how == "malformed":
        return draw(SENDERS), draw(fz.malformed), None
    if how == "open":
        return draw(open_attacks(KNOWN, vocab))
    if how == "not_for_verifiers":
        bad = st.sampled_from([TargetCard, Commit, Reject, Error]).flatmap(
            lambda cls: fz.valid_messages.filter(lambda m: type(m) is cls))
        return draw(SENDERS), draw(bad), None
    if how == "welcome":
        layers = st.integers(-1000, 1000).filter(lambda i: not -3 <= i <= 2)
        return draw(KNOWN), DrafterCard(feature_layers=[draw(layers)]), None
    if how == "unknown_tag":
        tag = draw(fz.ints.filter(lambda t: t not in (greedy, sampled)))
        star.tag = tag
        return draw(KNOWN), draw(st.sampled_from([star, Close(tag=tag)])), ErrorCode.UNKNOWN_TAG
    if how == "not_owner":
        return OTHER, draw(st.sampled_from([star, Close(tag=sampled)])), ErrorCode.NOT_OWNER
    if how == "stale":
        star.tag = greedy
        return OWNER, star, ErrorCode.STALE
    if how == "plain":
        return OWNER, Propose(tag=sampled, seq=1, plain=draw(st.integers(1, 64))), \
            ErrorCode.BAD_FIELD
    if how in ("too_many", "too_deep"):  # an empty tree is a drafter with no guess: served
        size = {"too_many": st.integers(MAX_NODES + 1, MAX_TREE_NODES),
                "too_deep": st.integers(MAX_DEPTH + 1, MAX_NODES)}[how]
        m = draw(size)
        return OWNER, Propose(tag=sampled, seq=1, tokens=np.ones(m, np.int32),
                              parents=np.arange(-1, m - 1, dtype=np.int32)), ErrorCode.TOO_LARGE
    if how == "bad_id":
        star.tokens = draw(spoiled(star.tokens, vocab))
    else:  # distributions are optional, but ids in them must still be in the vocabulary
        star.dist_ids = draw(spoiled(star.dist_ids.reshape(-1), vocab)).reshape(n + 1, 2)
    return OWNER, star, ErrorCode.BAD_FIELD


@given(st.data())
def test_the_verifier_answers_hostile_messages_with_an_error_and_changes_nothing(verifier,
                                                                                 data):
    v = verifier
    attacks = verifier_attacks(v.greedy.tag, v.sampled.tag, v.verifier.card.vocab_size)
    sender, msg, code = data.draw(attacks)
    before = verifier.state()
    refused(verifier.send(sender, msg), code)
    assert verifier.state() == before


def test_the_verifiers_sessions_serve_on_after_the_fuzzing(verifier):
    (commit,) = verifier.step(OWNER)
    assert isinstance(commit, Commit) and commit.tag == verifier.greedy.tag
    tree = Propose(tag=verifier.sampled.tag, seq=1, tokens=tokens([5]), parents=tokens([-1]),
                   dist_ids=tokens([[5], [6]]), dist_probs=np.ones((2, 1), np.float32))
    assert verifier.send(OWNER, wire(tree)) == []
    (commit,) = verifier.step(OWNER)
    assert isinstance(commit, Commit) and commit.tag == verifier.sampled.tag
    assert verifier.verifier.stats.errors.get("INTERNAL", 0) == 0
