"""Batched verification: several sessions' draft trees in one forward pass of the target.

Each session keeps its own KV cache (a ``TargetModel``), so sessions come and go freely.
A batched step right-pads the caches to the longest one, lays each session's tree out as a
row of its own (its own ancestor mask, its own positions), runs the model once, then hands
each session back its cache plus its accepted path. Rows never see each other or any
padding, so each row's logits are the ones it would get alone: greedy output stays
token-identical to ``generate()``, and sampling uses the star target's acceptance rules.

Nothing here knows about sockets or roles: the edge verifier drives it, and a star target
serving several requests can use it the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from starhub.tree import DraftTree, ancestor_mask, depths
from targets.acceptance import Sampling
from targets.verify import TargetModel, Verdict


@dataclass
class BatchStats:
    """What one batched step cost: the verifier's scheduler learns its time model from it."""

    rows: int
    new_tokens: int
    """Tokens fed: each row's root plus its tree nodes."""
    cached_tokens: int
    """Cache entries the rows attend to, summed over rows."""
    cached_x_new: int
    """Sum over rows of cached length times new tokens: the attention work."""


@torch.inference_mode()
def measure_budget(model: PreTrainedModel, slack: float = 1.5, limit: int = 256) -> int:
    """The most tokens one forward pass can feed for about the price of one token (within
    ``slack``): where weight reads still dominate, rows batched together cost nearly
    nothing more. Small on a CPU (about 16 here), hundreds on a GPU."""
    vocab = model.config.vocab_size
    device = next(model.parameters()).device

    def seconds(n: int) -> float:
        ids = torch.arange(1, n + 1, device=device)[None] % vocab
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    one = seconds(1)
    best = 1
    for n in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        if n > limit or seconds(n) > slack * one:
            break
        best = n
    return best


class VerifyEngine:
    """Sessions over one loaded model, verified alone or many per forward pass."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.sessions: dict[int, TargetModel] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self, sid: int, prompt: list[int], sampling: Sampling = Sampling(),
             seed: int = 0, feature_layers: list[int] | None = None
             ) -> tuple[int, torch.Tensor | None]:
        """Prefill a new session; return its first token and the prompt's features (the
        hidden states ``feature_layers`` names, concatenated; none when empty)."""
        if sid in self.sessions:
            raise KeyError(f"session {sid} is already open")
        target = TargetModel(self.model, sampling, seed, feature_layers)
        first, feats = target.prefill(list(prompt))
        self.sessions[sid] = target
        return first, feats

    def close(self, sid: int) -> None:
        self.sessions.pop(sid, None)

    def cached(self, sid: int) -> int:
        """Entries in a session's cache once the last verify is compacted."""
        return self.sessions[sid].cached

    def cost(self, work: list[tuple[int, DraftTree]]) -> BatchStats:
        new = [len(tree) + 1 for _, tree in work]
        cached = [self.cached(sid) for sid, _ in work]
        return BatchStats(len(work), sum(new), sum(cached),
                          sum(c * n for c, n in zip(cached, new, strict=True)))

    @torch.inference_mode()
    def verify(self, work: list[tuple[int, DraftTree]]) -> list[Verdict]:
        """Verify each (session, tree) pair, all in one forward pass."""
        targets = [self.sessions[sid] for sid, _ in work]
        if len(set(map(id, targets))) != len(targets):
            raise ValueError("a session can have one tree per batch")
        if len(work) == 1:
            return [targets[0].verify(work[0][1])]
        return _verify_batch(self.model, targets, [tree for _, tree in work])


def _verify_batch(model: PreTrainedModel, targets: list[TargetModel],
                  trees: list[DraftTree]) -> list[Verdict]:
    for target in targets:
        target.compact()
    rows = len(targets)
    cached = [t.cache.get_seq_length() for t in targets]
    feeds = [[t.last, *tree.tokens.tolist()] for t, tree in zip(targets, trees, strict=True)]
    base, width = max(cached), max(map(len, feeds))
    device = targets[0].device
    ids = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, 1, width, base + width, dtype=torch.bool)
    for b, (tree, feed, length) in enumerate(zip(trees, feeds, cached, strict=True)):
        n = len(feed)
        ids[b, :n] = torch.tensor(feed)
        positions[b, :n] = length + torch.cat([torch.zeros(1, dtype=torch.long),
                                               torch.from_numpy(depths(tree.parents))])
        positions[b, n:] = length
        mask[b, 0, :n, :length] = True
        mask[b, 0, :n, base:base + n] = ancestor_mask(tree.parents)
        mask[b, 0, n:, base + n - 1] = True  # padding rows: one visible entry, finite softmax
    cache = _padded_cache(model, targets, base)
    out = model(ids.to(device), past_key_values=cache, use_cache=True,
                position_ids=positions.to(device), attention_mask=mask.to(device),
                output_hidden_states=any(t.feature_layers for t in targets))
    logits = out.logits.float().cpu()
    verdicts = []
    for b, (target, tree, length) in enumerate(zip(targets, trees, cached, strict=True)):
        n = len(tree) + 1
        path, bonus = target.accept(tree, logits[b, :n], length)
        keep = [0] + [i + 1 for i in path]
        _write_back(cache, b, target, length, base, keep)
        feats = None
        if target.feature_layers:
            first = out.hidden_states[target.feature_layers[0]].device
            feats = torch.cat([out.hidden_states[i][b, :n].to(first)
                               for i in target.feature_layers], -1)[keep]
        target.last = bonus
        verdicts.append(Verdict(path=path, tokens=[int(tree.tokens[i]) for i in path] + [bonus],
                                features=feats))
    return verdicts


def _padded_cache(model: PreTrainedModel, targets: list[TargetModel], base: int
                  ) -> DynamicCache:
    """One cache holding every row's entries at the front, zeros (masked) after them."""
    cache = DynamicCache(config=model.config)
    for layer, per_row in enumerate(zip(*(t.cache.layers for t in targets), strict=True)):
        first = per_row[0].keys
        shape = (len(targets), first.shape[1], base, first.shape[3])
        keys = first.new_zeros(shape)
        values = per_row[0].values.new_zeros(shape[:3] + per_row[0].values.shape[3:])
        for b, row in enumerate(per_row):
            length = row.keys.shape[2]
            keys[b, :, :length] = row.keys[0]
            values[b, :, :length] = row.values[0]
        cache.update(keys, values, layer)
    return cache


def _write_back(cache: DynamicCache, b: int, target: TargetModel, length: int, base: int,
                keep: list[int]) -> None:
    """The session's cache becomes its old entries plus the kept tree entries, in order."""
    index = torch.tensor([base + k for k in keep])
    for mine, batched in zip(target.cache.layers, cache.layers, strict=True):
        index = index.to(batched.keys.device)  # a device map puts layers on several GPUs
        mine.keys = torch.cat([batched.keys[b:b + 1, :, :length],
                               batched.keys[b:b + 1, :, index]], 2)
        mine.values = torch.cat([batched.values[b:b + 1, :, :length],
                                 batched.values[b:b + 1, :, index]], 2)
