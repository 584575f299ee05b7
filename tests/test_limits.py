"""Each configurable limit refuses what passes it, with a reason naming its flag, and a
refused message changes nothing: the hub and the edge verifier go on serving."""

from __future__ import annotations

import numpy as np
import pytest

from starhub.cli.main import build_parser
from starhub.drafters.ngram import NgramDrafter
from starhub.hub.server import TOKEN_BYTES
from starhub.server.limits import SessionLimits
from starhub.settings.cli import settings_from
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Opened,
    Propose,
    TargetCard,
)
from tests.servers import HubHarness, VerifierHarness

A, B = b"peer-a", b"peer-b"


def ids(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32) % 50 + 1


def opening(n: int, ref: int = 1) -> Open:
    return Open(ref=ref, prompt_len=n - 1, tokens=ids(n))


def refused(reply, code: ErrorCode, flag: str) -> None:
    assert isinstance(reply, Error) and reply.code == code, reply
    assert flag in reply.message


@pytest.fixture
def make_hub():
    made = []

    def make(**limits) -> HubHarness:
        hub = HubHarness(NgramDrafter(), limits=SessionLimits(**limits))
        for who in (A, B):
            assert isinstance(hub.ask(who, TargetCard(name="t", vocab_size=100)), DrafterCard)
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


def test_a_prompt_past_the_limit_gets_too_large(make_hub):
    hub = make_hub(max_prompt_tokens=8)
    assert isinstance(hub.ask(A, opening(8)), Propose)
    before = hub.state()
    refused(hub.ask(A, opening(9, ref=2)), ErrorCode.TOO_LARGE, "--max-prompt-tokens")
    assert hub.state() == before


def test_sessions_per_peer_are_bounded_and_free_again_on_close(make_hub):
    hub = make_hub(max_sessions_per_peer=2)
    tags = [hub.ask(A, opening(4, ref=r)).tag for r in (1, 2)]
    before = hub.state()
    refused(hub.ask(A, opening(4, ref=3)), ErrorCode.REJECTED, "--max-sessions-per-peer")
    assert hub.state() == before
    assert isinstance(hub.ask(B, opening(4, ref=4)), Propose), "other peers are unaffected"
    hub.send(A, Close(tag=tags[0]))
    assert isinstance(hub.ask(A, opening(4, ref=5)), Propose)


def test_total_sessions_are_bounded(make_hub):
    hub = make_hub(max_sessions=3)
    for ref, who in enumerate((A, A, B)):
        assert isinstance(hub.ask(who, opening(4, ref=ref + 1)), Propose)
    before = hub.state()
    refused(hub.ask(B, opening(4, ref=9)), ErrorCode.REJECTED, "--max-sessions")
    assert hub.state() == before


def commit_plainly(hub: HubHarness, who: bytes, prop: Propose, token: int = 7):
    """Accept nothing: the one token is the target's own, so no first node may hold it."""
    roots = {int(t) for t, p in zip(prop.tokens, prop.parents, strict=True) if p < 0}
    token = next(t for t in range(token, token + 100) if t not in roots)
    return hub.ask(who, Commit(tag=prop.tag, seq=prop.seq, accepted=0,
                               tokens=np.array([token], np.int32)))


def test_a_session_cannot_grow_past_its_limit(make_hub):
    hub = make_hub(max_session_tokens=6)
    prop = hub.ask(A, opening(4))
    for _ in range(2):
        prop = commit_plainly(hub, A, prop)
        assert isinstance(prop, Propose)
    before = hub.state()
    refused(commit_plainly(hub, A, prop), ErrorCode.TOO_LARGE, "--max-session-tokens")
    assert hub.state() == before
    hub.send(A, Close(tag=prop.tag))
    assert hub.hub.table.budget.cached == 0


