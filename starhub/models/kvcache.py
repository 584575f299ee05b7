"""Caches of drafted positions: the EAGLE head's own KV cache, and the edit a draft model
makes to its transformers DynamicCache (the target's caches are ``targets.kv``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Forget everything after the first ``length`` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class KVCache:
    """Keys and values of the head's single attention layer, ``[B, kv_heads, S, head_dim]``.

    Drafting appends tree entries after the committed prefix; ``crop`` drops them again and
    ``keep`` retains chosen entries (e.g. an accepted tree path) in the given order. Entries
    live in buffers that grow by doubling, so a session's rounds write in place rather than
    reallocating; tensors that need gradients (training unrolls) are concatenated instead.
    """

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None) -> None:
        self._k, self._v = k, v
        self.length = 0 if k is None else k.shape[2]

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, :self.length]

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, :self.length]

    def _autograd(self, k: Tensor) -> bool:
        return k.requires_grad or (self._k is not None and self._k.requires_grad)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        need = self.length + k.shape[2]
        if self._autograd(k):
            self._k = k if self._k is None else torch.cat([self.k, k], dim=2)
            self._v = v if self._v is None else torch.cat([self.v, v], dim=2)
        else:
            if self._k is None or need > self._k.shape[2]:
                self._grow(k, v, max(need, 64, 2 * (0 if self._k is None else self._k.shape[2])))
            self._k[:, :, self.length:need] = k
            self._v[:, :, self.length:need] = v
        self.length = need
        return self.k, self.v

    def _grow(self, k: Tensor, v: Tensor, capacity: int) -> None:
        new_k = k.new_empty(*k.shape[:2], capacity, k.shape[3])
        new_v = v.new_empty(*v.shape[:2], capacity, v.shape[3])
        if self.length:
            new_k[:, :, :self.length] = self.k
            new_v[:, :, :self.length] = self.v
        self._k, self._v = new_k, new_v

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, index: Tensor | list[int]) -> None:
        if self._k is None:
            return
        index = torch.as_tensor(index, dtype=torch.long, device=self._k.device)
        k, v = self.k[:, :, index], self.v[:, :, index]
        if self._autograd(k):
            self._k, self._v = k, v
        else:
            self._k[:, :, :len(index)] = k
            self._v[:, :, :len(index)] = v
        self.length = len(index)

    def clone(self) -> KVCache:
        return KVCache(None if self._k is None else self.k.clone(),
                       None if self._v is None else self.v.clone())


@dataclass
class Segment:
    """A run of rows in a packed head pass that belongs to one cache: its rows attend to
    that cache (after appending to it) under ``mask``, never to another segment's rows.

    ``mask`` is [rows, cache.length + rows] boolean at the time the segment is appended, or
    None for causal among the new rows with a full view of the cache. Several segments may
    share a cache: each appends in turn, and its mask hides the rows appended before it.
    """

    rows: int
    cache: KVCache
    mask: Tensor | None = None
