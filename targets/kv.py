"""A session's keys and values in storage of its own that passes write in place.

Each layer holds one keys and one values buffer, ``[kv_heads, capacity, head_dim]``, with
the session's ``length`` entries at the front. A forward pass writes its new entries after
them (``DecoderPass``) and attention reads the front of the buffer as it is: nothing is
concatenated, padded or copied into a batch. Compaction after a verify moves only the
accepted entries down, inside the session (``keep``). A buffer grows, by half again, only
when a pass would overflow it, so a session is copied a few times in its life, never once
a pass.
"""

from __future__ import annotations

import torch

GRAIN = 128
"""Capacities are whole multiples of this many entries."""


def _rounded(n: int) -> int:
    return -(-n // GRAIN) * GRAIN


class SessionKV:
    """One session's cache over every layer of a model (``devices`` gives each layer's)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 devices: list[torch.device], capacity: int = 0):
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.devices = devices
        self.length = 0
        """Entries held: every layer's buffers hold this many at their front."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        """Nothing until the first ``reserve`` (or a ``capacity`` given here)."""
        if capacity:
            self._allocate(_rounded(capacity))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """What the buffers take, over every layer."""
        return 2 * sum(k.nbytes for k in self.keys)

    @torch.inference_mode(False)  # plain tensors: written in place in and out of passes
    def _allocate(self, capacity: int) -> None:
        old = list(zip(self.keys, self.values, strict=True))
        self.keys, self.values = [], []
        for layer, device in enumerate(self.devices):
            shape = (self.kv_heads, capacity, self.head_dim)
            keys = torch.empty(shape, dtype=self.dtype, device=device)
            values = torch.empty(shape, dtype=self.dtype, device=device)
            if old and self.length:
                keys[:, :self.length] = old[layer][0][:, :self.length]
                values[:, :self.length] = old[layer][1][:, :self.length]
            self.keys.append(keys)
            self.values.append(values)

    def reserve(self, new: int) -> None:
        """Make room for ``new`` more entries; grows (one copy) only when they do not fit."""
        need = self.length + new
        if need > self.capacity:
            self._allocate(_rounded(max(need, self.capacity + self.capacity // 2)))

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Put a pass's ``[kv_heads, n, head_dim]`` entries after the held ones (the caller
        reserved room); return the layer's keys and values including them. ``length`` moves
        on with ``advance`` once every layer has been written."""
        end = self.length + keys.shape[1]
        self.keys[layer][:, self.length:end] = keys
        self.values[layer][:, self.length:end] = values
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, new: int) -> None:
        self.length += new

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep entries [0, start) and then ``start + r`` for each r in ``rows``, in order:
        the accepted path of a verified tree. A chain-like path (0, 1, 2, ...) moves
        nothing."""
        if rows != list(range(len(rows))):
            index = torch.tensor([start + r for r in rows])
            end = start + len(rows)
            for keys, values in zip(self.keys, self.values, strict=True):
                at = index.to(keys.device)
                keys[:, start:end] = keys[:, at]
                values[:, start:end] = values[:, at]
        self.length = start + len(rows)

    def crop(self, length: int) -> None:
        """Forget every entry after the first ``length``."""
        self.length = min(self.length, length)
