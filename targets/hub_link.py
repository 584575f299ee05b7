"""The target core's link to its hub (``targets.batcher``, under the star target and the
server alike): the one greeting (our TARGET_CARD), the clock that follows whether the hub
computes on our cores, the OPEN every session starts with, and the check every PROPOSE
passes before it is verified."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from starhub.client.connection import HubClient, HubUnavailable
from starhub.client.link import Link
from starhub.cores import CoreClock
from starhub.wire.messages import DrafterCard, Open, Propose, TargetCard
from targets.acceptance import Sampling

log = logging.getLogger("starhub.target")


class HubLink(Link):
    """``Link`` to a hub, greeting it with ``card()``. Each new DRAFTER_CARD it holds (at
    start, after a reconnect, after the hub forgot us) is logged once and tells ``clock``
    whether plain steps and passes must be timed by CPU time, the hub sharing our cores."""

    def __init__(self, hub: str, card: Callable[[], TargetCard], clock: CoreClock,
                 name: str = "target", timeout_s: float = 3.0,
                 client_options: dict | None = None):
        super().__init__(hub, self._greet, name, floor_s=timeout_s)
        self.target_card = card
        self.clock = clock
        self.client_options = client_options or {}
        self._followed: object = None

    def _greet(self) -> tuple[HubClient, DrafterCard]:
        """A new connection to the hub, and its DRAFTER_CARD (``HubUnavailable`` if none)."""
        client = HubClient(self.address, timeout_s=max(self.floor_s, 5.0),
                           **self.client_options)
        try:
            return client, client.greet(self.target_card())
        except HubUnavailable:
            client.close()
            raise

    def open(self) -> DrafterCard:
        card = super().open()
        self.follow()
        return card

    def current(self) -> HubClient | None:
        client = super().current()
        self.follow()
        return client

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
