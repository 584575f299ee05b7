"""Held-out metrics of an EAGLE head, offline: teacher-forced agreement with the target,
and drafting simulated the way the hub drafts (the head on its own outputs)."""

from __future__ import annotations

import torch

from scripts.eagle_data import Dump
from starhub.drafters.eagle_head import EagleHead, KVCache


@torch.no_grad()
def evaluate(head: EagleHead, dump: Dump, depth: int = 5, widths: tuple[int, ...] = (1, 2, 4)
             ) -> dict[str, float]:
    """Held-out agreement and simulated drafting.

    top1: teacher-forced agreement of the head's argmax with the target's greedy next token.
    tau_w1: mean accepted length of a depth-``depth`` chain, counting the bonus token, with the
    head running on its own outputs after the committed prefix, as the hub drafts.
    tau_wK (K > 1): the same when each depth keeps the head's top-K tokens (a full K-ary tree;
    an upper bound for a pruned tree of that width).
    tau_wK_rounds: the same drafts met as a greedy run meets them, one round after another
    from the first answer token, each starting after the previous round's bonus token. Rounds
    start more often where the head fails, so this is lower than tau_wK and is the figure a
    real run's tau compares with.
    """
    head.eval()
    device = head.embed_weight.device
    dtype = head.embed_weight.dtype
    agree = total = covered = 0
    accepted = {w: [] for w in widths}
    rounds: dict[int, list[int]] = {w: [] for w in widths}
    per_depth = torch.zeros(depth)
    for i in range(len(dump)):
        s, n, p = dump.span(i), dump.length(i), int(dump.prompt_lens[i])
        ids = dump.ids[s].to(device)
        feats = dump.feats[s].to(device, dtype)
        cache = KVCache()
        hidden, logits = head(feats[None, :-1], ids[None, 1:], cache=cache)
        pred = head.to_target_ids(logits[0].argmax(-1))
        t = torch.arange(max(p - 2, 0), n - 2, device=device)
        agree += int((pred[t] == ids[t + 2]).sum())
        total += len(t)
        if head.t2d is not None:
            covered += int(head.t2d[ids[t + 2]].sum())
        starts = torch.arange(max(p - 1, 0), n - 1 - depth, device=device)
        if len(starts) == 0:
            continue
        base = cache.clone()
        for w in widths:
            alive = torch.ones(len(starts), dtype=torch.bool, device=device)
            length = torch.zeros(len(starts), dtype=torch.long, device=device)
            h, lg, chain = hidden[0, starts], logits[0, starts], base.clone()
            for k in range(1, depth + 1):
                truth = ids[starts + 1 + k]
                top = head.to_target_ids(lg.topk(w, dim=-1).indices)
                alive &= (top == truth[:, None]).any(-1)
                length += alive.long()
                if w == 1:
                    per_depth[k - 1] += float(alive.sum())
                if k == depth or not alive.any():
                    break
                m = len(starts)
                past = torch.arange(n - 1, device=device)[None, :] <= starts[:, None]
                own = torch.eye(m, dtype=torch.bool, device=device).repeat(1, k)
                mask = torch.cat([past, own], dim=1)[None, None]
                hn, lg = head(h[None], truth[None], position_ids=starts + k,
                              attention_mask=mask, cache=chain)
                h, lg = hn[0], lg[0]
            accepted[w].append(length.float().cpu())
            rounds[w] += _walk(length.tolist())
    out = {"top1": agree / max(total, 1), "positions": float(total)}
    n_starts = sum(len(a) for a in accepted[widths[0]])
    for w in widths:
        out[f"tau_w{w}"] = 1.0 + float(torch.cat(accepted[w]).mean()) if n_starts else 1.0
        out[f"tau_w{w}_rounds"] = sum(rounds[w]) / len(rounds[w]) if rounds[w] else 1.0
    for k in range(depth):
        out[f"accept_d{k + 1}"] = float(per_depth[k]) / max(n_starts, 1)
    if head.t2d is not None:
        out["vocab_coverage"] = covered / max(total, 1)
    return out


def _walk(accepted: list[int]) -> list[int]:
    """Tokens per round of a greedy run whose round at start ``j`` accepts ``accepted[j]``
    drafted tokens: the next round starts after that round's bonus token."""
    out, j = [], 0
    while j < len(accepted):
        out.append(accepted[j] + 1)
        j += accepted[j] + 1
    return out
