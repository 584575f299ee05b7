"""How often a draft tree's nodes are accepted against the drafter's path probability.

The hub's floor (``Controller.floor``) leaves out the nodes of a greedy tree whose path
probability is below what one node costs the target. That rule counts a node's
probability as its chance of being accepted; this script measures how far that holds. It
decodes greedily in one process, the target verifying each tree the EAGLE head drafts,
and bins every drafted node by its path probability. With ``--costs`` it also replays the
rounds with each floor of ``--floors`` held fixed: a round keeps the nodes at or above
the floor (the root's best child always), commits its accepted path up to the first node
left out plus the bonus token, and takes ``base + slope·nodes + hub`` milliseconds. It
also prints the median time the head took to draft a tree, in ``--draft-dtype``.

    .venv/bin/python -m scripts.tree_calibration --prompts scripts/prompts/heldout.jsonl
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from starhub.drafters import growing, make_drafter
from starhub.drafters.base import DraftContext
from starhub.models.loading import load_model
from starhub.models.prompts import encode_prompt, read_prompts
from starhub.options import DRAFT_DTYPES, TreeShape
from targets.verify import TargetModel

BINS = (0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.4, 0.7, 1.01)


class PathScores:
    """Each node's path log-probability as the greedy grower keeps its nodes: its final
    ``_best`` call ranks every candidate and returns the kept ones, in the order
    ``_subtree`` numbers them once sorted."""

    def __init__(self) -> None:
        self.kept: list[float] = []
        self._best = growing._best

    def __enter__(self) -> PathScores:
        def best(ids, scores, k):
            out = self._best(ids, scores, k)
            if isinstance(ids, range):  # the final choice over all candidates
                self.kept = [scores[i] for i in sorted(out)]
            return out

        growing._best = best
        return self

    def __exit__(self, *exc) -> None:
        growing._best = self._best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="scripts/prompts/heldout.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--max-nodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                   help="the head's weights, as for `starhub hub`")
    p.add_argument("--costs", default=None, metavar="BASE,SLOPE,HUB",
                   help="milliseconds: a verify's base, its cost per node, the hub's share "
                        "of a round; replays the rounds at each of --floors")
    p.add_argument("--floors", default="0,0.01,0.02,0.03,0.05,0.08,0.12")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("default")
    drafter = make_drafter("eagle", dtype=args.draft_dtype)
    shape = TreeShape(args.depth, args.topk, args.max_nodes)
    nodes: list[tuple[float, bool]] = []
    rounds: list[tuple[list[float], list[int]]] = []
    drafting: list[float] = []
    with PathScores() as paths:
        for _, prompt in read_prompts(args.prompts):
            ids = encode_prompt(tokenizer, prompt)
            target = TargetModel(model, feature_layers=list(drafter.feature_layers))
            first, feats = target.prefill(ids)
            ctx = DraftContext(tokens=[*ids, first], features=[feats])
            made = 0
            while made < args.max_new_tokens:
                start = time.perf_counter()
                tree = drafter.propose(ctx, shape)
                drafting.append(time.perf_counter() - start)
                if len(paths.kept) != len(tree):
                    raise RuntimeError("the drafter did not grow a greedy tree")
                verdict = target.verify(tree)
                probs = [math.exp(s) for s in paths.kept]
                rounds.append((probs, list(verdict.path)))
                accepted = set(verdict.path)
                nodes += [(q, i in accepted) for i, q in enumerate(probs)]
                ctx.tokens.extend(verdict.tokens)
                ctx.features.append(verdict.features)
                made += len(verdict.tokens)
                if tokenizer.eos_token_id in verdict.tokens:
                    break
    probs = np.array([n[0] for n in nodes])
    hits = np.array([n[1] for n in nodes], dtype=float)
    print(f"{len(nodes)} nodes in {len(rounds)} rounds "
          f"(depth {args.depth}, top-{args.topk}, {args.max_nodes} nodes, "
          f"{args.threads} torch thread(s)); accepted {hits.mean():.3f} of them; tau "
          f"{sum(len(path) + 1 for _, path in rounds) / len(rounds):.2f}")
    print(f"drafting a tree: {1e3 * float(np.median(drafting)):.1f} ms median "
          f"({drafter.weights})")
    print("path probability   nodes   mean probability   accepted")
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        inside = (probs >= lo) & (probs < hi)
        if inside.any():
            print(f"[{lo:.2f}, {min(hi, 1.0):.2f})   {int(inside.sum()):6d}   "
                  f"{probs[inside].mean():16.3f}   {hits[inside].mean():8.3f}")
    if args.costs:
        base, slope, hub = (float(x) / 1e3 for x in args.costs.split(","))
        for floor in (float(x) for x in args.floors.split(",")):
            tokens, seconds, kept = replay(rounds, floor, base, slope, hub)
            print(f"floor {floor:.2f}: {tokens / seconds:.1f} tok/s, "
                  f"tau {tokens / len(rounds):.2f}, {kept / len(rounds):.1f} nodes a tree")


def replay(rounds: list[tuple[list[float], list[int]]], floor: float, base: float,
           slope: float, hub: float) -> tuple[int, float, int]:
    """(tokens, seconds, nodes) of the rounds had each kept only nodes at or above
    ``floor``, the root's best child always; a node's subtree scores lower still."""
    tokens, seconds, kept = 0, 0.0, 0
    for probs, path in rounds:
        keep = {i for i, q in enumerate(probs) if q >= floor} or {int(np.argmax(probs))}
        accepted = 0
        for node in path:
            if node not in keep:
                break
            accepted += 1
        tokens += accepted + 1
        seconds += base + slope * len(keep) + hub
        kept += len(keep)
    return tokens, seconds, kept


if __name__ == "__main__":
    main()
