"""Batched drafting and pre-drafting: a packed pass drafts exactly the trees one-by-one
drafting would, pre-drafting leaves a session as it found it, and a hub that batches and
pre-drafts stays token-identical to generate()."""

from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import torch

from starhub.drafters.base import DraftContext, TreeShape
from starhub.drafters.eagle import EagleDrafter
from starhub.drafters.eagle_head import EAGLE, EAGLE3
from starhub.drafters.emulated import EmulatedDrafter
from starhub.drafters.growing import grow_greedy, grow_together
from starhub.drafters.outcomes import likely_outcomes, path_to
from starhub.hub.metrics import HubMetrics, derive
from starhub.hub.sessions import DraftSession
from starhub.hub.worker import DraftWorker, Request
from starhub.wire.tree import DraftTree, children
from targets import attach
from tests.conftest import HubThread
from tests.servers import wire
from tests.test_eagle_drafter import random_head
from tests.test_lossless_api import reference

SHAPE = TreeShape(depth=4, topk=3, max_nodes=9)


def contexts(count: int, seed: int = 0, temperature: float = 0.0) -> list[DraftContext]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 5 + 3 * i
        out.append(DraftContext(tokens=torch.randint(3, 4000, (n,), generator=g).tolist(),
                                features=[torch.randn(n - 1, 64, generator=g)],
                                temperature=temperature,
                                generator=torch.Generator().manual_seed(i)))
    return out


def commit(ctxs: list[DraftContext], seed: int) -> None:
    """The same two committed tokens, with their features, to every context."""
    g = torch.Generator().manual_seed(seed)
    tokens, features = torch.randint(3, 4000, (2,), generator=g).tolist(), torch.randn(2, 64)
    for ctx in ctxs:
        ctx.tokens += tokens
        ctx.features.append(features.clone())


def same(a: DraftTree, b: DraftTree) -> bool:
    return a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_packed_batch_drafts_the_trees_one_by_one_drafting_would(tiny_dir, kind,
                                                                   temperature):
    drafter = EagleDrafter(random_head(tiny_dir, kind, None).eval())
    width = drafter.feature_size
    alone = contexts(4, temperature=temperature)
    for ctx in alone:
        ctx.features = [torch.randn(len(ctx.tokens) - 1, width,
                                    generator=torch.Generator().manual_seed(len(ctx.tokens)))]
    together = copy.deepcopy(alone)
    for round_ in range(3):
        one_by_one = [drafter.propose(ctx, SHAPE) for ctx in alone]
        batched = drafter.propose_batch([(ctx, SHAPE) for ctx in together])
        assert all(same(a, b) for a, b in zip(one_by_one, batched, strict=True))
        if temperature:
            assert all(np.allclose(a.dist_probs, b.dist_probs, atol=1e-5)
                       for a, b in zip(one_by_one, batched, strict=True))
        for group in (alone, together):
            for ctx in group:
                ctx.tokens += [7 + round_, 9]
                ctx.features.append(torch.randn(2, width, generator=torch.Generator()
                                                .manual_seed(round_)))


@pytest.mark.parametrize("kind", [EAGLE, EAGLE3])
def test_requests_admitted_mid_batch_get_their_own_trees_and_each_leaves_when_done(tiny_dir,
                                                                                   kind):
    """Continuous batching: jobs admitted between layers draft exactly what they would
    alone, share passes with the running ones (an EAGLE-3 head's target features, wider
    than the trees' own rows, ride the same pass), and every tree is handed over the
    moment it is done, before the batch ends."""
    drafter = EagleDrafter(random_head(tiny_dir, kind, None).eval())
    alone = contexts(4, seed=3)
    g = torch.Generator().manual_seed(3)
    for ctx in alone:
        ctx.features = [torch.randn(len(ctx.tokens) - 1, drafter.feature_size, generator=g)]
    together = copy.deepcopy(alone)
    expected = [drafter.propose(ctx, SHAPE) for ctx in alone]
    shallow = TreeShape(depth=2, topk=3, max_nodes=4)
    late = [(ctx, SHAPE) for ctx in together[2:]]
    heard: list[tuple[int, DraftTree, float]] = []
    asked = []

    def admit():
        asked.append(len(heard))
        return [late.pop(0)] if late else []

    results = drafter.propose_batch([(together[0], shallow), (together[1], SHAPE)],
                                    admit=admit, finished=lambda k, tree, seconds, batch:
                                    heard.append((k, tree, batch)))
    assert [k for k, _, _ in heard][0] == 0, "the shallow tree leaves first"
    assert sorted(k for k, _, _ in heard) == [0, 1, 2, 3] and len(results) == 4
    assert asked[0] == 0 and len(asked) >= 3, "jobs join between layers, while others grow"
    for k in (1, 2, 3):
        assert same(results[k], expected[k])
    assert all(batch > 1 for _, _, batch in heard)


