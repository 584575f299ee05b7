"""The edge topology over real sockets: drafters get exactly generate()'s tokens from a
batched verifier, recover when it restarts or forgets them, and bad input gets errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from starhub.drafters.base import TreeShape
from starhub.drafters.model import ModelDrafter
from starhub.drafters.ngram import NgramDrafter
from starhub.edge.drafter import EdgeDrafter, VerifierUnavailable
from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    MAX_DIST_WIDTH,
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Opened,
    Propose,
    StatsQuery,
    TargetCard,
)
from starhub.wire.security import ServerSecurity, bind_server, prepare_client
from targets.verifier import Verifier, VerifierConfig

PROMPTS = [[1, 5, 9, 14, 3], list(range(20, 43)), [7, 7, 8, 100, 4000], [11] * 9]


class VerifierThread:
    def __init__(self, model, tokenizer, bind: str = "tcp://127.0.0.1:0", **config):
        self.verifier = Verifier.for_model(model, tokenizer, VerifierConfig(bind=bind, **config))
        self._stop = threading.Event()
        ready = threading.Event()
        self.thread = threading.Thread(
            target=self.verifier.serve, daemon=True,
            kwargs={"ready": lambda _: ready.set(), "stop": self._stop.is_set})
        self.thread.start()
        assert ready.wait(30)
        self.address = self.verifier.bound

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


@pytest.fixture
def verifier(tiny_model):
    v = VerifierThread(*tiny_model, ttl_s=30.0)
    yield v
    v.stop()


def _reference(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None)[0, len(prompt):].tolist()


def _edge(model, address, **kwargs) -> EdgeDrafter:
    return EdgeDrafter(ModelDrafter(model, label="self"), address, TreeShape(4, 2, 6),
                       eos=set(), **kwargs)


def test_drafters_get_generate_tokens_from_a_batched_verifier(tiny_model, verifier):
    model, _ = tiny_model
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        edge = _edge(model, verifier.address, name=f"d{i}")
        results[i] = edge.generate(PROMPTS[i], max_new_tokens=24)
        edge.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(PROMPTS):
        out, stats = results[i]
        assert out == _reference(model, prompt, 24)
        assert stats.rounds < 24 and stats.mean_accept_len > 1.5
    body = verifier.verifier.snapshot()
    assert body.rounds > 0 and body.sessions == 0 and body.closed == len(PROMPTS)


def test_a_drafter_with_no_guess_still_gets_generate_tokens(tiny_model, verifier):
    """Prompt lookup finds nothing in a prompt without repeats: its empty trees each commit
    the target's next token, and its guesses, once the output repeats, are verified."""
    model, _ = tiny_model
    edge = EdgeDrafter(NgramDrafter(), verifier.address, TreeShape(4, 2, 6), eos=set(),
                       retries=0)
    out, stats = edge.generate(PROMPTS[0], max_new_tokens=24)
    edge.close()
    assert out == _reference(model, PROMPTS[0], 24)
    assert stats.rounds >= 1 and verifier.verifier.snapshot().errors == {}


def test_budgets_never_exceed_what_the_verifier_accepts_from_a_chain_drafter(tiny_model):
    """Budgets (in OPEN and every COMMIT) are capped at --max-depth: a chain drafter's tree
    of S nodes is S deep, and the verifier must not ask for trees it then refuses."""
    model, _ = tiny_model
    v = VerifierThread(*tiny_model, schedule="random", budget=64, max_depth=3, nodes=2)
    try:
        edge = EdgeDrafter(ModelDrafter(model, label="self"), v.address,
                           TreeShape(64, 1, 2), eos=set(), retries=0)
        out, stats = edge.generate(PROMPTS[1], max_new_tokens=24)
        edge.close()
    finally:
        v.stop()
    assert out == _reference(model, PROMPTS[1], 24)
    assert stats.tree_nodes > stats.rounds * 2, "the random budgets must have grown trees"
    assert v.verifier.snapshot().errors == {}


def test_drafter_resumes_after_the_verifier_restarts(tiny_model):
    model, tokenizer = tiny_model
    first = VerifierThread(model, tokenizer)
    address = first.address
    edge = _edge(model, address, timeout_s=2.0, backoff_s=0.1)
    try:
        assert edge.generate(PROMPTS[0], 12)[0] == _reference(model, PROMPTS[0], 12)
        first.stop()
        second = VerifierThread(model, tokenizer, bind=address)
        out, stats = edge.generate(PROMPTS[1], 12)
        assert out == _reference(model, PROMPTS[1], 12) and stats.reopened >= 1
        assert second.verifier.stats.rounds > 0
        second.stop()
    finally:
        edge.close()


