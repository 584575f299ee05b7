"""The edge benchmark: one verifier, N drafters, one row per (N, schedule, max-batch).

Real mode starts a ``starhub verifier`` and N ``starhub drafter`` processes on loopback,
splits the prompts across the drafters and checks every output against ``generate()``.
Emulated mode (``bench.emulate_edge``) runs the same verifier loop over an engine that
waits instead of computing, with drafters of different acceptance and speed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

import msgspec

from bench.baselines import PromptRun, hf_generate
from bench.emulate import _spawn_ready, _stop
from bench.run import baseline_row, lossless_check, machine_info, wait_for_outputs
from starhub.launch import child_env
from starhub.launch.status import observer_client
from starhub.models.loading import load_model, set_threads
from starhub.models.prompts import encode_prompt, iter_results, read_prompts
from starhub.wire.messages import StatsQuery

EDGE_NOTES = {
    "system_tok_s": "committed tokens of all drafters over the run's span",
    "per_drafter_tok_s": "each drafter's committed tokens over its own busy time",
    "jain": "Jain's fairness index of per_drafter_tok_s: 1 when all are equal, 1/N at worst",
    "sum_log_goodput": "sum over drafters of ln(per_drafter_tok_s): what proportional "
                       "fairness maximises",
    "slo_attainment": "fraction of rounds with a deadline that the verifier committed in "
                      "time (None when no session asked for a speed)",
    "mean_batch": "sessions per verifier forward pass",
    "verify_ms_per_step": "the verifier's time per forward pass",
    "drafter_idle": "fraction of the drafters' time spent waiting for COMMITs",
    "time_model_mape": "the verifier's verify-time estimator, error on passes it had not "
                       "yet seen",
}


@dataclass
class EdgeConfig:
    drafters: list[int]
    schedules: list[str]
    max_batch: list[int | str]
    drafter: str = "eagle"
    draft: str | None = None
    model: str = "default"
    prompts: str = ""
    max_new_tokens: int = 64
    threads: int = 1
    verifier_threads: int = 1
    budget: int = 0
    """The verifier's tokens per pass; 0: auto."""
    nodes: int = 10
    depth: int = 5
    topk: int = 4
    log_dir: str | None = None
    drafter_nice: int = 10
    """Drafters stand in for edge devices, each with a processor of its own: on one host
    they run at a lower priority, so that they never take the verifier's core from it."""
    baselines: list[str] = field(default_factory=lambda: ["hf-generate"])

    def variants(self) -> list[tuple[int, str, int | str]]:
        return [(n, s, b) for n in self.drafters for s in self.schedules for b in self.max_batch]


def batch_flag(value: int | str) -> str:
    return "auto" if value in (0, "auto") else str(value)


def jain(values: list[float]) -> float | None:
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def edge_row(n: int, schedule: str, max_batch: int | str, per_drafter: list[list[dict]],
             verifier: dict, reference: dict | None, mode: str = "edge") -> dict:
    """A row from each drafter's results (``starhub drafter`` JSON lines) and the
    verifier's STATS."""
    gens = [g for results in per_drafter for g in results if "output_ids" in g]
    starts = [g["stats"]["started_at"] for g in gens]
    span = max(g["stats"]["started_at"] + g["stats"]["wall_s"] for g in gens) - min(starts) \
        if gens else 0.0
    rates, waits, walls = [], 0.0, 0.0
    for results in per_drafter:
        ok = [g for g in results if "output_ids" in g]
        wall = sum(g["stats"]["wall_s"] for g in ok)
        rates.append(sum(len(g["output_ids"]) for g in ok) / wall if wall else 0.0)
        waits += sum(g["stats"]["wait_s"] for g in ok)
        walls += wall
    tokens = sum(len(g["output_ids"]) for g in gens)
    rounds = sum(g["stats"]["rounds"] for g in gens)
    slo_rounds = verifier.get("slo_rounds") or 0
    row = {
        "mode": mode, "drafters": n, "schedule": schedule, "max_batch": max_batch,
        "budget": verifier.get("budget"),
        "system_tok_s": tokens / span if span else 0.0,
        "per_drafter_tok_s": rates,
        "jain": jain(rates),
        "sum_log_goodput": sum(math.log(r) for r in rates) if rates and min(rates) > 0
        else None,
        "slo_attainment": 1 - verifier["slo_late"] / slo_rounds if slo_rounds else None,
        "mean_batch": verifier.get("mean_batch"),
        "verify_ms_per_step": verifier.get("verify_ms_per_step"),
        "drafter_idle": waits / walls if walls else None,
        "mean_accept_len": tokens / rounds if rounds else None,
        "tokens": tokens, "wall_s": span, "rounds": rounds,
        "failed": sum(1 for results in per_drafter for g in results if "error" in g),
        "time_model_mape": (verifier.get("scheduler") or {}).get("time_model_mape"),
        "verifier": {k: verifier.get(k) for k in ("steps", "mean_batch", "fed_per_step",
                                                  "batch_hist", "threads", "step_ms",
                                                  "verify_s", "gather_s", "prefill_s")},
    }
    if reference is not None:
        row.update(lossless_check([PromptRun(g["id"], g["output_ids"], 0.0, 0) for g in gens],
                                  reference))
    return row


