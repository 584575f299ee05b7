"""The real-mode benchmark: for each N a fresh hub process and N target processes on
loopback, the prompts split across them, plus the baselines on the same prompts."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from bench.baselines import PromptRun, colocated, hf_generate
from bench.defaults import BASELINES
from bench.notes import METRIC_NOTES, THREADS_NOTE
from starhub.drafters import make_drafter
from starhub.drafters.base import TreeShape
from starhub.hub.metrics import DRAFT_KEYS
from starhub.launch import child_env, spawn_hub, target_command
from starhub.launch.status import observer_client
from starhub.models.loading import linear_in_use, load_model, set_threads
from starhub.models.prompts import iter_results, read_prompts
from starhub.options import (
    AUTO,
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    resolve_threads,
    usable_cores,
)
from starhub.wire.messages import StatsQuery
from targets.generate import encode_prompt

METRICS = ("system_tok_s", "per_target_tok_s", "t_s_ms", "t_wait_ms", "t_idle_ms", "r_q",
           "r_p", "load", "mean_accept_len")


@dataclass
class StarConfig:
    """What the star benchmarks share: the hub's drafter and tree, and the control lists
    that give every combination its own row (``variants``)."""

    targets: list[int]
    drafter: str
    draft: str | None | list[str | None]
    """The hub's drafter weights; a list gives every value its own star rows (the colocated
    baseline uses the first)."""
    depth: list[int | str]
    """Star rows run once per value: a fixed depth or ``auto``."""
    topk: int | list[int]
    """Star rows run once per value: the hub's ``--topk`` (the colocated baseline uses the
    first)."""
    max_nodes: int | list[int]
    """Star rows run once per value: the hub's ``--max-nodes`` (colocated: the first)."""
    draft_dtype: str = "auto"
    dtype: str = "auto"
    model: str = "default"
    threads: int | str = AUTO
    """Each target's torch threads; ``auto``: the usable cores split between a row's N
    targets (``resolve_threads``); the baselines, one process, get them all."""
    hub_threads: int = 1
    log_dir: str | None = None
    max_targets: list[int | str] = field(default_factory=lambda: [0])
    """Star rows run once per value: the hub's ``--max-targets``."""
    batch: list[int | str] = field(default_factory=lambda: ["auto"])
    """Star rows run once per value: the hub's ``--batch``."""
    predraft: list[bool] = field(default_factory=lambda: [DEFAULT_PREDRAFT])
    """Star rows run once per value: the hub's ``--predraft``."""
    lookup: list[bool] = field(default_factory=lambda: [DEFAULT_LOOKUP])
    """Star rows run once per value: the hub's ``--lookup``."""
    prune: list[bool] = field(default_factory=lambda: [DEFAULT_PRUNE])
    """Star rows run once per value: the hub's ``--prune``."""
    draft_process: list[bool | str] = field(default_factory=lambda: [DEFAULT_DRAFT_PROCESS])
    """Star rows run once per value: the hub's ``--draft-process``."""

    def __post_init__(self) -> None:
        for key in ("depth", "topk", "max_nodes"):
            if not isinstance(getattr(self, key), list):
                setattr(self, key, [getattr(self, key)])

    @property
    def first_draft(self) -> str | None:
        return self.draft[0] if isinstance(self.draft, list) else self.draft

    @property
    def first_shape(self) -> TreeShape:
        """The tree of the baselines that need one: the first fixed depth, topk and node
        budget given."""
        depth = next((d for d in self.depth if isinstance(d, int)), TreeShape().depth)
        return TreeShape(depth, self.topk[0], self.max_nodes[0])


@dataclass
class BenchConfig(StarConfig):
    linear: str = "auto"
    prompts: str = ""
    max_new_tokens: int = 64
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))

    @property
    def fixed_depth(self) -> int:
        """The depth of the baselines that need one: the first fixed value given."""
        return self.first_shape.depth


