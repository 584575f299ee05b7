"""EAGLE drafter: a one-layer head over the target's own features.

Pair i of a session is (token i+1, feature i). The head's cache covers committed pairs only;
tree nodes are fed as (node token, parent's head output) under a tree mask and cropped away
after the round, so each round costs one pass over the new pairs plus one per tree layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig

from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.eagle_head import EagleHead, KVCache, load_eagle_head
from starhub.models import onednn_packs, prepack_linears, resolve
from starhub.protocol import Hello
from starhub.tree import DraftTree, TreeFeed, build_greedy_tree, build_sampled_tree

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"
DEFAULT_HEAD = SHIPPED_HEADS / "smollm2-135m"


@dataclass
class _HeadState:
    cache: KVCache = field(default_factory=KVCache)
    features: torch.Tensor | None = None
    pairs: int = 0
    """Committed pairs already in ``cache``."""


def target_embeddings(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head, read from its safetensors without loading
    the rest of the model."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to take embeddings from")
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as fh:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in fh.keys():
                    found[key] = fh.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise KeyError(f"{model_dir}: no model.embed_tokens.weight in its safetensors")
    embed = found["model.embed_tokens.weight"].float()
    return embed, found.get("lm_head.weight", embed).float()


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, head: EagleHead, label: str = "eagle"):
        self.head = head
        self.label = label
        self.feature_layers = list(head.feature_layers)
        self.feature_size = head.feature_size
        weight = next(head.parameters())
        self.dtype = weight.dtype
        if onednn_packs(weight.dtype, weight.device.type):
            prepack_linears(head)

    @classmethod
    def load(cls, head_dir: str | Path | None, model: str = "default",
             dtype: torch.dtype = torch.float32) -> EagleDrafter:
        if head_dir is None and model != "default":
            raise ValueError(f"the shipped EAGLE head drafts for the embedded default model, not "
                             f"'{model}': pass --draft HEAD_DIR (see `starhub train-eagle`) or "
                             f"use --drafter ngram")
        head_dir = Path(head_dir) if head_dir else DEFAULT_HEAD
        if not (head_dir / "config.json").exists():
            raise FileNotFoundError(f"no EAGLE head at {head_dir} (config.json missing)")
        model_dir = resolve(model)
        embed, lm_head = target_embeddings(model_dir)
        head = load_eagle_head(head_dir, AutoConfig.from_pretrained(model_dir), embed, lm_head,
                               dtype=dtype)
        return cls(head, label=str(head_dir))

    def probe_context(self) -> DraftContext:
        ctx = super().probe_context()
        ctx.features = [torch.zeros(len(ctx.tokens) - 1, self.head.feature_size)]
        return ctx

    def check_target(self, hello: Hello) -> str | None:
        if hello.vocab_size != self.head.vocab_size:
            return (f"EAGLE head '{self.label}' drafts a {self.head.vocab_size}-token vocabulary,"
                    f" the target has {hello.vocab_size}")
        expected = self.head.target_hidden_size
        if hello.hidden_size and hello.hidden_size != expected:
            return (f"EAGLE head '{self.label}' reads {expected}-wide features, the target's "
                    f"hidden size is {hello.hidden_size}")
        return None

    def _to_target_ids(self, tree: DraftTree) -> DraftTree:
        """Trees grow over the draft vocabulary (cheaper top-k and softmax when it is
        reduced) and travel in target ids."""
        if self.head.d2t is None:
            return tree
        d2t = self.head.d2t.numpy()
        tree.tokens = (tree.tokens + d2t[tree.tokens]).astype(np.int32)
        if tree.dist_ids is not None:
            tree.dist_ids = (tree.dist_ids + d2t[tree.dist_ids]).astype(np.int32)
        return tree

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        if ctx.state is None:
            ctx.state = _HeadState()
        state: _HeadState = ctx.state
        if ctx.features:
            new = torch.cat([f.to(self.dtype) for f in ctx.features])
            state.features = new if state.features is None else torch.cat([state.features, new])
            ctx.features.clear()
        total = 0 if state.features is None else state.features.shape[0]
        if total != len(ctx.tokens) - 1:
            raise ValueError(f"session has {len(ctx.tokens)} tokens but {total} feature rows")
        if state.pairs >= total:
            state.cache.crop(total - 1)
            state.pairs = total - 1
        feats = state.features[state.pairs:total][None]
        ids = torch.tensor([ctx.tokens[state.pairs + 1: total + 1]])
        hidden, logits = self.head(feats, ids, position_ids=torch.arange(state.pairs, total),
                                   cache=state.cache, num_logits=1)
        state.pairs = total
        expand = _HeadExpansion(self, state.cache, hidden[0, -1], total)
        root = logits[0, -1]
        if ctx.greedy:
            tree = build_greedy_tree(root, expand, shape.depth, shape.topk, shape.max_nodes)
        else:
            tree = build_sampled_tree(root, expand, shape.depth, shape.topk, shape.max_nodes,
                                      ctx.temperature, shape.support, ctx.generator)
        state.cache.crop(total)
        return self._to_target_ids(tree)


class _HeadExpansion:
    """Feeds frontier nodes as (draft-vocabulary token, parent's head output) after the
    committed pairs."""

    def __init__(self, drafter: EagleDrafter, cache: KVCache, root_hidden: torch.Tensor,
                 base: int):
        self.drafter, self.cache = drafter, cache
        self.feed = TreeFeed(base)
        self.hidden: dict[int, torch.Tensor] = {-1: root_hidden}

    def __call__(self, ids: Sequence[int], tokens: Sequence[int],
                 parents: Sequence[int]) -> torch.Tensor:
        mask, positions = self.feed.layout(ids, parents, self.cache.length)
        feats = torch.stack([self.hidden[p] for p in parents])[None]
        target_ids = self.drafter.head.to_target_ids(torch.tensor([list(tokens)]))
        hidden, logits = self.drafter.head(feats, target_ids,
                                           position_ids=positions,
                                           attention_mask=mask[None, None], cache=self.cache)
        for row, node in enumerate(ids):
            self.hidden[node] = hidden[0, row]
        return logits[0]
