"""A hub's clean exit on SIGTERM: stop admitting, answer the rounds already in the buffer,
tell every session's target to finish on its own, and stop once those messages are out."""

from __future__ import annotations

import asyncio
import logging
import time

from starhub.wire.messages import Error, ErrorCode

log = logging.getLogger("starhub.hub")


async def drain(hub, task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Shut ``hub`` down; ``task`` is its ``serve()``. New cards and OPEN get ERROR
    (DRAINING) at once; a round a target is waiting for is drafted and sent; then each open
    session's target gets an ERROR (DRAINING), so it finishes without waiting out its reply
    deadline and takes its next sessions to another hub of its pool."""
    hub.accepting = False
    log.info("shutting down: %d sessions, %d requests queued", len(hub.table),
             len(hub.worker.buffer))
    deadline = time.monotonic() + timeout_s
    while (hub.worker.buffer or any(s.busy for s in hub.table.sessions.values())) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    for tag, session in list(hub.table.sessions.items()):
        hub.reply(session.owner, Error(tag=tag, code=int(ErrorCode.DRAINING),
                                       message="the hub is shutting down"))
        hub.close(tag)
    while hub.outbox and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    hub.linger_ms = 1000
    task.cancel()
