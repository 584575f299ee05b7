"""The edge drafter: a drafter that owns its users' prompts and sends its trees to a remote
verifier holding the target (``targets/verifier.py``), over the star's protocol.

Every token it emits comes from a COMMIT: drafts are only ever proposals. If the verifier
goes silent or forgets a session, the drafter reconnects with backoff and reopens the
session with everything committed so far as its prompt, so greedy output is unchanged;
after ``retries`` failed attempts the request fails with ``VerifierUnavailable``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from starhub.client.connection import Connection, LinkDown
from starhub.client.link import Backoff, Link
from starhub.client.round_stats import clip_output, count_round, mean_accept_len
from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.wire.codec import Limits, to_torch
from starhub.wire.messages import (
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
from starhub.wire.security import ClientSecurity

log = logging.getLogger("starhub.drafter")


class VerifierUnavailable(LinkDown):
    """The verifier could not be reached, refused us, or kept failing our session."""


class VerifierConnection(Connection):
    server = "verifier"
    down = VerifierUnavailable


@dataclass
class EdgeStats:
    """Per request, with the keys ``starhub target`` writes where they mean the same."""

    rounds: int = 0
    new_tokens: int = 0
    mean_accept_len: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    started_at: float = 0.0
    draft_s: float = 0.0
    """Drafting trees, on this process."""
    wait_s: float = 0.0
    """Waiting for COMMITs: the verifier's queue, its pass, and the link. Idle drafter time."""
    tree_nodes: int = 0
    reopened: int = 0
    threads: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    accept_len_hist: dict[str, int] = field(default_factory=dict)
    standalone: bool = False


