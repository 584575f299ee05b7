"""What a peer may make a server hold: sessions, their lengths, the tokens cached across
all of them, and the size and depth of the trees it sends.

Servers (the hub, the edge verifier) ask ``SessionBudget``, through their session table
(``starhub.server.sessions``), before they change anything, and tell it afterwards, so a
message past a limit is refused with a reason and changes no state. Each limit is a
command-line flag (``add_limit_args``); nothing here imports torch, so ``starhub --help``
stays fast.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, fields

from starhub.wire.messages import ErrorCode, ProtocolError


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 1024
    """Sessions open at once, over all peers."""
    max_sessions_per_peer: int = 64
    """Sessions one peer (one socket identity) may hold at once."""
    max_prompt_tokens: int = 32768
    """Tokens an OPEN may carry (the prompt plus the first token)."""
    max_session_tokens: int = 65536
    """Tokens one session may grow to, prompt included."""
    max_cache_tokens: int = 1 << 20
    """Tokens held over all sessions. Everything a server caches per session (token ids,
    features, the drafter's or target's KV cache) grows with them, so this bounds its
    memory: about 2 GB with the shipped EAGLE head in bfloat16, whose features and KV
    take ~2 kB a token (4 kB in float32)."""
    max_peers: int = 1024
    """Peers (connections that sent their card) known at once; past it the one idle the
    longest is forgotten to make room, and with none idle the card is refused."""


VERIFIER_LIMITS = SessionLimits(max_sessions=256, max_cache_tokens=1 << 18)
"""The verifier holds a full target KV cache per token (about 46 kB a token for the
embedded model in float32), so it caches fewer tokens by default."""

_HELP = {
    "max_sessions": "sessions open at once, over all peers; past it OPEN gets ERROR "
                    "(REJECTED)",
    "max_sessions_per_peer": "sessions one peer may hold at once",
    "max_peers": "peers (connections that sent their card) known at once; past it the one "
                 "idle the longest is forgotten, and with none idle the card gets REJECTED",
    "max_prompt_tokens": "the longest prompt an OPEN may carry; longer ones get ERROR "
                         "(TOO_LARGE)",
    "max_session_tokens": "the most tokens one session may grow to, prompt included",
    "max_cache_tokens": "tokens cached over all sessions; the memory held for sessions "
                        "(ids, features, KV caches) grows with them. Past it OPEN and "
                        "COMMIT get ERROR (REJECTED)",
}


def add_limit_args(p: argparse.ArgumentParser, defaults: SessionLimits = SessionLimits()
                   ) -> None:
    """One ``--max-…`` flag per field of ``SessionLimits``."""
    for f in fields(SessionLimits):
        value = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=positive_int, default=value,
                       help=f"{_HELP[f.name]} (default {value})")


def limits_from_args(args: argparse.Namespace) -> SessionLimits:
    return SessionLimits(**{f.name: getattr(args, f.name) for f in fields(SessionLimits)})


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class SessionBudget:
    """The sessions a server holds, per peer and in all, and their cached tokens.

    ``check_*`` raise ``ProtocolError`` with the reason and change nothing; ``opened``,
    ``grew`` and ``closed`` record what the server then did.
    """

    def __init__(self, limits: SessionLimits):
        self.limits = limits
        self.per_peer: Counter[bytes] = Counter()
        self.owner: dict[int, bytes] = {}
        self.tokens: dict[int, int] = {}
        self.cached = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def check_open(self, peer: bytes, tokens: int, ref: int = 0) -> None:
        lim = self.limits
        if tokens > lim.max_prompt_tokens:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a prompt of {tokens} tokens exceeds "
                                f"the limit of {lim.max_prompt_tokens} (--max-prompt-tokens)",
                                ref=ref)
        if len(self.tokens) >= lim.max_sessions:
            raise ProtocolError(ErrorCode.REJECTED, f"saturated: {len(self.tokens)} sessions "
                                f"open, the limit is {lim.max_sessions} (--max-sessions)",
                                ref=ref)
        if self.per_peer[peer] >= lim.max_sessions_per_peer:
            raise ProtocolError(ErrorCode.REJECTED, f"this peer holds {self.per_peer[peer]} "
                                f"sessions, the limit is {lim.max_sessions_per_peer} "
                                f"(--max-sessions-per-peer)", ref=ref)
        self._check_cache(tokens, 0, ref)

    def check_grow(self, tag: int, tokens: int) -> None:
        held = self.tokens.get(tag, 0)
        if held + tokens > self.limits.max_session_tokens:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"the session would hold {held + tokens} "
                                f"tokens, the limit is {self.limits.max_session_tokens} "
                                f"(--max-session-tokens)", tag=tag)
        self._check_cache(tokens, tag, 0)

    def _check_cache(self, tokens: int, tag: int, ref: int) -> None:
        if self.cached + tokens > self.limits.max_cache_tokens:
            raise ProtocolError(ErrorCode.REJECTED, f"cache full: sessions hold {self.cached} "
                                f"tokens, the limit is {self.limits.max_cache_tokens} "
                                f"(--max-cache-tokens)", tag=tag, ref=ref)

    def opened(self, tag: int, peer: bytes, tokens: int) -> None:
        self.owner[tag] = peer
        self.per_peer[peer] += 1
        self.tokens[tag] = tokens
        self.cached += tokens

    def grew(self, tag: int, tokens: int) -> None:
        if tag in self.tokens:
            self.tokens[tag] += tokens
            self.cached += tokens

    def closed(self, tag: int) -> None:
        """Forget a session; unknown tags (closed twice) are ignored."""
        if tag not in self.tokens:
            return
        self.cached -= self.tokens.pop(tag)
        peer = self.owner.pop(tag)
        self.per_peer[peer] -= 1
        if not self.per_peer[peer]:
            del self.per_peer[peer]

    def snapshot(self) -> dict:
        return {"sessions": len(self.tokens), "peers": len(self.per_peer),
                "cached_tokens": self.cached}


def check_tree(parents, max_nodes: int, max_depth: int, tag: int = 0) -> None:
    """Refuse a tree with more than ``max_nodes`` nodes or deeper than ``max_depth`` layers.

    ``parents`` must already be valid (each -1 or an earlier node), as ``Propose`` checks."""
    n = len(parents)
    if not 1 <= n <= max_nodes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"trees hold 1..{max_nodes} nodes here, got "
                            f"{n} (--max-nodes)", tag=tag)
    depth = [0] * n
    for i, p in enumerate(parents.tolist() if hasattr(parents, "tolist") else parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
        if depth[i] > max_depth:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"trees may be {max_depth} layers deep "
                                f"here, this one reaches {depth[i]} (--max-depth)", tag=tag)