def test_drafter_reopens_a_session_the_verifier_expired(tiny_model):
    model, tokenizer = tiny_model
    v = VerifierThread(model, tokenizer, ttl_s=0.3)
    edge = _edge(model, v.address, backoff_s=0.05)
    slow = edge.drafter.propose
    calls = []

    def propose(ctx, shape):
        calls.append(1)
        if len(calls) == 3:
            time.sleep(1.6)
        return slow(ctx, shape)

    edge.drafter.propose = propose
    try:
        out, stats = edge.generate(PROMPTS[2], 20)
        assert out == _reference(model, PROMPTS[2], 20)
        assert stats.reopened == 1 and v.verifier.stats.expired == 1
    finally:
        edge.close()
        v.stop()


def test_drafter_fails_clearly_without_a_verifier(tiny_model):
    model, _ = tiny_model
    edge = _edge(model, "tcp://127.0.0.1:9", timeout_s=0.2, retries=1, backoff_s=0.01)
    with pytest.raises(VerifierUnavailable, match="after 2 attempts"):
        edge.generate(PROMPTS[0], 8)
    edge.close()


class Raw:
    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        prepare_client(self.sock, "raw")  # this user's local keys, as a drafter's
        self.sock.connect(address)

    def ask(self, msg):
        self.sock.send_multipart(encode(msg))
        assert self.sock.poll(10_000)
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)


def test_verifier_answers_bad_input_with_errors_and_keeps_serving(tiny_model, verifier):
    model, _ = tiny_model
    a, b = Raw(verifier.address), Raw(verifier.address)
    try:
        reply = a.ask(TargetCard(vocab_size=10))
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_TYPE
        assert "hub's address" in reply.message
        reply = a.ask(Open(ref=1, prompt_len=2, tokens=np.array([1, 2], np.int32)))
        assert isinstance(reply, Error) and reply.code == ErrorCode.NO_CARD
        assert isinstance(a.ask(DrafterCard(drafter="raw")), TargetCard)
        reply = a.ask(DrafterCard(drafter="raw", feature_layers=[99]))
        assert reply.TYPE == "REJECT" and "do not exist" in reply.reason
        reply = a.ask(Open(ref=2, prompt_len=2, tokens=np.array([1, 10**6], np.int32)))
        assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FIELD
        opened = a.ask(Open(ref=3, prompt_len=3, temperature=0.7,
                            tokens=np.array([1, 2, 3], np.int32)))
        assert isinstance(opened, Opened) and len(opened.tokens) == 4
        tag = opened.tag
        tree = {"tokens": np.array([5, 6], np.int32), "parents": np.array([-1, 0], np.int32)}
        assert isinstance(b.ask(DrafterCard(drafter="other")), TargetCard)
        reply = b.ask(Propose(tag=tag, seq=1, **tree))
        assert reply.code == ErrorCode.NOT_OWNER
        reply = a.ask(Propose(tag=tag, seq=1, tokens=np.arange(40, dtype=np.int32),
                              parents=np.arange(-1, 39, dtype=np.int32)))
        assert reply.code == ErrorCode.TOO_LARGE
        reply = a.ask(Propose(tag=tag + 1, seq=1, **tree))
        assert reply.code == ErrorCode.UNKNOWN_TAG
        reply = a.ask(Propose(tag=tag, seq=1, **tree))  # sampled: the tree alone suffices
        assert reply.TYPE == "COMMIT" and len(reply.tokens) >= 1
        a.sock.send_multipart(encode(Close(tag=tag)))
        body = a.ask(StatsQuery()).body
        assert body.sessions == 0 and body.errors["BAD_FIELD"] == 1
    finally:
        a.close()
        b.close()
    edge = _edge(model, verifier.address)
    assert edge.generate(PROMPTS[3], 10)[0] == _reference(model, PROMPTS[3], 10)
    edge.close()


def test_sampled_edge_output_is_reproducible_for_a_seed(tiny_model, verifier):
    model, _ = tiny_model
    edge = _edge(model, verifier.address)
    runs = [edge.generate(PROMPTS[1], 16, temperature=0.05, seed=s)[0] for s in (3, 3, 4)]
    edge.close()
    assert runs[0] == runs[1] and len(runs[0]) == 16
    assert runs[2] != runs[0], "the seed must matter, or equality above pins nothing"
    assert all(0 <= t < model.config.vocab_size for t in runs[2])


