"""Batched verification: several sessions' draft trees in one forward pass of the target.

Each session keeps its own KV cache (a ``TargetModel``), so sessions come and go freely.
A batched step right-pads the caches to the longest one, lays each session's tree out as a
row of its own (its own ancestor mask, its own positions), runs the model once, then hands
each session back its cache plus its accepted path. Rows never see each other or any
padding, so each row's logits are the ones it would get alone: greedy output stays
token-identical to ``generate()``, and sampling uses the star target's acceptance rules.

Nothing here knows about sockets or roles: the edge verifier drives it, and so does a
serving star target (``targets.serve.batcher``) for its requests in flight.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from starhub.wire.tree import DraftTree, ancestor_mask, depths
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


LAYOUTS = ("auto", "padded", "packed")
COPY_BUDGET_BYTES = 256 << 20
"""The most KV cache one batched pass may copy into its padded or packed layout."""


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one cached token takes over every layer (keys and values)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    width = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv * head_dim * width


class VerifyEngine:
    """Sessions over one loaded model, verified alone or many per forward pass.

    ``layout`` says how a pass lays its sessions out: ``padded`` (a batch row each),
    ``packed`` (one sequence), or ``auto``, whichever wastes less work for that pass.
    A batched pass copies its sessions' caches into that layout; ``copy_budget`` bounds
    the copy in bytes: a session too long to share it is verified on its own, in place,
    and a padded layout past it is packed instead."""

    def __init__(self, model: PreTrainedModel, layout: str = "auto",
                 copy_budget: int = COPY_BUDGET_BYTES):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout '{layout}' ({', '.join(LAYOUTS)})")
        self.model = model
        self.layout = layout
        self.copy_budget = copy_budget
        self.token_bytes = kv_bytes_per_token(model)
        self.sessions: dict[int, TargetModel] = {}
        self.copied_bytes = 0
        """The largest cache copy a batched pass has made so far."""

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

    def open_chunks(self, sid: int, prompt: list[int], chunk: int,
                    sampling: Sampling = Sampling(), seed: int = 0,
                    feature_layers: list[int] | None = None
                    ) -> Generator[None, None, tuple[int, torch.Tensor | None]]:
        """``open``, ``chunk`` prompt tokens a step of the returned generator, so that a long
        prompt's prefill can alternate with other sessions' passes (``send`` a number to
        change the size of the chunks that follow). The session is not to be verified
        before the generator has returned."""
        if sid in self.sessions:
            raise KeyError(f"session {sid} is already open")
        target = TargetModel(self.model, sampling, seed, feature_layers)
        self.sessions[sid] = target
        return target.prefill_chunks(list(prompt), chunk)

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
        """Verify each (session, tree) pair: all in one forward pass, but for sessions whose
        caches the copy budget cannot hold, which get a pass each."""
        targets = [self.sessions[sid] for sid, _ in work]
        if len(set(map(id, targets))) != len(targets):
            raise ValueError("a session can have one tree per batch")
        verdicts: list[Verdict | None] = [None] * len(work)
        together, room = [], self.copy_budget // self.token_bytes
        for i in sorted(range(len(work)), key=lambda i: targets[i].cached):
            if targets[i].cached <= room:
                together.append(i)
                room -= targets[i].cached
            else:
                verdicts[i] = targets[i].verify(work[i][1])
        if len(together) == 1:
            verdicts[together[0]] = targets[together[0]].verify(work[together[0]][1])
        elif together:
            layout = self.layout
            cached = [targets[i].cached for i in together]
            if len(together) * max(cached) * self.token_bytes > self.copy_budget:
                layout = "packed"
            batch, copied = _verify_batch(self.model, [targets[i] for i in together],
                                          [work[i][1] for i in together], layout)
            self.copied_bytes = max(self.copied_bytes, copied * self.token_bytes)
            for i, verdict in zip(together, batch, strict=True):
                verdicts[i] = verdict
        return verdicts


def _verify_batch(model: PreTrainedModel, targets: list[TargetModel],
                  trees: list[DraftTree], how: str = "auto") -> tuple[list[Verdict], int]:
    """The verdicts, and how many cache entries the layout copied."""
    for target in targets:
        target.compact()
    cached = [t.cache.get_seq_length() for t in targets]
    feeds = [[t.last, *tree.tokens.tolist()] for t, tree in zip(targets, trees, strict=True)]
    pack = how == "packed" or (how == "auto" and _packing_pays(model.config, cached,
                                                               list(map(len, feeds))))
    layout = _packed if pack else _padded
    copied = sum(cached) if pack else len(targets) * max(cached)
    ids, positions, mask, cache, spans = layout(model, targets, trees, feeds, cached)
    past = cache.get_seq_length()
    device = targets[0].device
    out = model(ids.to(device), cache=cache, use_cache=True,
                position_ids=positions.to(device), attention_mask=mask.to(device),
                output_hidden_states=any(t.feature_layers for t in targets))
    logits = out.logits.float().cpu()
    verdicts = []
    for (row, start), target, tree, length in zip(spans, targets, trees, cached, strict=True):
        n = len(tree) + 1
        path, bonus = target.accept(tree, logits[row, start:start + n], length)
        keep = [0] + [i + 1 for i in path]
        _append_kept(cache, row, [past + start + k for k in keep], target)
        feats = None
        if target.feature_layers:
            first = out.hidden_states[target.feature_layers[0]].device
            feats = torch.cat([out.hidden_states[i][row, start:start + n].to(first)
                               for i in target.feature_layers], -1)[keep]
        target.last = bonus
        verdicts.append(Verdict(path=path, tokens=[int(tree.tokens[i]) for i in path] + [bonus],
                                features=feats))
    return verdicts, copied


Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache, list[tuple[int, int]]]
"""The model's inputs for one batched pass (ids, position ids, attention mask, cache), and
where each session's feed lies among the new tokens (batch row, offset)."""


