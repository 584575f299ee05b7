"""The hub's watch over its drafter: what happens when a drafting process dies or hangs.

``RemoteDrafter`` (``starhub.hub.drafting_process``) finds out and raises ``DrafterLost``;
the worker hands it here. Every session's drafting state died with the process, so every
session ends with an ERROR: its target finishes that request on its own, exactly as it
would have with the hub, and its next request opens a new session. While the process
restarts, the hub admits no target and opens no session (``healthy`` is false: a
TARGET_CARD gets REJECT, an OPEN an ERROR, both saying why). A start that fails is tried
again after a backoff; after ``MAX_FAILED_STARTS`` in a row the hub itself stops, so that
whoever runs it sees it down. Each loss is logged and kept, bounded, for STATS and
``starhub status``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from starhub.client.link import Backoff
from starhub.drafters.base import Drafter, DrafterLost
from starhub.hub.sessions import DraftSession, TargetPeer
from starhub.server.sessions import SessionTable
from starhub.wire.messages import Error, ErrorCode, Message
from starhub.wire.reports import MAX_DRAFTER_EVENTS, DrafterEvent, DrafterHealth

log = logging.getLogger("starhub.hub")

MAX_FAILED_STARTS = 3
"""Failed restarts in a row after which the hub gives up and stops."""
RESTART_BACKOFF = Backoff(first_s=1.0, max_s=30.0)
REASON_CHARS = 300


class Supervisor:
    """Ends the sessions of a lost drafter, restarts it, and keeps the record.
    ``call`` runs a function on the drafting thread; ``reply`` and ``close`` are the hub's."""

    def __init__(self, drafter: Drafter, table: SessionTable[DraftSession, TargetPeer],
                 call: Callable[..., Awaitable], reply: Callable[[bytes, Message], None],
                 close: Callable[[int], None]):
        self.drafter = drafter
        self.table = table
        self.call = call
        self.reply = reply
        self.close = close
        self.healthy = True
        """False from a loss until the restarted drafter is ready: admission is closed."""
        self.restarts = 0
        self.sessions_ended = 0
        self.events: collections.deque[DrafterEvent] = collections.deque(
            maxlen=MAX_DRAFTER_EVENTS)

    @property
    def unavailable(self) -> str:
        """Why the hub admits no one now (the REJECT's and ERROR's reason)."""
        last = self.events[-1].reason if self.events else "it was lost"
        return f"the hub is restarting its drafting process: {last}"

    async def recover(self, exc: DrafterLost, refs: dict[int, int]) -> None:
        """End every session (``refs``: the ref each waiting request carries, by tag, so
        that an OPEN still unanswered hears of it), then restart the drafter."""
        self.healthy = False
        reason = str(exc)[:REASON_CHARS]
        tags = list(self.table.sessions)
        log.error("%s: ending its %d sessions (their targets finish alone) and restarting it",
                  reason, len(tags))
        event = DrafterEvent(at=time.time(), reason=reason, sessions=len(tags))
        self.events.append(event)
        self.sessions_ended += len(tags)
        for tag in tags:
            owner = self.table.sessions[tag].owner
            self.close(tag)
            self.reply(owner, Error(tag=tag, ref=refs.get(tag, 0), code=int(ErrorCode.INTERNAL),
                                    message=f"{reason}; the hub restarts it: finish this "
                                            f"request alone"))
        started = time.monotonic()
        failures = 0
        while True:
            try:
                await self.call(self.drafter.restart)
                break
            except Exception as err:  # noqa: BLE001 - each failed start is tried again
                failures += 1
                if failures >= MAX_FAILED_STARTS:
                    raise RuntimeError(f"the drafting process could not be restarted "
                                       f"({failures} tries): {err}") from err
                wait = RESTART_BACKOFF.delay(failures - 1)
                log.error("restarting the drafting process failed (%s); trying again in "
                          "%.0fs", err, wait)
                await asyncio.sleep(wait)
        event.restart_s = time.monotonic() - started
        self.restarts += 1
        self.healthy = True
        log.warning("the drafting process is back (pid %d) after %.1fs, admitting targets "
                    "again (restarts so far: %d)", self.drafter.pid, event.restart_s,
                    self.restarts)

    def report(self) -> DrafterHealth:
        return DrafterHealth(process=self.drafter.supervised, healthy=self.healthy,
                             pid=self.drafter.pid, restarts=self.restarts,
                             sessions_ended=self.sessions_ended, events=list(self.events))
