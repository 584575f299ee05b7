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
    """Keep positions [0, start) plus ``start + r`` for each r in ``rows``, in that order.

    Kept rows move down in place and the rest is sliced off, as ``crop`` does, so a round
    copies only the rows that move instead of the whole cache; a chain-like accepted path
    (rows 0, 1, 2, ...) moves nothing.
    """
    end = start + len(rows)
    moved = rows != list(range(len(rows)))
    index = None
    for layer in cache.layers:
        if moved:
            if index is None:
                index = torch.tensor([start + r for r in rows], device=layer.keys.device)
            layer.keys[:, :, start:end] = layer.keys[:, :, index]
            layer.values[:, :, start:end] = layer.values[:, :, index]
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]
