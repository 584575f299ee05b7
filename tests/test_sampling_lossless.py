"""Sampling is lossless: committed tokens follow the target's distribution exactly.

Tiny random models with a 12-token vocabulary make q differ clearly from p; forward passes
are memoised by context so that 20,000 rounds (one seed each) take seconds. The joint law
of the first two committed tokens is compared with p(x1) p(x2 | x1) by a chi-square test,
for trees drafted with the target's noise (coupled) and without it, and a negative control
(a verifier that reuses one position's noise) must fail the same test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from starhub.drafters.base import DraftContext
from starhub.drafters.growing import build_greedy_tree, build_sampled_tree
from starhub.models.coupling import sample_at
from targets.acceptance import Sampling, accept_sampled, target_probs, walk
from tests.conftest import tiny_config

VOCAB = 12
CONTEXT = (3, 7, 1)
SAMPLES = 20_000
SAMPLING = Sampling(temperature=1.0, top_p=0.95)


class Memo:
    def __init__(self, seed: int, scale: float):
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(tiny_config(VOCAB, layers=1)).eval()
        self.scale = scale
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def logits(self, seq: tuple[int, ...]) -> torch.Tensor:
        if seq not in self.cache:
            out = self.model(torch.tensor([seq])).logits[0, -1]
            self.cache[seq] = out * self.scale
        return self.cache[seq]


TARGET = Memo(seed=1, scale=2.0)
DRAFT = Memo(seed=2, scale=3.0)


def model_proposer(topk: int, depth: int, max_nodes: int, coupled: bool = False):
    """Trees from a memoised independent draft model, as the ``model`` drafter builds them:
    ranked with the target's noise for the round's seed, or drawn from q."""

    def propose(gen: torch.Generator, seed: int):
        seqs: dict[int, tuple[int, ...]] = {-1: CONTEXT}

        def expand(ids, tokens, parents):
            rows = []
            for node, tok, parent in zip(ids, tokens, parents, strict=True):
                seqs[node] = seqs[parent] + (tok,)
                rows.append(DRAFT.logits(seqs[node]))
            return torch.stack(rows)

        if coupled:
            score = DraftContext(tokens=list(CONTEXT), temperature=1.0, seed=seed).coupled(VOCAB)
            return build_greedy_tree(DRAFT.logits(CONTEXT), expand, depth, topk, max_nodes,
                                     score)
        return build_sampled_tree(DRAFT.logits(CONTEXT), expand, depth, topk, max_nodes,
                                  temperature=1.0, support=6, generator=gen)

    return propose


def eagle_proposer(topk: int, depth: int, max_nodes: int):
    """Trees from the real EagleDrafter with a random head over the target's features."""
    from starhub.drafters.base import DraftContext, TreeShape
    from starhub.drafters.eagle import EagleDrafter
    from starhub.drafters.eagle_head import EAGLE, EagleHead, head_config

    torch.manual_seed(5)
    target = TARGET.model
    embed = target.model.embed_tokens.weight.detach()
    head = EagleHead(head_config(target.config), EAGLE, embed, target_lm_head=embed)
    drafter = EagleDrafter(head.eval())
    with torch.inference_mode():
        out = target(torch.tensor([CONTEXT]), output_hidden_states=True)
    feats = out.hidden_states[-1][0, :-1]
    shape = TreeShape(depth=depth, topk=topk, max_nodes=max_nodes, support=6)

    def propose(gen: torch.Generator, seed: int):
        ctx = DraftContext(tokens=list(CONTEXT), temperature=1.0, generator=gen,
                           features=[feats], seed=seed)
        return drafter.propose(ctx, shape)

    return propose


def run_round(propose, gen: torch.Generator, reuse_noise: bool = False) -> list[int]:
    seed = int(torch.randint(1 << 62, (1,), generator=gen))
    tree = propose(gen, seed)
    node_seq = {-1: CONTEXT}
    paths = [CONTEXT]
    for i, (tok, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(),
                                          strict=True)):
        node_seq[i] = node_seq[parent] + (tok,)
        paths.append(node_seq[i])
    logits = torch.stack([TARGET.logits(s) for s in paths])
    if reuse_noise:  # the bug: every depth drawn with the first position's noise
        path, bonus = walk(tree, lambda pos, depth: sample_at(
            target_probs(logits[pos], SAMPLING), seed, len(CONTEXT)))
    else:
        path, bonus = accept_sampled(tree, logits, SAMPLING, seed, len(CONTEXT))
    return [int(tree.tokens[i]) for i in path] + [bonus]


