"""Real servers driven one message at a time in the test's thread, for fuzzing and limits.

A message goes in through the same entry point the socket loop uses (``on_frames``), and
the replies come back decoded from their wire form, so a test sees what a peer would see.
"""

from __future__ import annotations

import asyncio

from starhub.hub.server import Hub, HubConfig
from starhub.wire.codec import decode, encode
from starhub.wire.messages import Message


def wire(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


class HubHarness:
    """A Hub whose worker drafts as it does in service; ``send`` returns once nothing is
    left to draft."""

    def __init__(self, drafter, **config):
        self.loop = asyncio.new_event_loop()
        self.hub = Hub(drafter, HubConfig(**config))
        self.worker = self.loop.create_task(self.hub.worker.run())

    def send(self, identity: bytes, msg: Message | list[bytes]) -> list[Message]:
        frames = msg if isinstance(msg, list) else wire(msg)
        self.hub.on_frames(identity, frames)
        self.loop.run_until_complete(self._settle())
        replies = []
        while self.hub.outbox:
            to, reply = self.hub.next_reply()
            assert to == identity
            replies.append(decode(wire(reply)))
        return replies

    def ask(self, identity: bytes, msg: Message | list[bytes]) -> Message:
        (reply,) = self.send(identity, msg)
        return reply

    async def _settle(self) -> None:
        await asyncio.sleep(0)
        while self.hub.worker.buffer or any(s.busy for s in self.hub.table.sessions.values()):
            await asyncio.sleep(0.001)

    def state(self) -> tuple:
        """Everything a rejected message must leave as it was."""
        hub = self.hub
        sessions = {t: (s.owner, s.seq, s.busy, tuple(s.ctx.tokens), len(s.ctx.features),
                        _rows(s.ctx.state), s.last_tree_size, s.prompt_len)
                    for t, s in hub.table.sessions.items()}
        peers = {i: (p.name, p.vocab_size, frozenset(p.sessions))
                 for i, p in hub.table.peers.items()}
        return (sessions, peers, len(hub.worker.buffer), hub.table.budget.snapshot(),
                sorted(hub.control.sessions), sorted(hub.control.targets))

    def close(self) -> None:
        self.worker.cancel()
        self.loop.run_until_complete(asyncio.gather(self.worker, return_exceptions=True))
        self.loop.close()
        self.hub.worker.shutdown(wait=True)


def _rows(state) -> tuple[int, int]:
    """A drafter state's committed pairs and cached entries (0 for drafters without)."""
    cache = getattr(state, "cache", None)
    return getattr(state, "pairs", 0), getattr(cache, "length", 0)


class VerifierHarness:
    """An edge Verifier on a real engine; ``step`` runs one verification pass."""

    def __init__(self, model, tokenizer, **config):
        from targets.verifier import Verifier, VerifierConfig

        self.verifier = Verifier.for_model(model, tokenizer, VerifierConfig(**config))

    def send(self, identity: bytes, msg: Message | list[bytes]) -> list[Message]:
        """The message, then every prompt it left to prefill, as the loop does between
        passes."""
        frames = msg if isinstance(msg, list) else wire(msg)
        self.verifier.on_frames(identity, frames)
        while self.verifier.prefills:
            asyncio.run(self.verifier.prefill_step())
        return self._drain(identity)

    def ask(self, identity: bytes, msg: Message | list[bytes]) -> Message:
        (reply,) = self.send(identity, msg)
        return reply

    def step(self, identity: bytes) -> list[Message]:
        asyncio.run(self.verifier.step())
        return self._drain(identity)

    def _drain(self, identity: bytes) -> list[Message]:
        replies = []
        while self.verifier.outbox:
            to, reply = self.verifier.next_reply()
            assert to == identity
            replies.append(decode(wire(reply)))
        return replies

    def state(self) -> tuple:
        v = self.verifier
        sessions = {t: (s.owner, s.greedy, s.rounds, s.committed, s.last_seen)
                    for t, s in v.table.sessions.items()}
        pending = {t: (p.seq, tuple(p.tree.tokens.tolist())) for t, p in v.pending.items()}
        cached = {t: v.engine.cached(t) for t in v.table.sessions}
        return (sessions, pending, sorted(v.table.peers), cached, v.table.budget.snapshot(),
                sorted(v.scheduler.sessions))