def _tree_positions(tree: DraftTree, length: int) -> torch.Tensor:
    return length + torch.cat([torch.zeros(1, dtype=torch.long),
                               torch.from_numpy(depths(tree.parents))])


def _padded(model: PreTrainedModel, targets: list[TargetModel], trees: list[DraftTree],
            feeds: list[list[int]], cached: list[int]) -> Layout:
    """One batch row per session: caches right-padded to the longest, feeds to the widest."""
    rows = len(targets)
    base, width = max(cached), max(map(len, feeds))
    ids = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, 1, width, base + width, dtype=torch.bool)
    for b, (tree, feed, length) in enumerate(zip(trees, feeds, cached, strict=True)):
        n = len(feed)
        ids[b, :n] = torch.tensor(feed)
        positions[b, :n] = _tree_positions(tree, length)
        positions[b, n:] = length
        mask[b, 0, :n, :length] = True
        mask[b, 0, :n, base:base + n] = ancestor_mask(tree.parents)
        mask[b, 0, n:, base + n - 1] = True  # padding rows: one visible entry, finite softmax
    cache = DynamicCache(config=model.config)
    for layer, per_row in enumerate(zip(*(t.cache.layers for t in targets), strict=True)):
        cache.layers[layer] = RoomLayer(_stack_padded([row.keys for row in per_row], base, width),
                                        _stack_padded([row.values for row in per_row], base, width),
                                        base)
    return ids, positions, mask, cache, [(b, 0) for b in range(rows)]


def _stack_padded(parts: list[torch.Tensor], base: int, room: int) -> torch.Tensor:
    """The sessions' caches, a batch row each, right-padded with zeros to ``base`` entries,
    then ``room`` entries left for the pass's new ones."""
    first = parts[0]
    out = first.new_empty((len(parts), first.shape[1], base + room, first.shape[3]))
    for b, part in enumerate(parts):
        out[b, :, :part.shape[2]] = part[0]
        out[b, :, part.shape[2]:base] = 0  # masked, but a value times a zero weight must be 0
    return out


