"""The target model's side of a round: prefill, verify a tree in one pass, compact the cache.

Invariant: the KV cache holds every committed token except the last, which is the root of
the next tree and is fed together with it. After a verify the cache still holds the whole
tree until ``compact``, which the next step or verify calls if nobody did, so that a caller
can send its COMMIT first and compact while the hub drafts.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from starhub.models.coupling import sample_at
from starhub.models.kvcache import keep_rows
from starhub.wire.tree import DraftTree, ancestor_mask, depths
from targets.acceptance import Sampling, accept_greedy, accept_sampled, target_probs


@dataclass
class Verdict:
    path: list[int]
    """Accepted node indices, root to leaf."""
    tokens: list[int]
    """The accepted tokens followed by the bonus token."""
    features: torch.Tensor | None
    """One row per new token, for the tokens before each of them (root and accepted)."""


class TargetModel:
    """One decoding stream over a loaded causal LM."""

    def __init__(self, model: PreTrainedModel, sampling: Sampling = Sampling(), seed: int = 0,
                 feature_layers: list[int] | None = None):
        self.model = model
        self.sampling = sampling
        self.seed = seed
        """Sampled tokens are seeded draws keyed by (seed, sequence index): the output is a
        function of the seed alone, whatever the hub drafted (``starhub.models.coupling``)."""
        self.feature_layers = feature_layers or []
        self.cache = DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self.last: int | None = None
        self.step_features: torch.Tensor | None = None
        """Features of the token the last ``step`` fed, when features are wanted."""
        self._keep: tuple[int, list[int]] | None = None

    def features_of(self, out) -> torch.Tensor | None:
        if not self.feature_layers:
            return None
        states = out.hidden_states
        first = states[self.feature_layers[0]].device  # a device map puts layers apart
        return torch.cat([states[i][0].to(first) for i in self.feature_layers], -1)

    @property
    def cached(self) -> int:
        """Cache entries once the last verify is compacted (without compacting now)."""
        if self._keep is None:
            return self.cache.get_seq_length()
        return self._keep[0] + len(self._keep[1])

    @torch.inference_mode()
    def compact(self) -> None:
        """Drop the rejected tree nodes of the last verify from the cache."""
        if self._keep is not None:
            keep_rows(self.cache, *self._keep)
            self._keep = None

    def _forward(self, ids: list[int], **kwargs):
        return self.model(torch.tensor([ids], device=self.device), cache=self.cache,
                          use_cache=True, output_hidden_states=bool(self.feature_layers),
                          **kwargs)

    def next_token(self, logits: torch.Tensor, index: int) -> int:
        """The token at sequence ``index`` from the logits before it."""
        if self.sampling.greedy:
            return int(logits.argmax())
        return sample_at(target_probs(logits.float().cpu(), self.sampling), self.seed, index)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """Process the prompt; return the first generated token and the prompt's features."""
        out = self._forward(prompt, logits_to_keep=1)
        self.last = self.next_token(out.logits[0, -1], len(prompt))
        return self.last, self.features_of(out)

    def prefill_chunks(self, prompt: list[int], chunk: int
                       ) -> Generator[None, None, tuple[int, torch.Tensor | None]]:
        """``prefill``, ``chunk`` tokens a forward pass: yields between passes, so that a
        caller can run other work between them; returns what ``prefill`` returns. A caller
        that ``send``s a number sets the size of the chunks that follow."""
        if len(prompt) <= chunk:
            return self.prefill(prompt)
        feats = []
        start = 0
        while start < len(prompt):
            with torch.inference_mode():
                out = self._forward(prompt[start:start + chunk], logits_to_keep=1)
                if self.feature_layers:
                    feats.append(self.features_of(out))
            start += chunk
            if start < len(prompt):
                chunk = (yield) or chunk
        with torch.inference_mode():
            self.last = self.next_token(out.logits[0, -1], len(prompt))
        return self.last, torch.cat(feats) if feats else None

    @torch.inference_mode()
    def step(self) -> int:
        """One plain autoregressive step, for decoding without a hub."""
        self.compact()
        index = self.cache.get_seq_length() + 1
        out = self._forward([self.last])
        self.step_features = self.features_of(out)
        self.last = self.next_token(out.logits[0, -1], index)
        return self.last

    def accept(self, tree: DraftTree, logits: torch.Tensor, cached: int) -> tuple[list[int], int]:
        """The accepted path and the bonus token, from the logits of the root and nodes;
        ``cached`` entries precede the root, so the root's child is token ``cached + 1``."""
        if self.sampling.greedy:
            return accept_greedy(tree, logits)
        return accept_sampled(tree, logits, self.sampling, self.seed, cached + 1)

    @torch.inference_mode()
    def verify(self, tree: DraftTree) -> Verdict:
        self.compact()
        cached = self.cache.get_seq_length()
        n = len(tree)
        mask = torch.ones(n + 1, cached + n + 1, dtype=torch.bool)
        mask[:, cached:] = ancestor_mask(tree.parents)
        positions = cached + torch.cat([torch.zeros(1, dtype=torch.long),
                                        torch.from_numpy(depths(tree.parents))])
        out = self._forward([self.last, *tree.tokens.tolist()],
                            position_ids=positions[None].to(self.device),
                            attention_mask=mask[None, None].to(self.device))
        path, bonus = self.accept(tree, out.logits[0].float().cpu(), cached)
        keep = [0] + [i + 1 for i in path]
        self._keep = (cached, keep)
        feats = self.features_of(out)
        self.last = bonus
        return Verdict(path=path, tokens=[int(tree.tokens[i]) for i in path] + [bonus],
                       features=feats[keep] if feats is not None else None)
