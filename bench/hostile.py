"""Hostile peers against a live hub and a live verifier on the embedded model.

    python -m bench.hostile [--long-tokens 4096] [--json report.json]

Each attack that the servers now defend runs against a real server process while a real
peer works beside the attacker: a star target (``targets.attach``) through the hub, an edge
drafter through the verifier. For each one it prints the server's resident memory (its
process and its children, from /proc) before, at its peak during, and after the attack,
against a stated bound: the memory at the start plus everything the server's limits let
peers make it hold (``--max-cache-mb``, the outbox, the peer table) plus the passing work
of one pass or prefill chunk. It checks that the real peer's output is ``generate()``'s and
that the server still answers afterwards.

The hub runs with CURVE on loopback and two allowed keys, one for the real target and one
the attacker uses on several connections, so that budgets per key are tried too. The
verifier, and a second hub, run with their default flags (CURVE with this user's local
keys), which the attackers other than the raw-ZMTP peer use.

Attacks on the hub: COMMITs that misreport how many nodes were accepted; many connections
that send a card and then idle; one key that OPENs long prompts on several connections to
fill the cache; a peer that sends requests and never reads a reply. On the verifier: a
card from each of many connections; a long prompt OPENed while the drafter decodes (how
long the drafter then waits for a COMMIT, against a pass); one peer that OPENs prompts to
fill the cache; a peer that never reads. On both, with default flags: a raw ZMTP peer (not
libzmq) that sends 1 GB of frames that all carry MORE (``bench.raw_zmtp``), against a
bound of 256 MB over the start: libzmq would hold the whole unfinished message, so it must
not get past the handshake. (An authenticated peer could still send one: libzmq bounds
frames, not messages.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import zmq

from bench.fuzz_hub import PROMPTS, rss_mb
from bench.raw_zmtp import RawPeer
from starhub.drafters.base import DraftContext, TreeShape
from starhub.drafters.ngram import NgramDrafter
from starhub.launch import child_env, spawn_hub
from starhub.launch.spawn import die_with_parent, wait_ready
from starhub.models.prompts import encode_prompt
from starhub.server.loop import QUEUED_MESSAGES
from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Opened,
    Ping,
    Pong,
    Propose,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.security import ClientCurve, ClientSecurity, generate_keys, prepare_client
from starhub.wire.tree import DraftTree, accepted_path, chain_tree

HUB_CACHE_MB = 256
UNENDING_MB = 1024
"""What the raw ZMTP peer sends as one unfinished multipart message."""
UNENDING_BOUND_MB = 256
"""What that may add to a server's memory."""
VERIFIER_CACHE_MB = 768
MAX_PEERS = 128
MESSAGE_MB = 16
PEER_ENTRY_MB = 0.05
"""What one peer-table entry may hold (its card, its counters), generously."""
PASSING_MB = {"hub": 192, "verifier": 448}
"""Work in flight besides what the limits bound: for the hub a drafting batch and the
decoding of one message; for the verifier one pass or prefill chunk (up to 1,024 tokens:
their logits alone take 200 MB for a 49,152-token vocabulary in float32) and the
allocator's slack."""


class Lookup(NgramDrafter):
    """Prompt lookup that always proposes something: a verifier takes no empty tree."""

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        tree = super().propose(ctx, shape)
        return tree if len(tree) else chain_tree(ctx.tokens[-1:])


@dataclass
class Attack:
    server: str
    name: str
    what: str
    bound_mb: float = 0.0
    start_mb: float = 0.0
    peak_mb: float = 0.0
    after_mb: float = 0.0
    answers: Counter = field(default_factory=Counter)
    """What the server answered the attacker, by kind."""
    detail: str = ""
    outputs_equal: bool = False
    rounds: int = 0
    serving: bool = False

    @property
    def ok(self) -> bool:
        return (self.outputs_equal and self.rounds > 0 and self.serving
                and self.peak_mb <= self.bound_mb
                and self.after_mb <= self.bound_mb)

    def line(self) -> str:
        answers = ", ".join(f"{k} {v}" for k, v in sorted(self.answers.items()))
        return (f"[{'ok' if self.ok else 'FAIL'}] {self.server} / {self.name}: {self.what}\n"
                f"    RSS MB: bound {self.bound_mb:.0f}; start {self.start_mb:.0f}, peak "
                f"during {self.peak_mb:.0f}, after {self.after_mb:.0f}\n"
                f"    server answered: {answers or 'nothing'}; {self.detail}\n"
                f"    real peer beside it: output == generate(): "
                f"{'yes' if self.outputs_equal else 'NO'}, {self.rounds} rounds through the "
                f"server; serves on: {'yes' if self.serving else 'NO'}")


