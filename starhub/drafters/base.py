"""What the hub needs from a drafter, and the per-session state every drafter sees."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from starhub.options import TreeShape
from starhub.protocol import Hello
from starhub.tree import DraftTree


@dataclass
class DraftContext:
    """One session as its drafter sees it: committed ids, features, sampling settings."""

    tokens: list[int]
    temperature: float = 0.0
    generator: torch.Generator | None = None
    features: list[torch.Tensor] = field(default_factory=list)
    state: Any = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Drafter(ABC):
    name: str = ""
    feature_layers: list[int] = []
    """Hidden states a target must send: [] none, [-1] the final one, else layer indices."""
    feature_size: int = 0
    """The width of the feature rows it reads (0: any, or none read)."""

    @abstractmethod
    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        """Draft a tree after ``ctx.tokens``; may read and update ``ctx.state``."""

    def probe_context(self) -> DraftContext:
        """A throwaway session to time drafts on before any target has connected."""
        return DraftContext(tokens=list(range(1, 17)))

    def check_target(self, hello: Hello) -> str | None:
        """Why this drafter cannot serve the target that sent ``hello``, or None."""
        return None
