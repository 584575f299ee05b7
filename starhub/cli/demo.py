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
from starhub.models.prompts import iter_results
from starhub.options import resolve_threads, usable_cores


def run_demo(args: argparse.Namespace, hub_flags: list[str]) -> int:
    quiet = ["--log-level", "warning"]
    args.threads = resolve_threads(args.threads, sharing=args.targets)
    n = args.targets
    with tempfile.TemporaryDirectory() as tmp:
        outs = [f"{tmp}/target{i}.jsonl" for i in range(n)]
        plain_outs = [f"{tmp}/plain{i}.jsonl" for i in range(n)]
        plain = [[sys.executable, "-m", "bench.plain_generate", args.prompts, out,
                  "--shard", f"{i}/{n}", *_model_flags(args), "--threads", str(args.threads)]
                 for i, out in enumerate(plain_outs)]
        print(f"timing plain generate() on each target's prompts: {n} processes at once, "
              f"{args.threads} torch thread(s) each, as the targets will run ...",
              file=sys.stderr)
        if not _run(plain, args.threads, together=True, what="generate()"):
            return 1
        before = _plain_rows(plain_outs)
        with spawn_hub(hub_flags, pre_args=quiet) as hub:
            print(f"hub at {hub.address} ({args.drafter} drafter); {n} targets, "
                  f"{args.threads} torch thread(s) each ({usable_cores()} usable cores)",
                  file=sys.stderr)
            cmds = [target_command(hub.address, args.prompts, out, threads=args.threads,
                                   pre_args=quiet,
                                   extra=[*_model_flags(args), "--shard", f"{i}/{n}",
                                          "--name", f"target{i}"])
                    for i, out in enumerate(outs)]
            if not _run(cmds, args.threads, together=True, what="target"):
                return 1
        results = [list(iter_results(out)) for out in outs]
        print("plain generate() at once again (the baseline is the mean of the two), then "
              "one process at a time with the machine to itself ...", file=sys.stderr)
        if not _run(plain, args.threads, together=True, what="generate()"):
            return 1
        after = _plain_rows(plain_outs)
        if not _run(plain, args.threads, together=False, what="generate()"):
            return 1
        alone = _plain_rows(plain_outs)
    beside = {id_: (ids, (wall + after[id_][1]) / 2) for id_, (ids, wall) in before.items()}
    for i, rows in enumerate(results):
        print(target_line(f"target{i}", rows, beside, alone, n,
                          same=[before, after, alone]))
        if rows:
            print(f"  e.g. {json.dumps(rows[0]['text'][:160])}")
    return 0


def _model_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--dtype", args.dtype, "--linear", args.linear,
            "--device", args.device, "--max-new-tokens", str(args.max_new_tokens)]


def _run(cmds: list[list[str]], threads: int, together: bool, what: str) -> bool:
    """Run the commands, all at once or one after another; False (said) if any failed."""
    procs = []
    for cmd in cmds:
        procs.append(subprocess.Popen(cmd, env=child_env(threads),
                                      preexec_fn=die_with_parent()))
        if not together:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"a {what} process failed: exit codes {codes}", file=sys.stderr)
    return not any(codes)


def _plain_rows(outs: list[str]) -> dict[str, tuple[list, float]]:
    """Each prompt's plain ``generate()`` ids and wall time, by prompt id."""
    return {row["id"]: (row["output_ids"], row["wall_s"])
            for out in outs for row in iter_results(out)}


def _speed(rows: list[dict], reference: dict[str, tuple[list, float]]) -> float:
    runs = [reference[r["id"]] for r in rows]
    wall = sum(w for _, w in runs)
    return sum(len(ids) for ids, _ in runs) / wall if wall else 0.0


def target_line(name: str, rows: list[dict], beside: dict[str, tuple[list, float]],
                alone: dict[str, tuple[list, float]], targets: int,
                same: list[dict[str, tuple[list, float]]]) -> str:
    """A target's speed against plain ``generate()`` on its prompts: in ``targets``
    processes at once, as the targets ran (the comparison that counts: the same machine,
    shared the same way; timed before and after the targets, and averaged), and in one
    process with the machine to itself. The output is identical when every run in
    ``same`` produced the target's ids."""
    tokens = sum(len(r["output_ids"]) for r in rows)
    wall = sum(r["stats"]["wall_s"] for r in rows)
    tau = pooled_accept_len(r["stats"] for r in rows)
    speed = tokens / wall if wall else 0.0
    prompts = f"{len(rows)} prompt" + "s" * (len(rows) != 1)
    line = (f"{name}: {prompts}, {tokens} tokens, {speed:.1f} tok/s, "
            f"mean accepted length {tau:.2f}")
    base, solo = _speed(rows, beside), _speed(rows, alone)
    if base and solo:
        identical = all(r["output_ids"] == run[r["id"]][0] for r in rows for run in same)
        line += (f"; generate() {targets} at once {base:.1f} tok/s -> {speed / base:.2f}x "
                 f"(alone {solo:.1f} tok/s -> {speed / solo:.2f}x), output "
                 f"{'identical' if identical else 'DIFFERENT'}")
    return line
