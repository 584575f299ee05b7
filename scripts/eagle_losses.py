"""What an EAGLE head trains on: (token, feature) batches from the recorded data, and the
losses of one step, optionally unrolled over the head's own outputs (EAGLE-3's
training-time test)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from scripts.eagle_data import Dump
from starhub.drafters.eagle_head import EAGLE, EagleHead, KVCache


def make_batch(dump: Dump, seq_ids: list[int], t2d_index: Tensor | None, device: str
               ) -> dict[str, Tensor]:
    """Pairs (x_{t+1}, f_t) -> targets f_{t+1} and p(x_{t+2}); loss on answer positions."""
    width = max(dump.length(i) for i in seq_ids) - 1
    b, f, k = len(seq_ids), dump.feats.shape[1], dump.top_ids.shape[1]
    ids = torch.zeros(b, width, dtype=torch.long)
    feats = torch.zeros(b, width, f, dtype=dump.feats.dtype)
    target = torch.zeros(b, width, f, dtype=dump.feats.dtype)
    top_ids = torch.zeros(b, width, k, dtype=torch.long)
    top_p = torch.zeros(b, width, k)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for row, i in enumerate(seq_ids):
        s, n, p = dump.span(i), dump.length(i), int(dump.prompt_lens[i])
        ids[row, :n - 1] = dump.ids[s][1:]
        feats[row, :n - 1] = dump.feats[s][:-1]
        target[row, :n - 1] = dump.feats[s][1:]
        top_ids[row, :n - 1] = dump.top_ids[s][1:].long()
        top_p[row, :n - 1] = dump.top_p[s][1:].float()
        mask[row, max(p - 2, 0):n - 2] = True
    if t2d_index is not None:
        top_ids = t2d_index[top_ids]
        top_p = top_p * (top_ids >= 0)
        top_ids = top_ids.clamp(min=0)
    top_p = top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-6)
    batch = dict(ids=ids, feats=feats.float(), target=target.float(), top_ids=top_ids,
                 top_p=top_p, mask=mask)
    return {name: t.to(device) for name, t in batch.items()}


def _shift(t: Tensor, k: int) -> Tensor:
    """``t[:, i + k]`` at column ``i``, zero past the end."""
    return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1) if k else t


def losses(head: EagleHead, batch: dict[str, Tensor], noise: float, unroll: int = 1,
           decay: float = 0.8) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-1 losses; with ``unroll > 1`` the head also runs on its own outputs.

    Unrolled step k for pair t feeds (x_{t+k}, h) where h is the step-(k-1) output, at
    position t+k-1, attending to the step-1 entries j <= t and its own earlier steps, exactly
    as in drafting. Step k's losses are weighted by ``decay ** (k - 1)``.
    """
    feats = batch["feats"]
    if noise > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * noise
    cache = KVCache() if unroll > 1 else None
    hidden, _ = head(feats, batch["ids"], num_logits=0, cache=cache)
    width = hidden.shape[1]
    vtotal = ptotal = hidden.new_zeros(())
    acc = hidden.new_zeros(())
    weights = 0.0
    for k in range(1, unroll + 1):
        if k > 1:
            past = torch.ones(width, width, dtype=torch.bool, device=hidden.device).tril()
            own = torch.eye(width, dtype=torch.bool, device=hidden.device).repeat(1, k - 1)
            pos = torch.arange(width, device=hidden.device) + k - 1
            hidden, _ = head(hidden, _shift(batch["ids"], k - 1), position_ids=pos,
                             attention_mask=torch.cat([past, own], 1)[None, None], cache=cache,
                             num_logits=0)
        m = _shift(batch["mask"], k - 1)
        if not m.any():
            break
        h = hidden[m]
        top_ids, top_p = _shift(batch["top_ids"], k - 1)[m], _shift(batch["top_p"], k - 1)[m]
        logp = head.logits(h).float().log_softmax(-1)
        w = decay ** (k - 1)
        if head.kind == EAGLE:
            vloss = F.smooth_l1_loss(h.float(), _shift(batch["target"], k - 1)[m],
                                     reduction="none")
            vtotal = vtotal + w * vloss.mean(-1).mean()
        ptotal = ptotal + w * -(top_p * logp.gather(-1, top_ids)).sum(-1).mean()
        weights += w
        if k == 1:
            acc = (logp.argmax(-1) == top_ids[:, 0]).float().mean()
    return vtotal / weights, ptotal / weights, acc
