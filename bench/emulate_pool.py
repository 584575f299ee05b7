"""A pool of emulated hubs: N emulated targets over H hubs, each target choosing its hub as
a real target given a pool does (``starhub.client.pool``), and the same N placed at random
for comparison.

Every row is measured on its own fresh hubs, over the same kind of window as a single hub's
rows (``bench.emulate.measure_point``). System tokens per second come from the targets' own
counts; each hub's load and round rate from its own STATS.
"""

from __future__ import annotations

import os
import sys
import tempfile

from bench.emulate import EmulateOptions, measure_point, per_target
from bench.emulate_spec import EmulateSpec
from bench.emulate_targets import PLACEMENTS
from starhub.hub.metrics import derive

__all__ = ["pool_doc", "pool_row"]


def balanced_model(spec: EmulateSpec, n: int, hubs: int) -> dict:
    """StarSD's model for N targets spread evenly over ``hubs`` hubs: the sum of each hub's
    system tokens/s at its share of the targets."""
    model = spec.model()
    shares = [len(range(h, n, hubs)) for h in range(hubs)]
    return {"system_tok_s": sum(model.predict(k)["system_tok_s"] for k in shares if k),
            "targets_per_hub": shares}


def pool_row(spec: EmulateSpec, n: int, hubs: int, placement: str,
             windows: list[tuple[dict, dict]], totals: list[dict]) -> dict:
    """One row: the targets' tokens over the window, and each hub's load, rounds and
    scheduling time over the same window."""
    per_hub = []
    for c0, c1 in windows:
        metrics = derive(c0["counters"], c1["counters"], targets=max(c1["admitted"], 1))
        rounds = max(metrics["rounds"], 1)
        busy_s = metrics["wall_s"] * (1 - metrics["hub_split"]["idle"])
        per_hub.append({"load": metrics["load"], "admitted": c1["admitted"],
                        "r_q": metrics["r_q"], "system_tok_s": metrics["system_tok_s"],
                        "t_sched_ms": metrics["t_sched_ms"],
                        "sched_ms_per_round": 1e3 * metrics["hub_split"]["sched"]
                        * metrics["wall_s"] / rounds,
                        "overhead_ms": 1e3 * busy_s / rounds - 1e3 * spec.model().S})
    targets = per_target(spec, totals)
    tokens = sum(t["tok_s"] for t in targets)
    alone = sum(not t["admitted"] for t in targets)
    loads = [h["load"] for h in per_hub]
    return {
        "mode": "pool", "emulated": True, "hubs": hubs, "placement": placement,
        "targets": n, "depth": spec.depth,
        "system_tok_s": tokens, "per_target_tok_s": tokens / max(n, 1),
        "slowest_tok_s": min((t["tok_s"] for t in targets), default=0.0),
        "hub_loads": loads,
        "load_spread": (max(loads) - min(loads)) / max(max(loads), 1e-9),
        "targets_per_hub": [h["admitted"] for h in per_hub],
        "alone": alone,
        "hub_r_q": [h["r_q"] for h in per_hub],
        "hub_system_tok_s": [h["system_tok_s"] for h in per_hub],
        "t_sched_ms": [h["t_sched_ms"] for h in per_hub],
        "sched_ms_per_round": [h["sched_ms_per_round"] for h in per_hub],
        "overhead_ms": [h["overhead_ms"] for h in per_hub],
        "model": balanced_model(spec, n, hubs),
        "emulated_targets": totals,
    }


def pool_doc(spec: EmulateSpec, ns: list[int], hubs: list[int], opts: EmulateOptions,
             progress: bool = True, max_targets: int | str = 0) -> dict:
    """Rows for every N and H, admission placement first and then random (for H > 1), and
    each row's ratio to one hub's system tokens/s at the same N where that row ran."""
    # deferred: torch and transformers load only when this runs
    from tqdm import tqdm

    from bench.run import machine_info

    plan = [(n, h, p) for n in ns for h in hubs for p in PLACEMENTS if h > 1 or p == PLACEMENTS[0]]
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="starhub-pool-")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    with tqdm(total=len(plan), unit="row", disable=not progress, file=sys.stderr) as bar:
        for n, h, placement in plan:
            bar.set_description(f"emulated pool N={n} H={h} {placement}")
            windows, totals = measure_point(spec, n, opts, log_dir, lambda _: None, spec.depth,
                                            max_targets, hubs=h, placement=placement)
            rows.append(pool_row(spec, n, h, placement, windows, totals))
            bar.update(1)
    for row in rows:
        one = next((r for r in rows if r["targets"] == row["targets"] and r["hubs"] == 1), None)
        row["vs_one_hub"] = row["system_tok_s"] / one["system_tok_s"] if one else None
    model = spec.model()
    config = {"mode": "pool", "emulate": spec.text(), "targets": ns, "hubs": hubs,
              "placements": list(PLACEMENTS), "max_targets": max_targets,
              "drafter": "emulated", "depth": spec.depth,
              "model": {**model.predict(1), "S_ms": 1e3 * model.S, "Z_ms": 1e3 * model.Z,
                        "tau": model.tau},
              "notes": {"placement": "admission: each target reads every hub's STATS and "
                                     "greets the best offer first (starhub.client.pool); "
                                     "random: one hub drawn at random, kept",
                        "load_spread": "(busiest hub's load - least busy's) / busiest's",
                        "vs_one_hub": "system_tok_s over the one-hub row's at the same N",
                        "t_sched_ms": "each hub's scheduling delay per idle gap (from a "
                                      "request ready on an idle hub to its draft)",
                        "sched_ms_per_round": "each hub's scheduling delays over the window, "
                                              "per round",
                        "overhead_ms": "each hub's busy time per round minus S(d)"}}
    return {"machine": machine_info(), "config": config, "rows": rows}
