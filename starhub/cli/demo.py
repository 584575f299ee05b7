"""``starhub demo``: a hub and a few targets on this machine, then each target's speed next
to plain ``generate()`` on the same prompts, and whether its output was identical. The hub
and the targets die with the demo, even when it is killed outright."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from starhub.client.round_stats import pooled_accept_len
from starhub.launch import child_env, die_with_parent, spawn_hub, target_command
from starhub.options import resolve_threads, usable_cores


def run_demo(args: argparse.Namespace, hub_flags: list[str]) -> int:
    # deferred: torch and transformers load only when this runs
    from targets.runner import iter_results

    quiet = ["--log-level", "warning"]
    args.threads = resolve_threads(args.threads, sharing=args.targets)
    with tempfile.TemporaryDirectory() as tmp, spawn_hub(hub_flags, pre_args=quiet) as hub:
        procs, outs = [], []
        print(f"hub at {hub.address} ({args.drafter} drafter); {args.targets} targets, "
              f"{args.threads} torch thread(s) each ({usable_cores()} usable cores)",
              file=sys.stderr)
        for i in range(args.targets):
            out = f"{tmp}/target{i}.jsonl"
            cmd = target_command(hub.address, args.prompts, out, threads=args.threads,
                                 pre_args=quiet,
                                 extra=["--model", args.model, "--dtype", args.dtype,
                                        "--linear", args.linear, "--device", args.device,
                                        "--max-new-tokens", str(args.max_new_tokens), "--shard",
                                        f"{i}/{args.targets}", "--name", f"target{i}"])
            procs.append(subprocess.Popen(cmd, env=child_env(args.threads),
                                          preexec_fn=die_with_parent()))
            outs.append(out)
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"a target failed: exit codes {codes}", file=sys.stderr)
            return 1
        results = [list(iter_results(out)) for out in outs]
    print(f"timing plain generate() on each target's prompts, one process, {args.threads} "
          f"torch thread(s) ...", file=sys.stderr)
    reference = generate_alone(args, [r for rows in results for r in rows])
    for i, rows in enumerate(results):
        print(target_line(f"target{i}", rows, reference))
        if rows:
            print(f"  e.g. {json.dumps(rows[0]['text'][:160])}")
    return 0


def generate_alone(args: argparse.Namespace, rows: list[dict]) -> dict[str, tuple[list, float]]:
    """Each prompt's greedy ``generate()`` output and wall time, by prompt id."""
    import torch

    # deferred: torch and transformers load only when this runs
    from bench.baselines import hf_generate
    from starhub.models.loading import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype, linear=args.linear, device=args.device)
    runs = hf_generate(model, [(r["id"], r["prompt_ids"]) for r in rows], args.max_new_tokens)
    return {run.id: (run.output_ids, run.wall_s) for run in runs}


def target_line(name: str, rows: list[dict], reference: dict[str, tuple[list, float]]) -> str:
    tokens = sum(len(r["output_ids"]) for r in rows)
    wall = sum(r["stats"]["wall_s"] for r in rows)
    tau = pooled_accept_len(r["stats"] for r in rows)
    alone = [reference[r["id"]] for r in rows if r["id"] in reference]
    alone_tokens = sum(len(ids) for ids, _ in alone)
    alone_wall = sum(w for _, w in alone)
    speed = tokens / wall if wall else 0.0
    line = (f"{name}: {len(rows)} prompts, {tokens} tokens, {speed:.1f} tok/s, "
            f"mean accepted length {tau:.2f}")
    if alone_wall and alone_tokens:
        base = alone_tokens / alone_wall
        same = all(r["output_ids"] == reference[r["id"]][0] for r in rows)
        line += (f"; generate() alone {base:.1f} tok/s -> {speed / base:.2f}x, output "
                 f"{'identical' if same else 'DIFFERENT'}")
    return line
