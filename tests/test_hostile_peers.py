"""What a hostile peer can no longer do to a server: skew the hub's acceptance estimate with
a COMMIT that misreports, grow the verifier's peer table, stall other sessions with a long
prompt, take a fresh allowance with each connection, or hold admission slots idle."""

from __future__ import annotations

import numpy as np
import pytest

from starhub.drafters.ngram import NgramDrafter
from starhub.wire.messages import Commit, DrafterCard, Error, ErrorCode, Open, Propose, TargetCard
from starhub.wire.tree import DraftTree
from targets.acceptance import walk
from tests.servers import HubHarness

T = b"target-a"
REPEATING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


@pytest.fixture
def hub():
    harness = HubHarness(NgramDrafter())
    assert isinstance(harness.ask(T, TargetCard(name="t", vocab_size=100)), DrafterCard)
    yield harness
    harness.close()


def commit(prop: Propose, accepted: int, tokens: list[int]) -> Commit:
    return Commit(tag=prop.tag, seq=prop.seq, accepted=accepted,
                  tokens=np.asarray(tokens, np.int32))


def test_a_commit_whose_accepted_count_its_tokens_do_not_walk_gets_an_error(hub):
    prop = hub.ask(T, Open(ref=1, prompt_len=10, tokens=np.asarray(REPEATING, np.int32)))
    assert isinstance(prop, Propose) and len(prop.tokens) >= 2, prop
    first = int(prop.tokens[0])
    stranger = next(t for t in range(1, 100) if t not in prop.tokens.tolist())
    acceptance = hub.hub.control.hub_acceptance
    before, seen = hub.state(), (list(acceptance.trials), list(acceptance.hits))
    # claims a whole path accepted, but its tokens leave the tree at once
    lie = hub.ask(T, commit(prop, 2, [stranger, stranger, stranger]))
    assert isinstance(lie, Error) and lie.code == ErrorCode.BAD_FIELD, lie
    assert "walk 0 nodes" in lie.message
    # claims nothing accepted, though its first token is the tree's first node
    modest = hub.ask(T, commit(prop, 0, [first]))
    assert isinstance(modest, Error) and modest.code == ErrorCode.BAD_FIELD, modest
    assert hub.state() == before
    assert (acceptance.trials, acceptance.hits) == seen, "the estimate learnt nothing"
    # what walking the tree gives is taken
    path, bonus = walk(DraftTree(prop.tokens, prop.parents), lambda pos, depth: (
        int(prop.tokens[pos]) if pos < len(prop.tokens) else stranger))
    honest = [int(prop.tokens[i]) for i in path] + [bonus]
    assert isinstance(hub.ask(T, commit(prop, len(path), honest)), Propose)
    assert hub.hub.metrics.accept_lengths[len(path) + 1] == 1

