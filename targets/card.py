"""What a target tells its peers about itself: its TARGET_CARD (model shape, tokenizer, plain
step time), the ids that end its sequences, and the precision its features travel at. The
star target, the serving batcher and the edge verifier all describe themselves here."""

from __future__ import annotations

import torch

from starhub.cores import CoreClock
from starhub.models.loading import tokenizer_fingerprint
from starhub.wire.messages import TargetCard
from targets.verify import TargetModel


def measure_step(model, steps: int = 8, clock: CoreClock | None = None) -> float:
    """Seconds of one plain decoding step, timed on a short throwaway sequence: the speed
    a target reaches on its own, which the hub's admission and tree choice must beat.
    The first steps warm the kernels up and run slow, so the median of the rest counts;
    plain steps taken later refine it. ``clock`` may time the steps alone (see
    ``starhub.cores``)."""
    clock = clock or CoreClock()
    probe = TargetModel(model)
    vocab = model.config.vocab_size
    probe.prefill([i % vocab for i in range(1, 33)])
    times = []
    for _ in range(steps):
        clock.start()
        probe.step()
        times.append(clock.lap()[1])
    settled = sorted(times[steps // 2:])
    return settled[len(settled) // 2]


def target_card(model, tokenizer, name: str, step_s: float) -> TargetCard:
    """What a target tells a hub (or the edge verifier its drafters) about itself: its
    model's shape and its plain speed."""
    cfg = model.config
    return TargetCard(name=name, vocab_size=cfg.vocab_size,
                      tokenizer_fp=tokenizer_fingerprint(tokenizer),
                      hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                      step_ms=1e3 * step_s)


def eos_ids(model) -> frozenset[int]:
    """The token ids that end a sequence, from the model's generation config."""
    eos = model.generation_config.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def feature_dtype(model) -> torch.dtype:
    """Features travel at half precision: bf16 models keep bf16, others send fp16."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def on_wire(features: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Features as a peer reads them (``feature_dtype``); None stays None."""
    return None if features is None else features.to(dtype)
