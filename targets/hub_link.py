"""The target core's link to its hub (``targets.batcher``, under the star target and the
server alike): the one greeting (our TARGET_CARD), the clock that follows whether the hub
computes on our cores, the OPEN every session starts with, and the check every PROPOSE
passes before it is verified.

Given a pool of hubs (``--hub A,B,C``), each greeting goes to the hub whose own figures
promise this target the most tokens per second (``starhub.client.pool``): at start, and
whenever the link reconnects, after its hub died, hung or began to drain. A watcher thread
asks the pool again in two cases, and chooses a hub to move to:

- its hub says it would rather lose this target (``Propose.leave``: the hub is over its
  admission limit, and this target gains least there): it moves to the best hub with room,
  and stays where none has room;
- every ``REBALANCE_S``, where another hub has clearly fewer targets
  (``starhub.client.pool.move_chance``): targets that start together see the same offers
  and may crowd one hub. After such a move it stays at least ``SETTLE_S``: the hubs'
  counts of their targets lag a move by their peer grace, and a target that moved on every
  glance at them would swing back and forth.

A move is never made mid-round: the core greets the new hub when it has no session open
or a new one about to open (``current(move=True)``), opens its sessions there from then on,
and keeps the old connection in ``retiring`` until the sessions open on it end (between two
requests of a star target, none are).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from starhub.client.connection import HubClient, HubUnavailable
from starhub.client.link import Link
from starhub.client.pool import move_chance, offer, pool_addresses, rank, survey
from starhub.cores import CoreClock
from starhub.wire.messages import DrafterCard, Open, Propose, TargetCard
from targets.acceptance import Sampling

log = logging.getLogger("starhub.target")

REBALANCE_S = 10.0
"""How often a target of a pool asks whether another hub has clearly fewer targets."""
SETTLE_S = 30.0
"""How long a target stays at a hub it moved to before it may move again."""
LOOK_GAP_S = 1.0
"""The least time between two looks at the pool: a hub that wants to lose this target says
so in every PROPOSE."""
MOVE_GREET_S = 1.0
"""How long a move's greeting may hold the core up (at a session boundary, other sessions
waiting): a hub that answered the survey a moment ago and cannot answer a card within this
is not one to move to."""
RETIRE_LINGER_MS = 200
"""How long a connection moved away from may still deliver its last CLOSE once closed."""


class HubLink(Link):
    """``Link`` to a hub, or to the best of a pool of hubs (``hub``: an address, several
    comma-separated, or a list), greeting it with ``card()``. Each new DRAFTER_CARD it
    holds (at start, after a reconnect, after the hub forgot us) is logged once and tells
    ``clock`` whether plain steps and passes must be timed by CPU time, the hub sharing our
    cores. ``address`` is the hub greeted last."""

    def __init__(self, hub: str | Sequence[str], card: Callable[[], TargetCard],
                 clock: CoreClock, name: str = "target", timeout_s: float = 3.0,
                 client_options: dict | None = None):
        self.pool = pool_addresses(hub)
        super().__init__(self.pool[0], self._greet, name, floor_s=timeout_s)
        self.target_card = card
        self.clock = clock
        self.client_options = client_options or {}
        self.rng = random.Random()
        """Breaks ties between hubs with equal offers (``starhub.client.pool.rank``)."""
        self._followed: object = None
        self._move: tuple[str, float, str] | None = None
        """The hub chosen to move to (one with room, where ours asked us to leave; one with
        clearly fewer targets), when, and from which hub, until the core takes it up at a
        session boundary (a choice older than ``REBALANCE_S``, or made from a hub we have
        left meanwhile, is dropped)."""
        self._moved_at = -math.inf
        self.moves = 0
        self.retiring: list[HubClient] = []
        """Connections to hubs moved away from, kept until their sessions end (the core
        closes them with ``retire``)."""
        self._told = threading.Event()
        """The hub would rather lose this target (``told``): look at the pool now."""
        self._told_by = ""
        """The hub that said so (a PROPOSE from a hub moved away from says nothing now)."""
        self._deaf_until = -math.inf
        """A look found no hub with room: until then (``REBALANCE_S`` later), ``told``
        is not acted on."""
        self._stay_said = False
        if len(self.pool) > 1:
            threading.Thread(target=self._watch, name=f"{name}-pool", daemon=True).start()

    def _greet(self) -> tuple[HubClient, DrafterCard]:
        """A new connection to the hub (or the pool's best that admits us), and its
        DRAFTER_CARD; ``HubUnavailable`` if none."""
        if len(self.pool) == 1:
            return self._greet_one(self.pool[0])
        reports = survey(self.pool, patience_s=self.floor_s, client_options=self.client_options)
        step_s = self.target_card().step_ms / 1e3
        order = [o.address for o in rank([offer(address, report, step_s=step_s)
                                          for address, report in reports.items()], self.rng)]
        if not order:
            raise HubUnavailable(f"no hub of the pool {','.join(self.pool)} answered within "
                                 f"{self.floor_s:g}s")
        refusals = []
        for address in order:
            try:
                found = self._greet_one(address)
            except HubUnavailable as exc:
                refusals.append(exc)
                continue
            self.address = address
            return found
        waits = [e.retry_after_s for e in refusals if e.retry_after_s > 0]
        silent = len(self.pool) - len(order)
        raise HubUnavailable(
            "; ".join(map(str, refusals)) + (f"; {silent} more did not answer" if silent else ""),
            retry_after_s=min(waits, default=0.0),
            rejected=not silent and all(e.rejected for e in refusals))

    def _greet_one(self, address: str,
                   timeout_s: float | None = None) -> tuple[HubClient, DrafterCard]:
        client = HubClient(address, timeout_s=timeout_s or max(self.floor_s, 5.0),
                           **self.client_options)
        try:
            return client, client.greet(self.target_card())
        except HubUnavailable:
            client.close()
            raise

    def connect(self) -> bool:
        """``Link.connect``, saying once why there is no hub where there is none."""
        if super().connect():
            return True
        retrying = self._thread is not None and self._thread.is_alive()
        log.warning("%s: no hub to draft with (%s); decoding alone%s", self.name, self.note,
                    ", and asking again in the background" if retrying else "")
        return False

    def open(self) -> DrafterCard:
        card = super().open()
        self.follow()
        return card

    def current(self, move: bool = True) -> HubClient | None:
        """``Link.current``; ``move`` (a session boundary: the core has no session open, or
        a new request about to begin): adopt the hub the watcher chose to move to, if any.
        The connection left keeps serving the sessions open on it (``retiring``). A hub
        forgets a target that holds no session for its peer grace, so the greeting waits
        for such a boundary rather than being made while old sessions run on."""
        if move:
            self._adopt_move()
        client = super().current()
        self.follow()
        return client

    def retire(self, in_use: set[HubClient]) -> None:
        """Close the connections moved away from that no session in ``in_use`` holds."""
        for old in [c for c in self.retiring if c not in in_use]:
            self.retiring.remove(old)
            old.close(RETIRE_LINGER_MS)  # its sessions' last CLOSE still leaves

    def told(self, address: str) -> None:
        """The hub at ``address`` (in a PROPOSE) would rather lose this target: look for a
        hub with room. Called for every such PROPOSE; looks at most every ``LOOK_GAP_S``,
        and after a look that found no room, not for ``REBALANCE_S``."""
        if time.monotonic() < self._deaf_until or address != self.address:
            return
        if len(self.pool) == 1:
            self._deaf_until = math.inf
            log.info("%s: the hub %s is over its admission limit and would rather lose this "
                     "target; it has no other hub (--hub A,B,... gives a pool), so it stays",
                     self.name, self.address)
            return
        self._told_by = address
        self._told.set()

    def close(self) -> None:
        super().close()
        self._told.set()  # ends the watcher's wait
        self.retire(set())

    def _watch(self) -> None:
        """Look at the pool when the hub says it would rather lose this target, and every
        ``REBALANCE_S`` (the first time sooner, at a random moment, so that targets that
        started together ask apart); at most every ``LOOK_GAP_S``."""
        wait = self.rng.uniform(1.0, 3.0)
        while not self._closed.wait(LOOK_GAP_S):
            told = self._told.wait(max(wait - LOOK_GAP_S, 0.0))
            if self._closed.is_set():
                return
            self._told.clear()
            wait = REBALANCE_S
            try:
                self._look(told)
            except Exception as exc:  # a look that fails must not end rebalancing
                log.debug("%s: could not survey the pool: %s", self.name, exc)

    def _look(self, told: bool = False) -> None:
        """One look at the pool: choose a move to the best hub with room where this hub
        would rather lose us (``told``), else where ``move_chance`` says so."""
        here = self.address
        settled = time.monotonic() - self._moved_at > SETTLE_S
        told = told and self._told_by == here  # not a hub moved away from since
        with self._lock:
            if self._move is not None and time.monotonic() - self._move[1] > REBALANCE_S:
                self._move = None  # the core opened no session meanwhile: choose afresh
        if self.client is None or self._move is not None or not (settled or told):
            return  # reconnecting, a move waits for the core, or it just moved
        reports = survey(self.pool, client_options=self.client_options)
        if here not in reports and not told:  # the counts need ours; a hub that asked us
            return                            # to leave may be too busy to answer
        step_s = self.target_card().step_ms / 1e3
        offers = rank([offer(a, r, step_s=step_s) for a, r in reports.items() if a != here],
                      self.rng)
        if told:
            better = [o for o in offers if o.tok_s > 0]
            if not better:
                self._deaf_until = time.monotonic() + REBALANCE_S
                log.log(logging.DEBUG if self._stay_said else logging.INFO,
                        "%s: the hub %s would rather lose this target, but no other hub of "
                        "the pool has room; staying", self.name, here)
                self._stay_said = True
                return
            why = f"hub {here} would rather lose this target (it is over its admission limit)"
        else:
            better = [o for o in offers
                      if self.rng.random() < move_chance(reports[here], o, step_s)]
            why = (f"hub {better[0].address} has {better[0].admitted} targets, {here} "
                   f"{reports[here].control.admitted} with this one" if better else "")
        with self._lock:
            if not better or self.address != here or self.client is None:
                return  # it moved or was lost while the survey ran
            self._move = better[0].address, time.monotonic(), here
        self._stay_said = False
        log.info("%s: %s; moving to %s for the sessions that open next", self.name, why,
                 better[0].address)

    def _adopt_move(self) -> None:
        """Greet the hub the watcher chose and switch to it (on the core's thread, waiting
        at most ``MOVE_GREET_S``), keeping the old connection for its sessions; where the
        new hub turns us away, stay."""
        with self._lock:
            move, self._move = self._move, None
        if move is None or self.client is None:  # lost meanwhile: the reconnection decides
            return
        address, chosen, origin = move
        if address == self.address or origin != self.address \
                or time.monotonic() - chosen > REBALANCE_S:
            return  # already there or elsewhere (a reconnection), or chosen too long ago
        try:
            client, card = self._greet_one(address, MOVE_GREET_S)
        except HubUnavailable as exc:
            log.info("%s: staying with %s: %s", self.name, self.address, exc)
            return
        self.retiring.append(self.client)
        self.client, self.card, self.address = client, card, address
        self._moved_at = time.monotonic()
        self._told.clear()
        self.moves += 1

    def follow(self) -> None:
        """Read the card the link holds, if it is new: log what the hub drafts with and
        whether it shares our cores."""
        card = self.card
        if card is None or card is self._followed:
            return
        self._followed = card
        self.clock.follow(card.host, card.cpus)
        log.info("%s: hub %s drafts with '%s' (depth %s, topk %d, %d nodes)%s", self.name,
                 self.address, card.drafter, card.depth or "auto", card.topk, card.max_nodes,
                 "; it shares our CPU cores, so steps and passes are timed by CPU time"
                 if self.clock.shared else "")

    def rejoin(self) -> bool:
        """The hub no longer knows us (it frees the slot of a target that held no session
        for a while, or it restarted): our card again, on a new connection. False when
        none can be had now (the link retries in the background)."""
        log.info("%s: the hub %s no longer knows this target; greeting it again", self.name,
                 self.address)
        return self.connect()

    def opening(self, tokens: list[int], prompt_len: int, sampling: Sampling, seed: int,
                step_s: float, features: torch.Tensor | None, ref: int = 0,
                batched: bool = False) -> Open:
        """The OPEN of a session whose stream holds ``tokens`` (the prompt's first
        ``prompt_len``, then what it decoded), with their features."""
        return Open(prompt_len=prompt_len, temperature=sampling.temperature,
                    top_p=sampling.top_p, seed=seed, step_ms=1e3 * step_s, ref=ref,
                    shares_cores=self.clock.shared, batched=batched,
                    tokens=torch.tensor(tokens, dtype=torch.int32), features=features)


def check_propose(msg: Propose, vocab_size: int) -> None:
    """Trust nothing from the wire: a PROPOSE this target cannot verify is a hub failure."""
    ids = [msg.tokens] + ([msg.dist_ids] if msg.dist_ids is not None else [])
    for arr in ids:
        if arr.size and not (0 <= int(arr.min()) and int(arr.max()) < vocab_size):
            raise HubUnavailable(f"the hub sent token ids outside [0, {vocab_size})")
