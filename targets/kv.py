"""Sessions' keys and values in shared storage that passes write in place.

A ``KVPool`` holds, for each size class, shelves of ``SLOTS`` sessions (one on an
accelerator): each layer's keys and each layer's values are one ``[slots, kv_heads,
capacity, head_dim]`` tensor, and a session (``SessionKV``) owns one slot of a shelf, its
``length`` entries at the front: a slot on a shelf with room of at most twice what it
needs, else on a new shelf of its size class. A forward pass writes its new entries after
them (``DecoderPass``) and attention reads the slot as it is: nothing is concatenated,
padded or copied into a batch. Sessions that share a shelf are attended to by one call
over the shelf (the slot is the batch dimension), which on two threads runs a pass of
several trees faster than one call a session (a call over one session splits its three
key-value heads unevenly between two threads).

Compaction after a verify moves only the accepted entries down, inside the slot
(``keep``). A session moves to a bigger slot, one copy, only when a pass would overflow its
own, so it is copied a few times in its life, never once a pass. A slot is zeroed when a
session takes it, so a call over the shelf never reads another session's entries or
uninitialised memory (it reads them only under a mask, past a row's own); it goes back to
its shelf when the session is dropped, and a shelf with no session is freed.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

GRAIN = 128
"""The smallest capacity; the size classes are it times 1, 1.5, 2, 3, 4, 6, 8, ..."""

SLOTS = 8
"""Sessions a shelf holds on a CPU: the most rows one attention call covers. On an
accelerator, whose memory a tensor takes whole from the start, a shelf holds one."""


def size_class(n: int) -> int:
    """The smallest capacity of at least ``n`` entries."""
    size = GRAIN
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


class Shelf:
    """Storage of up to ``slots`` sessions of one capacity, over every layer."""

    @torch.inference_mode(False)  # plain tensors: written in place in and out of passes
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 devices: list[torch.device], capacity: int):
        self.capacity = capacity
        # on a CPU, untouched pages of empty slots take no memory until a session zeroes
        # its own
        self.slots = SLOTS if all(d.type == "cpu" for d in devices) else 1
        shape = (self.slots, kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=d) for d in devices]
        self.values = [torch.empty(shape, dtype=dtype, device=d) for d in devices]
        self.free = set(range(self.slots))


class KVPool:
    """Every shelf of one model's sessions."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 devices: list[torch.device]):
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.devices = devices
        self.shelves: dict[int, list[Shelf]] = {}
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[Shelf, int]] = collections.deque()
        """Slots given back and not yet settled: a session is dropped on any thread, even
        by a garbage collection inside ``take``."""

    def new_cache(self, capacity: int = 0) -> SessionKV:
        return SessionKV(self, capacity)

    def take(self, need: int) -> tuple[Shelf, int]:
        """A free slot of at least ``need`` entries: on a shelf with room of at most twice
        that (the smallest), so that sessions of different lengths still share shelves and
        with them their passes' attention calls; else on a new shelf of ``need``'s size
        class. The lowest free slot, so that a pass's sessions tend to lie together."""
        with self._lock:
            self._settle()
            fits = [shelf for size, shelves in self.shelves.items()
                    if need <= size <= max(2 * need, size_class(need)) for shelf in shelves
                    if shelf.free]
            if fits:
                shelf = min(fits, key=lambda shelf: shelf.capacity)
            else:
                shelf = Shelf(self.kv_heads, self.head_dim, self.dtype, self.devices,
                              size_class(need))
                self.shelves.setdefault(shelf.capacity, []).append(shelf)
            slot = min(shelf.free)
            shelf.free.remove(slot)
            return shelf, slot

    def give_back(self, shelf: Shelf, slot: int) -> None:
        """Free a slot: now, unless the pool is busy (then at its next ``take``)."""
        self._returned.append((shelf, slot))
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        while self._returned:
            shelf, slot = self._returned.popleft()
            shelf.free.add(slot)
            if len(shelf.free) == shelf.slots:
                self.shelves[shelf.capacity].remove(shelf)


class SessionKV:
    """One session's cache over every layer: a slot of a ``KVPool`` shelf, once it holds
    anything. ``keys[layer]`` and ``values[layer]`` are the slot's ``[kv_heads, capacity,
    head_dim]`` storage."""

    def __init__(self, pool: KVPool, capacity: int = 0):
        self.pool = pool
        self.length = 0
        """Entries held: every layer's storage holds this many at its front."""
        self.shelf: Shelf | None = None
        self.slot = -1
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        """Nothing until the first ``reserve`` (or a ``capacity`` given here)."""
        self._release: weakref.finalize | None = None
        if capacity:
            self._move(capacity)

    @property
    def capacity(self) -> int:
        return 0 if self.shelf is None else self.shelf.capacity

    @property
    def nbytes(self) -> int:
        """What the slot takes, over every layer."""
        return 2 * sum(k.nbytes for k in self.keys)

    @torch.inference_mode(False)  # views of plain tensors, written in and out of passes
    def _move(self, need: int) -> None:
        """Into a zeroed slot of at least ``need`` entries, with the held entries; the old
        slot goes back."""
        shelf, slot = self.pool.take(need)
        keys = [k[slot] for k in shelf.keys]
        values = [v[slot] for v in shelf.values]
        for new, old in ((keys, self.keys), (values, self.values)):
            for layer, storage in enumerate(new):
                storage.zero_()
                if old and self.length:
                    storage[:, :self.length] = old[layer][:, :self.length]
        if self._release is not None:
            self._release()
        self._release = weakref.finalize(self, self.pool.give_back, shelf, slot)
        self._release.atexit = False
        self.shelf, self.slot, self.keys, self.values = shelf, slot, keys, values

    def reserve(self, new: int) -> None:
        """Make room for ``new`` more entries; moves (one copy) only when they do not fit."""
        need = self.length + new
        if need > self.capacity:
            self._move(need)

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
