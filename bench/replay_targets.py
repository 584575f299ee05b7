"""Replay clients: N targets on one asyncio loop that speak the real protocol to a real hub
but compute nothing. Each walks every PROPOSE along a recorded greedy continuation
(``bench.replay``), commits what a real target would have (the accepted nodes, the bonus
token and their recorded features) and answers a tree at once, or after ``t_v``. A plain
round (the hub found no tree worth drafting) takes the recorded step per token, as a
target decoding alone would: answered at once it would spin the hub and the clients on
messages and say nothing about drafting. A recording that runs out is closed and the next
prompt opened, so the hub's load stays constant.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from bench.emulate_targets import CalibratedWait, ask, dealer
from bench.replay import Recording
from starhub.wire.codec import decode, encode
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    ObserverCard,
    Open,
    Propose,
    Reject,
    StatsQuery,
    TargetCard,
)
from starhub.wire.tree import accepted_path

log = logging.getLogger("starhub.bench.replay")


@dataclass
class ReplayTotals:
    """What the clients did, all of them together; ``marks`` snapshot it for a window."""

    clients: int = 0
    admitted: int = 0
    rounds: int = 0
    plain_rounds: int = 0
    tokens: int = 0
    accepted: int = 0
    sessions: int = 0
    errors: int = 0
    stray: int = 0
    """Replies that belonged to no session in flight (dropped)."""
    marks: list[list] = field(default_factory=list)
    """``[time, rounds, tokens, accepted]`` at each ``mark``."""

    def mark(self) -> None:
        self.marks.append([time.monotonic(), self.rounds, self.tokens, self.accepted])

    def window(self) -> dict:
        """Rates between the first and the last mark."""
        (t0, r0, k0, a0), (t1, r1, k1, a1) = self.marks[0], self.marks[-1]
        span = max(t1 - t0, 1e-9)
        return {"rounds": r1 - r0, "tokens": k1 - k0, "tok_s": (k1 - k0) / span,
                "mean_accept_len": (k1 - k0) / (r1 - r0) if r1 > r0 else 0.0,
                "accepted": a1 - a0}


class ReplayTargets:
    """``count`` replay clients, each its own DEALER socket and one session at a time."""

    def __init__(self, hub: str, recording: Recording, count: int,
                 t_v: float | None = None):
        import zmq.asyncio

        self.hub, self.rec, self.count = hub, recording, count
        self.t_v = t_v
        """Seconds to wait before answering a tree (None: at once)."""
        self.step_s = recording.meta.step_ms / 1e3
        self.ctx = zmq.asyncio.Context()
        self.wait = CalibratedWait()
        self.totals = ReplayTotals(clients=count)
        self.refs = itertools.count(1)
        self.stop = asyncio.Event()
        self.socks: list = []

    def card(self, index: int):
        meta = self.rec.meta
        return TargetCard(name=f"replay{index}", vocab_size=meta.vocab_size,
                          tokenizer_fp=meta.tokenizer_fp, hidden_size=meta.hidden_size,
                          num_layers=meta.num_layers, step_ms=meta.step_ms)

    async def stats(self, sock) -> dict:
        """The hub's raw counters, asked on an observer socket (``sock``)."""

        return msgspec.to_builtins((await ask(sock, StatsQuery(counters=True))).body)

    async def observer(self):
        sock = dealer(self.ctx, self.hub, "replay-observer")
        await ask(sock, ObserverCard(name="bench"))
        return sock

    async def run(self) -> None:
        """Greet the hub from every client, then keep one session open per client."""
        self.socks = [dealer(self.ctx, self.hub, f"replay{i}") for i in range(self.count)]
        try:
            await asyncio.gather(*(self.client(i, s) for i, s in enumerate(self.socks)))
        finally:
            for sock in self.socks:
                sock.close(0)

    def close(self) -> None:
        self.ctx.term()

    async def client(self, i: int, sock) -> None:
        prompts = itertools.cycle(range(i % len(self.rec), i % len(self.rec) + len(self.rec)))
        admitted = False
        while not self.stop.is_set():
            if not admitted:
                reply = await ask(sock, self.card(i))
                if isinstance(reply, DrafterCard):
                    admitted = True
                    self.totals.admitted += 1
                    continue
                retry = reply.retry_after_s if isinstance(reply, Reject) else 0.0
                if retry <= 0:
                    log.warning("replay%d: the hub turned it away: %s", i, reply)
                    return
                await asyncio.sleep(retry)
                continue
            admitted = await self.session(i, sock, next(prompts) % len(self.rec))

    async def session(self, i: int, sock, index: int) -> bool:
        """One recorded prompt from OPEN to CLOSE; False when the hub forgot our card."""

        prompt, out = self.rec.prompts[index], self.rec.outputs[index]
        feats = self.rec.features[index]
        has_feats = feats.size > 0
        plen, total = len(prompt), len(out)
        ref = next(self.refs)
        await sock.send_multipart(encode(Open(
            ref=ref, prompt_len=plen, tokens=np.concatenate([prompt, out[:1]]),
            features=feats[:plen] if has_feats else None, step_ms=self.rec.meta.step_ms)),
            copy=False)
        tag, pos = 0, 1  # pos: continuation tokens committed (out[0] went with OPEN)
        while not self.stop.is_set():
            msg = decode(await sock.recv_multipart(copy=False))
            arrived = time.monotonic()
            if isinstance(msg, Error) and (msg.ref == ref or (tag and msg.tag == tag)):
                self.totals.errors += 1
                log.warning("replay%d: hub error %d: %s", i, msg.code, msg.message)
                await asyncio.sleep(0.05)
                return msg.code != ErrorCode.NO_CARD
            if not isinstance(msg, Propose) or (tag and msg.tag != tag) or (
                    not tag and msg.ref != ref):
                self.totals.stray += 1
                continue
            tag = msg.tag
            if msg.plain:
                accepted, new = 0, out[pos:pos + msg.plain]
                busy = msg.plain * self.step_s  # decoding alone is the target's own time
                verify_ms = msg.plain * self.rec.meta.step_ms
            else:
                accepted = len(accepted_path(msg.tokens, msg.parents, out[pos:]))
                new = out[pos:pos + accepted + 1]
                busy = self.t_v or 0.0
                verify_ms = 1e3 * self.t_v if self.t_v is not None else self.rec.meta.verify_ms
            if busy:
                await self.wait.until(arrived + busy)
            if self.stop.is_set():
                break
            self.totals.rounds += 1
            self.totals.plain_rounds += bool(msg.plain)
            self.totals.tokens += len(new)
            self.totals.accepted += accepted
            if pos + len(new) >= total:  # the recording ends: like a real target's last
                break                    # round, this one is never committed
            rows = feats[plen + pos - 1:plen + pos - 1 + len(new)] if has_feats else None
            await sock.send_multipart(encode(Commit(
                tag=tag, seq=msg.seq, accepted=accepted, tokens=np.ascontiguousarray(new),
                features=rows, verify_ms=verify_ms, step_ms=self.rec.meta.step_ms)),
                copy=False)
            pos += len(new)
        if tag:
            await sock.send_multipart(encode(Close(tag=tag)), copy=False)
        self.totals.sessions += 1
        return True


async def measure(hub: str, recording: Recording, count: int, warmup_s: float,
                  duration_s: float, t_v: float | None = None) -> tuple[dict, dict, ReplayTotals]:
    """Run ``count`` replay clients against ``hub``; return the hub's counters at the start
    and the end of the measured window (after ``warmup_s``) and the clients' totals."""
    targets = ReplayTargets(hub, recording, count, t_v)
    observer = await targets.observer()
    task = asyncio.create_task(targets.run())
    try:
        await asyncio.sleep(warmup_s)
        if task.done():
            task.result()
        targets.totals.mark()
        c0 = await targets.stats(observer)
        await asyncio.sleep(duration_s)
        targets.totals.mark()
        c1 = await targets.stats(observer)
        if task.done():
            task.result()
    finally:
        targets.stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        observer.close(0)
        targets.close()
    return c0, c1, targets.totals