def test_one_bad_session_does_not_cost_the_batch_its_round(tiny_dir):
    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())
    good = contexts(2)
    bad = DraftContext(tokens=[1, 2, 3], features=[torch.randn(1, 64)])
    results = drafter.propose_batch([(good[0], SHAPE), (bad, SHAPE), (good[1], SHAPE)])
    assert isinstance(results[1], ValueError) and "feature rows" in str(results[1])
    assert all(isinstance(r, DraftTree) and len(r) == SHAPE.max_nodes
               for r in (results[0], results[2]))


def test_growing_stops_between_layers_and_keeps_what_it_has():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    layers = []

    def expand_many(asks):
        layers.append(len(asks))
        return [torch.randn(len(frontier[0]), 50) for _, frontier in asks]

    full = grow_together([grow_greedy(logits, 5, 3, 40) for _ in range(2)], expand_many)
    assert layers == [2, 2, 2, 2] and all(t.depth == 5 for t in full)
    layers.clear()
    calls = iter([False, True])
    cut = grow_together([grow_greedy(logits, 5, 3, 40) for _ in range(2)], expand_many,
                        stop=lambda: next(calls))
    assert layers == [2] and all(t.depth == 2 for t in cut)


def test_outcomes_are_ranked_by_probability_and_the_bonus_is_never_a_child():
    # root -> a (p .6) -> b (p .5 after a); root's other child c (p .3)
    vocab = 6
    parents, tokens = [-1, -1, 0], [1, 3, 2]
    logp = {-1: torch.tensor([.0, .6, .05, .3, .05, .0]).clamp_min(1e-9).log(),
            0: torch.tensor([.1, .0, .5, .0, .4, .0]).clamp_min(1e-9).log(),
            2: torch.tensor([.0, .0, .0, .0, .0, 1.]).clamp_min(1e-9).log()}
    found = likely_outcomes(parents, tokens, logp, limit=vocab)
    scores = [s for s, _, _ in found]
    assert scores == sorted(scores, reverse=True)
    best_score, v, b = found[0]
    assert (v, b) == (2, 5) and best_score == pytest.approx(np.log(.6 * .5 * 1.0))
    kids = children(parents)
    for _, v, b in found:
        assert b not in [tokens[c] for c in kids[v + 1]]
    assert sum(np.exp(s) for s, _, _ in likely_outcomes(parents, tokens, logp, 100, 6)) <= 1.0001
    assert path_to(parents, 2) == [0, 2] and path_to(parents, -1) == []


def test_predrafting_leaves_the_session_as_it_found_it(tiny_dir):
    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())
    ctx = contexts(1)[0]
    tree = drafter.propose(ctx, SHAPE)
    plain = copy.deepcopy(ctx)
    found = drafter.predraft(ctx, tree, SHAPE, stop=lambda: False, limit=6)
    assert 0 < len(found) <= 6
    kids = children(tree.parents)
    tokens = tree.tokens.tolist()
    for key, grown in found.items():
        *path, bonus = key
        assert len(grown) > 0
        at = -1
        for token in path:  # the key is a root path of the tree in flight, then a bonus
            at = next(c for c in kids[at + 1] if tokens[c] == token)
        assert bonus not in [tokens[c] for c in kids[at + 1]]
    assert ctx.state.cache.length == plain.state.cache.length == len(ctx.tokens) - 1
    commit([ctx, plain], seed=3)
    assert same(drafter.propose(ctx, SHAPE), drafter.propose(plain, SHAPE))
    sampled = contexts(1, temperature=0.7)[0]
    assert drafter.predraft(sampled, drafter.propose(sampled, SHAPE), SHAPE, lambda: False) == {}