# -- memory -------------------------------------------------------------------------------

def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the hub's drafting process)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_mb(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return total


class Sampler:
    """The peak of ``tree_rss_mb(pid)`` while it runs, sampled every 50 ms; each sample
    (wall-clock time, MB) is also appended to ``samples`` where one is given."""

    def __init__(self, pid: int, samples: list[tuple[float, float]] | None = None):
        self.pid, self.samples = pid, samples
        self.peak = self._sample()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> float:
        mb = tree_rss_mb(self.pid)
        if self.samples is not None:
            self.samples.append((time.time(), mb))
        return mb

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._sample())


# -- sockets ------------------------------------------------------------------------------

def dealer(address: str, curve: ClientCurve | None = None, hwm: int = 1000) -> zmq.Socket:
    """An attacker's socket: with ``curve``, or else this user's local keys (it is an
    authenticated hostile peer)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    prepare_client(sock, "x", ClientSecurity(curve))
    sock.connect(address)
    return sock


def ask(sock: zmq.Socket, msg, timeout_s: float = 60.0):
    sock.send_multipart(encode(msg))
    return reply(sock, timeout_s)


def reply(sock: zmq.Socket, timeout_s: float = 60.0):
    if not sock.poll(int(timeout_s * 1e3)):
        return None
    return decode(sock.recv_multipart())


def kind(msg) -> str:
    if isinstance(msg, Error):
        return f"ERROR {ErrorCode(msg.code).name}"
    return "no reply" if msg is None else msg.TYPE


def stats(address: str, curve: ClientCurve | None = None):
    sock = dealer(address, curve)
    try:
        got = ask(sock, StatsQuery(), 30.0)
        return got.body if isinstance(got, StatsReport) else None
    finally:
        sock.close(0)


def serving(address: str, curve: ClientCurve | None = None) -> bool:
    sock = dealer(address, curve)
    try:
        return isinstance(ask(sock, Ping(nonce=7), 30.0), Pong)
    finally:
        sock.close(0)


# -- a run --------------------------------------------------------------------------------

class Bench:
    def __init__(self, long_tokens: int, max_new_tokens: int, log_dir: str):
        import torch

        # deferred: transformers load only when this runs
        from starhub.models.loading import load_model

        torch.set_num_threads(1)
        self.model, self.tokenizer = load_model("default")
        self.vocab = self.model.config.vocab_size
        self.hidden = self.model.config.hidden_size
        self.long_tokens = long_tokens
        self.max_new_tokens = max_new_tokens
        self.log_dir = Path(log_dir)
        self.prompts = [encode_prompt(self.tokenizer, p, True) for p in PROMPTS]
        # the mask says every prompt token counts: without it, generate() takes the chat
        # template's end-of-turn tokens for padding (they share the pad id) and masks them
        self.expected = {eos: [self.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
            **({} if eos else {"eos_token_id": None}))[0, len(ids):].tolist()
            for ids in self.prompts] for eos in (True, False)}
        """``generate()``'s outputs: the star target stops at EOS, the edge drafter here
        (``eos=set()``) decodes on."""
        self.turn = 0
        rng = np.random.default_rng(0)
        self.long_prompt = rng.integers(100, self.vocab - 100, long_tokens).astype(np.int32)
        self.attacks: list[Attack] = []

    def prompt(self, eos: bool = True) -> tuple[list[int], list[int]]:
        """The next prompt the real peer decodes, and what ``generate()`` gives for it."""
        i = self.turn % len(self.prompts)
        self.turn += 1
        return self.prompts[i], self.expected[eos][i]

    def run_attack(self, attack: Attack, pid: int, address: str, bound_mb: float,
                   hostile: Callable[[Attack, threading.Event, threading.Event], None],
                   real: Callable[[], tuple[bool, int]], curve: ClientCurve | None = None
                   ) -> None:
        """``hostile(attack, ready, done)`` sets its state up, sets ``ready``, holds it
        until ``done``; ``real()`` decodes beside it."""
        print(f"{attack.server}: {attack.name} ...", flush=True)
        attack.start_mb, attack.bound_mb = tree_rss_mb(pid), bound_mb
        ready, done = threading.Event(), threading.Event()
        failed: list[BaseException] = []

        def attacker() -> None:
            try:
                hostile(attack, ready, done)
            except BaseException as exc:  # reported below
                failed.append(exc)
            finally:
                ready.set()

        with Sampler(pid) as sampler:
            thread = threading.Thread(target=attacker, daemon=True)
            thread.start()
            ready.wait(600)
            attack.outputs_equal, attack.rounds = real()
            done.set()
            thread.join(600)
        if failed:
            attack.detail += f" (the attacker failed: {failed[0]!r})"
        time.sleep(1.0)
        attack.peak_mb = sampler.peak
        attack.after_mb = tree_rss_mb(pid)
        attack.serving = serving(address, curve)
        self.attacks.append(attack)
        print(attack.line(), flush=True)

    def star_rounds(self, session) -> tuple[bool, int]:
        """The real target decodes two prompts: whether they are ``generate()``'s, and the
        rounds it took."""
        equal, rounds = True, 0
        for _ in range(2):
            ids, want = self.prompt()
            result = session.generate(ids, self.max_new_tokens)
            equal &= result.output_ids == want
            rounds += result.stats.rounds + result.stats.plain_rounds
        return equal, rounds

    def unending(self, server: str, pid: int, address: str,
                 real: Callable[[], tuple[bool, int]]) -> None:
        self.run_attack(Attack(server, "unending message", f"a raw ZMTP peer (not libzmq) "
                               f"sends {UNENDING_MB} MB of frames that all carry MORE to a "
                               f"{server} started with its default flags"),
                        pid, address, tree_rss_mb(pid) + UNENDING_BOUND_MB,
                        _unending(address, UNENDING_MB), real)

    # -- the hub --------------------------------------------------------------------------
    def default_hub(self) -> None:
        """A hub started with its default flags (this user's local keys), against a raw ZMTP
        peer, a real target beside it."""
        from targets import attach

        with ExitStack() as stack:
            log = stack.enter_context(open(self.log_dir / "hub-default.log", "w"))
            hub = stack.enter_context(spawn_hub(["--model", "default"], log_file=log))
            session = stack.enter_context(attach(self.model, self.tokenizer, hub.address,
                                                 name="real", timeout_s=30.0))
            warm = session.generate(self.prompts[0], self.max_new_tokens)
            assert warm.output_ids == self.expected[True][0], "the target differs unattacked"
            self.unending("hub", hub.proc.pid, hub.address, lambda: self.star_rounds(session))

    def hub(self) -> None:
        from starhub.wire.security import use_client_security
        from targets import attach

        keys = Path(tempfile.mkdtemp(prefix="hostile-keys-"))
        allow = keys / "allow"
        allow.mkdir()
        hub_public, hub_secret = generate_keys(keys, "hub")
        curves = {}
        for name in ("real", "attacker"):
            public, secret = generate_keys(keys, name)
            (allow / public.name).write_bytes(public.read_bytes())
            curves[name] = ClientCurve.load(secret, hub_public)
        bad = curves["attacker"]
        flags = ["--model", "default", "--drafter", "eagle", "--curve-secret", str(hub_secret),
                 "--curve-allow", str(allow), "--max-cache-mb", str(HUB_CACHE_MB),
                 "--max-peers", str(MAX_PEERS), "--max-message-mb", str(MESSAGE_MB)]
        with ExitStack() as stack:
            log = stack.enter_context(open(self.log_dir / "hub.log", "w"))
            hub = stack.enter_context(spawn_hub(flags, log_file=log))
            pid, address = hub.proc.pid, hub.address
            use_client_security(ClientSecurity(curves["real"]))
            session = stack.enter_context(attach(self.model, self.tokenizer, address,
                                                 name="real", timeout_s=30.0))
            stack.callback(use_client_security, None)
            warm = session.generate(self.prompts[0], self.max_new_tokens)
            assert warm.output_ids == self.expected[True][0], "the target differs unattacked"
            probe = dealer(address, bad)
            card = ask(probe, TargetCard(name="probe", vocab_size=self.vocab))
            probe.close(0)
            width = self.hidden * len(card.feature_layers)
            # the longest prompt whose features fit in one message
            fill_tokens = min(self.long_tokens, (MESSAGE_MB << 20) // (2 * width + 8) - 1)
            bound = (tree_rss_mb(pid) + HUB_CACHE_MB + QUEUED_MESSAGES * MESSAGE_MB
                     + MAX_PEERS * PEER_ENTRY_MB + PASSING_MB["hub"])

            def real() -> tuple[bool, int]:
                return self.star_rounds(session)

            def opening(n: int, ref: int) -> Open:
                ids = self.long_prompt[:n]
                return Open(ref=ref, prompt_len=n - 1, tokens=ids,
                            features=np.zeros((n - 1, width), np.float16) if width else None)

            def lying(attack: Attack, ready, done) -> None:
                sock = dealer(address, bad)
                try:
                    ask(sock, TargetCard(name="liar", vocab_size=self.vocab))
                    prop = ask(sock, opening(64, 1))
                    before = stats(address, bad)
                    ready.set()
                    lies = 0
                    while not done.is_set() and isinstance(prop, Propose) and not prop.plain:
                        if len(prop.tokens) == 0:
                            break
                        # every node accepted, whatever the tokens say
                        wrong = (int(prop.tokens[0]) + 1) % self.vocab
                        tokens = np.full(len(prop.tokens) + 1, wrong, np.int32)
                        got = ask(sock, Commit(tag=prop.tag, seq=prop.seq,
                                               accepted=len(prop.tokens), tokens=tokens,
                                               features=np.zeros((len(tokens), width),
                                                                 np.float16) if width else None))
                        attack.answers[kind(got)] += 1
                        lies += 1
                        assert len(accepted_path(prop.tokens, prop.parents, tokens)) == 0
                    after = stats(address, bad)
                    attack.detail = (f"{lies} COMMITs claimed every node of their tree; the "
                                     f"hub counted {after.commits - before.commits} COMMITs "
                                     f"meanwhile, the real target's")
                finally:
                    sock.close(0)

            self.run_attack(Attack("hub", "misreported COMMITs", "COMMITs claiming every "
                                   "node accepted while their tokens walk none"),
                            pid, address, bound, lying, real, curves["real"])

            def idle_cards(attack: Attack, ready, done) -> None:
                socks = [dealer(address, bad) for _ in range(3 * MAX_PEERS)]
                try:
                    answers = Counter(kind(ask(s, TargetCard(name="idle", vocab_size=self.vocab),
                                               30.0)) for s in socks)
                    attack.answers.update(answers)
                    body = stats(address, bad)
                    attack.detail = (f"{len(socks)} connections with one key sent a card and "
                                     f"idled; the hub then knew {body.peers} peers "
                                     f"(--max-peers {MAX_PEERS})")
                    ready.set()
                    done.wait()
                finally:
                    for s in socks:
                        s.close(0)

            self.run_attack(Attack("hub", "idle cards", f"{3 * MAX_PEERS} connections that "
                                   f"send a card and never open a session"),
                            pid, address, bound, idle_cards, real, curves["real"])

            def fill(attack: Attack, ready, done) -> None:
                socks = [dealer(address, bad) for _ in range(4)]
                try:
                    for s in socks:  # the last attack's idle cards go after a grace
                        while not isinstance(ask(s, TargetCard(name="filler",
                                                               vocab_size=self.vocab)),
                                             DrafterCard):
                            time.sleep(1.0)
                    refused, ref = 0, 0
                    while refused < len(socks) and ref < 200:
                        ref += 1
                        got = ask(socks[ref % len(socks)], opening(fill_tokens, ref))
                        attack.answers[kind(got)] += 1
                        refused += isinstance(got, Error)
                    body = stats(address, bad)
                    attack.detail = (f"OPENs of {fill_tokens} tokens with features from "
                                     f"4 connections of one key, never closed: it holds "
                                     f"{body.active_sessions} sessions, {body.cached_tokens} "
                                     f"tokens (--max-cache-mb {HUB_CACHE_MB})")
                    ready.set()
                    done.wait()
                finally:
                    for s in socks:
                        s.close(0)

            self.run_attack(Attack("hub", "cache fill", "one key OPENs long prompts on "
                                   "several connections to take the whole cache"),
                            pid, address, bound, fill, real, curves["real"])

            self.run_attack(Attack("hub", "never reads", "20,000 STATS queries sent, no "
                                   "reply read"), pid, address, bound,
                            _never_reads(address, bad, 20_000), real, curves["real"])

    # -- the verifier ---------------------------------------------------------------------
    def verifier(self, only_unending: bool = False) -> None:
        from starhub.edge.drafter import EdgeDrafter

        cmd = [sys.executable, "-m", "starhub", "verifier", "--bind", "tcp://127.0.0.1:0",
               "--model", "default", "--threads", "1", "--max-cache-mb",
               str(VERIFIER_CACHE_MB), "--max-peers", str(MAX_PEERS),
               "--max-message-mb", str(MESSAGE_MB)]
        with ExitStack() as stack:
            log = stack.enter_context(open(self.log_dir / "verifier.log", "w"))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                    env=child_env(1), preexec_fn=die_with_parent())
            stack.callback(_stop, proc)
            address, pid = wait_ready(proc, "verifier", 180.0), proc.pid
            gaps: list[float] = []
            last = [0.0]

            def on_commit(_: int) -> None:
                now = time.monotonic()
                if last[0]:
                    gaps.append(now - last[0])
                last[0] = now

            edge = EdgeDrafter(Lookup(), address, TreeShape(4, 2, 8), name="real",
                               eos=set(), timeout_s=120.0, on_commit=on_commit)
            stack.callback(edge.close)
            warm, _ = edge.generate(self.prompts[0], self.max_new_tokens)
            assert warm == self.expected[False][0], "the real drafter differs unattacked"
            calm = _gaps(gaps)
            bound = (tree_rss_mb(pid) + VERIFIER_CACHE_MB + QUEUED_MESSAGES * MESSAGE_MB
                     + MAX_PEERS * PEER_ENTRY_MB + PASSING_MB["verifier"])

            prefilling = threading.Event()

            def real() -> tuple[bool, int]:
                """Two prompts, and on while an attack's prompt is prefilled."""
                equal, rounds = True, 0
                gaps.clear()
                last[0] = 0.0
                for turn in range(40):
                    if turn >= 2 and not prefilling.is_set():
                        break
                    ids, want = self.prompt(eos=False)
                    out, st = edge.generate(ids, self.max_new_tokens)
                    equal &= out == want
                    rounds += st.rounds
                    last[0] = 0.0
                return equal, rounds

            self.unending("verifier", pid, address, real)
            if only_unending:
                return
            card = DrafterCard(drafter="hostile", feature_layers=[-1], depth=4, topk=2,
                               max_nodes=8)

            def card_flood(attack: Attack, ready, done) -> None:
                for _ in range(10 * MAX_PEERS):
                    s = dealer(address)
                    attack.answers[kind(ask(s, card, 30.0))] += 1
                    s.close(0)
                body = stats(address)
                attack.detail = (f"{10 * MAX_PEERS} connections each sent a card and left; "
                                 f"the verifier then knew {body.drafters} drafters "
                                 f"(--max-peers {MAX_PEERS})")
                ready.set()

            self.run_attack(Attack("verifier", "card flood", f"{10 * MAX_PEERS} new "
                                   f"connections, each with a card"),
                            pid, address, bound, card_flood, real)

            def long_prompt(attack: Attack, ready, done) -> None:
                s = dealer(address)
                try:
                    ask(s, card)
                    prefilling.set()
                    s.send_multipart(encode(Open(ref=1, prompt_len=self.long_tokens - 1,
                                                 tokens=self.long_prompt)))
                    ready.set()
                    got = reply(s, 600.0)
                    attack.answers[kind(got)] += 1
                    prefilling.clear()
                    done.wait()
                    after = stats(address)
                    attack.detail = (
                        f"its prefill took {after.prefill_s - before.prefill_s:.1f} s, in "
                        f"chunks between passes; meanwhile the drafter waited {_gaps(gaps)} "
                        f"between two COMMITs ({calm} unattacked; a pass takes "
                        f"{after.verify_ms_per_step:.0f} ms on average; prefilled at once, "
                        f"the prompt would have held every drafter up for the whole of it)")
                finally:
                    s.close(0)
                    prefilling.clear()

            before = stats(address)
            self.run_attack(Attack("verifier", "long prompt", f"a {self.long_tokens}-token "
                                   f"prompt OPENed while the drafter decodes"),
                            pid, address, bound, long_prompt, real)

            def fill(attack: Attack, ready, done) -> None:
                s = dealer(address)
                try:
                    ask(s, card)
                    refused, ref = 0, 0
                    n = min(self.long_tokens, 1024)
                    while not refused and ref < 100:
                        ref += 1
                        got = ask(s, Open(ref=ref, prompt_len=n - 1,
                                          tokens=self.long_prompt[:n]), 600.0)
                        attack.answers[kind(got)] += 1
                        refused = not isinstance(got, Opened)
                    body = stats(address)
                    attack.detail = (f"OPENs of {n} tokens, never closed: it holds "
                                     f"{body.sessions} sessions, {body.cached_tokens} tokens "
                                     f"(--max-cache-mb {VERIFIER_CACHE_MB}); the real drafter "
                                     f"still opens")
                    ready.set()
                    done.wait()
                finally:
                    s.close(0)

            self.run_attack(Attack("verifier", "cache fill", "one peer OPENs prompts until "
                                   "refused and keeps them"), pid, address, bound, fill, real)
            self.run_attack(Attack("verifier", "never reads", "20,000 STATS queries sent, "
                                   "no reply read"), pid, address, bound,
                            _never_reads(address, None, 20_000), real)


def _gaps(gaps: list[float]) -> str:
    if not gaps:
        return "-"
    ms = sorted(1e3 * g for g in gaps)
    return f"{ms[len(ms) // 2]:.0f} ms typically, {ms[-1]:.0f} ms at most"


def _never_reads(address: str, curve: ClientCurve | None, count: int):
    def hostile(attack: Attack, ready, done) -> None:
        s = dealer(address, curve, hwm=0)
        try:
            if curve is not None:
                s.send_multipart(encode(TargetCard(name="mute", vocab_size=100)))
            for _ in range(count):
                s.send_multipart(encode(StatsQuery(counters=True, peers=True)))
            attack.detail = (f"{count} queries sent, each answered with a full report "
                             f"that nobody reads")
            ready.set()
            done.wait()
        finally:
            s.close(0)
    return hostile


def _unending(address: str, megabytes: int):
    def hostile(attack: Attack, ready, done) -> None:
        peer = RawPeer(address, timeout_s=30.0)
        try:
            sent = peer.greet()
            if not sent.stopped:
                sent = peer.send_unending(megabytes << 20)
            how = ("the server closed the connection" if sent.closed
                   else sent.stopped or "the server took it all")
            attack.answers[how] += 1
            attack.detail = (f"{sent.bytes / (1 << 20):.1f} MB of {megabytes} MB sent before "
                             f"{how}; bound: the start + {UNENDING_BOUND_MB} MB")
            ready.set()
            done.wait()
        finally:
            peer.close()
    return hostile


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-tokens", type=int, default=4096,
                   help="the long prompts' length (the servers take up to 32,768)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--only", choices=("hub", "verifier", "unending"), default=None,
                   help="unending: only the raw ZMTP peer's rows")
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="hostile-")
    os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    bench = Bench(args.long_tokens, args.max_new_tokens, log_dir)
    if args.only in (None, "hub", "unending"):
        bench.default_hub()
    if args.only in (None, "hub"):
        bench.hub()
    if args.only in (None, "verifier", "unending"):
        bench.verifier(only_unending=args.only == "unending")
    ok = all(a.ok for a in bench.attacks)
    print(f"\n{sum(a.ok for a in bench.attacks)} of {len(bench.attacks)} attacks held in "
          f"{time.monotonic() - started:.0f} s; server logs in {log_dir}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**asdict(a), "answers": dict(a.answers), "ok": a.ok}
                       for a in bench.attacks], fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
