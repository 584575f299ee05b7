"""Baselines measured in the benchmark's own process, on the same prompts as the star runs:
plain ``model.generate``, transformers' prompt lookup, and the hub's drafter colocated with
the target (the same round loop, no network)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from targets.acceptance import Sampling
from targets.verify import TargetModel


@dataclass
class PromptRun:
    """One prompt's decode in a baseline: ids, wall time and round accounting."""

    id: object
    output_ids: list[int]
    wall_s: float
    rounds: int
    draft_s: float = 0.0
    draft_layers: int = 0
    accept_len_hist: Counter = field(default_factory=Counter)
    accepted_at_depth: Counter = field(default_factory=Counter)


def _eos(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class ForwardCounter:
    """Counts the model's forward calls: one prefill, then one per decoding round."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.calls += 1

    def close(self) -> None:
        self.handle.remove()


@torch.inference_mode()
def hf_generate(model, prompts: list[tuple[object, list[int]]], max_new_tokens: int,
                prompt_lookup: int = 0, tick: Callable[[], None] = lambda: None
                ) -> list[PromptRun]:
    """Greedy ``model.generate``; with ``prompt_lookup`` > 0, transformers' prompt lookup."""
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    counter = ForwardCounter(model)
    runs = []
    try:
        for id_, ids in prompts:
            counter.calls = 0
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, **extra)
            wall = time.perf_counter() - start
            new = out[0, len(ids):].tolist()
            rounds = max(counter.calls - 1, 0)
            run = PromptRun(id_, new, wall, rounds)
            if not prompt_lookup:
                run.accept_len_hist[1] = rounds
            runs.append(run)
            tick()
    finally:
        counter.close()
    return runs


@torch.inference_mode()
def colocated(model, drafter: Drafter, shape: TreeShape,
              prompts: list[tuple[object, list[int]]], max_new_tokens: int,
              tick: Callable[[], None] = lambda: None) -> list[PromptRun]:
    """The hub's round loop with drafter and target in one process: draft, verify, commit."""
    eos = _eos(model)
    runs = []
    for id_, ids in prompts:
        start = time.perf_counter()
        target = TargetModel(model, Sampling(), feature_layers=drafter.feature_layers)
        first, feats = target.prefill(list(ids))
        ctx = DraftContext(tokens=[*ids, first], features=[] if feats is None else [feats])
        out = [first]
        run = PromptRun(id_, out, 0.0, 0)
        while len(out) < max_new_tokens and out[-1] not in eos:
            t0 = time.perf_counter()
            tree = drafter.propose(ctx, shape)
            run.draft_s += time.perf_counter() - t0
            run.draft_layers += max(tree.depth, 1)
            verdict = target.verify(tree)
            run.rounds += 1
            run.accept_len_hist[len(verdict.path) + 1] += 1
            for k in range(1, len(verdict.path) + 1):
                run.accepted_at_depth[k] += 1
            ctx.tokens.extend(verdict.tokens)
            if verdict.features is not None:
                ctx.features.append(verdict.features)
            for tok in verdict.tokens:
                if len(out) >= max_new_tokens:
                    break
                out.append(tok)
                if tok in eos:
                    break
        run.wall_s = time.perf_counter() - start
        runs.append(run)
        tick()
    return runs