def first_two(propose, reuse_noise=False) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(99)
    counts = np.zeros((VOCAB, VOCAB))
    singles = np.zeros(VOCAB)
    for _ in range(SAMPLES):
        out = run_round(propose, gen, reuse_noise)
        if len(out) >= 2:
            counts[out[0], out[1]] += 1
        else:
            singles[out[0]] += 1
    return counts, singles


def expected_joint() -> np.ndarray:
    p1 = target_probs(TARGET.logits(CONTEXT), SAMPLING).numpy()
    joint = np.zeros((VOCAB, VOCAB))
    for x in range(VOCAB):
        if p1[x] > 0:
            joint[x] = p1[x] * target_probs(TARGET.logits(CONTEXT + (x,)), SAMPLING).numpy()
    return joint


def chi_square_rejects(observed: np.ndarray, probs: np.ndarray, alpha_z: float = 3.09) -> tuple:
    """Pearson's test over cells with expected count >= 5, the rest pooled; Wilson-Hilferty
    gives the critical value (z=3.09 is a 0.1% false-alarm rate)."""
    n = observed.sum()
    exp = probs.ravel() * n
    obs = observed.ravel()
    big = exp >= 5
    cells_obs = np.append(obs[big], obs[~big].sum())
    cells_exp = np.append(exp[big], exp[~big].sum())
    keep = cells_exp > 0
    stat = float(((cells_obs[keep] - cells_exp[keep]) ** 2 / cells_exp[keep]).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical, stat, critical, df


def joint_observed(counts, singles):
    """Rounds that committed only one token still sample x1 from p: condition on x1."""
    p1 = target_probs(TARGET.logits(CONTEXT), SAMPLING).numpy()
    first = counts.sum(1) + singles
    return first, p1


PROPOSERS = {
    "model-chain-coupled": lambda: model_proposer(1, 4, 4, coupled=True),
    "model-tree-coupled": lambda: model_proposer(3, 3, 9, coupled=True),
    "model-tree-drawn": lambda: model_proposer(3, 3, 9),
    "eagle-tree-coupled": lambda: eagle_proposer(3, 3, 9),
}


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_sampled_rounds_match_target_distribution(name):
    counts, singles = first_two(PROPOSERS[name]())
    first, p1 = joint_observed(counts, singles)
    rejects, stat, crit, df = chi_square_rejects(first, p1)
    assert not rejects, f"first token: chi2={stat:.1f} > {crit:.1f} (df={df})"
    joint = expected_joint()
    assert counts.sum() > SAMPLES * 0.3, "too few rounds committed two tokens to test x2"
    rows = counts.sum(1, keepdims=True)
    cond_expected = joint / np.where(joint.sum(1, keepdims=True) > 0,
                                     joint.sum(1, keepdims=True), 1)
    rejects, stat, crit, df = chi_square_rejects(counts, cond_expected * rows / rows.sum())
    assert not rejects, f"second token given first: chi2={stat:.1f} > {crit:.1f} (df={df})"


def test_the_test_detects_a_verifier_that_reuses_one_positions_noise():
    counts, _ = first_two(model_proposer(3, 3, 9, coupled=True), reuse_noise=True)
    joint = expected_joint()
    rows = counts.sum(1, keepdims=True)
    cond_expected = joint / np.where(joint.sum(1, keepdims=True) > 0,
                                     joint.sum(1, keepdims=True), 1)
    rejects, stat, crit, _ = chi_square_rejects(counts, cond_expected * rows / rows.sum())
    assert rejects, f"a biased verifier went unnoticed: chi2={stat:.1f} <= {crit:.1f}"


def test_coupled_drafts_are_accepted_more_often_than_drawn_ones():
    """Not needed for losslessness; it is why drafts rank with the target's noise."""
    coupled, _ = first_two(model_proposer(3, 3, 9, coupled=True))
    drawn, _ = first_two(model_proposer(3, 3, 9))
    assert coupled.sum() > drawn.sum()