def test_the_verifier_refuses_draft_distributions_wider_than_the_wire_allows(verifier):
    """A 1-node tree with [2, 100000] distributions would become 200,000-entry lists on
    the verifier's only thread: past MAX_DIST_WIDTH entries per node it is an ERROR."""
    raw = Raw(verifier.address)
    try:
        assert isinstance(raw.ask(DrafterCard(drafter="raw")), TargetCard)
        opened = raw.ask(Open(ref=1, prompt_len=3, temperature=0.7,
                              tokens=np.array([1, 2, 3], np.int32)))
        one = {"tokens": np.array([5], np.int32), "parents": np.array([-1], np.int32)}
        for seq, width in ((1, 100_000), (1, MAX_DIST_WIDTH + 1)):
            reply = raw.ask(Propose(tag=opened.tag, seq=seq, **one,
                                    dist_ids=np.zeros((2, width), np.int32),
                                    dist_probs=np.full((2, width), 1 / width, np.float32)))
            assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_FIELD, reply
            assert f"{MAX_DIST_WIDTH} entries per node, got {width}" in reply.message
        reply = raw.ask(Propose(tag=opened.tag, seq=1, **one,
                                dist_ids=np.zeros((2, MAX_DIST_WIDTH), np.int32),
                                dist_probs=np.full((2, MAX_DIST_WIDTH), 1 / MAX_DIST_WIDTH,
                                                   np.float32)))
        assert reply.TYPE == "COMMIT"
    finally:
        raw.close()


# -- a verifier that lies -------------------------------------------------------------
VOCAB = 49152


class RogueVerifier:
    """Answers a DRAFTER_CARD with ``card``, an OPEN with ``opened(open)`` and a PROPOSE
    with ``commit(propose)``, on every connection."""

    def __init__(self, opened, commit, card: TargetCard | None = None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.release = bind_server(self.sock, "tcp://127.0.0.1:0", ServerSecurity())
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.card = card or TargetCard(name="rogue", vocab_size=VOCAB, hidden_size=64,
                                       num_layers=2)
        self.answers = {DrafterCard: lambda m: self.card, Open: opened, Propose: commit}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            answer = self.answers.get(type(msg))
            if answer is not None:
                self.sock.send_multipart([identity, *encode(answer(msg))])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.sock.close(0)
        self.release()


def _opened(first: int = 7, width: int | None = None, prefix=None):
    def answer(m: Open) -> Opened:
        tokens = np.array([*(m.tokens if prefix is None else prefix), first], np.int32)
        feats = None if width is None else np.zeros((len(tokens) - 1, width), np.float16)
        return Opened(tag=9, ref=m.ref, tokens=tokens, features=feats)
    return answer


def _commit(tokens, width: int | None = None, accepted: int | None = None):
    def answer(m: Propose) -> Commit:
        feats = None if width is None else np.zeros((len(tokens), width), np.float16)
        return Commit(tag=m.tag, seq=m.seq,
                      accepted=len(tokens) - 1 if accepted is None else accepted,
                      tokens=np.array(tokens, np.int32), features=feats)
    return answer


def _eagle(tiny_dir):
    from starhub.drafters.eagle import EagleDrafter
    from starhub.drafters.eagle_head import EAGLE
    from tests.test_eagle_drafter import random_head

    return EagleDrafter(random_head(tiny_dir, EAGLE, None).eval())


@pytest.mark.parametrize("drafter, opened, commit, error", [
    ("model", _opened(), _commit([-5]), "invalid COMMIT: token ids outside [0, 49152)"),
    ("model", _opened(), _commit([VOCAB]), "invalid COMMIT: token ids outside [0, 49152)"),
    ("model", _opened(first=-3), _commit([5]), "invalid OPENED: token ids outside"),
    ("model", _opened(prefix=[4, 4]), _commit([5]), "do not start with the prompt"),
    ("model", _opened(), _commit([5, 6], accepted=0), "accepted, with 2 tokens"),
    ("eagle", _opened(width=32), _commit([5], 64), "features 32 wide, drafter 'eagle' reads 64"),
    ("eagle", _opened(width=64), _commit([5], 16), "features 16 wide, drafter 'eagle' reads 64"),
    ("eagle", _opened(), _commit([5], 64), "invalid OPENED: no features"),
], ids=["negative-commit", "past-vocab-commit", "negative-opened", "other-prefix",
        "accepted-vs-tokens", "narrow-opened-features", "narrow-commit-features",
        "no-features"])
def test_a_verifier_reply_the_drafter_cannot_use_ends_the_session_with_a_clear_error(
        tiny_model, tiny_dir, drafter, opened, commit, error):
    """Negative or out-of-vocabulary ids, a context that is not the drafter's own, features
    of the wrong width or none: checked before the drafter drafts from them, so the request
    fails with ``VerifierUnavailable`` (which ``starhub drafter`` writes as that prompt's
    error line) instead of an IndexError or a shape error that ends the process."""
    model, _ = tiny_model
    draft = ModelDrafter(model, label="self") if drafter == "model" else _eagle(tiny_dir)
    rogue = RogueVerifier(opened, commit)
    edge = EdgeDrafter(draft, rogue.address, TreeShape(2, 1, 2), eos=set(), timeout_s=5.0,
                       retries=1, backoff_s=0.01)
    try:
        with pytest.raises(VerifierUnavailable) as err:
            edge.generate(PROMPTS[0], 8)
        assert "after 2 attempts" in str(err.value) and error in str(err.value), str(err.value)
    finally:
        edge.close()
        rogue.close()
