"""What a hub is configured with."""

from __future__ import annotations

from dataclasses import dataclass, field

from starhub.control.plane import AUTO, ControlConfig
from starhub.drafters.base import TreeShape
from starhub.options import (
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    Amount,
    Count,
    MessageBytes,
    Port,
    Positive,
    Seconds,
    Ttl,
    auto_or,
    check,
)
from starhub.server.limits import SessionLimits
from starhub.wire.codec import Limits
from starhub.wire.security import ServerSecurity


@dataclass
class HubConfig:
    bind: str = "tcp://127.0.0.1:5555"
    shape: TreeShape = field(default_factory=TreeShape)
    ttl_s: float = 120.0
    max_message_bytes: int = Limits().max_message_bytes
    adaptive: bool = False
    """``--depth auto``: each round's depth and node budget are chosen for goodput, and a
    session no tree can speed up decodes plainly; otherwise every round uses ``shape``."""
    max_targets: int | str = 0
    """Admission: 0 admits every target, N at most N, ``auto`` while every admitted target
    stays at or above its standalone speed (N_max)."""
    retry_after_s: float = 1.0
    """Told to a rejected target: when to ask again."""
    peer_grace_s: float = 5.0
    """A peer without sessions for this long gives its admission slot back."""
    log_every_s: float = 10.0
    metrics_port: int = 0
    """Serve Prometheus text on 127.0.0.1:PORT/metrics; 0 serves none."""
    threads: int = 0
    """Torch threads of the drafting thread; 0 keeps torch's setting."""
    limits: SessionLimits = field(default_factory=SessionLimits)
    """Sessions, their lengths and the tokens cached over all of them (``server.limits``)."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    batch: int | str = AUTO
    """``--batch``: sessions drafted together in one pass per tree layer; ``auto`` takes
    every waiting request (up to ``MAX_AUTO_BATCH``), 1 drafts one at a time."""
    predraft: bool = DEFAULT_PREDRAFT
    """``--predraft``: while a proposal is out and nothing waits, draft the session's next
    tree for its likeliest outcomes, so a matching COMMIT is answered at once."""
    lookup: bool = DEFAULT_LOOKUP
    """``--lookup``: graft a prompt-lookup branch onto each greedy session's tree."""
    prune: bool = DEFAULT_PRUNE
    """``--prune``: greedy trees leave out nodes worth less than the verify time they cost."""

    def __post_init__(self) -> None:
        """Every number finite and in range (``starhub.options``), or a ``ValueError`` that
        names the field: the flags and deployment files check the same bounds first."""
        self.shape.check("hub config: shape")
        for name, number in (("ttl_s", Ttl), ("max_message_bytes", MessageBytes),
                             ("retry_after_s", Seconds), ("peer_grace_s", Amount),
                             ("log_every_s", Seconds), ("metrics_port", Port),
                             ("threads", Count), ("max_targets", auto_or(Count)),
                             ("batch", auto_or(Positive))):
            check(getattr(self, name), number, f"hub config: {name}")

    def control(self, calibrated: bool = True) -> ControlConfig:
        """The control plane's settings; ``calibrated``: the drafter's path probabilities
        track acceptance (``Drafter.calibrated``), without which no tree is pruned."""
        return ControlConfig(depth=AUTO if self.adaptive else self.shape.depth,
                             topk=self.shape.topk, max_nodes=self.shape.max_nodes,
                             max_targets=self.max_targets, retry_after_s=self.retry_after_s,
                             prune=self.prune and calibrated)
