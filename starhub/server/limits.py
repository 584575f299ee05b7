"""What a peer may make a server hold: sessions, their lengths, the bytes cached across all
of them, and the size and depth of the trees it sends.

Servers (the hub, the edge verifier) ask ``SessionBudget``, through their session table
(``starhub.server.sessions``), before they change anything, and tell it afterwards, so a
message past a limit is refused with a reason and changes no state. Each limit is a
setting of the server's process (``starhub.settings.processes.Limits``); nothing here
imports torch, so ``starhub --help`` stays fast.

Budgets are kept per principal: the CURVE key a connection authenticated with, or the
connection itself where there is none, so that a second connection with the same key gets
no fresh allowance. Over all principals, sessions and cached bytes have a global cap with
fair shares (``fair_share``): a principal may always hold its share, the cap divided among
the principals holding something plus one for a newcomer, and more only while at least a
share stays free, so nobody can take the whole cache from those who come after.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from starhub.options import Positive, check
from starhub.settings.processes import Limits, VerifierSettings
from starhub.wire.messages import ErrorCode, ProtocolError

DEFAULT = Limits.default_limits()


@dataclass(frozen=True)
class SessionLimits:
    """What a server holds at most; each field's meaning, bounds and default are its setting's
    (``starhub.settings.processes.Limits``)."""

    max_sessions: int = DEFAULT["max_sessions"]
    max_sessions_per_peer: int = DEFAULT["max_sessions_per_peer"]
    max_prompt_tokens: int = DEFAULT["max_prompt_tokens"]
    max_session_tokens: int = DEFAULT["max_session_tokens"]
    max_cache_mb: int = DEFAULT["max_cache_mb"]
    max_peers: int = DEFAULT["max_peers"]

    def __post_init__(self) -> None:
        for f in fields(self):
            check(getattr(self, f.name), Positive, f"{f.name} (--{f.name.replace('_', '-')})")


VERIFIER_LIMITS = SessionLimits(**VerifierSettings.default_limits())
"""The verifier holds a full target KV cache per token (``VerifierSettings.max_cache_mb``)."""

def fair_share(held: int, want: int, total: int, cap: int, holders: int) -> str | None:
    """Whether a principal holding ``held`` of ``total`` (over ``holders`` principals, itself
    counted) may take ``want`` more of ``cap``: None, or what stops it ("full": the cap;
    "share": past its fair share while less than a share would stay free)."""
    if total + want > cap:
        return "full"
    share = cap // (holders + 1)
    if held + want <= share or cap - (total + want) >= share:
        return None
    return "share"


class SessionBudget:
    """The sessions a server holds, per principal and in all, and the tokens and bytes they
    cache.

    ``check_*`` raise ``ProtocolError`` with the reason and change nothing; ``opened``,
    ``grew`` and ``closed`` record what the server then did.
    """

    def __init__(self, limits: SessionLimits):
        self.limits = limits
        self.cap = limits.max_cache_mb << 20
        self.per_peer: Counter[bytes] = Counter()
        """Sessions per principal."""
        self.bytes_of: Counter[bytes] = Counter()
        """Bytes per principal."""
        self.owner: dict[int, bytes] = {}
        """Each session's principal."""
        self.tokens: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.cached = 0
        """Tokens over all sessions."""
        self.held = 0
        """Bytes over all sessions."""

    def __len__(self) -> int:
        return len(self.tokens)

    def check_open(self, principal: bytes, tokens: int, nbytes: int, ref: int = 0) -> None:
        lim = self.limits
        if tokens > lim.max_prompt_tokens:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"a prompt of {tokens} tokens exceeds "
                                f"the limit of {lim.max_prompt_tokens} (--max-prompt-tokens)",
                                ref=ref)
        if self.per_peer[principal] >= lim.max_sessions_per_peer:
            raise ProtocolError(ErrorCode.REJECTED, f"this peer holds "
                                f"{self.per_peer[principal]} sessions, the limit is "
                                f"{lim.max_sessions_per_peer} (--max-sessions-per-peer)",
                                ref=ref)
        held = self.per_peer[principal]
        why = fair_share(held, 1, len(self.tokens), lim.max_sessions,
                         len(self.per_peer) + (principal not in self.per_peer))
        if why == "full":
            raise ProtocolError(ErrorCode.REJECTED, f"saturated: {len(self.tokens)} sessions "
                                f"open, the limit is {lim.max_sessions} (--max-sessions)",
                                ref=ref)
        if why == "share":
            raise ProtocolError(ErrorCode.REJECTED, f"this peer holds {held} of the "
                                f"{len(self.tokens)} sessions open, past its fair share of "
                                f"the {lim.max_sessions} (--max-sessions)", ref=ref)
        self._check_bytes(principal, nbytes, 0, ref)

    def check_grow(self, tag: int, tokens: int, nbytes: int) -> None:
        held = self.tokens.get(tag, 0)
        if held + tokens > self.limits.max_session_tokens:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"the session would hold {held + tokens} "
                                f"tokens, the limit is {self.limits.max_session_tokens} "
                                f"(--max-session-tokens)", tag=tag)
        if tag in self.owner:
            self._check_bytes(self.owner[tag], nbytes, tag, 0)

    def _check_bytes(self, principal: bytes, nbytes: int, tag: int, ref: int) -> None:
        held = self.bytes_of[principal]
        why = fair_share(held, nbytes, self.held, self.cap,
                         len(self.bytes_of) + (principal not in self.bytes_of))
        if why == "full":
            raise ProtocolError(ErrorCode.REJECTED, f"cache full: sessions hold "
                                f"{_mib(self.held)}, {_mib(nbytes)} more would pass the limit "
                                f"of {self.limits.max_cache_mb} MiB (--max-cache-mb)",
                                tag=tag, ref=ref)
        if why == "share":
            raise ProtocolError(ErrorCode.REJECTED, f"this peer holds {_mib(held)} of the "
                                f"{_mib(self.held)} cached, past its fair share of the "
                                f"{self.limits.max_cache_mb} MiB (--max-cache-mb)",
                                tag=tag, ref=ref)

    def opened(self, tag: int, principal: bytes, tokens: int, nbytes: int) -> None:
        self.owner[tag] = principal
        self.per_peer[principal] += 1
        self.tokens[tag] = tokens
        self.bytes[tag] = nbytes
        self.bytes_of[principal] += nbytes
        self.cached += tokens
        self.held += nbytes

    def grew(self, tag: int, tokens: int, nbytes: int) -> None:
        if tag in self.tokens:
            self.tokens[tag] += tokens
            self.bytes[tag] += nbytes
            self.bytes_of[self.owner[tag]] += nbytes
            self.cached += tokens
            self.held += nbytes

    def closed(self, tag: int) -> None:
        """Forget a session; unknown tags (closed twice) are ignored."""
        if tag not in self.tokens:
            return
        self.cached -= self.tokens.pop(tag)
        nbytes = self.bytes.pop(tag)
        self.held -= nbytes
        principal = self.owner.pop(tag)
        self.per_peer[principal] -= 1
        self.bytes_of[principal] -= nbytes
        if not self.per_peer[principal]:
            del self.per_peer[principal]
            del self.bytes_of[principal]

    def snapshot(self) -> dict:
        return {"sessions": len(self.tokens), "peers": len(self.per_peer),
                "cached_tokens": self.cached, "cached_bytes": self.held}


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def check_tree(parents, max_nodes: int, max_depth: int, tag: int = 0) -> None:
    """Refuse a tree with more than ``max_nodes`` nodes or deeper than ``max_depth`` layers.
    An empty tree is a drafter with no guess (a lookup that found nothing): its round
    commits the target's next token alone.

    ``parents`` must already be valid (each -1 or an earlier node), as ``Propose`` checks."""
    n = len(parents)
    if n > max_nodes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"trees hold at most {max_nodes} nodes here, "
                            f"got {n} (--max-nodes)", tag=tag)
    depth = [0] * n
    for i, p in enumerate(parents.tolist() if hasattr(parents, "tolist") else parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
        if depth[i] > max_depth:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"trees may be {max_depth} layers deep "
                                f"here, this one reaches {depth[i]} (--max-depth)", tag=tag)
