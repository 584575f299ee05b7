"""A session and a peer as the hub sees them: a drafting context per tag, and the target
card each peer's TARGET_CARD carried. The table that holds them is ``starhub.server.sessions``."""

from __future__ import annotations

from dataclasses import dataclass, field

from starhub.control.plane import Choice
from starhub.drafters.base import DraftContext
from starhub.drafters.ngram import NgramIndex
from starhub.server.sessions import Peer, Session
from starhub.wire.tree import DraftTree


@dataclass(kw_only=True)
class DraftSession(Session):
    ctx: DraftContext
    prompt_len: int
    seq: int = 0
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


@dataclass(kw_only=True)
class TargetPeer(Peer):
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
