"""Per-session state on the hub, indexed by tag, each tag bound to the peer that opened it."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from starhub.control.plane import Choice
from starhub.drafters.base import DraftContext
from starhub.drafters.ngram import NgramIndex
from starhub.wire.messages import ErrorCode, Open, ProtocolError
from starhub.wire.tree import DraftTree


@dataclass
class Session:
    tag: int
    owner: bytes
    ctx: DraftContext
    prompt_len: int
    last_seen: float = field(default_factory=time.monotonic)
    seq: int = 0
    busy: bool = False
    choice: Choice = Choice()
    """The controller's plan for the round in flight."""
    proposed_at: float | None = None
    out_tree: DraftTree | None = None
    """The tree in flight (None after a plain round): its COMMIT may not accept more
    nodes than it has, and pre-drafting guesses from it."""
    grafted: int = 0
    """Nodes of ``out_tree`` from this index on were grafted by ``--lookup`` (0: none)."""
    lookup: NgramIndex | None = None
    """``--lookup``'s index of this session's tokens, built on its first tree."""
    predraft_for: int = -1
    """The round (seq) whose outcomes were last pre-drafted."""
    predrafts: dict[tuple[int, ...], DraftTree] = field(default_factory=dict)
    """Next trees by the tokens that round's COMMIT may carry."""

    @property
    def last_tree_size(self) -> int:
        return len(self.out_tree) if self.out_tree is not None else 0

    @property
    def last_tree_depth(self) -> int:
        return self.out_tree.depth if self.out_tree is not None else 0


@dataclass
class Peer:
    identity: bytes
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    sessions: set[int] = field(default_factory=set)
    idle_since: float | None = field(default_factory=time.monotonic)
    """Since when the peer holds no session; its admission slot frees after a grace."""


class SessionTable:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.sessions: dict[int, Session] = {}
        self.peers: dict[bytes, Peer] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self, owner: bytes, msg: Open, features: list) -> Session:
        tag = secrets.randbits(62) or 1
        while tag in self.sessions:
            tag = secrets.randbits(62) or 1
        ctx = DraftContext(tokens=msg.tokens.tolist(), temperature=msg.temperature,
                           features=features, seed=msg.seed)
        session = Session(tag=tag, owner=owner, ctx=ctx, prompt_len=msg.prompt_len)
        self.sessions[tag] = session
        if owner in self.peers:
            self.peers[owner].sessions.add(tag)
            self.peers[owner].idle_since = None
        return session

    def get(self, tag: int, owner: bytes, ref: int = 0) -> Session:
        """The session for ``tag``; a tag used by anyone but its owner is an error."""
        session = self.sessions.get(tag)
        if session is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TAG, f"no open session with tag {tag}",
                                tag=tag, ref=ref)
        if session.owner != owner:
            raise ProtocolError(ErrorCode.NOT_OWNER, f"tag {tag} belongs to another peer",
                                tag=tag, ref=ref)
        session.last_seen = time.monotonic()
        return session

    def close(self, tag: int) -> Session | None:
        session = self.sessions.pop(tag, None)
        peer = self.peers.get(session.owner) if session is not None else None
        if peer is not None:
            peer.sessions.discard(tag)
            if not peer.sessions:
                peer.idle_since = time.monotonic()
        return session

    def idle_peers(self, grace_s: float, now: float | None = None) -> list[bytes]:
        """Peers that have held no session for ``grace_s``: their slots can be freed."""
        now = time.monotonic() if now is None else now
        return [i for i, p in self.peers.items()
                if p.idle_since is not None and now - p.idle_since > grace_s]

    def expired(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        return [t for t, s in self.sessions.items()
                if not s.busy and now - s.last_seen > self.ttl_s]
