"""What the hub needs from a drafter, and the per-session state every drafter sees."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from starhub.drafters.growing import Score
from starhub.models.coupling import coupled_scores
from starhub.options import TreeShape
from starhub.wire.messages import TargetCard
from starhub.wire.tree import DraftTree


@dataclass
class DraftContext:
    """One session as its drafter sees it: committed ids, features, sampling settings."""

    tokens: list[int]
    temperature: float = 0.0
    generator: torch.Generator | None = None
    features: list[torch.Tensor] = field(default_factory=list)
    state: Any = None
    seed: int | None = None
    """A sampled session's seed. Its target draws token i as the Gumbel-max keyed by (seed,
    i) (``starhub.models.coupling``); ranking drafts with the same noise makes the first guesses
    the target's draws wherever drafter and target agree."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def coupled(self, vocab: int, to_target: torch.Tensor | None = None) -> Score | None:
        """The scores a tree for this session ranks by (None: plain log-probabilities, for
        greedy sessions). ``vocab`` is the target's vocabulary size; ``to_target`` maps
        the drafter's ids to the target's where they differ."""
        if self.greedy or self.seed is None:
            return None
        seed, temperature, first = self.seed, self.temperature, len(self.tokens)
        return lambda logits, layer: coupled_scores(logits, temperature, seed,
                                                    first + layer - 1, vocab, to_target)


@dataclass(frozen=True)
class TargetNeeds:
    """What a target must match for a drafter to serve it (0 or "": anything). Plain data,
    so a drafter in another process can state it once (``starhub.hub.drafting_process``)."""

    who: str = "the drafter"
    vocab_size: int = 0
    hidden_size: int = 0
    tokenizer_fp: str = ""

    def mismatch(self, card: TargetCard) -> str | None:
        if self.vocab_size and card.vocab_size != self.vocab_size:
            return (f"{self.who} drafts a {self.vocab_size}-token vocabulary, the target has "
                    f"{card.vocab_size}")
        if self.hidden_size and card.hidden_size and card.hidden_size != self.hidden_size:
            return (f"{self.who} reads {self.hidden_size}-wide features, the target's hidden "
                    f"size is {card.hidden_size}")
        if self.tokenizer_fp and card.tokenizer_fp and card.tokenizer_fp != self.tokenizer_fp:
            return f"{self.who} uses a different tokenizer than the target"
        return None


class DrafterLost(RuntimeError):
    """The drafter died or hung (one in a process of its own), and every session's drafting
    state went with it. ``Drafter.restart`` brings up a fresh one."""


class Drafter(ABC):
    name: str = ""
    feature_layers: list[int] = []
    """Hidden states a target must send: [] none, [-1] the final one, else layer indices."""
    feature_size: int = 0
    """The width of the feature rows it reads (0: any, or none read)."""
    lookup_branches: bool = True
    """Whether the hub may graft a prompt-lookup branch onto this drafter's greedy trees
    (``--lookup``): not for one that is all lookup, nor for a stand-in whose target never
    reads tokens."""
    calibrated: bool = False
    """Whether a greedy tree's path probabilities track how often its nodes are accepted,
    so that the hub may leave out the unlikely ones (``--prune``). Measured for the EAGLE
    head (``scripts/tree_calibration.py``); not so for a draft model, whose probabilities
    say nothing of a target that agrees with it everywhere (``self``) or nowhere."""
    batches: bool = False
    """Whether ``propose_batch`` shares work across sessions. A drafter that would only
    loop is given one request at a time, so no session waits for others' drafts."""
    supervised: bool = False
    """Whether it can die or hang apart from the hub (a drafting process): the hub then
    asks ``check`` while idle, and on ``DrafterLost`` ends every session and ``restart``s it."""
    weights: str = "none"
    """How its weights are held (``float32``, ``int8 linear layers``...), for the logs."""
    pid: int = 0
    """The process it drafts in, where that is not the hub's own (0: the hub's)."""

    @abstractmethod
    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        """Draft a tree after ``ctx.tokens``; may read and update ``ctx.state``."""

    def propose_batch(self, jobs: list[tuple[DraftContext, TreeShape]],
                      admit: Callable[[], list[tuple[DraftContext, TreeShape]]] | None = None,
                      finished: Callable[[int, DraftTree | Exception, float, float], None]
                      | None = None) -> list[DraftTree | Exception]:
        """Draft several sessions' trees; a failure is returned in that session's place so
        that one bad session never costs the others their round. ``admit()`` may add jobs
        while drafting, and ``finished(k, result, seconds, batch)`` hears of each job as
        soon as it is done (``batch``: the sessions drafted with it, on average).
        Drafters that can share their matrix products across sessions override this; this
        one drafts the jobs one after another."""
        out: list[DraftTree | Exception] = []
        jobs = list(jobs)
        while len(out) < len(jobs):
            ctx, shape = jobs[len(out)]
            started = time.perf_counter()
            try:
                result: DraftTree | Exception = self.propose(ctx, shape)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller per session
                result = exc
            out.append(result)
            if finished is not None:
                finished(len(out) - 1, result, time.perf_counter() - started, 1.0)
            if admit is not None:
                jobs.extend(admit())
        return out

    def predraft(self, ctx: DraftContext, tree: DraftTree, shape: TreeShape,
                 stop: Callable[[], bool]) -> dict[tuple[int, ...], DraftTree]:
        """Trees for the round after ``tree`` (the proposal in flight), keyed by the tokens
        its COMMIT would carry (accepted path, then the bonus token). ``stop()`` true means
        a real request waits: return what is done. Must leave ``ctx`` as it found it, apart
        from catching up on committed tokens. Drafters that cannot guess return {}."""
        return {}

    def probe_context(self) -> DraftContext:
        """A throwaway session to time drafts on before any target has connected."""
        return DraftContext(tokens=list(range(1, 17)))

    @property
    def predrafts(self) -> bool:
        """Whether ``predraft`` can guess at all (the base one never does)."""
        return type(self).predraft is not Drafter.predraft

    def needs(self) -> TargetNeeds:
        """What a target must match for this drafter to serve it."""
        return TargetNeeds()

    def check_target(self, card: TargetCard) -> str | None:
        """Why this drafter cannot serve the target that sent ``card``, or None."""
        return self.needs().mismatch(card)

    def wake(self) -> None:
        """``admit`` has more jobs. A drafter that waits on something other than its own
        passes (``starhub.hub.drafting_process``) looks now, not at its next timeout."""
        return None

    def check(self) -> None:
        """Raise ``DrafterLost`` if the drafter is gone. One in the hub's own process never
        is; one in a process of its own looks whether that process lives and answers."""
        return None

    def restart(self) -> None:
        """A fresh drafter in place of a lost one (``DrafterLost``); it holds no sessions."""
        raise NotImplementedError(f"the {self.name} drafter cannot be restarted")

    def close(self) -> None:
        """Let go of what outlives the hub's event loop (a drafting process)."""
        return None
