import numpy as np
import pytest
import torch

from starhub.drafters.growing import (
    build_greedy_tree,
    build_sampled_tree,
    rank,
    sample_without_replacement,
    top_k,
)
from starhub.wire.tree import (
    DraftTree,
    accepted_path,
    ancestor_mask,
    children,
    depths,
    graft,
    subtree,
)


def random_expand(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def expand(ids, tokens, parents):
        return torch.randn(len(ids), vocab, generator=gen) * 3

    return expand


def test_greedy_tree_respects_budget_and_orders_parents_first():
    tree = build_greedy_tree(torch.randn(50) * 3, random_expand(50), depth=5, topk=3,
                             max_nodes=12)
    assert len(tree) == 12
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.depth <= 5


def path_expand(vocab: int, seed: int, scale: float, fed: list[int]):
    """Logits that depend only on the node's own path, so that a tree does not change with
    which other nodes were expanded; ``fed`` collects the rows of each call."""
    paths = {-1: ()}

    def expand(ids, tokens, parents):
        fed.append(len(ids))
        rows = []
        for node, token, parent in zip(ids, tokens, parents, strict=True):
            paths[node] = paths[parent] + (token,)
            gen = torch.Generator().manual_seed(hash((seed, *paths[node])) % 2**31)
            rows.append(torch.randn(vocab, generator=gen) * scale)
        return torch.stack(rows)

    return expand


def test_greedy_tree_expands_only_nodes_whose_children_could_still_be_chosen(monkeypatch):
    import starhub.drafters.growing

    def build(seed: int, scale: float) -> tuple[list, list, list]:
        fed: list[int] = []
        root = torch.randn(200, generator=torch.Generator().manual_seed(seed)) * scale
        tree = build_greedy_tree(root, path_expand(200, seed, scale, fed), depth=6, topk=3,
                                 max_nodes=10)
        return tree.tokens.tolist(), tree.parents.tolist(), fed

    runs = [(seed, scale) for seed in range(12) for scale in (0.3, 1.0, 3.0)]
    pruned = [build(*run) for run in runs]
    monkeypatch.setattr(starhub.drafters.growing, "_useful",
                        lambda frontier, scores, max_nodes: frontier)
    full = [build(*run) for run in runs]
    assert [p[:2] for p in pruned] == [f[:2] for f in full]
    assert all(f[2] == [3] * 5 for f in full)
    assert sum(map(sum, (p[2] for p in pruned))) < sum(map(sum, (f[2] for f in full))) / 2


def test_greedy_chain_follows_argmax():
    logits = torch.zeros(10)
    logits[4] = 5

    def expand(ids, tokens, parents):
        out = torch.zeros(len(ids), 10)
        out[:, (tokens[0] + 1) % 10] = 5
        return out

    tree = build_greedy_tree(logits, expand, depth=4, topk=1, max_nodes=10)
    assert tree.tokens.tolist() == [4, 5, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_sampled_tree_keeps_every_draw_and_sends_q_rows():
    gen = torch.Generator().manual_seed(0)
    tree = build_sampled_tree(torch.randn(30), random_expand(30), depth=3, topk=2,
                              max_nodes=7, temperature=1.0, support=8, generator=gen)
    assert len(tree) == 7
    assert tree.dist_probs.shape == (8, 8)
    kids = children(tree.parents)
    for pos, row in enumerate(tree.dist_probs):
        if kids[pos]:
            assert abs(row.sum() - 1) < 1e-5
            assert set(tree.tokens[kids[pos]].tolist()) <= set(tree.dist_ids[pos].tolist())


def test_ancestor_mask_and_depths_describe_the_tree():
    parents = np.array([-1, -1, 0, 2], np.int32)
    assert depths(parents).tolist() == [1, 1, 2, 3]
    mask = ancestor_mask(parents)
    assert mask[4].tolist() == [True, True, False, True, True]
    assert mask[2].tolist() == [True, False, True, False, False]


def test_without_replacement_draw_order_matches_sequential_sampling():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    firsts = np.zeros(3)
    seconds_after_0 = np.zeros(3)
    n = 20000
    for _ in range(n):
        order = sample_without_replacement(probs, 2, gen).tolist()
        firsts[order[0]] += 1
        if order[0] == 0:
            seconds_after_0[order[1]] += 1
    np.testing.assert_allclose(firsts / n, [0.5, 0.3, 0.2], atol=0.015)
    np.testing.assert_allclose(seconds_after_0[1:] / seconds_after_0.sum(), [0.6, 0.4], atol=0.02)


@pytest.mark.parametrize("rows", [[0, 2, 5], [0, 1, 2], [0]])
def test_keep_keeps_the_prefix_and_the_chosen_rows_in_order(rows):
    from targets.kv import KVPool

    kv = KVPool(kv_heads=2, head_dim=3, dtype=torch.float32,
                devices=[torch.device("cpu")] * 2).new_cache(4)
    entries = torch.arange(10.0).view(1, 10, 1).expand(2, 10, 3)
    kv.reserve(10)
    for layer in range(2):
        kv.write(layer, entries + 100 * layer, -(entries + 100 * layer))
    kv.advance(10)
    kv.keep(4, rows)
    want = torch.tensor([0.0, 1, 2, 3] + [4.0 + r for r in rows])
    assert kv.length == 4 + len(rows)
    for layer in range(2):
        assert torch.equal(kv.keys[layer][1, :kv.length, 2], want + 100 * layer)
        assert torch.equal(kv.values[layer][0, :kv.length, 0], -(want + 100 * layer))
    keys, _ = kv.write(0, torch.zeros(2, 1, 3), torch.zeros(2, 1, 3))
    assert keys.shape[1] == 5 + len(rows), "the next pass writes after what was kept"


def test_a_cache_grows_only_when_a_pass_would_overflow_it_and_keeps_its_entries():
    from targets.kv import GRAIN, KVPool

    pool = KVPool(kv_heads=1, head_dim=2, dtype=torch.float32, devices=[torch.device("cpu")])
    kv = pool.new_cache(GRAIN)
    first = kv.keys[0].data_ptr()
    kv.reserve(GRAIN)
    kv.write(0, torch.ones(1, GRAIN, 2), torch.ones(1, GRAIN, 2))
    kv.advance(GRAIN)
    assert kv.keys[0].data_ptr() == first and kv.capacity == GRAIN
    kv.reserve(1)
    assert kv.capacity == GRAIN + GRAIN // 2
    assert torch.equal(kv.keys[0][:, :GRAIN], torch.ones(1, GRAIN, 2))
    assert not kv.keys[0][:, GRAIN:].any(), "a slot is zeroed when a session takes it"
    assert list(pool.shelves) == [GRAIN, GRAIN + GRAIN // 2] and not pool.shelves[GRAIN], \
        "the slot it left went back, and its shelf, empty, was dropped"


def test_size_classes_grow_by_a_half_or_a_third_from_the_grain():
    from targets.kv import GRAIN, size_class

    assert [size_class(n) for n in (1, GRAIN, GRAIN + 1, 2 * GRAIN, 2 * GRAIN + 1, 600, 857)] \
        == [GRAIN, GRAIN, 192, 256, 384, 768, 1024]


def test_a_dropped_session_gives_its_slot_back_and_an_empty_shelf_is_freed():
    import gc

    from targets.kv import SLOTS, KVPool

    pool = KVPool(kv_heads=1, head_dim=2, dtype=torch.float32, devices=[torch.device("cpu")])
    caches = [pool.new_cache(10) for _ in range(SLOTS + 1)]
    assert [kv.slot for kv in caches] == [*range(SLOTS), 0]
    assert len(pool.shelves[128]) == 2, "a full shelf makes room on a new one"
    second = caches.pop(3)
    del second
    gc.collect()
    assert pool.new_cache(10).slot == 3, "the lowest free slot goes first"
    del caches
    gc.collect()
    assert not pool.shelves[128]


def test_graft_adds_only_the_nodes_a_path_of_the_tree_lacks():
    # root -> 5 -> 6, root -> 7
    tree = DraftTree(np.array([5, 7, 6], np.int32), np.array([-1, -1, 0], np.int32))
    grown = graft(tree, [5, 6, 8, 9])
    assert grown.tokens.tolist() == [5, 7, 6, 8, 9]
    assert grown.parents.tolist() == [-1, -1, 0, 2, 3]
    assert all(p < i for i, p in enumerate(grown.parents))
    assert graft(tree, [7]) is tree  # already there: the same tree, nothing added
    assert accepted_path(grown.tokens, grown.parents, [5, 6, 8, 4]) == [0, 2, 3]
    assert accepted_path(grown.tokens, grown.parents, [7, 6]) == [1]
    assert len(graft(tree, [5, 6, 8, 9], max_nodes=4)) == 4
    with pytest.raises(ValueError, match="greedy"):
        graft(DraftTree(tree.tokens, tree.parents, np.zeros((4, 1), np.int32),
                        np.ones((4, 1), np.float32)), [1])


def test_a_subtree_keeps_the_nodes_below_a_node_rooted_there():
    # root -> 5 -> 6 -> 9, 5 -> 8; root -> 7 -> 4
    tree = DraftTree(np.array([5, 7, 6, 4, 8, 9], np.int32),
                     np.array([-1, -1, 0, 1, 0, 2], np.int32),
                     np.zeros((7, 1), np.int32), np.ones((7, 1), np.float32))
    below = subtree(tree, 0)
    assert below.tokens.tolist() == [6, 8, 9]
    assert below.parents.tolist() == [-1, -1, 0]
    assert below.dist_ids is None
    assert accepted_path(below.tokens, below.parents, [6, 9]) == [0, 2]
    whole = subtree(tree, -1)
    assert whole.tokens.tolist() == tree.tokens.tolist()
    assert whole.parents.tolist() == tree.parents.tolist()
    assert len(subtree(tree, 3)) == 0  # a leaf has nothing below it


@pytest.mark.parametrize("rows,width,k", [(1, 6144, 4), (24, 6144, 4), (5, 49152, 10),
                                          (3, 6144, 96), (2, 100, 4), (4, 256, 1)])
def test_top_k_finds_what_topk_finds(rows, width, k):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width + k))
    values, ids = top_k(x, k)
    expected = x.topk(min(k, width), -1)
    assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)


