"""Batched verification: several sessions' draft trees in one forward pass of the target.

Each session keeps its own KV cache (a ``TargetModel`` over a slot of the model's
``KVPool``), so sessions come and go freely. A batched pass is one ``DecoderPass`` over
every session's row: the linear layers run over all rows' tokens together, and each row
attends to its own cache in place under its own ancestor mask and positions. Rows never
see each other, so each row's logits are the ones it would get alone: greedy output stays
token-identical to ``generate()``, and sampling uses the star target's acceptance rules.

Nothing here knows about sockets or roles: the edge verifier drives it, and so does a
serving star target (``targets.batcher``) for its requests in flight.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from starhub.wire.tree import DraftTree
from targets.acceptance import Sampling
from targets.cost import BatchStats
from targets.forward import ALL, Row, run_through
from targets.prefill import CHUNK, ChunkedPrefill
from targets.verify import TargetModel, Verdict, decoder_pass


@torch.inference_mode()
def measure_budget(model: PreTrainedModel, slack: float = 1.5, limit: int = 256) -> int:
    """The most tokens one forward pass can feed for about the price of the smallest tree
    pass, a root and one node (within ``slack``): where weight reads still dominate, rows
    batched together cost nearly nothing more. Small on a CPU (about 16 here), hundreds on
    a GPU. Priced against two tokens, not one: a one-token pass may run on other kernels
    (``--linear auto`` keeps plain weights for one row where they are faster), and no
    verification pass feeds fewer than two."""
    vocab = model.config.vocab_size
    runner = decoder_pass(model)

    def seconds(n: int) -> float:
        ids = [i % vocab for i in range(1, n + 1)]
        times = []
        for _ in range(3):
            start = time.perf_counter()
            # through the layers, as the verifier's passes of several trees run (a pass of
            # one row, or of one-token rows, may run on numpy: ``targets.numpy_pass``)
            run_through(runner.layer_by_layer([Row(runner.new_cache(n), ids, logits=ALL)]))
            times.append(time.perf_counter() - start)
        return min(times[1:])

    smallest = seconds(2)
    best = 2
    for n in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        if n > limit or seconds(n) > slack * smallest:
            break
        best = n
    return best


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one cached token takes over every layer (keys and values)."""
    return decoder_pass(model).token_bytes


class VerifyEngine:
    """Sessions over one loaded model, verified alone or many per forward pass."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.runner = decoder_pass(model)
        self.token_bytes = self.runner.token_bytes
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

    def open_chunks(self, sid: int, prompt: list[int], chunk: int = CHUNK,
                    sampling: Sampling = Sampling(), seed: int = 0,
                    feature_layers: list[int] | None = None, logprobs: int | None = None,
                    echo: bool = False) -> ChunkedPrefill[tuple[int, torch.Tensor | None]]:
        """``open``, run a slice at a time (``ChunkedPrefill.run``: ``chunk`` prompt tokens a
        pass, each pass paused between layers), so that a long prompt's prefill can
        alternate with other sessions' passes. The session is not to be verified before the
        prefill is done. ``logprobs``, ``echo``: see ``TargetModel``."""
        if sid in self.sessions:
            raise KeyError(f"session {sid} is already open")
        target = TargetModel(self.model, sampling, seed, feature_layers, logprobs, echo)
        self.sessions[sid] = target
        return ChunkedPrefill(target.prefill_chunks(list(prompt), chunk or CHUNK),
                              len(prompt))

    def close(self, sid: int) -> None:
        self.sessions.pop(sid, None)

    def cached(self, sid: int) -> int:
        """Entries in a session's cache once the last verify is compacted."""
        return self.sessions[sid].cached

    def cost(self, work: list[tuple[int, DraftTree]]) -> BatchStats:
        return BatchStats.of(work, self.cached)

    def verify(self, work: list[tuple[int, DraftTree]]) -> list[Verdict]:
        """Verify each (session, tree) pair, all in one forward pass."""
        targets = [self.sessions[sid] for sid, _ in work]
        if len(set(map(id, targets))) != len(targets):
            raise ValueError("a session can have one tree per batch")
        trees = [tree for _, tree in work]
        outs = self.runner([t.tree_row(tree) for t, tree in zip(targets, trees, strict=True)])
        return [t.verdict(tree, out) for t, tree, out in zip(targets, trees, outs, strict=True)]
