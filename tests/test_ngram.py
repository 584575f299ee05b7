import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from starhub.drafters.base import DraftContext, TreeShape
from starhub.drafters.ngram import NgramDrafter, NgramIndex


def test_latest_longest_match_comes_first():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    conts = NgramDrafter().continuations(tokens, depth=2, count=2)
    assert conts == [[7, 8], [9, 1]]


def test_greedy_trie_shares_prefixes_and_respects_budget():
    tokens = [4, 5, 6, 4, 5, 7, 4, 5]
    tree = NgramDrafter().propose(DraftContext(tokens=tokens), TreeShape(depth=3, topk=4,
                                                                         max_nodes=4))
    assert tree.tokens.tolist() == [7, 4, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 1, -1]
    assert tree.dist_ids is None


def test_sampled_sessions_get_a_point_mass_chain():
    ctx = DraftContext(tokens=[1, 2, 3, 1, 2, 3, 1, 2], temperature=1.0,
                       generator=torch.Generator())
    tree = NgramDrafter().propose(ctx, TreeShape(depth=3, topk=4, max_nodes=8))
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.dist_probs[:3, 0].tolist() == [1.0, 1.0, 1.0]
    assert tree.dist_ids[:3, 0].tolist() == tree.tokens.tolist()


def test_no_match_gives_an_empty_tree():
    tree = NgramDrafter().propose(DraftContext(tokens=[1, 2, 3, 4]), TreeShape())
    assert len(tree) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=1, max_size=30),
       st.integers(1, 8))
def test_the_incremental_index_finds_what_a_full_scan_finds(appends, depth):
    """The hub's per-session index gives the same branch as scanning every token, round
    after round as the session grows."""
    scan, index, tokens = NgramDrafter(max_ngram=4, min_ngram=2), NgramIndex(4, 2), []
    for new in appends:
        tokens += new
        found = scan.continuations(tokens, depth, 1)
        assert index.continuation(tokens, depth) == (found[0] if found else [])