def test_ranked_children_are_log_probabilities_best_first():
    logits = torch.randn(3, 6144, generator=torch.Generator().manual_seed(0))
    ranked = rank(logits.bfloat16(), 4)
    logp = torch.log_softmax(logits.bfloat16().float(), -1)
    for row in range(3):
        assert ranked.ids[row] == logp[row].topk(4).indices.tolist()
        assert ranked.logp[row] == pytest.approx(logp[row].topk(4).values.tolist())


def path_probabilities(tree: DraftTree, root: torch.Tensor, expand) -> list[float]:
    """Each node's draft path probability under ``path_expand`` logits (which depend only
    on the node's own path), fed parents first with the tree's indices as ids."""
    rows, logp = {-1: root}, {-1: 0.0}
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(),
                                            strict=True)):
        logp[i] = logp[parent] + float(torch.log_softmax(rows[parent], -1)[token])
        rows[i] = expand([i], [token], [parent])[0]
    return [float(np.exp(logp[i])) for i in range(len(tree))]


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_floor_leaves_out_the_unlikely_nodes_of_the_same_tree(seed):
    root = torch.randn(200, generator=torch.Generator().manual_seed(seed)) * 2.0
    trees = {}
    for floor in (0.0, 0.05):
        trees[floor] = build_greedy_tree(root, path_expand(200, seed, 2.0, []), depth=5,
                                         topk=4, max_nodes=10, floor=floor)
    full, cut = trees[0.0], trees[0.05]
    probs = path_probabilities(full, root, path_expand(200, seed, 2.0, []))
    kept = {path for path, p in zip(node_paths(full), probs, strict=True) if p >= 0.05}
    assert set(node_paths(cut)) == (kept or {node_paths(full)[0]}), \
        "the full tree's nodes at or above the floor, and no others"
    assert len(cut) < len(full)


