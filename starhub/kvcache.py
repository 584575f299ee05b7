"""The two edits speculative decoding makes to a transformers DynamicCache."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Forget everything after the first ``length`` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Keep positions [0, start) plus ``start + r`` for each r in ``rows``, in that order."""
    for layer in cache.layers:
        index = torch.tensor([start + r for r in rows], device=layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, index]], 2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, index]], 2)
