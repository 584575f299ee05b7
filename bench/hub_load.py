"""``starhub bench --hub-load``: the hub's own throughput, with nothing else computing.

For each N and each combination of the hub's control options (depth, admission, batch,
pre-drafting) a fresh real hub with its real drafter serves N replay clients
(``bench.replay_targets``) that answer every PROPOSE from a recorded greedy run of the
target model. The hub is then the only thing that computes, so its rounds per second
(``r_q``), draft time per round and ``load`` show what batching and pre-drafting buy.
Rates come from the hub's counters over a window after a warm-up.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.defaults import DEFAULT_REPLAY_PROMPTS
from bench.emulate_spec import EmulateSpec
from bench.replay import Recording, ensure_recording
from bench.replay_targets import measure
from bench.run import StarConfig, StarVariant, hub_flags, machine_info, on_off, variants
from bench.runs import median_run
from starhub.client.connection import HubClient
from starhub.hub.metrics import DRAFT_KEYS, derive
from starhub.launch import spawn_hub
from starhub.wire.messages import DrafterCard, ObserverCard

WINDOW_KEYS = ("r_q", "t_s_ms", "t_draft_ms", "load", "system_tok_s", "per_target_tok_s",
               "mean_accept_len", "t_wait_ms", "t_idle_ms", "z_ms", "rounds", "commits",
               "plain_rounds", "tokens", "wall_s", "proposed_nodes_mean")
METRIC_NOTES = {
    "r_q": "hub draft rounds per second over the measured window",
    "t_s_ms": "hub drafting time per tree layer (the model's t_s)",
    "t_draft_ms": "hub drafting time per round (draft seconds over rounds)",
    "load": "fraction of the window the hub's drafter was busy",
    "system_tok_s": "tokens the replay clients committed per second, by the hub's count",
    "mean_accept_len": "committed tokens per verified round, bonus included, by the hub's "
                       "count; the clients accept greedily along the recorded continuation",
    "batch": "the hub's --batch as given; batch_mean the sessions it drafted per pass",
    "predraft": "the hub's --predraft as given; predraft_hit_rate the COMMITs answered by a "
                "tree drafted ahead",
    "critical_draft_ms": "draft time per round that a target waited for (pre-drafted "
                         "rounds excluded)",
    "lookup": "the hub's --lookup as given; lookup_token_share the committed tokens that "
              "only its grafted prompt-lookup branch held",
    "draft_process": "the hub's --draft-process as given: on, drafting in a process of its "
                     "own; off, in a thread of the hub's; auto, on for the eagle drafter",
    "r_q_runs": "with --repeat: r_q of every run of the row, in the order they ran; the "
                "row's other figures are from its median run",
}


@dataclass
class HubLoadConfig(StarConfig):
    prompts: str = str(DEFAULT_REPLAY_PROMPTS)
    record_prompts: int = 8
    max_new_tokens: int = 128
    warmup_s: float = 1.0
    duration_s: float = 3.0
    t_v: float | None = None
    """Seconds the clients wait before answering a tree; None answers at once."""
    repeat: int = 1
    """Runs of every row, interleaved; the table keeps each row's median run."""
    cache: str | None = None

    def variants(self) -> list[StarVariant]:
        return variants(self)


def parse_t_v(spec: str | None) -> float | None:
    """``--emulate`` in hub-load mode: only ``t_v=`` (how long a client 'verifies')."""
    if not spec:
        return None

    keys = {item.partition("=")[0].strip() for item in spec.split(",") if item.strip()}
    if keys != {"t_v"}:
        raise ValueError(f"--hub-load takes --emulate t_v=TIME only (got {sorted(keys)})")
    return EmulateSpec.parse(spec).t_v


def feature_layers_of(address: str) -> tuple[list[int], str]:
    """The features the hub's DRAFTER_CARD asks targets for, and its drafter's name."""

    client = HubClient(address, timeout_s=30)
    try:
        card = client.request(ObserverCard(name="bench"))
    finally:
        client.close()
    if not isinstance(card, DrafterCard):
        raise RuntimeError(f"the hub answered an observer's card with {card}")
    return list(card.feature_layers), card.drafter


