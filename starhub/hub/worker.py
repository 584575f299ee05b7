"""The hub's drafting loop (StarSD's Algorithm 1, worker side), batched and pre-drafting.

Work-conserving: whenever the global buffer holds requests, draft them, up to ``--batch``
of them in one pass per tree layer; never wait for a batch to fill. A request whose
session already has a tree pre-drafted for exactly the tokens its COMMIT carried is
answered at once. When the buffer is empty, the worker pre-drafts: for the session whose
proposal went out last, it grows the next tree for the likeliest outcomes of the round in
flight, and gives way to any request that arrives, within one tree layer. Every greedy
tree leaves with a prompt-lookup branch grafted on where the session's own tokens suggest
one (``--lookup``). A drafter in a process of its own is looked at every ``CHECK_S`` while
the worker idles; when it is lost (``DrafterLost``), ``starhub.hub.supervision`` ends every
session and restarts it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from starhub.control.plane import Controller
from starhub.drafters.base import Drafter, DrafterLost, TreeShape
from starhub.drafters.ngram import NgramIndex
from starhub.hub.config import HubConfig
from starhub.hub.metrics import HubMetrics
from starhub.hub.sessions import DraftSession, TargetPeer
from starhub.hub.supervision import Supervisor
from starhub.server.sessions import SessionTable
from starhub.wire.messages import Error, ErrorCode, Message, Propose
from starhub.wire.tree import DraftTree, graft

log = logging.getLogger("starhub.hub")

LOOKUP_NGRAMS = (4, 2)
"""``--lookup``: a branch matched on the last 4, 3 or 2 tokens; a single token matches
almost anywhere, and its branch would cost verification more often than it pays."""

MAX_AUTO_BATCH = 16
"""``--batch auto`` drafts every waiting request up to this many: past it, a CPU pass costs
about as much per session as drafting one by one, and the batch only delays its first."""

LINGER_S = 2e-3
"""How long the drafting thread, with nothing left to draft, waits for the next request
before it hands itself back to the event loop. A request handed to a waiting thread
starts drafting about 0.15 ms sooner than one that goes through the executor again (its
hand-off, then the loop seeing the last batch end): below saturation the hub idles
``Z - (N-1)·S`` a cycle, often less than a millisecond, and every round would pay that."""

CHECK_S = 0.5
"""While idle, how often the worker asks a drafting process whether it lives (its calls
look by themselves while they wait)."""


@dataclass
class Request:
    """An entry of the global buffer: a session that needs a draft, and since when."""

    identity: bytes
    session: DraftSession
    ref: int
    arrival: float
    committed: tuple[int, ...] = ()
    """The tokens of the COMMIT that asked for this draft (a pre-drafted tree's key)."""


def drafting_thread(threads: int) -> None:
    """Drafting runs on this one thread. Where the event-loop thread has also run multithreaded
    torch code (loading, say), the process holds two OpenMP teams, and once it has more
    OpenMP threads than cores libgomp throttles its spin-waits: on 2 cores that made every
    draft ~1.7x slower. ``starhub hub`` therefore loads with one thread."""
    if threads:
        torch.set_num_threads(threads)


class DraftWorker:
    """The global request buffer and the one drafting thread that empties it. The hub
    ``submit``s requests; the worker answers each through ``reply`` (and ``close``s a
    session whose drafting failed)."""

    def __init__(self, drafter: Drafter, config: HubConfig,
                 table: SessionTable[DraftSession, TargetPeer], metrics: HubMetrics,
                 control: Controller, reply: Callable[[bytes, Message], None],
                 close: Callable[[int], None]):
        self.drafter = drafter
        self.config = config
        self.table = table
        self.metrics = metrics
        self.control = control
        self.reply = reply
        self.close = close
        self.buffer: collections.deque[Request] = collections.deque()
        self._work = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter",
                                           initializer=drafting_thread,
                                           initargs=(config.threads,))
        batch = config.batch
        self.max_batch = MAX_AUTO_BATCH if batch == "auto" else int(batch)
        if not drafter.batches:
            self.max_batch = 1
        self.ahead = 0 if drafter.batches else 1
        """Requests handed to a drafter that drafts one at a time while it still drafts
        another: it goes straight on to the next when one is done, instead of waiting a
        round trip through the event loop (about 0.7 ms a round on a busy 2-core machine,
        8% of an 8 ms round). A batching drafter takes what arrives between tree layers."""
        self.predrafting = config.predraft and drafter.predrafts
        """Only for drafters that can guess; the others would return nothing every time."""
        self.lookup = config.lookup and drafter.lookup_branches
        self.supervisor = Supervisor(drafter, table, self.call, reply, close)

    def submit(self, req: Request) -> None:
        self.buffer.append(req)
        self._work.set()

    async def call(self, fn: Callable, *args):
        """Run ``fn`` on the drafting thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self, wait: bool = False) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=True)

    async def run(self) -> None:
        while True:
            try:
                await self._drafting()
            except DrafterLost as exc:
                refs = {req.session.tag: req.ref for req in self.buffer}
                self.buffer.clear()  # their sessions end with the rest
                await self.supervisor.recover(exc, refs)

    async def _drafting(self) -> None:
        backlog_since: float | None = None
        while True:
            if not self.buffer:
                backlog_since = None
                if self.predrafting and await self.predraft():
                    continue
                self._work.clear()
                await self._idle()
                continue
            batch = self.take()
            if not batch:
                continue
            started = time.monotonic()
            if backlog_since is not None:
                self.control.observe_overhead(started - backlog_since)
            await self.draft(batch, started)
            backlog_since = time.monotonic() if self.buffer else None

    async def _idle(self) -> None:
        """Wait for work; meanwhile look, every ``CHECK_S``, whether the drafter lives."""
        if not self.drafter.supervised:
            await self._work.wait()
            return
        while not self._work.is_set():
            try:
                await asyncio.wait_for(self._work.wait(), CHECK_S)
            except TimeoutError:
                await self.call(self.drafter.check)

    def take(self, limit: int | None = None) -> list[Request]:
        """Pop up to a batch (or ``limit``) of live requests; answer those a pre-drafted
        tree fits."""
        batch: list[Request] = []
        while self.buffer and len(batch) < (self.max_batch if limit is None else limit):
            req = self.buffer.popleft()
            session = req.session
            if self.table.sessions.get(session.tag) is not session:
                continue
            tree = self.predrafted(session, req)
            if tree is None:
                batch.append(req)
                continue
            now = time.monotonic()
            self.metrics.draft_started(req.arrival, now, len(self.table), first=False)
            self.metrics.draft_finished(now, now, tree.depth, len(tree), req.arrival,
                                        session.tag, req.identity)
            session.busy = False
            self.send(req, tree, now)
        return batch

    def predrafted(self, session: DraftSession, req: Request) -> DraftTree | None:
        """The tree pre-drafted for what this COMMIT carried, if the guess was right."""
        if session.predraft_for != session.seq - 1:
            return None
        tree = session.predrafts.get(req.committed)
        session.predrafts = {}
        self.metrics.predraft(tree is not None)
        return tree

    async def draft(self, batch: list[Request], started: float) -> None:
        """Draft ``batch``. Continuous batching: requests that arrive meanwhile join it
        between tree layers, up to ``--batch`` trees at a time (a drafter that drafts one
        at a time is handed the next request ahead: ``ahead``), and each PROPOSE leaves as
        soon as its own tree is done; nothing waits for the batch to fill or to end.

        The event loop hands arriving requests over as they come (``feed``) and the
        drafting thread takes what is there between layers, so neither waits on the
        other: a thread that asked the loop instead waited about a millisecond a layer
        while the loop was busy with the very COMMITs it was asking for. A request's draft
        begins when the drafting thread takes it (``begun``), so its wait in the buffer
        and its draft time are each counted as what they were."""
        loop = asyncio.get_running_loop()
        requests = list(batch)
        begun = [started] * len(requests)
        for i, req in enumerate(requests):
            self.metrics.draft_started(req.arrival, started, len(self.table), first=i == 0)
        delivered: set[int] = set()
        handed: collections.deque[tuple] = collections.deque()
        counts = {"admitted": len(requests), "finished": 0}  # written by the drafting thread
        handing = threading.Event()
        after_wait: set[int] = set()
        """Requests the thread took after waiting with nothing to draft: their start ends
        an idle gap, as a batch's first does."""

        def feed() -> None:  # on the event loop
            room = self.max_batch + self.ahead - (len(requests) - counts["finished"])
            if room <= 0 or not self.buffer:
                return
            now = time.monotonic()
            more = self.take(room)
            first = len(requests)
            # the thread may take from ``handed`` at any moment: it goes last
            requests.extend(more)
            begun.extend([now] * len(more))
            handed.extend((first + i, (req.session.ctx, self.shape(req.session)))
                          for i, req in enumerate(more))
            if more:
                handing.set()
                self.drafter.wake()

        async def feeder() -> None:
            while True:
                self._work.clear()
                feed()
                await self._work.wait()

        def admit() -> list[tuple]:  # on the drafting thread, between tree layers
            handing.clear()
            waited = not handed and counts["finished"] >= counts["admitted"]
            if waited:
                handing.wait(LINGER_S)
            jobs = []
            now = time.monotonic()
            while handed:
                k, job = handed.popleft()
                begun[k] = now
                jobs.append(job)
                if waited:
                    after_wait.add(k)
            counts["admitted"] += len(jobs)
            return jobs

        def finished(k: int, result: DraftTree | Exception, seconds: float,
                     shared: float) -> None:
            counts["finished"] += 1
            loop.call_soon_threadsafe(deliver, k, result, seconds, shared)

        def started_late(k: int) -> None:
            """A request handed over while drafting began when the thread took it."""
            if k >= len(batch):
                self.metrics.draft_started(requests[k].arrival, begun[k], len(self.table),
                                           first=k in after_wait)

        def deliver(k: int, result: DraftTree | Exception, seconds: float,
                    shared: float) -> None:
            delivered.add(k)
            started_late(k)
            self.deliver(requests[k], result, begun[k], seconds, shared)
            feed()

        jobs = [(req.session.ctx, self.shape(req.session)) for req in batch]
        feeding = loop.create_task(feeder()) if self.max_batch + self.ahead > 1 else None
        lost: DrafterLost | None = None
        try:
            await loop.run_in_executor(self.executor, lambda: self.drafter.propose_batch(
                jobs, admit=admit if feeding else None, finished=finished))
        except DrafterLost as exc:  # its requests wait in the buffer for the supervisor
            lost = exc
        except Exception as exc:  # a failing drafter fails this batch's rounds, not the hub
            log.exception("drafting a batch of %d failed", counts["admitted"])
            for k in range(counts["admitted"]):
                if k not in delivered:
                    started_late(k)
                    self.deliver(requests[k], exc, begun[k], 0.0, 1.0)
                    delivered.add(k)
        finally:
            if feeding is not None:
                feeding.cancel()
        # handed over after the drafting thread last looked: back to the front of the line
        self.buffer.extendleft(reversed([req for k, req in enumerate(requests)
                                         if k not in delivered]))
        if lost is not None:
            raise lost  # the supervisor ends every session and restarts the drafter

    def deliver(self, req: Request, result: DraftTree | Exception, begun: float,
                seconds: float, shared: float) -> None:
        """Send a drafted tree (or the error that replaced it) to its target."""
        session = req.session
        session.busy = False
        if isinstance(result, Exception):
            log.error("drafting failed for tag %d: %s", session.tag, result)
            self.close(session.tag)
            self.reply(req.identity, Error(tag=session.tag, ref=req.ref,
                                           code=int(ErrorCode.INTERNAL),
                                           message=f"drafting failed: {result}"))
            return
        now = time.monotonic()
        self.metrics.batch(shared, now - begun)
        self.metrics.draft_finished(begun, now, result.depth, len(result), req.arrival,
                                    session.tag, req.identity,
                                    share=max((now - begun) / max(seconds, 1e-9), 1.0))
        self.control.observe_draft(session.choice.depth, session.choice.nodes, seconds)
        if self.table.sessions.get(session.tag) is session:
            self.send(req, result, now)

    def shape(self, session: DraftSession) -> TreeShape:
        config = self.config.shape
        return TreeShape(session.choice.depth, config.topk, session.choice.nodes,
                         config.support, session.choice.floor)

    def send(self, req: Request, tree: DraftTree, now: float) -> None:
        session = req.session
        session.grafted = 0
        if self.lookup and session.ctx.greedy and len(tree):
            if session.lookup is None:
                session.lookup = NgramIndex(*LOOKUP_NGRAMS)
            chain = session.lookup.continuation(session.ctx.tokens, tree.depth)
            if chain:
                grown = graft(tree, chain)
                session.grafted = len(tree) if len(grown) > len(tree) else 0
                tree = grown
        session.proposed_at = now
        session.out_tree = tree
        self.reply(req.identity, Propose(
            tag=session.tag, seq=session.seq, ref=req.ref,
            leave=req.identity in self.control.unwanted, tokens=tree.tokens,
            parents=tree.parents, dist_ids=tree.dist_ids, dist_probs=tree.dist_probs))

    async def predraft(self) -> bool:
        """Pre-draft for the session whose proposal went out last; False if none needs it."""
        session = None
        for s in self.table.sessions.values():
            if (s.busy or s.out_tree is None or not s.ctx.greedy or s.predraft_for == s.seq
                    or (session is not None and s.proposed_at <= session.proposed_at)):
                continue
            session = s
        if session is None:
            return False
        session.predraft_for = session.seq
        started = time.monotonic()
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.drafter.predraft, session.ctx, session.out_tree,
                self.shape(session), lambda: bool(self.buffer))
        except DrafterLost:
            raise
        except Exception:
            log.exception("pre-drafting failed for tag %d (its rounds go on as usual)",
                          session.tag)
            found = {}
        self.metrics.predraft(None, time.monotonic() - started)
        session.predrafts = found
        return True