def variants(cfg) -> list[StarVariant]:
    """Every combination of a config's ``draft``, ``depth``, ``topk``, ``max_nodes``,
    ``max_targets``, ``batch``, ``predraft``, ``lookup``, ``prune`` and ``draft_process``
    lists, one row each."""
    drafts = cfg.draft if isinstance(cfg.draft, list) else [cfg.draft]
    return [StarVariant(d, m, b, p, w, k, n, look, x, cut) for w in drafts for d in cfg.depth
            for k in cfg.topk for n in cfg.max_nodes
            for m in cfg.max_targets for b in cfg.batch for p in cfg.predraft
            for look in cfg.lookup for x in cfg.draft_process for cut in cfg.prune]


def hub_flags(cfg, variant: StarVariant) -> list[str]:
    """``starhub hub`` flags for a config's drafter and tree, with one row's settings."""
    draft = ["--draft", variant.draft] if variant.draft else []
    return ["--model", cfg.model, "--drafter", cfg.drafter, *draft,
            "--depth", str(variant.depth), "--topk", str(variant.topk),
            "--max-nodes", str(variant.max_nodes), "--draft-dtype", cfg.draft_dtype,
            "--max-targets", str(variant.max_targets), "--batch", str(variant.batch),
            "--predraft", on_off(variant.predraft), "--lookup", on_off(variant.lookup),
            "--prune", on_off(variant.prune), "--draft-process", on_off(variant.draft_process)]


@dataclass(frozen=True)
class StarVariant:
    """One star row's hub settings: each comparison option's value for that row."""

    depth: int | str
    max_targets: int | str = 0
    batch: int | str = "auto"
    predraft: bool = DEFAULT_PREDRAFT
    draft: str | None = None
    topk: int = TreeShape().topk
    max_nodes: int = TreeShape().max_nodes
    lookup: bool = DEFAULT_LOOKUP
    draft_process: bool | str = DEFAULT_DRAFT_PROCESS
    prune: bool = DEFAULT_PRUNE

    @property
    def name(self) -> str:
        tag = (f"d{self.depth}-k{self.topk}-n{self.max_nodes}-m{self.max_targets}"
               f"-b{self.batch}-p{on_off(self.predraft)}-l{on_off(self.lookup)}"
               f"-x{on_off(self.draft_process)}-c{on_off(self.prune)}")
        return tag + (f"-w{zlib.crc32(self.draft.encode()):08x}" if self.draft else "")

    def record(self) -> dict:
        """What a row records: the values as given to the hub."""
        return {"depth": self.depth, "topk": self.topk, "max_nodes": self.max_nodes,
                "max_targets": self.max_targets, "batch": self.batch,
                "predraft": on_off(self.predraft), "lookup": on_off(self.lookup),
                "draft_process": on_off(self.draft_process), "prune": on_off(self.prune),
                "draft": self.draft}


def first_variant(cfg: StarConfig) -> StarVariant:
    """The star row of a config's first values (the row a single-valued config runs)."""
    shape = cfg.first_shape
    return StarVariant(shape.depth, draft=cfg.first_draft, topk=shape.topk,
                       max_nodes=shape.max_nodes)


def on_off(value: bool | str) -> str:
    """A switch as the command line spells it; ``auto`` stays ``auto``."""
    if isinstance(value, str):
        return value
    return "on" if value else "off"


def machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def empty_row(mode: str, targets: int, drafter: str, depth: int | None) -> dict:
    return {"mode": mode, "targets": targets, "drafter": drafter, "depth": depth,
            **dict.fromkeys(METRICS), "tokens": 0, "wall_s": 0.0, "threads": {}}


def baseline_row(mode: str, runs: list[PromptRun], drafter: str, depth: int | None,
                 threads: int, reference: dict | None) -> dict:
    row = empty_row(mode, 1, drafter, depth)
    tokens = sum(len(r.output_ids) for r in runs)
    wall = sum(r.wall_s for r in runs)
    rounds = sum(r.rounds for r in runs)
    hist: Counter = sum((r.accept_len_hist for r in runs), Counter())
    at_depth: Counter = sum((r.accepted_at_depth for r in runs), Counter())
    rate = tokens / wall if wall else 0.0
    row.update(system_tok_s=rate, per_target_tok_s=rate, r_p=rounds / wall if wall else 0.0,
               tokens=tokens, wall_s=wall, rounds=rounds, prompts=len(runs),
               threads={"bench": threads})
    row["mean_accept_len"] = (sum(k * v for k, v in hist.items()) / sum(hist.values())
                              if hist else (tokens - len(runs)) / max(rounds, 1))
    row["accept_len_hist"] = {str(k): v for k, v in sorted(hist.items())}
    row["accept_rate_by_depth"] = [at_depth[k] / max(rounds, 1)
                                   for k in range(1, max(at_depth, default=0) + 1)]
    if mode != "hf-generate":
        row["r_q"] = row["r_p"]
    if mode == "colocated":
        draft_s = sum(r.draft_s for r in runs)
        row.update(t_s_ms=1e3 * draft_s / max(sum(r.draft_layers for r in runs), 1),
                   t_wait_ms=0.0, t_idle_ms=1e3 * (wall - draft_s) / max(rounds, 1),
                   load=draft_s / wall if wall else 0.0)
    row.update(lossless_check(runs, reference))
    return row


