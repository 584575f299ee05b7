"""Emulated target processes: many targets on one asyncio loop, each its own DEALER socket.

Given several hubs, each target chooses its own as a real target does with a pool
(``starhub.client.pool``: every hub's STATS read, the best offer greeted first), or, with
``placement="random"``, greets one hub drawn at random and stays with it. Targets connect
one after another, so that each sees the admissions before it.

A target waits ``t_v`` to "verify" every proposal and ``t_c`` for the link (less the
loopback round trip the real sockets already add), then commits an accepted length drawn
per token with its own ``beta``. Told to decode plainly, or turned away by admission, it
makes one token every ``t_step`` on its own, and a turned-away target asks again after
the hub's ``retry_after_s``. ``mark`` on stdin snapshots every target's token count, so the
driver measures each one's speed over the same window as the hub's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from bench.emulate_spec import PROMPT_LEN, VOCAB, EmulateSpec
from starhub.client.pool import offer, pool_addresses, rank
from starhub.wire.messages import (
    Close,
    Commit,
    DrafterCard,
    Error,
    ErrorCode,
    Open,
    Ping,
    Propose,
    Reject,
    StatsQuery,
    StatsReport,
    TargetCard,
)
from starhub.wire.reports import HubReport

PLACEMENTS = ("admission", "random")


def dealer(ctx, hub: str, name: str):
    """A DEALER socket to ``hub`` whose identity starts with ``name``."""
    import zmq

    # deferred: torch load only when this runs
    from starhub.wire.codec import Limits, configure_socket
    from starhub.wire.security import prepare_client

    sock = ctx.socket(zmq.DEALER)
    configure_socket(sock, Limits())
    prepare_client(sock, name)  # random identity; this user's local keys
    sock.connect(hub)
    return sock


async def ask(sock, msg):
    """Send one message and wait for the reply."""
    # deferred: torch load only when this runs
    from starhub.wire.codec import decode, encode

    await sock.send_multipart(encode(msg), copy=False)
    return decode(await sock.recv_multipart(copy=False))


class CalibratedWait:
    """``asyncio.sleep`` until a deadline, woken early by the loop's learned lateness."""

    def __init__(self, smoothing: float = 0.05):
        self.lateness = 0.0
        self.smoothing = smoothing
        self.samples = 0
        self.total_late = 0.0

    async def until(self, deadline: float) -> None:
        delay = deadline - time.monotonic() - self.lateness
        if delay > 0:
            await asyncio.sleep(delay)
        late = time.monotonic() - deadline
        self.lateness = min(max(self.lateness + self.smoothing * late, -1e-3), 2e-3)
        self.samples += 1
        self.total_late += late


@dataclass
class TargetTotals:
    targets: int = 0
    rounds: int = 0
    tokens: int = 0
    sessions: int = 0
    errors: int = 0
    rejections: int = 0
    link_rtt_ms: float = 0.0
    link_delay_ms: float = 0.0
    mean_late_ms: float = 0.0
    threads: int = 0
    first: int = 0
    betas: list[float] = field(default_factory=list)
    admitted: list[bool] = field(default_factory=list)
    """Whether each target held an admission slot at the end of the window."""
    hubs: list[str] = field(default_factory=list)
    """The hub each target was admitted by at the end of the window ("": none)."""
    marks: list[list] = field(default_factory=list)
    """``[time, [tokens of each target]]`` at each ``mark`` command."""


