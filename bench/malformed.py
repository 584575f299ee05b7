"""Malformed messages for soak-testing a hub, drawn from a seeded RNG (no test framework).

Every message this yields is one a hub must refuse with exactly one ERROR: broken framing,
wrong types, bad versions and types, lying array specs, rule-breaking trees, NaN features,
ids past the vocabulary, unknown or stale tags, prompts and messages past the hub's limits.
The suite's property-based tests (``tests/fuzz_strategies.py``) cover the same ground with
shrinking; this generator is for volume.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from starhub.wire.codec import encode
from starhub.wire.messages import (
    MESSAGE_TYPES,
    VERSION,
    Close,
    Commit,
    DrafterCard,
    Open,
    Ping,
    Pong,
    Propose,
    TargetCard,
)

Frames = list[bytes]


@dataclass
class Target:
    """What a blasting peer knows: the hub's vocabulary and limits, and its own session."""

    vocab: int
    max_prompt_tokens: int
    max_message_bytes: int
    feature_width: int = 0
    tag: int = 0
    seq: int = 0


def frames_of(msg) -> Frames:
    return [bytes(f) for f in encode(msg)]


class Malformed:
    """``next()`` returns (kind, frames). Kinds are drawn uniformly, except oversized
    messages, which are rare (``huge_share``) because each is a megabyte on the wire."""

    def __init__(self, seed: int, target: Target, huge_share: float = 0.002):
        self.rng = random.Random(seed)
        self.t = target
        self.huge_share = huge_share
        self.kinds: dict[str, Callable[[], Frames]] = {
            "random_bytes": self.random_bytes, "truncated": self.truncated,
            "wrong_type": self.wrong_type, "bad_version": self.bad_version,
            "unknown_type": self.unknown_type, "huge_shape": self.huge_shape,
            "bad_tree": self.bad_tree, "nan_features": self.nan_features,
            "bad_ids": self.bad_ids, "bad_open": self.bad_open,
            "unknown_tag": self.unknown_tag, "stale_commit": self.stale_commit,
            "bad_commit": self.bad_commit, "not_for_hubs": self.not_for_hubs,
            "long_prompt": self.long_prompt,
        }
        self.names = list(self.kinds)

    def next(self) -> tuple[str, Frames]:
        if self.rng.random() < self.huge_share:
            return "too_large", self.too_large()
        kind = self.rng.choice(self.names)
        return kind, self.kinds[kind]()

    # -- framing ---------------------------------------------------------------------
    def random_bytes(self) -> Frames:
        r = self.rng
        return [r.randbytes(r.randint(0, 300)) for _ in range(r.randint(1, 3))]

    def _valid(self) -> Frames:
        r = self.rng
        n = r.randint(2, 30)
        return frames_of(r.choice([
            Ping(nonce=r.getrandbits(32)),
            TargetCard(name="x" * r.randint(0, 20), vocab_size=self.t.vocab),
            Open(ref=1, prompt_len=n - 1, tokens=self._ids(n)),
            Commit(tag=r.getrandbits(62), accepted=0, tokens=self._ids(1)),
        ]))

    def truncated(self) -> Frames:
        frames = self._valid()
        i = self.rng.randrange(len(frames))
        if frames[i]:
            frames[i] = frames[i][:self.rng.randrange(len(frames[i]))]
        else:
            frames.append(b"\x00" * self.rng.randint(1, 8))
        if not frames[0] and len(frames) == 1:
            frames[0] = b"\xc1"
        return frames

    def _header(self) -> tuple[dict, Frames]:
        frames = self._valid()
        return msgpack.unpackb(frames[0]), frames[1:]

    def _pack(self, header: dict, rest: Frames) -> Frames:
        return [msgpack.packb(header, use_bin_type=True), *rest]

    def wrong_type(self) -> Frames:
        header, rest = self._header()
        arrays = {name for name, _ in MESSAGE_TYPES[header["type"]].ARRAYS}
        field = self.rng.choice([k for k in header if k not in ("v", "type", *arrays)])
        junk = [None, "seven", [1, 2], {"a": 1}, 1.5, True, b"\x01"]
        if isinstance(header[field], bool):
            junk = [None, "x", [1], {"a": 1}, 1.5, 7]
        elif isinstance(header[field], str):
            junk = [None, 7, [1], {"a": 1}, 1.5, True]
        elif isinstance(header[field], float):
            junk = [None, "x", [1], {"a": 1}, True]
        if self.rng.random() < 0.2:
            del header[field]
        else:
            header[field] = self.rng.choice(junk)
        return self._pack(header, rest)

    def bad_version(self) -> Frames:
        header, rest = self._header()
        header["v"] = self.rng.choice([0, VERSION - 1, VERSION + 1, 99, -1, str(VERSION),
                                       float(VERSION), None, [VERSION]])
        return self._pack(header, rest)

    def unknown_type(self) -> Frames:
        header, rest = self._header()
        header["type"] = self.rng.choice(["SHUTDOWN", "", "ping", "X" * 5000, 7, None,
                                          ["PING"], {"t": 1}])
        return self._pack(header, rest)

    def huge_shape(self) -> Frames:
        header, rest = self._header()
        dims = [self.rng.choice([1 << 30, (1 << 31) - 1, 1 << 16])
                for _ in range(self.rng.randint(1, 4))]
        name = self.rng.choice(["tokens", "parents", "features", "evil"])
        header[name] = [self.rng.choice(["int32", "float16", "bfloat16", "float32", "object"]),
                        dims, 1]
        return self._pack(header, [b"" if self.rng.random() < 0.5 else b"\x00" * 64])

    def too_large(self) -> Frames:
        pad = self.t.max_message_bytes + self.rng.randint(1, 4096)
        return [*frames_of(Ping()), b"\x00" * pad]

    # -- rule-breaking messages ------------------------------------------------------------
    def _ids(self, n: int) -> np.ndarray:
        return np.asarray([self.rng.randrange(self.t.vocab) for _ in range(n)], np.int32)

    def _features(self, rows: int) -> np.ndarray | None:
        return np.zeros((rows, self.t.feature_width), np.float16) if self.t.feature_width \
            else None

    def bad_tree(self) -> Frames:
        n = self.rng.randint(1, 40)
        parents = np.arange(-1, n - 1, dtype=np.int32)
        i = self.rng.randrange(n)
        parents[i] = self.rng.choice([i, i + 1, n + 5, -7, (1 << 31) - 1])
        return frames_of(Propose(tag=self.rng.getrandbits(62), tokens=self._ids(n),
                                 parents=parents))

    def nan_features(self) -> Frames:
        n = self.rng.randint(2, 20)
        feats = np.zeros((n - 1, max(self.t.feature_width, 8)), np.float16)
        feats[self.rng.randrange(n - 1), self.rng.randrange(feats.shape[1])] = \
            self.rng.choice([np.nan, np.inf, -np.inf])
        return frames_of(Open(ref=2, prompt_len=n - 1, tokens=self._ids(n), features=feats))

    def bad_ids(self) -> Frames:
        n = self.rng.randint(2, 20)
        ids = self._ids(n)
        ids[self.rng.randrange(n)] = self.rng.choice([-1, -(1 << 31), self.t.vocab,
                                                      (1 << 31) - 1])
        return frames_of(Open(ref=3, prompt_len=n - 1, tokens=ids,
                              features=self._features(n - 1)))

    def bad_open(self) -> Frames:
        n = self.rng.randint(2, 20)
        msg = Open(ref=4, prompt_len=n - 1, tokens=self._ids(n), features=self._features(n - 1))
        how = self.rng.randrange(4)
        if how == 0:
            msg.prompt_len = self.rng.choice([0, -3, n + 1, 1 << 40])
        elif how == 1:
            msg.temperature = self.rng.choice([float("nan"), float("inf"), -0.5])
        elif how == 2:
            msg.top_p = self.rng.choice([0.0, 1.5, float("nan")])
        else:
            msg.features = np.zeros((n + 2, max(self.t.feature_width, 8)), np.float16)
        return frames_of(msg)

    def long_prompt(self) -> Frames:
        n = self.t.max_prompt_tokens + self.rng.randint(1, 512)
        return frames_of(Open(ref=5, prompt_len=n - 1, tokens=self._ids(n),
                              features=self._features(n - 1)))

    def unknown_tag(self) -> Frames:
        tag = self.rng.getrandbits(62) | 1
        if self.rng.random() < 0.5:
            return frames_of(Close(tag=tag))
        return frames_of(Commit(tag=tag, accepted=0, tokens=self._ids(1)))

    def stale_commit(self) -> Frames:
        if not self.t.tag:
            return self.unknown_tag()
        return frames_of(Commit(tag=self.t.tag, seq=self.t.seq + self.rng.randint(1, 1 << 20),
                                accepted=0, tokens=self._ids(1), features=self._features(1)))

    def bad_commit(self) -> Frames:
        """The right round, but the tokens are not ids, or the shape disagrees."""
        if not self.t.tag:
            return self.unknown_tag()
        ids = self._ids(1)
        ids[0] = self.rng.choice([-5, self.t.vocab, self.t.vocab + 1000])
        return frames_of(Commit(tag=self.t.tag, seq=self.t.seq, accepted=0, tokens=ids,
                                features=self._features(1)))

    def not_for_hubs(self) -> Frames:
        r = self.rng
        return frames_of(r.choice([
            Propose(tag=r.getrandbits(62), tokens=self._ids(2),
                    parents=np.array([-1, 0], np.int32)),
            DrafterCard(drafter="evil", feature_layers=[-1]),
            Pong(nonce=1),
        ]))
