"""Time the batched verification passes a serving target runs, under each attention.

For every (rows, cached tokens, tree nodes) it opens that many sessions of throwaway
tokens, then times passes that verify a tree of that size for each (0: a plain pass) with
transformers' ``sdpa`` attention and with ``starhub.models.attention``'s folded one,
alternating the two, each group of passes on freshly opened sessions. Prints the median
pass of each and their ratio.

    .venv/bin/python -m scripts.pass_timing --rows 1,3 --cached 100,600 --nodes 0,2,10
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from starhub.models.attention import NAME
from starhub.models.loading import load_model, set_threads
from starhub.wire.tree import DraftTree
from targets.engine import VerifyEngine
from targets.serve.calibration import throwaway_tree

ATTENTIONS = ("sdpa", NAME)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=ints, default=[1, 3], help="comma list of sessions a pass")
    p.add_argument("--cached", type=ints, default=[100, 600],
                   help="comma list of tokens each session holds")
    p.add_argument("--nodes", type=ints, default=[0, 2, 10],
                   help="comma list of tree sizes (0: a plain pass)")
    p.add_argument("--repeat", type=int, default=4, help="groups of passes per shape")
    p.add_argument("--passes", type=int, default=3, help="passes per group")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    set_threads(args.threads)
    model, _ = load_model(args.model)
    vocab = model.config.vocab_size
    engine = VerifyEngine(model)
    plain = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32))
    print(f"threads {args.threads}; median pass in ms, {args.repeat}x{args.passes} passes")
    for rows in args.rows:
        for cached in args.cached:
            prompts = [[(7 * i + j) % vocab for j in range(cached)] for i in range(rows)]
            times: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.repeat):
                for attention in ATTENTIONS:
                    model.set_attn_implementation(attention)
                    for nodes in args.nodes:
                        tree = throwaway_tree(nodes, vocab) if nodes else plain
                        for sid, prompt in enumerate(prompts):
                            engine.open(sid, prompt)
                        for _ in range(args.passes):
                            start = time.perf_counter()
                            engine.verify([(sid, tree) for sid in range(rows)])
                            times.setdefault((attention, nodes), []).append(
                                time.perf_counter() - start)
                        for sid in range(rows):
                            engine.close(sid)
            for nodes in args.nodes:
                stock, folded = (1e3 * statistics.median(times[a, nodes]) for a in ATTENTIONS)
                print(f"rows {rows} cached {cached:4d} nodes {nodes:2d}: sdpa {stock:6.1f}  "
                      f"folded {folded:6.1f}  ({folded / stock:.3f})", flush=True)


if __name__ == "__main__":
    main()
