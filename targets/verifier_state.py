"""The edge verifier's settings and state: its configuration, each session and drafter as
the verifier sees it, the proposals waiting for a pass, and the counters STATS reports."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starhub.control.estimators import Ema
from starhub.options import Budget, Count, Fraction, MessageBytes, Schedule, Seed, Tree, Ttl, check
from starhub.server.limits import VERIFIER_LIMITS, SessionLimits
from starhub.server.sessions import Peer, Session
from starhub.wire.messages import DrafterCard
from starhub.wire.security import ServerSecurity
from starhub.wire.tree import DraftTree
from targets.prefill import ChunkedPrefill
from targets.schedule import Waiting


@dataclass
class VerifierConfig:
    bind: str = "tcp://127.0.0.1:5556"
    budget: int = 0
    """Tokens one forward pass feeds, over all its rows (C); 0: measured at start."""
    max_batch: int = 0
    """Rows per pass; 0 (``auto``): as many as the budget holds."""
    schedule: str = Schedule.GOODSPEED
    nodes: int = 10
    """The draft budget every session starts with, and ``fifo``'s fixed S_i."""
    max_nodes: int = 32
    """The most a schedule grants one tree; larger trees are refused."""
    max_depth: int = 16
    """Deeper trees are refused."""
    ttl_s: float = 120.0
    peer_grace_s: float = 60.0
    """A drafter without sessions for this long is forgotten; it sends its card again."""
    limits: SessionLimits = VERIFIER_LIMITS
    max_message_bytes: int = 64 << 20
    seed: int = 0
    gather_fraction: float = 0.5
    """How long, as a fraction of a pass, to wait for proposals about to arrive."""
    prefill_chunk: int = 0
    """Prompt tokens a prefill pass takes; 0: ``targets.prefill.CHUNK``."""
    security: ServerSecurity = field(default_factory=ServerSecurity)

    def __post_init__(self) -> None:
        """Every number finite and in range (``starhub.options``), or a ``ValueError`` that
        names the field: the flags and deployment files check the same bounds first."""
        for name, number in (("max_batch", Count), ("nodes", Tree),
                             ("max_nodes", Tree), ("max_depth", Tree), ("ttl_s", Ttl),
                             ("max_message_bytes", MessageBytes), ("seed", Seed),
                             ("gather_fraction", Fraction)):
            check(getattr(self, name), number, f"verifier config: {name}")
        if self.budget:  # 0: measured at start
            check(self.budget, Budget, "verifier config: budget")


@dataclass(kw_only=True)
class EdgeSession(Session):
    greedy: bool
    opened_at: float
    rounds: int = 0
    committed: int = 0
    committed_at: float = 0.0
    """When its last COMMIT left: the drafter is drafting since then."""
    turnaround: Ema = field(default_factory=lambda: Ema(alpha=0.2))
    """COMMIT out to next PROPOSE in, on average: the drafter's draft time plus the link."""


@dataclass(kw_only=True)
class DrafterPeer(Peer):
    card: DrafterCard
    """What the drafter's DRAFTER_CARD said it drafts: the feature layers it needs, its shape."""


@dataclass
class Prefill:
    """An OPEN whose prompt is being prefilled, a slice between two passes."""

    identity: bytes
    ref: int
    prompt: list[int]
    chunks: ChunkedPrefill[tuple[int, Any]]
    """``VerifyEngine.open_chunks``: a slice a step, then the first token and features."""
    target_tok_s: float


@dataclass
class Pending:
    waiting: Waiting
    tree: DraftTree
    seq: int


@dataclass
class VerifierStats:
    steps: int = 0
    rows: int = 0
    fed: int = 0
    verify_s: float = 0.0
    gather_s: float = 0.0
    """Time spent waiting for proposals about to arrive, so that they share a pass."""
    prefill_s: float = 0.0
    """Time spent prefilling the prompts of new sessions."""
    rounds: int = 0
    committed: int = 0
    accepted: int = 0
    deadlined: int = 0
    late: int = 0
    opened: int = 0
    closed: int = 0
    expired: int = 0
    started: float = field(default_factory=time.monotonic)
    batch_hist: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