class _Hub:
    """Just what ``DraftWorker.predrafted`` reads."""

    def __init__(self):
        from starhub.hub.config import HubConfig

        self.config = HubConfig()
        self.metrics = HubMetrics()
        self.drafter = EagleDrafter.__new__(EagleDrafter)


def _worker(hub: _Hub) -> DraftWorker:
    return DraftWorker(hub.drafter, hub.config, None, hub.metrics, None, None, None)


def test_a_commit_gets_the_tree_predrafted_for_exactly_its_tokens():
    worker = _worker(_Hub())
    tree = DraftTree(np.array([5, 6], np.int32), np.array([-1, 0], np.int32))
    session = DraftSession(tag=1, owner=b"t", ctx=DraftContext(tokens=[1]), prompt_len=1, seq=4)
    session.predraft_for, session.predrafts = 3, {(8, 9): tree}
    assert worker.predrafted(session, Request(b"t", session, 0, 0.0, (8, 9))) is tree
    session.predraft_for, session.predrafts = 3, {(8, 9): tree}
    assert worker.predrafted(session, Request(b"t", session, 0, 0.0, (8, 7))) is None
    session.predraft_for, session.predrafts = 2, {(8, 9): tree}  # made for an older round
    assert worker.predrafted(session, Request(b"t", session, 0, 0.0, (8, 9))) is None
    stats = derive(None, worker.metrics.counters())
    assert stats["predraft_hits"] == 1 and stats["predraft_hit_rate"] == pytest.approx(0.5)


def test_a_batching_predrafting_hub_stays_lossless_for_concurrent_targets(tiny_model,
                                                                          tiny_dir):
    model, tok = tiny_model
    drafter = EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())
    hub = HubThread(drafter, shape=TreeShape(4, 3, 9), batch="auto", predraft=True)
    prompts = ["Tell me a story.", "1, 2, 3, 4,", "The capital of France", "Once upon"]
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(prompt: str) -> None:
        try:
            with attach(model, tok, hub.address) as session:
                results[prompt] = (session.generate(prompt, max_new_tokens=24), session)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for result, _ in results.values():
            assert result.output_ids == reference(model, result.prompt_ids, 24)
            assert result.stats.rounds > 0 and result.stats.note == ""
        stats = hub.hub.stats()
        assert stats.rounds > 0 and stats.batch_mean >= 1.0
    finally:
        hub.stop()


def test_only_a_drafter_that_shares_work_gets_batches():
    from starhub.drafters.ngram import NgramDrafter
    from starhub.hub.worker import MAX_AUTO_BATCH

    hub = _Hub()
    assert _worker(hub).max_batch == MAX_AUTO_BATCH
    hub.config.batch = 3
    assert _worker(hub).max_batch == 3
    hub.drafter = NgramDrafter()
    assert _worker(hub).max_batch == 1


def test_a_drafter_that_raises_fails_its_rounds_and_the_hub_serves_on():
    from starhub.drafters.ngram import NgramDrafter
    from starhub.wire.messages import DrafterCard, Error, ErrorCode, Open, Propose, TargetCard
    from tests.servers import HubHarness

    class Exploding(NgramDrafter):
        batches = True
        armed = True

        def propose_batch(self, jobs, **kwargs):
            if self.armed:
                raise RuntimeError("boom")
            return super().propose_batch(jobs, **kwargs)

    drafter = Exploding()
    hub = HubHarness(drafter, shape=TreeShape(3, 2, 4))
    try:
        assert isinstance(hub.ask(b"a", TargetCard(name="t", vocab_size=100)), DrafterCard)
        opening = Open(ref=1, prompt_len=5, tokens=np.arange(1, 7, dtype=np.int32))
        reply = hub.ask(b"a", opening)
        assert isinstance(reply, Error) and reply.code == ErrorCode.INTERNAL
        assert "boom" in reply.message and not hub.hub.table.sessions
        drafter.armed = False
        assert isinstance(hub.ask(b"a", opening), Propose)
    finally:
        hub.close()


def test_pre_drafting_runs_only_for_a_drafter_that_can_guess():
    from starhub.drafters.ngram import NgramDrafter

    hub = _Hub()
    hub.config.predraft = True
    assert _worker(hub).predrafting
    hub.drafter = NgramDrafter()
    assert not _worker(hub).predrafting
    hub.config.predraft, hub.drafter = False, EagleDrafter.__new__(EagleDrafter)
    assert not _worker(hub).predrafting