def test_a_floor_above_every_node_keeps_the_best_first_guess():
    root = torch.zeros(50)
    root[7] = 0.5
    tree = build_greedy_tree(root, random_expand(50), depth=5, topk=4, max_nodes=10,
                             floor=0.9)
    assert tree.tokens.tolist() == [7] and tree.parents.tolist() == [-1]


def test_a_session_joins_a_shelf_with_room_of_up_to_twice_its_need_before_opening_one():
    from targets.kv import KVPool

    pool = KVPool(kv_heads=1, head_dim=2, dtype=torch.float32, devices=[torch.device("cpu")])
    long = pool.new_cache(500)
    assert long.capacity == 512
    near, far = pool.new_cache(300), pool.new_cache(200)
    assert near.shelf is long.shelf, "512 is within twice 300"
    assert far.capacity == 256 and far.shelf is not long.shelf


def test_a_slot_given_back_while_the_pool_is_busy_is_freed_at_its_next_take():
    from targets.kv import KVPool

    pool = KVPool(kv_heads=1, head_dim=2, dtype=torch.float32, devices=[torch.device("cpu")])
    kept, dropped = pool.new_cache(10), pool.new_cache(10)
    with pool._lock:  # as a garbage collection inside ``take`` drops a session: no deadlock
        dropped._release()
    assert dropped.slot not in kept.shelf.free
    assert pool.new_cache(10).slot == dropped.slot


def test_off_the_cpu_a_shelf_holds_one_session_so_no_empty_slot_takes_memory():
    from targets.kv import KVPool

    pool = KVPool(kv_heads=1, head_dim=2, dtype=torch.float32, devices=[torch.device("meta")])
    first, second = pool.new_cache(10), pool.new_cache(10)
    assert first.shelf.slots == 1 and first.shelf.keys[0].shape[0] == 1
    assert first.shelf is not second.shelf