def pooled_generate_row(passes: list[list[PromptRun]], threads: int,
                        reference: dict) -> dict:
    """One hf-generate row over several passes on the same prompts, each pass's rate kept.

    Both passes must give the reference tokens: ``generate()`` is deterministic here."""
    row = baseline_row("hf-generate", [r for p in passes for r in p], "none", None, threads,
                       None)
    row["prompts"] = len(passes[0])
    row["passes_tok_s"] = [sum(len(r.output_ids) for r in p) / sum(r.wall_s for r in p)
                           for p in passes]
    row["deterministic"] = lossless_check(passes[-1], reference)["lossless"]
    return row


def lossless_check(runs, reference: dict | None) -> dict:
    """Greedy outputs must equal plain ``generate``'s on the same prompts, token for token."""
    if reference is None:
        return {"lossless": None, "lossless_mismatches": None}
    mismatches = [str(r.id) for r in runs if r.output_ids != reference.get(str(r.id))]
    return {"lossless": not mismatches, "lossless_mismatches": mismatches}


def per_target_rows(results: list[list[dict]]) -> list[dict]:
    """Each target's speed, whether the hub admitted it, and its own standalone speed."""
    out = []
    for i, target in enumerate(results):
        wall = sum(g["stats"]["wall_s"] for g in target)
        steps = [g["stats"].get("step_ms", 0.0) for g in target if g["stats"].get("step_ms")]
        step = sum(steps) / len(steps) if steps else 0.0
        out.append({"name": f"target{i}",
                    "tok_s": sum(len(g["output_ids"]) for g in target) / wall if wall else 0.0,
                    "admitted": any(not g["stats"]["standalone"] for g in target),
                    "standalone_tok_s": 1e3 / step if step else None,
                    "plain_tokens": sum(g["stats"].get("plain_tokens", 0) for g in target)})
    return out