class EdgeDrafter:
    """One link to a verifier (``starhub.client.link``), serving this process's requests
    one at a time."""

    _refs = itertools.count(1)

    def __init__(self, drafter: Drafter, address: str, shape: TreeShape, eos: set[int],
                 name: str = "drafter", timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.5, limits: Limits = Limits(),
                 on_commit: Callable[[int], None] = lambda tokens: None,
                 security: ClientSecurity | None = None):
        self.drafter = drafter
        self.address = address
        self.shape = shape
        self.eos = eos
        self.name = name
        self.timeout_s = timeout_s
        self.retries = retries
        self.limits = limits
        self.on_commit = on_commit
        """Called with each COMMIT's token count, as it arrives (for live progress)."""
        self.security = security
        """How to connect (None: this process's default, ``use_client_security``)."""
        self.draft_s = 0.0
        self.wait_s = 0.0
        """Totals over this drafter's life: drafting, and waiting for COMMITs."""
        self.link = Link(address, self._greet, name, backoff=Backoff(backoff_s, math.inf))

    @property
    def target(self) -> TargetCard | None:
        """The verifier's TARGET_CARD: the target it verifies for."""
        return self.link.card

    # -- connection -------------------------------------------------------------------
    def connect(self) -> TargetCard:
        """Send the verifier our DRAFTER_CARD; its TARGET_CARD describes the target."""
        reply = self.link.open()
        log.info("%s: verifier %s serves '%s' (%d-token vocabulary, step %.1f ms)", self.name,
                 self.address, reply.name, reply.vocab_size, reply.step_ms)
        return reply

    def _greet(self) -> tuple[VerifierConnection, TargetCard]:
        conn = VerifierConnection(self.address, self.timeout_s, self.limits, self.security,
                                  prefix="d", role="drafter")
        try:
            shape = self.shape
            conn.send(DrafterCard(drafter=self.drafter.name,
                                  feature_layers=list(self.drafter.feature_layers),
                                  depth=shape.depth, topk=shape.topk,
                                  max_nodes=shape.max_nodes))
            reply = conn.wait_for(lambda m: isinstance(m, TargetCard | Reject | Error))
            if isinstance(reply, Reject):
                raise VerifierUnavailable(f"the verifier refused this drafter: {reply.reason}")
            if isinstance(reply, Error):
                raise VerifierUnavailable(f"the verifier answered our card with an error: "
                                          f"{reply.message}")
            reason = self.drafter.check_target(reply)
            if reason:
                raise VerifierUnavailable(f"cannot draft for the verifier's target: {reason}",
                                          rejected=True)
        except LinkDown:
            conn.close()
            raise
        return conn, reply

    def close(self) -> None:
        self.link.close_client()

    def _send(self, msg: Message) -> None:
        self.link.client.send(msg)

    # -- requests ---------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, target_tok_s: float = 0.0
                 ) -> tuple[list[int], EdgeStats]:
        """Decode one prompt: every returned token was committed by the verifier."""
        stats = EdgeStats(started_at=time.time(), threads=torch.get_num_threads())
        start = time.perf_counter()
        out: list[int] = []
        failures = 0
        while not self._done(out, max_new_tokens):
            try:
                if self.link.client is None:
                    self.connect()
                self._session(prompt, out, max_new_tokens, temperature, top_p, seed,
                              target_tok_s, stats)
            except (LinkDown, _SessionLost) as exc:
                failures += 1
                if isinstance(exc, VerifierUnavailable) and exc.rejected:
                    raise
                if failures > self.retries:
                    raise VerifierUnavailable(
                        f"lost the verifier at {self.address} after {failures} attempts "
                        f"({len(out)} tokens committed): {exc}") from None
                delay = self.link.backoff.delay(failures - 1)
                log.warning("%s: %s; reconnecting in %.1fs (attempt %d of %d)", self.name, exc,
                            delay, failures, self.retries)
                self.close()
                time.sleep(delay)
                stats.reopened += 1
        out = clip_output(out, max_new_tokens, self.eos)
        stats.new_tokens = len(out)
        stats.wall_s = time.perf_counter() - start
        stats.tokens_per_s = len(out) / max(stats.wall_s, 1e-9)
        stats.mean_accept_len = mean_accept_len(stats)
        return out, stats

    def _session(self, prompt: list[int], out: list[int], max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, target_tok_s: float,
                 stats: EdgeStats) -> None:
        """OPEN (with everything committed so far), then rounds until done; ``out`` grows
        by each COMMIT's tokens, so a lost session resumes where it stopped."""
        ref = next(self._refs)
        prefix = [*prompt, *out]
        self._send(Open(ref=ref, prompt_len=len(prompt), temperature=temperature, top_p=top_p,
                        seed=seed, target_tok_s=target_tok_s,
                        tokens=torch.tensor(prefix, dtype=torch.int32)))
        opened = self._reply(lambda m: isinstance(m, Opened) and m.ref == ref, ref=ref)
        tag = opened.tag
        try:
            self._check(opened)
            if opened.tokens[:-1].tolist() != prefix:
                raise VerifierUnavailable("the verifier sent an invalid OPENED: its tokens do "
                                          "not start with the prompt this drafter sent")
            first = int(opened.tokens[-1])
            ctx = DraftContext(tokens=opened.tokens.tolist(), temperature=temperature,
                               seed=seed, features=[] if opened.features is None
                               else [to_torch(opened.features)])
            out.append(first)
            nodes = opened.budget or self.shape.max_nodes
            seq = 0
            while not self._done(out, max_new_tokens):
                shape = TreeShape(min(self.shape.depth, nodes), self.shape.topk, nodes,
                                  self.shape.support)
                t0 = time.perf_counter()
                tree = self.drafter.propose(ctx, shape)
                t1 = time.perf_counter()
                seq += 1
                self._send(Propose(tag=tag, seq=seq, tokens=tree.tokens, parents=tree.parents,
                                   dist_ids=tree.dist_ids, dist_probs=tree.dist_probs))
                commit = self._reply(lambda m, s=seq: isinstance(m, Commit) and m.tag == tag
                                     and m.seq == s, tag=tag)
                waited = time.perf_counter() - t1
                stats.draft_s += t1 - t0
                stats.wait_s += waited
                self.draft_s += t1 - t0
                self.wait_s += waited
                self._check(commit)
                if commit.accepted > len(tree) or len(commit.tokens) != commit.accepted + 1:
                    raise VerifierUnavailable(
                        f"the verifier sent an invalid COMMIT: {commit.accepted} nodes of a "
                        f"{len(tree)}-node tree accepted, with {len(commit.tokens)} tokens")
                tokens = commit.tokens.tolist()
                count_round(stats, commit.accepted, len(tree))
                ctx.tokens.extend(tokens)
                if commit.features is not None:
                    ctx.features.append(to_torch(commit.features))
                out.extend(tokens)
                self.on_commit(len(tokens))
                nodes = max(1, commit.budget or self.shape.max_nodes)
        finally:
            if self.link.client is not None:
                self._send(Close(tag=tag))

    def _check(self, msg: Opened | Commit) -> None:
        """Trust nothing from the wire: token ids in the target's vocabulary, and features
        where this drafter reads them, of the width it reads. A reply that fails ends its
        session (``VerifierUnavailable``) before anything is drafted from it."""
        vocab = self.target.vocab_size
        if msg.tokens.size and (int(msg.tokens.min()) < 0 or int(msg.tokens.max()) >= vocab):
            raise VerifierUnavailable(f"the verifier sent an invalid {msg.TYPE}: token ids "
                                      f"outside [0, {vocab})")
        if not self.drafter.feature_layers:
            return
        if msg.features is None:
            raise VerifierUnavailable(f"the verifier sent an invalid {msg.TYPE}: no features, "
                                      f"and drafter '{self.drafter.name}' reads them")
        width = self.drafter.feature_size
        if width and msg.features.shape[1] != width:
            raise VerifierUnavailable(f"the verifier sent an invalid {msg.TYPE}: features "
                                      f"{msg.features.shape[1]} wide, drafter "
                                      f"'{self.drafter.name}' reads {width}")

    def _reply(self, wanted, tag: int = 0, ref: int = 0) -> Message:
        msg = self.link.client.wait_for(lambda m: wanted(m) or isinstance(m, Error) and (
            (tag and m.tag == tag) or (ref and m.ref == ref) or not (m.tag or m.ref)))
        if isinstance(msg, Error):
            if msg.code in (ErrorCode.UNKNOWN_TAG, ErrorCode.NO_CARD, ErrorCode.REJECTED):
                raise _SessionLost(f"verifier: {msg.message}")
            raise VerifierUnavailable(f"verifier error {msg.code}: {msg.message}")
        return msg

    def _done(self, out: list[int], max_new_tokens: int) -> bool:
        return len(out) >= max_new_tokens or any(t in self.eos for t in out)


class _SessionLost(RuntimeError):
    """The verifier no longer holds our session (it restarted, expired it, or is full)."""


def result_json(id_: object, prompt: list[int], output: list[int], text: str,
                stats: EdgeStats) -> dict:
    """The line ``starhub target`` writes for a request, from an edge drafter."""
    return {"id": id_, "prompt_ids": prompt, "output_ids": output, "text": text,
            "stats": asdict(stats)}
