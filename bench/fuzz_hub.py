"""Hostile-input soak run: a real hub process serves a real target session while several
DEALER sockets blast it with malformed messages (``bench.malformed``).

    python -m bench.fuzz_hub --messages 100000

It checks what a deployment on an untrusted network needs: every malformed message gets
exactly one ERROR, the hub still answers PING afterwards, the concurrent session's greedy
output is token-for-token ``generate()``'s (and went through the hub, not around it), and
the hub's resident memory stays bounded (sampled from /proc while the run goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import zmq

from bench.malformed import Malformed, Target
from starhub.launch import spawn_hub
from starhub.models.prompts import encode_prompt
from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Ping,
    Pong,
    Propose,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.security import prepare_client

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France? Explain.",
           "List three uses of a paperclip.", "def fibonacci(n):"]
WINDOW = 64
"""Messages a blaster keeps in flight before it waits for their ERRORs."""


@dataclass
class Report:
    messages: int = 0
    errors: int = 0
    other_replies: int = 0
    missing_replies: int = 0
    codes: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)
    senders: int = 0
    blast_s: float = 0.0
    serving: bool = False
    prompts: int = 0
    outputs_equal: bool = False
    rounds: int = 0
    fallbacks: int = 0
    """Prompts the target finished on its own after a hub error or silence."""
    notes: list = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_quarters_mb: list = field(default_factory=list)
    hub_errors: dict = field(default_factory=dict)
    hub_sessions_after: int = -1

    def summary(self) -> str:
        rate = self.messages / max(self.blast_s, 1e-9)
        q = ", ".join(f"{p}%: {v:.1f}" for p, v in zip((25, 50, 75, 100),
                                                       self.rss_quarters_mb, strict=False))
        return "\n".join([
            f"malformed messages sent: {self.messages} from {self.senders} DEALER sockets in "
            f"{self.blast_s:.1f} s ({rate:.0f} msg/s)",
            f"ERROR replies: {self.errors}; other replies: {self.other_replies}; "
            f"missing: {self.missing_replies}",
            "error codes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.codes.items())),
            f"hub still serving (PING): {'yes' if self.serving else 'NO'}; hub error counters: "
            f"{self.hub_errors.get('INTERNAL', 0)} INTERNAL",
            f"concurrent session: {self.prompts} prompts, output == generate(): "
            f"{'yes' if self.outputs_equal else 'NO'}, {self.rounds} rounds through the hub, "
            f"{self.fallbacks} fell back to decoding alone",
            f"hub RSS (MB): start {self.rss_start_mb:.1f}, peak {self.rss_peak_mb:.1f}, "
            f"end {self.rss_end_mb:.1f}; after {q}",
        ])


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Blaster(threading.Thread):
    """One DEALER socket sending its share of malformed messages, WINDOW in flight, and
    counting the replies. Blaster 0 never sends its card; the others send it and OPEN a
    session of their own first, so that stale and rule-breaking COMMITs aim at a live tag."""

    def __init__(self, index: int, address: str, count: int, target: Target,
                 sent: list[int], seed: int):
        super().__init__(daemon=True)
        self.index, self.address, self.count, self.target = index, address, count, target
        self.sent = sent
        self.gen = Malformed(seed, target)
        self.codes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.errors = self.other = self.missing = 0

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        prepare_client(sock, "blaster")  # an authenticated hostile peer: the local keys
        sock.connect(self.address)
        try:
            if self.index:
                self.handshake(sock)
            inflight = 0
            for _ in range(self.count):
                kind, frames = self.gen.next()
                self.kinds[kind] += 1
                sock.send_multipart(frames)
                self.sent[self.index] += 1
                inflight += 1
                while inflight >= WINDOW or (inflight and sock.poll(0)):
                    if not sock.poll(30_000):
                        break
                    self.count_reply(sock)
                    inflight -= 1
            while inflight and sock.poll(30_000):
                self.count_reply(sock)
                inflight -= 1
            self.missing = inflight
        finally:
            sock.close(0)

    def count_reply(self, sock: zmq.Socket) -> None:
        reply = decode(sock.recv_multipart())
        if isinstance(reply, Error):
            self.errors += 1
            self.codes[ErrorCode(reply.code).name] += 1
        else:
            self.other += 1

    def handshake(self, sock: zmq.Socket) -> None:
        t = self.target
        sock.send_multipart(encode(TargetCard(name=f"blaster{self.index}", vocab_size=t.vocab)))
        card = _reply(sock)
        if not isinstance(card, DrafterCard):
            return
        ids = np.arange(1, 9, dtype=np.int32)
        feats = np.zeros((7, t.feature_width), np.float16) if t.feature_width else None
        sock.send_multipart(encode(Open(ref=1, prompt_len=7, tokens=ids, features=feats)))
        prop = _reply(sock)
        if isinstance(prop, Propose):
            t.tag, t.seq = prop.tag, prop.seq


def _reply(sock: zmq.Socket, timeout_s: float = 60.0):
    if not sock.poll(int(timeout_s * 1e3)):
        raise TimeoutError("the hub did not answer a handshake")
    return decode(sock.recv_multipart())


def _ask(address: str, msg, timeout_s: float = 10.0):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    prepare_client(sock, "x")
    sock.connect(address)
    try:
        sock.send_multipart(encode(msg))
        return decode(sock.recv_multipart()) if sock.poll(int(timeout_s * 1e3)) else None
    finally:
        sock.close(0)


def run(messages: int, model_spec: str = "default", drafter: str = "eagle",
        draft: str | None = None, senders: int = 4, max_new_tokens: int = 32,
        max_prompt_tokens: int = 1024, max_message_mb: float = 1.0, seed: int = 0,
        log_path: str | None = None, hub_args: tuple[str, ...] = ()) -> Report:
    """Blast ``messages`` malformed messages at a fresh hub while one target decodes the
    prompts through it, over and over, until the blast is over."""
    import torch

    # deferred: transformers load only when this runs
    from starhub.models.loading import load_model
    from targets import attach

    torch.set_num_threads(1)
    model, tokenizer = load_model(model_spec)
    prompts = [encode_prompt(tokenizer, p, True) for p in PROMPTS]
    expected = [model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                               do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    flags = ["--model", model_spec, "--drafter", drafter, *(["--draft", draft] if draft else []),
             "--max-prompt-tokens", str(max_prompt_tokens),
             "--max-message-mb", str(max_message_mb), *hub_args]
    report = Report(senders=senders)
    with open(log_path or os.devnull, "w") as log, spawn_hub(flags, log_file=log) as hub:
        pid = hub.proc.pid
        card = _ask(hub.address, TargetCard(name="probe", vocab_size=model.config.vocab_size))
        layers = len(card.feature_layers) if isinstance(card, DrafterCard) else 0
        target = dict(vocab=model.config.vocab_size, max_prompt_tokens=max_prompt_tokens,
                      max_message_bytes=int(max_message_mb * (1 << 20)),
                      feature_width=model.config.hidden_size * layers)
        outputs, rounds = [], 0
        with attach(model, tokenizer, hub.address, name="real") as session:
            first = session.generate(prompts[0], max_new_tokens)  # warm: the hub's caches fill
            outputs.append((0, first.output_ids))
            rounds += first.stats.rounds + first.stats.plain_rounds
            report.notes += [first.stats.note] if first.stats.note else []
            samples: list[tuple[int, float]] = [(0, rss_mb(pid))]
            sent = [0] * senders
            share = [messages // senders + (i < messages % senders) for i in range(senders)]
            blasters = [Blaster(i, hub.address, share[i], Target(**target), sent, seed + i)
                        for i in range(senders)]
            stop = threading.Event()
            sampler = threading.Thread(target=_sample, args=(pid, sent, samples, stop),
                                       daemon=True)
            start = time.monotonic()
            sampler.start()
            for b in blasters:
                b.start()
            i = 1
            while any(b.is_alive() for b in blasters) or i < len(prompts):
                result = session.generate(prompts[i % len(prompts)], max_new_tokens)
                outputs.append((i % len(prompts), result.output_ids))
                rounds += result.stats.rounds + result.stats.plain_rounds
                report.notes += [result.stats.note] if result.stats.note else []
                i += 1
            for b in blasters:
                b.join()
            report.blast_s = time.monotonic() - start
            stop.set()
            sampler.join()
        report.serving = isinstance(_ask(hub.address, Ping(nonce=7)), Pong)
        stats = _ask(hub.address, StatsQuery())
        if isinstance(stats, StatsReport):
            report.hub_errors = stats.body.errors
            report.hub_sessions_after = stats.body.active_sessions
        samples.append((sum(sent), rss_mb(pid)))
    report.messages = sum(sent)
    report.errors = sum(b.errors for b in blasters)
    report.other_replies = sum(b.other for b in blasters)
    report.missing_replies = sum(b.missing for b in blasters)
    report.codes = dict(sum((b.codes for b in blasters), Counter()))
    report.kinds = dict(sum((b.kinds for b in blasters), Counter()))
    report.prompts = len(outputs)
    report.outputs_equal = all(out == expected[k] for k, out in outputs)
    report.rounds, report.fallbacks = rounds, len(report.notes)
    values = [v for _, v in samples]
    report.rss_start_mb, report.rss_peak_mb, report.rss_end_mb = values[0], max(values), values[-1]
    report.rss_quarters_mb = [next((v for n, v in samples if n >= q * report.messages / 4),
                                   values[-1]) for q in (1, 2, 3, 4)]
    return report


def _sample(pid: int, sent: list[int], samples: list, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        try:
            samples.append((sum(sent), rss_mb(pid)))
        except OSError:
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz_hub", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--senders", type=int, default=4, help="DEALER sockets blasting")
    p.add_argument("--model", default="default",
                   help="the target's model ('default': the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default="eagle", help="the hub's drafter")
    p.add_argument("--draft", default=None)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hub-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG on to `starhub hub` (repeat it; e.g. --hub-arg=--depth "
                        "--hub-arg=5 to draft a tree every round instead of --depth auto)")
    p.add_argument("--hub-log", default=None, help="write the hub's log here")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    report = run(args.messages, args.model, args.drafter, args.draft, args.senders,
                 args.max_new_tokens, seed=args.seed, log_path=args.hub_log,
                 hub_args=tuple(args.hub_arg))
    print(report.summary())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(report), fh, indent=1)
    ok = (report.serving and report.outputs_equal and report.rounds > 0
          and report.errors == report.messages and not report.other_replies)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