class _Recording(EmulatedDrafter):
    """An emulated drafter that records, per ``propose_batch`` call, the first prompt
    token of each session it drafts."""

    def __init__(self, t_s: float = 0.0):
        super().__init__(t_s, 100)
        self.calls: list[list[int]] = []

    def propose_batch(self, jobs, **kwargs):
        self.calls.append([])
        return super().propose_batch(jobs, **kwargs)

    def propose(self, ctx, shape):
        self.calls[-1].append(ctx.tokens[0])
        return super().propose(ctx, shape)


def test_a_drafter_that_drafts_one_at_a_time_goes_straight_on_to_the_next_request():
    """A request that arrives while another is drafted is handed over ahead, so the
    drafting thread takes it the moment it is done (in the same ``propose_batch``), not
    after a round trip through the event loop; its wait counts until the thread took it."""
    import time

    from starhub.wire.messages import DrafterCard, Open, Propose, TargetCard
    from tests.servers import HubHarness

    class Gated(_Recording):
        def __init__(self):
            super().__init__()
            self.entered, self.gate = threading.Event(), threading.Event()

        def propose(self, ctx, shape):
            self.entered.set()
            self.gate.wait(30)
            return super().propose(ctx, shape)

    drafter = Gated()
    hub = HubHarness(drafter, shape=TreeShape(2, 1, 2))
    run = hub.loop.run_until_complete

    def until(done, what: str) -> None:
        for _ in range(5000):
            if done():
                return
            run(asyncio.sleep(0.001))
        raise AssertionError(what)

    try:
        for name in (b"a", b"b"):
            hub.hub.on_frames(name, wire(TargetCard(name=name.decode(), vocab_size=100)))
        hub.hub.on_frames(b"a", wire(Open(ref=1, prompt_len=3,
                                          tokens=np.array([11, 2, 3], np.int32))))
        until(drafter.entered.is_set, "the first request was never drafted")
        hub.hub.on_frames(b"b", wire(Open(ref=2, prompt_len=3,
                                          tokens=np.array([22, 2, 3], np.int32))))
        until(lambda: not hub.hub.worker.buffer, "the second request was not handed ahead")
        arrived = time.monotonic()
        run(asyncio.sleep(0.01))
        released = time.monotonic()
        drafter.gate.set()
        run(hub._settle())
        assert drafter.calls == [[11, 22]]
        replies = [hub.hub.next_reply() for _ in range(len(hub.hub.outbox))]
        assert [type(m) for _, m in replies] == [DrafterCard, DrafterCard, Propose, Propose]
        assert hub.hub.metrics.rounds == 2
        assert hub.hub.metrics.wait_s >= released - arrived
    finally:
        drafter.gate.set()
        hub.close()


@pytest.mark.parametrize("linger_s, calls", [(1.0, [[11, 22]]), (0.0, [[11], [22]])])
def test_a_request_that_finds_the_drafting_thread_waiting_is_drafted_without_a_new_hand_off(
        monkeypatch, linger_s, calls):
    """With nothing left to draft the thread waits ``LINGER_S`` for the next request
    before it hands itself back: a request arriving meanwhile is drafted in the same
    ``propose_batch``, and the hub's idle time still counts the gap before it."""
    import time

    from starhub.wire.messages import Open, TargetCard
    from tests.servers import HubHarness

    monkeypatch.setattr("starhub.hub.worker.LINGER_S", linger_s)
    drafter = _Recording(1e-4)
    hub = HubHarness(drafter, shape=TreeShape(2, 1, 2))
    try:
        for name in (b"a", b"b"):
            hub.send(name, TargetCard(name=name.decode(), vocab_size=100))
        hub.send(b"a", Open(ref=1, prompt_len=3, tokens=np.array([11, 2, 3], np.int32)))
        gap = 0.05
        time.sleep(gap)
        hub.send(b"b", Open(ref=2, prompt_len=3, tokens=np.array([22, 2, 3], np.int32)))
        assert drafter.calls == calls
        assert hub.hub.metrics.rounds == 2
        assert hub.hub.metrics.idle_s >= gap
    finally:
        hub.close()
