"""How long a pass waits for rows about to arrive, so that they share it.

A pass over a few rows costs far less than a pass per row. Without a short wait, rows
that were verified together fall apart: the first to come back starts a pass of its own,
and the cohort alternates half-empty passes. Both target-side loops (the core's
``Batcher`` for a hub's trees, the edge ``Verifier`` for its drafters') hold a pass by
this one rule (``waits``) and differ only in how they wait (a socket poll, an asyncio
event).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

SLACK = 0.2
"""How long past its expected arrival a row is waited for, in passes."""


def hold_until(start: float, pass_s: float, cap: float, due: list[float]) -> float:
    """Until when a pass that could start at ``start`` waits for the rows expected at the
    times ``due``, on the clock of ``start``; at most ``start`` (do not wait).

    Only rows expected by ``start + cap * pass_s`` are waited for, each up to ``SLACK`` of a
    pass past its estimate; a row overdue by a whole pass is stalled and not waited for."""
    limit = start + cap * pass_s
    soon = [at for at in due if start - pass_s < at <= limit]
    if not soon:
        return start
    return max(start, min(max(soon) + SLACK * pass_s, limit))


def waits(start: float, pass_s: float, cap: float, due: Callable[[], list[float]],
          clock: Callable[[], float]) -> Iterator[float]:
    """The waits of a pass that could start at ``start`` (on ``clock``): each the seconds
    until the rows ``due()`` expects now are in (``hold_until``), asked again after each
    wait, as rows arrive; done once nobody is waited for."""
    while (wait := hold_until(start, pass_s, cap, due()) - clock()) > 0:
        yield wait
