"""Time the target engine's batched verification passes and its plain decoding step.

For every (rows, cached tokens, tree nodes) it opens that many sessions of throwaway
tokens, then times passes that verify a tree of that size for each (0: a plain pass of
every row), each group of passes on freshly opened sessions; then plain steps of one
session (``TargetModel.step``, what ``starhub target`` runs without a hub). Prints the
median of each; ``--profile`` adds where a plain step's and a pass's time goes (linear
products, attention, everything else, by ``torch.profiler``). It uses only the engine's
public calls, so the same file times any commit's engine: run it with that commit's tree
first on ``PYTHONPATH``.

    .venv/bin/python -m scripts.pass_timing --rows 4 --cached 600 --nodes 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from starhub.models.loading import load_model, set_threads
from starhub.wire.tree import DraftTree
from targets.calibration import throwaway_tree
from targets.engine import VerifyEngine
from targets.verify import TargetModel


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def time_passes(engine: VerifyEngine, vocab: int, rows: int, cached: int, nodes: int,
                repeat: int, passes: int) -> list[float]:
    tree = throwaway_tree(nodes, vocab) if nodes else DraftTree(np.zeros(0, np.int32),
                                                                 np.zeros(0, np.int32))
    prompts = [[(7 * i + j) % vocab for j in range(cached)] for i in range(rows)]
    times = []
    for _ in range(repeat):
        for sid, prompt in enumerate(prompts):
            engine.open(sid, prompt)
        for _ in range(passes):
            start = time.perf_counter()
            engine.verify([(sid, tree) for sid in range(rows)])
            times.append(time.perf_counter() - start)
        for sid in range(rows):
            engine.close(sid)
    return times


def time_steps(model, vocab: int, cached: int, steps: int) -> list[float]:
    target = TargetModel(model)
    target.prefill([(7 * j) % vocab for j in range(cached)])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        target.step()
        times.append(time.perf_counter() - start)
    return times[steps // 4:]


def breakdown(label: str, run, times: int) -> None:
    """Per call of ``run``: the linear products, attention and the rest, by the profiler
    (whose own overhead inflates the many small ops)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(times):
            run()
    events = prof.key_averages()

    def ms(pick) -> float:
        return sum(e.self_cpu_time_total for e in events if pick(e.key)) / times / 1e3

    total = ms(lambda key: True)
    linear = ms(lambda key: "linear" in key or key in ("aten::mm", "aten::addmm"))
    attention = ms(lambda key: "scaled_dot_product" in key)
    calls = sum(e.count for e in events) / times
    print(f"profile {label}: {total:.1f} ms: linear {linear:.1f}, attention {attention:.1f}, "
          f"other {total - linear - attention:.1f} over {calls:.0f} op calls", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=ints, default=[1, 4], help="comma list of sessions a pass")
    p.add_argument("--cached", type=ints, default=[100, 600],
                   help="comma list of tokens each session holds")
    p.add_argument("--nodes", type=ints, default=[0, 10],
                   help="comma list of tree sizes (0: a plain pass)")
    p.add_argument("--repeat", type=int, default=4, help="groups of passes per shape")
    p.add_argument("--passes", type=int, default=3, help="passes per group")
    p.add_argument("--steps", type=int, default=64,
                   help="plain steps of one session at each --cached (0: none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--linear", default="auto", help="the linear kernel (see starhub target)")
    p.add_argument("--profile", action="store_true",
                   help="also profile a plain step at the first --cached and a pass of the "
                        "last --rows, --cached and --nodes")
    args = p.parse_args()
    set_threads(args.threads)
    model, _ = load_model(args.model, linear=args.linear)
    vocab = model.config.vocab_size
    engine = VerifyEngine(model)
    print(f"torch threads {args.threads} (torch.set_num_threads), --linear {args.linear}; "
          f"median in ms, "
          f"{args.repeat}x{args.passes} passes a shape", flush=True)
    with torch.inference_mode():
        time_passes(engine, vocab, 1, 32, 0, 1, 3)  # warm-up
        for rows in args.rows:
            for cached in args.cached:
                for nodes in args.nodes:
                    ms = 1e3 * statistics.median(time_passes(engine, vocab, rows, cached,
                                                             nodes, args.repeat, args.passes))
                    print(f"pass  rows {rows} cached {cached:4d} nodes {nodes:2d}: {ms:7.1f}",
                          flush=True)
        if args.steps:
            for cached in args.cached:
                ms = 1e3 * statistics.median(time_steps(model, vocab, cached, args.steps))
                print(f"plain step  cached {cached:4d}: {ms:6.1f} ({1e3 / ms:.1f} tokens/s)",
                      flush=True)
        if args.profile:
            target = TargetModel(model)
            target.prefill([(7 * j) % vocab for j in range(args.cached[0])])
            breakdown(f"plain step, cached {args.cached[0]}", target.step, 20)
            rows, cached, nodes = args.rows[-1], args.cached[-1], args.nodes[-1]
            for sid in range(rows):
                engine.open(sid, [(7 * sid + j) % vocab for j in range(cached)])
            tree = throwaway_tree(nodes, vocab) if nodes else DraftTree(
                np.zeros(0, np.int32), np.zeros(0, np.int32))
            breakdown(f"pass, {rows} rows x {nodes} nodes, cached {cached}",
                      lambda: engine.verify([(sid, tree) for sid in range(rows)]), 3)


if __name__ == "__main__":
    main()
