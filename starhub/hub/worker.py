"""The hub's drafting loop (StarSD's Algorithm 1, worker side), batched and pre-drafting.

Work-conserving: whenever the global buffer holds requests, draft them, up to ``--batch``
of them in one pass per tree layer; never wait for a batch to fill. A request whose
session already has a tree pre-drafted for exactly the tokens its COMMIT carried is
answered at once. When the buffer is empty, the worker pre-drafts: for the session whose
proposal went out last, it grows the next tree for the likeliest outcomes of the round in
flight, and gives way to any request that arrives, within one tree layer. Every greedy
tree leaves with a prompt-lookup branch grafted on where the session's own tokens suggest
one (``--lookup``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from starhub.drafters.base import TreeShape
from starhub.drafters.ngram import NgramIndex
from starhub.hub.config import Request
from starhub.hub.sessions import Session
from starhub.wire.messages import Error, ErrorCode, Propose
from starhub.wire.tree import DraftTree, graft

if TYPE_CHECKING:
    from starhub.hub.server import Hub

log = logging.getLogger("starhub.hub")

LOOKUP_NGRAMS = (4, 2)
"""``--lookup``: a branch matched on the last 4, 3 or 2 tokens; a single token matches
almost anywhere, and its branch would cost verification more often than it pays."""

MAX_AUTO_BATCH = 16
"""``--batch auto`` drafts every waiting request up to this many: past it, a CPU pass costs
about as much per session as drafting one by one, and the batch only delays its first."""


class DraftWorker:
    def __init__(self, hub: Hub):
        self.hub = hub
        batch = hub.config.batch
        self.max_batch = MAX_AUTO_BATCH if batch == "auto" else int(batch)
        if not hub.drafter.batches:
            self.max_batch = 1
        self.predrafting = hub.config.predraft and hub.drafter.predrafts
        """Only for drafters that can guess; the others would return nothing every time."""
        self.lookup = hub.config.lookup and hub.drafter.lookup_branches

    async def run(self) -> None:
        hub = self.hub
        backlog_since: float | None = None
        while True:
            if not hub.buffer:
                backlog_since = None
                if self.predrafting and await self.predraft():
                    continue
                hub._work.clear()
                await hub._work.wait()
                continue
            batch = self.take()
            if not batch:
                continue
            started = time.monotonic()
            if backlog_since is not None:
                hub.control.observe_overhead(started - backlog_since)
            await self.draft(batch, started)
            backlog_since = time.monotonic() if hub.buffer else None

    def take(self, limit: int | None = None) -> list[Request]:
        """Pop up to a batch (or ``limit``) of live requests; answer those a pre-drafted
        tree fits."""
        hub = self.hub
        batch: list[Request] = []
        while hub.buffer and len(batch) < (self.max_batch if limit is None else limit):
            req = hub.buffer.popleft()
            session = req.session
            if hub.table.sessions.get(session.tag) is not session:
                continue
            tree = self.predrafted(session, req)
            if tree is None:
                batch.append(req)
                continue
            now = time.monotonic()
            hub.metrics.draft_started(req.arrival, now, len(hub.table), first=False)
            hub.metrics.draft_finished(now, now, tree.depth, len(tree), req.arrival,
                                       session.tag, req.identity)
            session.busy = False
            self.send(req, tree, now)
        return batch

    def predrafted(self, session: Session, req: Request) -> DraftTree | None:
        """The tree pre-drafted for what this COMMIT carried, if the guess was right."""
        if session.predraft_for != session.seq - 1:
            return None
        tree = session.predrafts.get(req.committed)
        session.predrafts = {}
        self.hub.metrics.predraft(tree is not None)
        return tree

    async def draft(self, batch: list[Request], started: float) -> None:
        """Draft ``batch``. Continuous batching: requests that arrive meanwhile join it
        between tree layers, up to ``--batch`` trees at a time, and each PROPOSE leaves as
        soon as its own tree is done; nothing waits for the batch to fill or to end.

        The event loop hands arriving requests over as they come (``feed``) and the
        drafting thread takes what is there between layers, so neither waits on the
        other: a thread that asked the loop instead waited about a millisecond a layer
        while the loop was busy with the very COMMITs it was asking for."""
        hub = self.hub
        loop = asyncio.get_running_loop()
        requests = list(batch)
        begun = [started] * len(requests)
        for i, req in enumerate(requests):
            hub.metrics.draft_started(req.arrival, started, len(hub.table), first=i == 0)
        delivered: set[int] = set()
        handed: collections.deque[tuple] = collections.deque()
        counts = {"admitted": len(requests), "finished": 0}  # written by the drafting thread

        def feed() -> None:  # on the event loop
            room = self.max_batch - (len(requests) - counts["finished"])
            if room <= 0 or not hub.buffer:
                return
            now = time.monotonic()
            more = self.take(room)
            for req in more:
                hub.metrics.draft_started(req.arrival, now, len(hub.table), first=False)
            requests.extend(more)
            begun.extend([now] * len(more))
            handed.extend((req.session.ctx, self.shape(req.session)) for req in more)
            if more:
                hub.drafter.wake()

        async def feeder() -> None:
            while True:
                hub._work.clear()
                feed()
                await hub._work.wait()

        def admit() -> list[tuple]:  # on the drafting thread, between tree layers
            jobs = []
            while handed:
                jobs.append(handed.popleft())
            counts["admitted"] += len(jobs)
            return jobs

        def finished(k: int, result: DraftTree | Exception, seconds: float,
                     shared: float) -> None:
            counts["finished"] += 1
            loop.call_soon_threadsafe(deliver, k, result, seconds, shared)

        def deliver(k: int, result: DraftTree | Exception, seconds: float,
                    shared: float) -> None:
            delivered.add(k)
            self.deliver(requests[k], result, begun[k], seconds, shared)
            feed()

        jobs = [(req.session.ctx, self.shape(req.session)) for req in batch]
        feeding = loop.create_task(feeder()) if self.max_batch > 1 else None
        try:
            await loop.run_in_executor(hub._executor, lambda: hub.drafter.propose_batch(
                jobs, admit=admit if feeding else None, finished=finished))
        except Exception as exc:  # a failing drafter fails this batch's rounds, not the hub
            log.exception("drafting a batch of %d failed", counts["admitted"])
            for k in range(counts["admitted"]):
                if k not in delivered:
                    self.deliver(requests[k], exc, begun[k], 0.0, 1.0)
                    delivered.add(k)
        finally:
            if feeding is not None:
                feeding.cancel()
        # handed over after the drafting thread last looked: back to the front of the line
        hub.buffer.extendleft(reversed([req for k, req in enumerate(requests)
                                        if k not in delivered]))

    def deliver(self, req: Request, result: DraftTree | Exception, begun: float,
                seconds: float, shared: float) -> None:
        """Send a drafted tree (or the error that replaced it) to its target."""
        hub = self.hub
        session = req.session
        session.busy = False
        if isinstance(result, Exception):
            log.error("drafting failed for tag %d: %s", session.tag, result)
            hub.close(session.tag)
            hub.reply(req.identity, Error(tag=session.tag, ref=req.ref,
                                          code=int(ErrorCode.INTERNAL),
                                          message=f"drafting failed: {result}"))
            return
        now = time.monotonic()
        hub.metrics.batch(shared, now - begun)
        hub.metrics.draft_finished(begun, now, result.depth, len(result), req.arrival,
                                   session.tag, req.identity,
                                   share=max((now - begun) / max(seconds, 1e-9), 1.0))
        hub.control.observe_draft(session.choice.depth, session.choice.nodes, seconds)
        if hub.table.sessions.get(session.tag) is session:
            self.send(req, result, now)

    def shape(self, session: Session) -> TreeShape:
        config = self.hub.config.shape
        return TreeShape(session.choice.depth, config.topk, session.choice.nodes,
                         config.support)

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
        self.hub.reply(req.identity, Propose(
            tag=session.tag, seq=session.seq, ref=req.ref, tokens=tree.tokens,
            parents=tree.parents, dist_ids=tree.dist_ids, dist_probs=tree.dist_probs))

    async def predraft(self) -> bool:
        """Pre-draft for the session whose proposal went out last; False if none needs it."""
        hub = self.hub
        session = None
        for s in hub.table.sessions.values():
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
                hub._executor, hub.drafter.predraft, session.ctx, session.out_tree,
                self.shape(session), lambda: bool(hub.buffer))
        except Exception:
            log.exception("pre-drafting failed for tag %d (its rounds go on as usual)",
                          session.tag)
            found = {}
        hub.metrics.predraft(None, time.monotonic() - started)
        session.predrafts = found
        return True