class EmulatedTargets:
    """``count`` targets on one event loop, each a DEALER socket with one session at a time."""

    def __init__(self, hub: str, spec: EmulateSpec, count: int, first: int = 0,
                 max_new_tokens: int = 64, seed: int = 0, share: float = 1.0,
                 placement: str = "admission"):
        import zmq.asyncio

        self.hubs = pool_addresses(hub)
        self.spec, self.count, self.first = spec, count, first
        self.placement = placement
        self.rng = random.Random(seed * 104729 + first)
        self.home = [self.rng.choice(self.hubs) for _ in range(count)]
        """Each target's hub under random placement."""
        self.max_new_tokens = max_new_tokens
        self.ctx = zmq.asyncio.Context()
        # libzmq caps a context at 1,023 sockets by default; one socket a target, plus room
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, count + 64))
        self.wait = CalibratedWait()
        self.totals = TargetTotals(targets=count, first=first)
        self.totals.betas = [spec.target_beta(first + i, seed) for i in range(count)]
        self.totals.admitted = [False] * count
        self.totals.hubs = [""] * count
        self.draws = [spec.sampler(random.Random(seed * 7919 + first + i), beta)
                      for i, beta in enumerate(self.totals.betas)]
        self.tokens = [0] * count
        self.link_delay = spec.t_c
        self.share = share
        """This process's part of the correction when several processes calibrate."""
        self.refs = itertools.count(1)
        self.go = asyncio.Event()
        self.stop = asyncio.Event()

    def card(self, index: int):
        return TargetCard(name=f"emu{index}", vocab_size=VOCAB, step_ms=1e3 * self.spec.step)

    async def connect(self) -> list:
        """Sockets for every target, each greeted once (admitted or not), and the link's
        own round trip measured so that the emulated ``t_c`` includes it."""

        self.surveyors = {h: dealer(self.ctx, h, "emu-survey") for h in self.hubs}
        self.survey_lock = asyncio.Lock()
        """One placement at a time (``place``)."""
        if len(self.hubs) == 1:  # one hub: every target greets it at once
            hub = self.hubs[0]
            socks = [dealer(self.ctx, hub, f"emu{self.first + i}") for i in range(self.count)]
            replies = await asyncio.gather(*(ask(s, self.card(self.first + i))
                                             for i, s in enumerate(socks)))
            for i, reply in enumerate(replies):
                self.admit(i, hub, reply)
        else:
            socks, replies = [], []
            for i in range(self.count):
                sock, reply = await self.place(i)
                socks.append(sock)
                replies.append(reply)
        self.retry_after = [getattr(r, "retry_after_s", 0.0) for r in replies]
        rtts = []
        probe = self.surveyors[self.hubs[0]]
        for nonce in range(30):
            start = time.monotonic()
            await ask(probe, Ping(nonce=nonce))
            rtts.append(time.monotonic() - start)
        rtt = sorted(rtts[5:])[len(rtts[5:]) // 2]
        self.link_delay = max(0.0, self.spec.t_c - rtt)
        self.totals.link_rtt_ms, self.totals.link_delay_ms = 1e3 * rtt, 1e3 * self.link_delay
        return socks

    def admit(self, i: int, hub: str, reply) -> None:
        if not isinstance(reply, DrafterCard | Reject):
            raise RuntimeError(f"hub {hub} answered our card with {reply}")
        self.totals.admitted[i] = isinstance(reply, DrafterCard)
        self.totals.hubs[i] = hub if self.totals.admitted[i] else ""

    async def place(self, i: int) -> tuple:
        """Greet target ``i``'s hub (random placement) or the pool's best offers in turn
        until one admits it: its socket (to the last hub greeted) and that hub's answer.
        This process's targets place themselves one at a time, each seeing the last one's
        admission, as targets that start apart do."""
        async with self.survey_lock:
            if self.placement == "random":
                order = [self.home[i]]
            else:
                answers = [await ask(sock, StatsQuery()) for sock in self.surveyors.values()]
                order = [o.address for o in rank(
                    [offer(hub, a.body, step_s=self.spec.step)
                     for hub, a in zip(self.surveyors, answers, strict=True)
                     if isinstance(a, StatsReport) and isinstance(a.body, HubReport)],
                    self.rng)]
            sock = reply = None
            for hub in order:
                if sock is not None:
                    sock.close(0)
                sock = dealer(self.ctx, hub, f"emu{self.first + i}")
                reply = await ask(sock, self.card(self.first + i))
                self.admit(i, hub, reply)
                if self.totals.admitted[i]:
                    break
            return sock, reply

    async def calibrate_link(self, period_s: float = 0.2, gain: float = 0.5) -> None:
        """Steer the added link delay so that the return time the hub measures (from a
        draft finishing to that session's next request) is the model's Z = t_c + t_v: the
        real sockets' latency is part of t_c, never added on top of it. Where hundreds of
        targets crowd a few cores their wake-ups alone can exceed t_c; the delay then goes
        negative (shortening the emulated verification), and the row reports it."""

        await self.go.wait()
        socks = [dealer(self.ctx, hub, "emu-1") for hub in self.hubs]
        before = None
        try:
            while True:
                counters = [(await ask(sock, StatsQuery(counters=True))).body.counters
                            for sock in socks]
                now = (sum(c.returns for c in counters), sum(c.return_s for c in counters))
                if before is not None and now[0] - before[0] >= 4:
                    z = (now[1] - before[1]) / (now[0] - before[0])
                    step = gain * self.share * (self.spec.t_c + self.spec.t_v - z)
                    self.link_delay = min(max(self.link_delay + step, -self.spec.t_v / 2),
                                          self.spec.t_c)
                before = now
                await asyncio.sleep(period_s)
        finally:
            for sock in socks:
                sock.close(0)

    def open_message(self, index: int):
        import numpy as np

        tokens = (np.arange(PROMPT_LEN + 1, dtype=np.int32) * 7 + index) % VOCAB
        return Open(ref=next(self.refs), prompt_len=PROMPT_LEN, tokens=tokens,
                    step_ms=1e3 * self.spec.step)

    async def run_one(self, i: int) -> None:
        """Target ``first + i``: sessions while admitted; alone, and asking again (its pool,
        or its one hub), while not."""

        await self.go.wait()
        while not self.stop.is_set():
            if self.totals.admitted[i]:
                await self.session(i, self.socks[i])
                continue
            retry = self.retry_after[i]
            if retry <= 0:
                await self.alone(i, float("inf"))
                return
            await self.alone(i, time.monotonic() + retry)
            if len(self.hubs) == 1:
                reply = await ask(self.socks[i], self.card(self.first + i))
                self.admit(i, self.hubs[0], reply)
            else:
                self.socks[i].close(0)
                self.socks[i], reply = await self.place(i)
            self.retry_after[i] = getattr(reply, "retry_after_s", 0.0)
            self.totals.rejections += not self.totals.admitted[i]

    async def alone(self, i: int, until: float) -> None:
        """Decode on our own, one token every ``t_step``, until ``until``."""
        deadline = time.monotonic()
        while not self.stop.is_set() and deadline < until:
            deadline += self.spec.step
            await self.wait.until(deadline)
            self.tokens[i] += 1
            self.totals.tokens += 1

    async def session(self, i: int, sock) -> None:
        """One session of ``max_new_tokens``: OPEN, then verify or decode as proposed."""
        import numpy as np

        # deferred: torch load only when this runs
        from starhub.wire.codec import decode, encode

        index = self.first + i
        await sock.send_multipart(encode(self.open_message(index)), copy=False)
        produced = 0
        while not self.stop.is_set():
            msg = decode(await sock.recv_multipart(copy=False))
            arrived = time.monotonic()
            if isinstance(msg, Error) and msg.code == ErrorCode.NO_CARD:
                # the hub let our idle slot go (its peer grace) before the run began:
                # greet again, as a real target does
                self.totals.admitted[i], self.retry_after[i] = False, 1e-3
                return
            if not isinstance(msg, Propose):
                self.totals.errors += 1
                logging.warning("emulated target %d got %s", index, msg)
                await asyncio.sleep(0.1)
                return
            if msg.plain:
                tokens = ((np.arange(msg.plain) + produced + index) % VOCAB).astype(np.int32)
                accepted, busy = 0, msg.plain * self.spec.step
            else:
                accepted = min(self.draws[i](len(msg.tokens)), len(msg.tokens))
                bonus = (int(msg.tokens[accepted - 1]) + 7 if accepted else index) % VOCAB
                if accepted < len(msg.tokens) and bonus == int(msg.tokens[accepted]):
                    bonus = (bonus + 1) % VOCAB  # the chain's next node would be accepted
                tokens = np.append(msg.tokens[:accepted], np.int32(bonus)).astype(np.int32)
                busy = self.spec.t_v
            produced += len(tokens)
            await self.wait.until(arrived + busy + self.link_delay)
            if self.stop.is_set():
                return
            self.totals.rounds += 1
            self.totals.tokens += len(tokens)
            self.tokens[i] += len(tokens)
            if produced >= self.max_new_tokens:
                await sock.send_multipart(encode(Close(tag=msg.tag)), copy=False)
                self.totals.sessions += 1
                return
            await sock.send_multipart(encode(Commit(
                tag=msg.tag, seq=msg.seq, accepted=accepted, tokens=tokens,
                verify_ms=1e3 * busy, step_ms=1e3 * self.spec.step)), copy=False)

    async def main(self, commands: asyncio.Queue) -> TargetTotals:
        self.socks = await self.connect()
        tasks = [asyncio.create_task(self.run_one(i)) for i in range(self.count)]
        tasks.append(asyncio.create_task(self.calibrate_link()))
        print("READY " + json.dumps({"link_rtt_ms": self.totals.link_rtt_ms}), flush=True)
        while True:
            command = await commands.get()
            if command == "go":
                self.go.set()
            elif command == "mark":
                self.totals.marks.append([time.monotonic(), list(self.tokens)])
            elif command in ("stop", ""):
                break
        self.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in [*self.socks, *self.surveyors.values()]:
            s.close(0)
        self.ctx.term()
        import torch

        self.totals.link_delay_ms = 1e3 * self.link_delay
        self.totals.threads = torch.get_num_threads()
        self.totals.mean_late_ms = 1e3 * self.wait.total_late / max(self.wait.samples, 1)
        return self.totals


def targets_main(args: argparse.Namespace) -> int:
    spec = EmulateSpec.parse(args.spec)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        commands: asyncio.Queue[str] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, line.strip())
            loop.call_soon_threadsafe(commands.put_nowait, "")

        threading.Thread(target=read, daemon=True).start()
        targets = EmulatedTargets(args.hub, spec, args.count, args.first, args.max_new_tokens,
                                  args.seed, share=1.0 / max(args.procs, 1),
                                  placement=args.placement)
        totals = await targets.main(commands)
        print("RESULT " + json.dumps(asdict(totals)), flush=True)

    asyncio.run(main())
    return 0
