"""The hub's drafting loop (StarSD's Algorithm 1, worker side), batched and pre-drafting.

Work-conserving: whenever the global buffer holds requests, draft them, up to ``--batch``
of them in one pass per tree layer; never wait for a batch to fill. A request whose
session already has a tree pre-drafted for exactly the tokens its COMMIT carried is
answered at once. When the buffer is empty, the worker pre-drafts: for the session whose
proposal went out last, it grows the next tree for the likeliest outcomes of the round in
flight, and gives way to any request that arrives, within one tree layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starhub.drafters.base import Drafter, TreeShape
from starhub.hub_config import Request
from starhub.protocol import Error, ErrorCode, Propose
from starhub.sessions import Session
from starhub.tree import DraftTree

if TYPE_CHECKING:
    from starhub.hub import Hub

log = logging.getLogger("starhub.hub")

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
        self.predrafting = hub.config.predraft and type(hub.drafter).predraft is not \
            Drafter.predraft
        """Only for drafters that can guess; the others would return nothing every time."""

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

    def take(self) -> list[Request]:
        """Pop up to a batch of live requests; answer those a pre-drafted tree fits."""
        hub = self.hub
        batch: list[Request] = []
        while hub.buffer and len(batch) < self.max_batch:
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
        hub = self.hub
        for i, req in enumerate(batch):
            hub.metrics.draft_started(req.arrival, started, len(hub.table), first=i == 0)
        jobs = [(req.session.ctx, self.shape(req.session)) for req in batch]
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(hub._executor, hub.drafter.propose_batch, jobs)
        except Exception as exc:  # a failing drafter fails this batch's rounds, not the hub
            log.exception("drafting a batch of %d failed", len(batch))
            results = [exc] * len(batch)
        finished = time.monotonic()
        hub.metrics.batch(len(batch), finished - started)
        share = (finished - started) / len(batch)
        for req, result in zip(batch, results, strict=True):
            session = req.session
            session.busy = False
            if isinstance(result, Exception):
                log.error("drafting failed for tag %d: %s", session.tag, result)
                hub.close(session.tag)
                hub.reply(req.identity, Error(tag=session.tag, ref=req.ref,
                                              code=int(ErrorCode.INTERNAL),
                                              message=f"drafting failed: {result}"))
                continue
            hub.metrics.draft_finished(started, finished, result.depth, len(result),
                                       req.arrival, session.tag, req.identity,
                                       share=len(batch))
            hub.control.observe_draft(session.choice.depth, session.choice.nodes, share)
            if hub.table.sessions.get(session.tag) is session:
                self.send(req, result, finished)

    def shape(self, session: Session) -> TreeShape:
        config = self.hub.config.shape
        return TreeShape(session.choice.depth, config.topk, session.choice.nodes,
                         config.support)

    def send(self, req: Request, tree: DraftTree, now: float) -> None:
        session = req.session
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
