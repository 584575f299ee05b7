"""The session table both servers keep: peers that introduced themselves, sessions indexed by
tag, each tag bound to the peer that opened it, silence past a TTL, and the budget of what
the sessions hold (``starhub.server.limits``).

What a session or a peer means to a server (a drafting context on the hub, a verification
row on the edge verifier) lives in its own subclass of ``Session`` and ``Peer``; this table
only allocates, owns, counts and expires.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from starhub.server.limits import SessionBudget, SessionLimits, fair_share
from starhub.wire.messages import ErrorCode, Message, ProtocolError


@dataclass(kw_only=True)
class Session:
    tag: int
    owner: bytes
    """The peer that opened it: nobody else may use the tag."""
    last_seen: float = field(default_factory=time.monotonic)
    busy: bool = False
    """Work in flight for it: it does not expire meanwhile."""


@dataclass(kw_only=True)
class Peer:
    identity: bytes
    """The connection: where replies go."""
    principal: bytes = b""
    """Whom its budgets count against: its CURVE key, or (empty) the connection itself
    (``starhub.server.loop.principal_of``)."""
    sessions: set[int] = field(default_factory=set)
    idle_since: float | None = field(default_factory=time.monotonic)
    """Since when the peer holds no session; its admission slot frees after a grace."""


S = TypeVar("S", bound=Session)
P = TypeVar("P", bound=Peer)


class SessionTable(Generic[S, P]):
    """Sessions and peers; ``budget`` refuses what would hold more than ``limits`` allow."""

    def __init__(self, ttl_s: float, limits: SessionLimits):
        self.ttl_s = ttl_s
        self.sessions: dict[int, S] = {}
        self.peers: dict[bytes, P] = {}
        self.budget = SessionBudget(limits)

    def __len__(self) -> int:
        return len(self.sessions)

    def __iter__(self) -> Iterator[S]:
        return iter(self.sessions.values())

    # -- peers ------------------------------------------------------------------------
    def join(self, peer: P) -> None:
        """Add (or refresh) a peer, keeping the sessions it already holds."""
        peer.principal = peer.principal or peer.identity
        known = self.peers.get(peer.identity)
        if known is not None:
            peer.sessions, peer.idle_since = known.sessions, known.idle_since
        self.peers[peer.identity] = peer

    def peer(self, identity: bytes, msg: Message, greeting: str) -> P:
        """The peer that sent ``msg``; one that never said ``greeting`` is an error."""
        peer = self.peers.get(identity)
        if peer is None:
            raise ProtocolError(ErrorCode.NO_CARD, f"send {greeting} before {msg.TYPE}",
                                tag=msg.tag, ref=getattr(msg, "ref", 0))
        return peer

    def idle_peers(self, grace_s: float, now: float | None = None) -> list[bytes]:
        """Peers that have held no session for ``grace_s``: their slots can be freed."""
        now = time.monotonic() if now is None else now
        return [i for i, p in self.peers.items()
                if p.idle_since is not None and now - p.idle_since > grace_s]

    def drop_idle(self, grace_s: float, now: float | None = None) -> list[P]:
        """Forget the peers that have held no session for ``grace_s``; they send their
        card again when they come back."""
        return [self.peers.pop(i) for i in self.idle_peers(grace_s, now)]

    def make_room(self, identity: bytes, principal: bytes = b"", ref: int = 0) -> list[P]:
        """Before ``join``: a new peer past ``max_peers`` first pushes out the one idle the
        longest (returned, forgotten); with every peer holding sessions it is refused, and
        so is a principal (a CURVE key) past its fair share of the table."""
        limit = self.budget.limits.max_peers
        if identity in self.peers:
            return []
        principal = principal or identity
        mine = sum(p.principal == principal for p in self.peers.values())
        holders = len({p.principal for p in self.peers.values()} | {principal})
        if fair_share(mine, 1, len(self.peers), limit, holders) == "share":
            raise ProtocolError(ErrorCode.REJECTED, f"this key holds {mine} of the "
                                f"{len(self.peers)} peers known, past its fair share of the "
                                f"{limit} (--max-peers)", ref=ref)
        if len(self.peers) < limit:
            return []
        idle = [p for p in self.peers.values() if p.idle_since is not None]
        if not idle:
            raise ProtocolError(ErrorCode.REJECTED, f"saturated: {len(self.peers)} peers hold "
                                f"sessions, the limit is {limit} (--max-peers)", ref=ref)
        oldest = min(idle, key=lambda p: p.idle_since)
        return [self.peers.pop(oldest.identity)]

    # -- sessions ---------------------------------------------------------------------
    def principal(self, identity: bytes) -> bytes:
        """Whom a peer's budgets count against (``Peer.principal``)."""
        peer = self.peers.get(identity)
        return peer.principal if peer is not None else identity

    def check_open(self, identity: bytes, tokens: int, nbytes: int, ref: int = 0) -> None:
        """Refuse, changing nothing, an OPEN of ``tokens`` taking ``nbytes`` that the budget
        cannot hold."""
        self.budget.check_open(self.principal(identity), tokens, nbytes, ref)

    def new_tag(self) -> int:
        """A fresh random tag: 62 bits, never 0, none in use."""
        tag = secrets.randbits(62) or 1
        while tag in self.sessions:
            tag = secrets.randbits(62) or 1
        return tag

    def add(self, session: S, tokens: int, nbytes: int) -> S:
        """Hold ``session`` (made with ``new_tag``), counting ``tokens`` and ``nbytes``
        against the budget."""
        self.sessions[session.tag] = session
        self.budget.opened(session.tag, self.principal(session.owner), tokens, nbytes)
        peer = self.peers.get(session.owner)
        if peer is not None:
            peer.sessions.add(session.tag)
            peer.idle_since = None
        return session

    def get(self, tag: int, owner: bytes, ref: int = 0) -> S:
        """The session for ``tag``; a tag used by anyone but its owner is an error."""
        session = self.sessions.get(tag)
        if session is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TAG, f"no open session with tag {tag} "
                                f"(closed or expired)", tag=tag, ref=ref)
        if session.owner != owner:
            raise ProtocolError(ErrorCode.NOT_OWNER, f"tag {tag} belongs to another peer",
                                tag=tag, ref=ref)
        return session

    def use(self, tag: int, owner: bytes, ref: int = 0) -> S:
        """``get``, and the session's TTL starts again."""
        session = self.get(tag, owner, ref)
        session.last_seen = time.monotonic()
        return session

    def check_grow(self, tag: int, tokens: int, nbytes: int) -> None:
        """Refuse, changing nothing, ``tokens`` (``nbytes``) more for a session past its
        budget."""
        self.budget.check_grow(tag, tokens, nbytes)

    def grew(self, tag: int, tokens: int, nbytes: int) -> None:
        self.budget.grew(tag, tokens, nbytes)

    def close(self, tag: int) -> S | None:
        """Forget a session (None if it was not held: closed twice is fine)."""
        session = self.sessions.pop(tag, None)
        self.budget.closed(tag)
        peer = self.peers.get(session.owner) if session is not None else None
        if peer is not None:
            peer.sessions.discard(tag)
            if not peer.sessions:
                peer.idle_since = time.monotonic()
        return session

    def expired(self, now: float | None = None) -> list[int]:
        """Sessions silent past the TTL with nothing in flight."""
        now = time.monotonic() if now is None else now
        return [t for t, s in self.sessions.items()
                if not s.busy and now - s.last_seen > self.ttl_s]


def check_ids(ids, vocab_size: int, msg: Message) -> None:
    """Refuse token ids (an array) outside ``[0, vocab_size)``."""
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"{msg.TYPE}: token ids must lie in [0, {vocab_size})",
                            tag=msg.tag, ref=getattr(msg, "ref", 0))