def star_row(cfg: BenchConfig, n: int, results: list[list[dict]], hub: dict,
             reference: dict | None, variant: StarVariant | None = None) -> dict:
    """One N from the targets' JSONL results and the hub's STATS reply."""
    variant = variant or first_variant(cfg)
    row = empty_row("star", n, cfg.drafter, variant.depth)
    gens = [g for target in results for g in target]
    tokens = sum(len(g["output_ids"]) for g in gens)
    starts = [g["stats"]["started_at"] for g in gens]
    ends = [g["stats"]["started_at"] + g["stats"]["wall_s"] for g in gens]
    span = max(ends) - min(starts) if gens else 0.0
    per_target, r_p = [], []
    for target in results:
        wall = sum(g["stats"]["wall_s"] for g in target)
        if wall:
            per_target.append(sum(len(g["output_ids"]) for g in target) / wall)
            r_p.append(sum(g["stats"]["rounds"] for g in target) / wall)
    hist: Counter = Counter()
    at_depth: Counter = Counter()
    for g in gens:
        hist.update({int(k): v for k, v in g["stats"]["accept_len_hist"].items()})
        at_depth.update({k + 1: v for k, v in enumerate(g["stats"]["accepted_at_depth"])})
    rounds = sum(hist.values())
    split_keys = ("prefill_s", "verify_s", "plain_s", "hub_queue_s", "hub_draft_s", "comm_s")
    split = {k: sum(g["stats"].get(k, 0.0) for g in gens) for k in split_keys}
    split["other_s"] = max(0.0, sum(g["stats"]["wall_s"] for g in gens) - sum(split.values()))
    row.update(
        system_tok_s=tokens / span if span else 0.0,
        per_target_tok_s=sum(per_target) / len(per_target) if per_target else 0.0,
        r_p=sum(r_p) / len(r_p) if r_p else 0.0,
        mean_accept_len=sum(k * v for k, v in hist.items()) / rounds if rounds else 0.0,
        accept_rate_by_depth=[at_depth[k] / max(rounds, 1)
                              for k in range(1, max(at_depth, default=0) + 1)],
        accept_len_hist={str(k): v for k, v in sorted(hist.items())},
        tokens=tokens, wall_s=span, rounds=rounds, prompts=len(gens),
        target_split=split,
        threads={"hub": hub.get("threads"),
                 "targets": [target[0]["stats"].get("threads") for target in results if target]},
        standalone_prompts=sum(bool(g["stats"]["standalone"]) for g in gens),
        **variant.record(),
        per_target=per_target_rows(results),
        n_max=hub.get("n_max"),
        n_full=hub.get("n_full"),
        choices=hub.get("choices"),
        control=hub.get("control"),
        plain_tokens=sum(g["stats"].get("plain_tokens", 0) for g in gens),
        **{k: hub.get(k) for k in ("t_s_ms", "t_wait_ms", "t_idle_ms", "r_q", "load",
                                   *DRAFT_KEYS)},
        hub={k: hub.get(k) for k in ("wall_s", "rounds", "t_idle_gap_ms", "t_sched_ms",
                                     "z_ms", "hub_split", "system_tok_s", "mean_accept_len")},
    )
    row.update(admitted=sum(t["admitted"] for t in row["per_target"]),
               rejected=sum(not t["admitted"] for t in row["per_target"]))
    row.update(lossless_check([PromptRun(g["id"], g["output_ids"], 0.0, 0) for g in gens],
                              reference))
    return row


def add_speedups(rows: list[dict]) -> None:
    """Each row's per-target tok/s over plain ``generate()``'s from the same run."""
    base = next((r["per_target_tok_s"] for r in rows if r["mode"] == "hf-generate"), None)
    for row in rows:
        row["speedup_vs_generate"] = (row["per_target_tok_s"] / base
                                      if base and row["per_target_tok_s"] is not None else None)


def run_star(cfg: BenchConfig, n: int, log_dir: str, reference: dict | None,
             tick=lambda k: None, variant: StarVariant | None = None) -> dict:

    variant = variant or first_variant(cfg)
    name = f"n{n}-{variant.name}"
    threads = resolve_threads(cfg.threads, sharing=n)
    with open(f"{log_dir}/hub-{name}.log", "w") as hub_log, \
            spawn_hub(hub_flags(cfg, variant), threads=cfg.hub_threads,
                      log_file=hub_log) as hub, \
            open(f"{log_dir}/targets-{name}.log", "w") as target_log:
        outs = [f"{log_dir}/{name}-target{i}.jsonl" for i in range(n)]
        procs = []
        for i, out in enumerate(outs):
            cmd = target_command(hub.address, cfg.prompts, out, threads=threads,
                                 extra=["--model", cfg.model, "--dtype", cfg.dtype,
                                        "--linear", cfg.linear,
                                        "--max-new-tokens",
                                        str(cfg.max_new_tokens), "--shard", f"{i}/{n}",
                                        "--name", f"target{i}"])
            procs.append(subprocess.Popen(cmd, env=child_env(threads), stderr=target_log,
                                          stdout=subprocess.DEVNULL))
        wait_for_outputs(procs, outs, tick, f"a target failed; see {target_log.name}")
        client = observer_client(hub.address, timeout_s=30, name="bench")
        stats = msgspec.to_builtins(client.request(StatsQuery()).body)
        client.close()
    return star_row(cfg, n, [list(iter_results(out)) for out in outs], stats, reference,
                    variant)


def wait_for_outputs(procs: list[subprocess.Popen], outs: list[str], tick,
                     failure: str) -> None:
    """Wait for ``procs``, ticking once per JSON line they write to ``outs``; raise
    RuntimeError(``failure`` and the exit codes) if any of them failed."""
    done = 0
    while any(p.poll() is None for p in procs):
        time.sleep(0.5)
        now = sum(_lines(out) for out in outs)
        tick(now - done)
        done = now
    tick(sum(_lines(out) for out in outs) - done)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{failure} (exit codes {codes})")


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


