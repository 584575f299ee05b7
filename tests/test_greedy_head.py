"""The greedy head: each row's token is the float32 LM head's argmax, though it reads the
bfloat16 copy of the head and the float32 rows of a few candidates only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from starhub.models.loading import native_bf16_cpu
from targets.greedy_head import GreedyHead, head_weight

needs_bf16 = pytest.mark.skipif(not native_bf16_cpu(),
                                reason="the greedy head runs where the CPU multiplies bf16")


def _near_ties(rows: int = 48, vocab: int = 4096, width: int = 256, gap: float = 1e-3):
    """Hidden rows each with two best tokens whose logits differ by ``gap`` either way: far
    apart for float32, not for bfloat16, which rounds the two tokens' weights apart (they
    differ along a direction the row does not see)."""
    rng = np.random.default_rng(0)
    weight = (0.05 * rng.standard_normal((vocab, width))).astype(np.float32)
    x = (2.0 * rng.standard_normal((rows, width))).astype(np.float32)
    pairs = rng.permutation(vocab)[:2 * rows].reshape(rows, 2)
    for r, (a, b) in enumerate(pairs):
        unit = x[r] / np.linalg.norm(x[r])
        weight[a] = 0.5 * unit  # a logit of about 0.5 |x|, far above the rest
        sign = 1 if r % 2 else -1
        aside = rng.standard_normal(width)
        aside -= np.dot(aside, unit) * unit
        weight[b] = weight[a] + sign * gap * x[r] / np.dot(x[r], x[r]) + \
            0.02 * aside / np.linalg.norm(aside)
    return torch.from_numpy(weight), torch.from_numpy(x)


@needs_bf16
def test_picks_are_the_float32_heads_argmax_where_bfloat16_cannot_tell_the_best_apart():
    weight, x = _near_ties()
    truth = (x.double() @ weight.double().T).argmax(-1).tolist()
    assert truth == (x @ weight.T).argmax(-1).tolist(), "the gaps are wide for float32"
    rough = (x.bfloat16() @ weight.bfloat16().T).float().argmax(-1).tolist()
    assert sum(a != b for a, b in zip(rough, truth, strict=True)) >= 5, \
        "bfloat16 alone must get some rows wrong, or this test shows nothing"
    assert GreedyHead(weight).picks(x) == truth


@needs_bf16
def test_picks_take_the_first_token_on_an_exact_tie_and_survive_non_finite_rows():
    weight, x = _near_ties(rows=4)
    weight[7] = weight[11] = 4 * x[0] / x[0].norm()  # rows 7 and 11 tie, above the rest
    head = GreedyHead(weight)
    assert head.picks(x[:1]) == [7]
    bad = x[1:2].clone()
    bad[0, 3] = float("nan")
    assert head.picks(torch.cat([x[2:3], x[3:4]])) == (x[2:4] @ weight.T).argmax(-1).tolist()
    assert len(head.picks(bad)) == 1  # no bound holds: the whole float32 head, no error


def test_a_head_with_a_bias_or_no_float32_weight_gets_no_greedy_head():
    class Model(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.lm_head = head

    assert head_weight(Model(torch.nn.Linear(8, 32, bias=True))) is None
    assert head_weight(Model(torch.nn.Linear(8, 32, bias=False))) is not None
    assert GreedyHead.of(Model(torch.nn.Linear(8, 32, bias=False).double())) is None