class RoomLayer(DynamicLayer):
    """A batched pass's cache layer: its ``length`` entries at the front of buffers with room
    for the pass's new ones, which the forward pass writes in place. ``DynamicLayer``
    would concatenate them, copying the whole batch cache once more in every layer; once
    the room is filled the keys and values are these buffers whole, the very tensors the
    concatenation would have made."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buffers = (keys, values)
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.buffers
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > keys.shape[-2]:
            raise ValueError(f"a pass fed {end - start} tokens into a cache with room "
                             f"for {keys.shape[-2] - start}")
        keys[..., start:end, :] = key_states
        values[..., start:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values


def _packed(model: PreTrainedModel, targets: list[TargetModel], trees: list[DraftTree],
            feeds: list[list[int]], cached: list[int]) -> Layout:
    """All sessions in one sequence: their caches end to end, then their feeds end to end,
    each feed seeing only its own cache and its own tree. No token is computed for padding;
    instead every token's attention scans every session's cache."""
    total, fed = sum(cached), sum(map(len, feeds))
    ids = torch.tensor([[t for feed in feeds for t in feed]])
    positions = torch.cat([_tree_positions(tree, length)
                           for tree, length in zip(trees, cached, strict=True)])[None]
    mask = torch.zeros(1, 1, fed, total + fed, dtype=torch.bool)
    spans: list[tuple[int, int]] = []
    cache_at = feed_at = 0
    for tree, feed, length in zip(trees, feeds, cached, strict=True):
        n = len(feed)
        rows = slice(feed_at, feed_at + n)
        mask[0, 0, rows, cache_at:cache_at + length] = True
        mask[0, 0, rows, total + feed_at:total + feed_at + n] = ancestor_mask(tree.parents)
        spans.append((0, feed_at))
        cache_at += length
        feed_at += n
    cache = DynamicCache(config=model.config)
    for layer, per_row in enumerate(zip(*(t.cache.layers for t in targets), strict=True)):
        cache.layers[layer] = RoomLayer(_end_to_end([row.keys for row in per_row], fed),
                                        _end_to_end([row.values for row in per_row], fed),
                                        total)
    return ids, positions, mask, cache, spans


def _end_to_end(parts: list[torch.Tensor], room: int) -> torch.Tensor:
    """The sessions' caches end to end in one row, then ``room`` entries for new ones."""
    first = parts[0]
    total = sum(part.shape[2] for part in parts)
    out = first.new_empty((1, first.shape[1], total + room, first.shape[3]))
    torch.cat(parts, 2, out=out[:, :, :total])
    return out


def _packing_pays(config, cached: list[int], fed: list[int]) -> bool:
    """Whether packing wastes less work than padding. Padding computes every linear layer
    for its pad tokens; packing lets each token score every session's cache (masked), not
    only its own. Both are counted in multiply-adds."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim \
        + 3 * hidden * config.intermediate_size
    per_token = config.num_hidden_layers * per_layer + hidden * config.vocab_size
    per_pair = config.num_hidden_layers * heads * 2 * head_dim
    pad_tokens = len(fed) * max(fed) - sum(fed)
    scanned = sum(fed) * (sum(cached) + sum(fed))
    needed = sum(n * (c + n) for c, n in zip(cached, fed, strict=True))
    return (scanned - needed) * per_pair < pad_tokens * per_token


def _append_kept(cache: DynamicCache, row: int, columns: list[int],
                 target: TargetModel) -> None:
    """The session's own cache, untouched by the pass, gains the kept tree entries in
    order: its root and accepted path."""
    index = torch.tensor(columns)
    for mine, batched in zip(target.cache.layers, cache.layers, strict=True):
        index = index.to(batched.keys.device)  # a device map puts layers on several GPUs
        mine.keys = torch.cat([mine.keys, batched.keys[row:row + 1, :, index]], 2)
        mine.values = torch.cat([mine.values, batched.values[row:row + 1, :, index]], 2)