def run_edge_real(cfg: EdgeConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    threads = set_threads(cfg.threads)
    items = read_prompts(cfg.prompts)
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="starhub-edge-")
    os.makedirs(log_dir, exist_ok=True)
    rows, reference = [], None
    variants = cfg.variants()
    with tqdm(total=len(items) * (len(variants) + 1), unit="prompt", disable=not progress,
              file=sys.stderr) as bar:
        if "hf-generate" in cfg.baselines:
            bar.set_description("hf-generate")
            model, tokenizer = load_model(cfg.model)
            prompts = [(str(i), encode_prompt(tokenizer, text)) for i, text in items]
            runs = hf_generate(model, prompts, cfg.max_new_tokens, tick=lambda: bar.update(1))
            reference = {str(r.id): r.output_ids for r in runs}
            base = baseline_row("hf-generate", runs, "none", None, threads, None)
            base.update(drafters=1, schedule=None, max_batch=None,
                        per_drafter_tok_s=[base["per_target_tok_s"]])
            rows.append(base)
            del model
        for n, schedule, max_batch in variants:
            bar.set_description(f"edge N={n} {schedule} max-batch={batch_flag(max_batch)}")
            rows.append(_run_variant(cfg, n, schedule, max_batch, log_dir, reference,
                                     lambda k: bar.update(k)))
    config = {k: v for k, v in asdict(cfg).items() if k != "log_dir"}
    config.update(mode="real", topology="edge", n_prompts=len(items), logs=log_dir,
                  metric_notes=EDGE_NOTES,
                  threads_note=f"the verifier runs {cfg.verifier_threads} torch thread(s), each "
                               f"drafter and the baseline {cfg.threads} (--threads; child "
                               f"processes also get OMP_NUM_THREADS); drafters run at nice "
                               f"{cfg.drafter_nice}, standing in for devices of their own")
    return {"machine": machine_info(), "config": config, "rows": rows}


def drafter_command(address: str, prompts: str, out: str, max_new_tokens: int, name: str,
                    model: str = "default", drafter: str = "eagle", draft: str | None = None,
                    depth: int = 5, topk: int = 4, nodes: int = 10, threads: int = 1,
                    shard: str = "0/1", timeout_s: float = 30.0) -> list[str]:
    """The ``starhub drafter`` command line of one benchmark drafter."""
    return [sys.executable, "-m", "starhub", "drafter", "--verifier", address,
            "--model", model, "--drafter", drafter, *(["--draft", draft] if draft else []),
            "--depth", str(depth), "--topk", str(topk), "--max-nodes", str(nodes),
            "--prompts", prompts, "--out", out, "--max-new-tokens", str(max_new_tokens),
            "--threads", str(threads), "--shard", shard, "--name", name,
            "--timeout", repr(timeout_s)]


def _run_variant(cfg: EdgeConfig, n: int, schedule: str, max_batch: int | str, log_dir: str,
                 reference: dict | None, tick) -> dict:

    name = f"n{n}-{schedule}-b{batch_flag(max_batch)}"
    cmd = [sys.executable, "-m", "starhub", "verifier", "--bind", "tcp://127.0.0.1:0",
           "--model", cfg.model, "--threads", str(cfg.verifier_threads),
           "--schedule", schedule, "--max-batch", batch_flag(max_batch),
           "--budget", str(cfg.budget or "auto"), "--nodes", str(cfg.nodes)]
    verifier, address = _spawn_ready(cmd, f"{log_dir}/verifier-{name}.log")
    outs = [f"{log_dir}/{name}-drafter{i}.jsonl" for i in range(n)]
    try:
        with open(f"{log_dir}/drafters-{name}.log", "w") as log:
            procs = [subprocess.Popen(
                drafter_command(address, cfg.prompts, out, cfg.max_new_tokens, f"drafter{i}",
                                model=cfg.model, drafter=cfg.drafter, draft=cfg.draft,
                                depth=cfg.depth, topk=cfg.topk, nodes=cfg.nodes,
                                threads=cfg.threads, shard=f"{i}/{n}"),
                env=child_env(cfg.threads), stderr=log, stdout=subprocess.DEVNULL,
                preexec_fn=(lambda: os.nice(cfg.drafter_nice)) if cfg.drafter_nice else None)
                for i, out in enumerate(outs)]
            wait_for_outputs(procs, outs, tick, f"a drafter failed; see {log.name}")
        client = observer_client(address, timeout_s=30, name="bench")
        stats = msgspec.to_builtins(client.request(StatsQuery()).body)
        client.close()
    finally:
        _stop(verifier)
    return edge_row(n, schedule, max_batch, [list(iter_results(out)) for out in outs], stats,
                    reference)