def load_row(cfg: HubLoadConfig, n: int, variant: StarVariant, c0: dict, c1: dict,
             replay: dict, drafter: str) -> dict:

    window = derive(c0["counters"], c1["counters"], targets=n)
    return {
        "mode": "hub-load", "targets": n, "drafter": drafter, **variant.record(),
        **{k: window.get(k) for k in WINDOW_KEYS},
        **{k: window.get(k) for k in DRAFT_KEYS},
        "choices": window.get("choices"), "accept_len_hist": window.get("accept_len_hist"),
        "accept_rate_by_depth": window.get("accept_rate_by_depth"),
        "hub_split": window.get("hub_split"),
        "threads": {"hub": cfg.hub_threads, "hub_stats": c1.get("threads")},
        "replay": replay,
    }


def run_point(cfg: HubLoadConfig, n: int, variant: StarVariant, log_dir: str,
              recording: Recording | None, progress: bool, run: int = 0
              ) -> tuple[dict, Recording]:
    """One row: a fresh hub, N replay clients, a warm-up, then the measured window. The
    recording is made (or read from the cache) once the first hub says which features
    it wants."""

    name = f"n{n}-{variant.name}" + (f"-run{run + 1}" if cfg.repeat > 1 else "")
    with open(f"{log_dir}/hub-{name}.log", "w") as hub_log, \
            spawn_hub(hub_flags(cfg, variant), threads=cfg.hub_threads,
                      log_file=hub_log) as hub:
        layers, drafter = feature_layers_of(hub.address)
        if recording is None or recording.meta.feature_layers != layers:
            recording = ensure_recording(
                cfg.model, cfg.prompts, cfg.record_prompts, cfg.max_new_tokens, layers,
                threads=cfg.threads, dtype=cfg.dtype,
                cache=Path(cfg.cache) if cfg.cache else None, progress=progress)
        if progress:
            print(f"hub-load: N={n} depth={variant.depth} topk={variant.topk} "
                  f"max-nodes={variant.max_nodes} max-targets={variant.max_targets} "
                  f"batch={variant.batch} predraft={on_off(variant.predraft)} "
                  f"lookup={on_off(variant.lookup)} prune={on_off(variant.prune)} "
                  f"draft-process={on_off(variant.draft_process)}: "
                  + (f"run {run + 1} of {cfg.repeat}, " if cfg.repeat > 1 else "") +
                  f"{cfg.warmup_s:g}s warm-up, "
                  f"{cfg.duration_s:g}s measured", file=sys.stderr, flush=True)
        c0, c1, totals = asyncio.run(measure(hub.address, recording, n, cfg.warmup_s,
                                             cfg.duration_s, cfg.t_v))
    replay = {"window": totals.window(), **{k: v for k, v in asdict(totals).items()
                                              if k != "marks"}}
    return load_row(cfg, n, variant, c0, c1, replay, drafter), recording


def run_hub_load(cfg: HubLoadConfig, progress: bool = True) -> dict:
    """Rows for every N and combination of control values, in that order. With
    ``repeat`` > 1 all rows run, then all again, so that a machine's slow spell falls on
    every row rather than on one; each row keeps its median run."""

    if cfg.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="starhub-hub-load-")
    os.makedirs(log_dir, exist_ok=True)
    points = [(n, variant) for n in cfg.targets for variant in cfg.variants()]
    runs: list[list[dict]] = [[] for _ in points]
    recording = None
    for run in range(cfg.repeat):
        for (n, variant), done in zip(points, runs, strict=True):
            row, recording = run_point(cfg, n, variant, log_dir, recording, progress, run)
            done.append(row)
    rows = [median_run(done, "r_q") for done in runs]
    meta = asdict(recording.meta) if recording is not None else {}
    config = {k: v for k, v in asdict(cfg).items() if k not in ("log_dir", "predraft")}
    config.update(mode="hub-load", predraft=[on_off(p) for p in cfg.predraft],
                  lookup=[on_off(v) for v in cfg.lookup], prune=[on_off(v) for v in cfg.prune],
                  draft_process=[on_off(v) for v in cfg.draft_process], logs=log_dir,
                  recording={**{k: meta.get(k) for k in (
                      "key", "model", "prompts", "prompt_names", "max_new_tokens",
                      "feature_layers", "step_ms", "verify_ms", "verify_nodes")},
                      "path": str(recording.path) if recording else None,
                      "reused": bool(recording and recording.reused),
                      "tokens": sum(len(o) for o in recording.outputs) if recording else 0},
                  threads_note=f"the hub drafts with {cfg.hub_threads} torch thread(s) "
                               f"(--hub-threads); the replay clients compute nothing",
                  metric_notes=METRIC_NOTES)
    return {"machine": machine_info(), "config": config, "rows": rows}
