"""Seeded sampling that drafts cannot change: the Gumbel-max trick keyed by position.

A sampled session's token at sequence index i is ``argmax_x(log p_i(x) + G_i(x))``, where
``G_i`` is Gumbel noise drawn from a generator seeded by (session seed, i) alone. Given
its prefix each token is then an exact draw from the target's ``p_i``, so output is
lossless; and it is a function of the seed, never of what was drafted, how deep, how
many rounds, or whether the hub answered at all. Two runs with one seed give one output.

Target and drafter compute the same ``G_i`` from the same seed. A drafter that ranks its
own log-probabilities plus ``G_i`` (its "coupled" guess) proposes the target's sample
whenever the two perturbed argmaxes agree, which for a good drafter is about as often as
a greedy draft matches a greedy target.
"""

from __future__ import annotations

from functools import lru_cache

import torch

MASK64 = (1 << 64) - 1


def noise_seed(seed: int, index: int) -> int:
    """A 64-bit generator seed for (session seed, sequence index), well mixed
    (SplitMix64's finaliser), so that neighbouring indices get unrelated noise."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) * 0xD1B54A32D192ED03 + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=32)
def gumbel_noise(seed: int, index: int, size: int) -> torch.Tensor:
    """Standard Gumbel noise over a ``size``-token vocabulary for the token at ``index``
    (float64, on the CPU; read-only). Cached: a drafter's next tree revisits the indices
    its last one reached past the accepted path (32 entries of a 49k vocabulary: 13 MB)."""
    generator = torch.Generator().manual_seed(noise_seed(seed, index))
    u = torch.rand(size, generator=generator, dtype=torch.float64).clamp_min_(1e-300)
    return -torch.log(-torch.log(u))


def sample_at(probs: torch.Tensor, seed: int, index: int) -> int:
    """The token at sequence ``index``: an exact draw from ``probs`` (zeros never win)."""
    noise = gumbel_noise(seed, index, probs.numel())
    return int((probs.double().log() + noise).argmax())


def coupled_scores(logits: torch.Tensor, temperature: float, seed: int, index: int,
                   vocab: int, to_target: torch.Tensor | None = None) -> torch.Tensor:
    """A drafter's rows of ``logits`` (over its own vocabulary) perturbed with the noise the
    target will draw at ``index``: their argmax is the drafter's guess of the target's
    sample. ``to_target`` maps draft ids to target ids where the vocabularies differ;
    ``vocab`` is the target's vocabulary size, which fixes the noise."""
    noise = gumbel_noise(seed, index, vocab)
    if to_target is not None:
        noise = noise[to_target]
    return logits.double() / max(temperature, 1e-5) + noise.to(logits.device)
