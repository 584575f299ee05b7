"""An independent causal LM as drafter: the target's own weights, a truncation, or any LM
with the target's tokenizer. Each session keeps a KV cache of its committed tokens; tree
expansion appends to it under a tree mask and is cropped away after the round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from starhub.drafters.base import DraftContext, Drafter, TargetNeeds, TreeShape
from starhub.drafters.growing import TreeFeed, build_greedy_tree, build_sampled_tree
from starhub.models.devices import model_device
from starhub.models.kvcache import crop_to
from starhub.models.loading import tokenizer_fingerprint
from starhub.wire.tree import DraftTree


@dataclass
class _Cache:
    kv: DynamicCache
    cached: int = 0


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: PreTrainedModel, tokenizer=None, label: str = "model"):
        self.model = model
        self.label = label
        self.weights = str(model.dtype).removeprefix("torch.")
        self.vocab_size = model.config.vocab_size
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""

    def needs(self) -> TargetNeeds:
        return TargetNeeds(f"draft model '{self.label}'", self.vocab_size,
                           tokenizer_fp=self.fingerprint)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        if ctx.state is None:
            ctx.state = _Cache(DynamicCache(config=self.model.config))
        state: _Cache = ctx.state
        if state.cached >= len(ctx.tokens):
            crop_to(state.kv, len(ctx.tokens) - 1)
            state.cached = len(ctx.tokens) - 1
        base = len(ctx.tokens)
        pending = torch.tensor([ctx.tokens[state.cached:]], device=model_device(self.model))
        root_logits = self.model(pending, cache=state.kv, use_cache=True).logits[0, -1]
        state.cached = base
        expand = _TreeExpansion(self.model, state.kv, base)
        score = ctx.coupled(self.vocab_size)
        if ctx.greedy or score is not None:
            tree = build_greedy_tree(root_logits, expand, shape.depth, shape.topk,
                                     shape.max_nodes, score, shape.floor)
        else:
            tree = build_sampled_tree(root_logits, expand, shape.depth, shape.topk,
                                      shape.max_nodes, ctx.temperature, shape.support,
                                      ctx.generator)
        crop_to(state.kv, base)
        return tree


class _TreeExpansion:
    """Feeds frontier nodes into the cache after the committed prefix, under a tree mask."""

    def __init__(self, model: PreTrainedModel, kv: DynamicCache, base: int):
        self.model, self.kv = model, kv
        self.feed = TreeFeed(base)

    def __call__(self, ids: Sequence[int], tokens: Sequence[int],
                 parents: Sequence[int]) -> torch.Tensor:
        mask, positions = self.feed.layout(ids, parents, self.kv.get_seq_length())
        device = model_device(self.model)
        out = self.model(torch.tensor([list(tokens)], device=device),
                         position_ids=positions[None].to(device),
                         attention_mask=mask[None, None].to(device),
                         cache=self.kv, use_cache=True)
        return out.logits[0]