def run_real(cfg: BenchConfig, progress: bool = True) -> dict:
    """Baselines in this process, then a hub and N target processes per star row. This
    process's torch threads are set for the baselines and restored afterwards."""

    previous = set_threads(None)
    try:
        return _run_real(cfg, set_threads(resolve_threads(cfg.threads)), progress)
    finally:
        set_threads(previous)


def _run_real(cfg: BenchConfig, threads: int, progress: bool) -> dict:
    from tqdm import tqdm

    items = read_prompts(cfg.prompts)
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="starhub-bench-")
    os.makedirs(log_dir, exist_ok=True)
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, linear=cfg.linear)
    prompts = [(str(id_), encode_prompt(tokenizer, text)) for id_, text in items]
    rows: list[dict] = []
    reference: dict | None = None
    star_rows = variants(cfg)
    total = len(prompts) * (len(cfg.baselines) + len(cfg.targets) * len(star_rows))
    with tqdm(total=total, unit="prompt", disable=not progress, file=sys.stderr) as bar:
        def tick(k: int = 1) -> None:
            bar.update(k)

        if "hf-generate" in cfg.baselines:
            bar.set_description("hf-generate")
            generate_runs = hf_generate(model, prompts, cfg.max_new_tokens, tick=tick)
            reference = {str(r.id): r.output_ids for r in generate_runs}
            rows.append(baseline_row("hf-generate", generate_runs, "none", None, threads,
                                     None))
        if "hf-prompt-lookup" in cfg.baselines:
            bar.set_description("hf-prompt-lookup")
            runs = hf_generate(model, prompts, cfg.max_new_tokens,
                               prompt_lookup=cfg.fixed_depth, tick=tick)
            rows.append(baseline_row("hf-prompt-lookup", runs, "prompt-lookup",
                                     cfg.fixed_depth, threads, reference))
        if "colocated" in cfg.baselines:
            bar.set_description("colocated")
            drafter = make_drafter(cfg.drafter, cfg.first_draft, cfg.model, cfg.draft_dtype)
            runs = colocated(model, drafter, cfg.first_shape, prompts, cfg.max_new_tokens,
                             tick=tick)
            rows.append(baseline_row("colocated", runs, cfg.drafter, cfg.fixed_depth, threads,
                                     reference))
            del drafter
        for n in cfg.targets:
            for variant in star_rows:
                bar.set_description(f"star N={n} depth={variant.depth} topk={variant.topk} "
                                    f"max-nodes={variant.max_nodes} max-targets="
                                    f"{variant.max_targets} batch={variant.batch} "
                                    f"predraft={on_off(variant.predraft)} "
                                    f"lookup={on_off(variant.lookup)} "
                                    f"prune={on_off(variant.prune)} "
                                    f"draft-process={on_off(variant.draft_process)}")
                rows.append(run_star(cfg, n, log_dir, reference, tick=tick, variant=variant))
        if reference is not None and cfg.targets and star_rows:
            bar.set_description("hf-generate (second pass)")
            bar.total += len(prompts)
            again = hf_generate(model, prompts, cfg.max_new_tokens, tick=tick)
            rows[0] = pooled_generate_row([generate_runs, again], threads, reference)
    add_speedups(rows)
    config = {k: v for k, v in asdict(cfg).items() if k != "log_dir"}
    config.update(linear=linear_in_use(model),
                  predraft=[on_off(p) for p in cfg.predraft],
                  lookup=[on_off(v) for v in cfg.lookup],
                  prune=[on_off(v) for v in cfg.prune],
                  draft_process=[on_off(v) for v in cfg.draft_process])
    config.update(threads_resolved={"cores": usable_cores(), "baselines": threads,
                                    "targets": {str(n): resolve_threads(cfg.threads, n)
                                                for n in cfg.targets}})
    config.update(mode="real", n_prompts=len(prompts), threads_note=THREADS_NOTE,
                  metric_notes=METRIC_NOTES, logs=log_dir)
    return {"machine": machine_info(), "config": config, "rows": rows}