def test_the_cache_bound_holds_over_all_sessions_with_fair_shares_and_frees_on_close(make_hub):
    hub = make_hub(max_cache_mb=1)
    room = (1 << 20) // TOKEN_BYTES  # tokens the cap holds, without features
    first = hub.ask(A, opening(room * 48 // 100))  # within a lone peer's half
    before = hub.state()
    refused(hub.ask(A, opening(room // 10, ref=2)), ErrorCode.REJECTED, "fair share")
    assert hub.state() == before
    second = hub.ask(B, opening(room * 30 // 100, ref=3))  # within a third
    assert isinstance(second, Propose), "a newcomer still finds its share free"
    before = hub.state()
    refused(hub.ask(B, opening(room * 30 // 100, ref=4)), ErrorCode.REJECTED, "--max-cache-mb")
    refused(commit_plainly(hub, A, first), ErrorCode.REJECTED, "--max-cache-mb")
    assert hub.state() == before
    hub.send(A, Close(tag=first.tag))
    assert isinstance(commit_plainly(hub, B, second), Propose)
    assert hub.hub.table.budget.cached == room * 30 // 100 + 1
    assert hub.hub.table.budget.held == hub.hub.table.budget.cached * TOKEN_BYTES


def test_expired_sessions_give_their_budget_back(make_hub):
    hub = make_hub(max_sessions=1)
    prop = hub.ask(A, opening(4))
    hub.hub.close(prop.tag)  # what housekeeping does at the TTL
    assert hub.hub.table.budget.snapshot() == {"sessions": 0, "peers": 0, "cached_tokens": 0,
                                               "cached_bytes": 0}
    assert isinstance(hub.ask(B, opening(4, ref=2)), Propose)


def test_hub_flags_carry_the_limits():
    hub = settings_from(build_parser().parse_args([
        "hub", "--max-sessions", "7", "--max-sessions-per-peer", "2", "--max-prompt-tokens",
        "100", "--max-session-tokens", "200", "--max-cache-mb", "5000", "--max-peers", "9"]))
    assert SessionLimits(**hub.limit_values()) == SessionLimits(7, 2, 100, 200, 5000, 9)
    default = settings_from(build_parser().parse_args(["hub"]))
    assert SessionLimits(**default.limit_values()) == SessionLimits()


def test_a_limit_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        settings_from(build_parser().parse_args(["hub", "--max-sessions", "0"]))
    assert "greater than or equal to 1" in capsys.readouterr().err


def test_verifier_flags_carry_its_limits():
    args = settings_from(build_parser().parse_args(["verifier", "--max-depth", "4",
                                                    "--max-sessions", "3"]))
    assert args.max_depth == 4 and SessionLimits(**args.limit_values()).max_sessions == 3
    assert settings_from(build_parser().parse_args(["verifier"])).max_cache_mb == 12288


# -- the edge verifier -----------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier(tiny_model):
    v = VerifierHarness(*tiny_model, budget=16, max_nodes=8, max_depth=3,
                        limits=SessionLimits(max_sessions=2, max_sessions_per_peer=1,
                                             max_prompt_tokens=16, max_session_tokens=20))
    for who in (A, B):
        assert isinstance(v.ask(who, DrafterCard(drafter="t")), TargetCard)
    v.session = v.ask(A, opening(12))
    assert isinstance(v.session, Opened)
    return v


def chain(tag: int, n: int, seq: int = 1) -> Propose:
    return Propose(tag=tag, seq=seq, tokens=ids(n), parents=np.arange(-1, n - 1, dtype=np.int32))


def test_the_verifier_refuses_trees_past_its_depth_and_node_limits(verifier):
    tag = verifier.session.tag
    before = verifier.state()
    refused(verifier.ask(A, chain(tag, 4)), ErrorCode.TOO_LARGE, "--max-depth")
    wide = Propose(tag=tag, seq=1, tokens=ids(9), parents=np.full(9, -1, np.int32))
    refused(verifier.ask(A, wide), ErrorCode.TOO_LARGE, "--max-nodes")
    assert verifier.state() == before
    assert verifier.send(A, chain(tag, 3)) == []
    (commit,) = verifier.step(A)
    assert isinstance(commit, Commit)


def test_the_verifier_bounds_prompts_and_sessions(verifier):
    before = verifier.state()
    refused(verifier.ask(B, opening(17)), ErrorCode.TOO_LARGE, "--max-prompt-tokens")
    refused(verifier.ask(A, opening(4, ref=2)), ErrorCode.REJECTED, "--max-sessions-per-peer")
    assert verifier.state() == before


def test_the_verifier_bounds_a_sessions_length(verifier):
    tag = verifier.session.tag
    held = verifier.verifier.table.budget.tokens[tag]
    room = 20 - held
    before = verifier.state()
    wide = Propose(tag=tag, seq=2, tokens=ids(room), parents=np.full(room, -1, np.int32))
    refused(verifier.ask(A, wide), ErrorCode.TOO_LARGE, "--max-session-tokens")
    assert verifier.state() == before
