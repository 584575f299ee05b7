"""``starhub bench --serve``: N ``starhub serve`` processes sharing one hub (star) against
the same N servers without a hub (plain), driven open-loop by Poisson arrivals at each
request rate, every greedy output checked against the other mode's and ``generate()``'s.

Both fleets start once and stay up for the whole run; the rates run in turn, each rate
once per mode (the mode that goes first alternates from rate to rate, so slow drift of a
shared host falls on both). With ``--repeat R`` every rate runs R times, all rates and then
all again, the first mode alternating from run to run too; a row then shows its median run.
The hub's figures for a row are its counters over that row's window, as ``--hub-load``
reads them."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import msgspec

from bench.baselines import hf_generate
from bench.defaults import DEFAULT_PROMPTS
from bench.run import machine_info
from bench.runs import median_run
from bench.serve_checks import scrape
from bench.serve_load import (
    Arrival,
    Outcome,
    closed_schedule,
    drive,
    per_request,
    poisson_schedule,
    slo_summary,
    spec_summary,
    summarize,
    sustained_rates,
)
from starhub.hub.metrics import derive
from starhub.launch.spawn import HubProcess, spawn_hub, spawn_servers
from starhub.launch.status import observer_client
from starhub.models.prompts import read_prompts
from starhub.options import AUTO, resolve_threads, usable_cores
from starhub.wire.messages import StatsQuery

MODES = ("star", "plain")
GENERATE_SAMPLE = 8
"""Distinct prompts whose outputs are also checked against ``generate()`` in this process."""
WARMUP_TOKENS = 16

SERVE_NOTES = {
    "rate": "offered load: Poisson arrivals at this many requests per second in total, sent "
            "round-robin to the N servers (each gets rate/N); the same seeded schedule "
            "drives both modes",
    "request_throughput": "completed requests over the span from the first send to the "
                          "last finish",
    "output_tok_s": "output tokens over that span, all servers together; below the servers' "
                    "capacity it follows the offered load in both modes",
    "ttft_p50_ms": "time to first token: the client's send to the first streamed chunk with "
                   "text (p50 and p99 over the row's requests)",
    "tpot_p50_ms": "time per output token after the first: (last chunk - first text chunk) / "
                   "(completion tokens - 1), per request",
    "tau": "committed tokens per verified round, bonus included, from the responses' "
           "spec_decode fields (star only)",
    "plain_token_share": "output tokens decoded without a draft tree (the hub sent the "
                         "request plain, or was late), from spec_decode",
    "hub_load": "fraction of the row's window the hub spent drafting (its counters, as "
                "--hub-load reads them); hub_tau, hub_r_q, hub_batch_mean the same window",
    "mean_verify_batch": "requests per batched verify pass over the row's window, all "
                         "servers (their /metrics counters)",
    "lossless": "every output's token ids equal the plain rows' for the same prompt (greedy), "
                f"and generate()'s for up to {GENERATE_SAMPLE} distinct prompts",
    "tok_s_vs_plain": "output_tok_s over the plain row's at the same rate",
    "output_tok_s_runs": "with --repeat: output_tok_s of every run of the row, in the order "
                         "they ran; the row's other figures are from its median run, but "
                         "requests, completed, failed and lossless, which cover every run",
    "tok_s_vs_plain_runs": "with --repeat: each run's output_tok_s over the plain run's at the "
                           "same rate and repeat, which ran just before or after it",
    "tpot_p50_vs_plain": "the plain row's tpot_p50_ms over this row's (above 1: faster)",
    "max_send_lag_ms": "how late the load generator sent a request after its scheduled "
                       "arrival (it shares the cores with the servers)",
    "goodput_rps": "with --slo: requests a second that met every SLO (a failed request meets "
                   "none), over the row's span, as DistServe and vLLM's --goodput count them",
    "slo_attainment": "with --slo: the share of the row's requests that met every SLO",
    "sustained_rate": "with --slo: per mode, the highest offered rate whose attainment is "
                      "at least 90%, and star's over plain's (sustained_concurrency: the "
                      "same for the closed loop's client counts)",
    "e2e_p50_vs_plain": "the plain row's median end-to-end latency over this row's at the "
                        "same load: above 1, this mode answers sooner",
    "concurrency": "with --concurrency: clients in a closed loop, each sending its next "
                   "request when its last ends (rate is then none)",
    "requests": "one record per request of every run (mode, rate, ttft_ms, tpot_ms, e2el_ms, "
                "output_tokens, lossless), to compute goodput at another SLO",
    "per_request": "each request in schedule order: its server, prompt (index), send time "
                   "from the row's first, TTFT, TPOT, end-to-end time, tokens, and its "
                   "spec_decode rounds and plain steps",
}
PLAIN_NOTE = ("plain: the same servers without --hub decode every request alone, batched, "
              "one plain step per pass; that already is plain generate() serving, so there is "
              "no third row")


@dataclass
class ServeConfig:
    targets: int
    rates: list[float]
    requests: int
    concurrency: list[int] = field(default_factory=list)
    """Closed-loop loads (clients each sending its next request when its last ends), in
    place of ``rates``; none: open loop at each rate."""
    model: str = "default"
    prompts: str = str(DEFAULT_PROMPTS)
    max_new_tokens: int = 64
    threads: int | str = AUTO
    """Each server's torch threads; ``auto``: the usable cores over the N servers."""
    hub_threads: int = 1
    hub_args: list[str] = field(default_factory=list)
    """``starhub hub`` flags beyond ``--model`` (none: the hub's defaults)."""
    seed: int = 0
    max_concurrency: int | None = None
    """The servers' ``--max-concurrency`` (None: theirs)."""
    speculate: str = "auto"
    """The star servers' ``--speculate``."""
    dtype: str = "auto"
    linear: str = "auto"
    repeat: int = 1
    """Runs of every row; each row shows its median run."""
    slo: dict[str, float] = field(default_factory=dict)
    """Seconds by ``bench.serve_load.SLO_KEYS`` (none: no goodput columns)."""
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.targets < 1:
            raise ValueError("--targets: at least one server")
        if not self.concurrency and (not self.rates or min(self.rates) <= 0):
            raise ValueError("--rate: request rates must be positive")
        if self.concurrency and min(self.concurrency) < 1:
            raise ValueError("--concurrency: at least one client")
        if self.requests < 1:
            raise ValueError("--requests must be at least 1")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.repeat < 1:
            raise ValueError("--repeat must be at least 1")


class Fleet:
    """N ``starhub serve`` processes on loopback, with a hub of their own (star) or none
    (plain); a context manager that stops them all."""

    def __init__(self, mode: str, cfg: ServeConfig, threads: int, log_dir: str):
        self.mode, self.cfg, self.threads, self.log_dir = mode, cfg, threads, log_dir
        self.hub: HubProcess | None = None
        self.urls: list[str] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        cfg = self.cfg
        if self.mode == "star":
            hub_log = self._stack.enter_context(open(f"{self.log_dir}/hub.log", "w"))
            self.hub = self._stack.enter_context(
                spawn_hub(["--model", cfg.model, *cfg.hub_args], threads=cfg.hub_threads,
                          log_file=hub_log))
        log = self._stack.enter_context(open(f"{self.log_dir}/servers-{self.mode}.log", "w"))

        many = []
        for i in range(cfg.targets):
            args = ["--model", cfg.model, "--dtype", cfg.dtype, "--linear", cfg.linear,
                    "--name", f"{self.mode}{i}"]
            if self.hub is not None:
                args += ["--hub", self.hub.address, "--speculate", cfg.speculate]
            if cfg.max_concurrency:
                args += ["--max-concurrency", str(cfg.max_concurrency)]
            many.append(args)
        try:
            servers = spawn_servers(many, threads=self.threads, timeout_s=300, log_file=log)
        except Exception as exc:
            raise RuntimeError(f"a {self.mode} server did not start ({exc}); see "
                               f"{log.name}") from exc
        self.urls = [self._stack.enter_context(server).url for server in servers]

    def model_name(self) -> str:
        with urllib.request.urlopen(self.urls[0] + "/v1/models", timeout=30) as resp:
            return json.loads(resp.read())["data"][0]["id"]

    def hub_stats(self) -> dict | None:
        """The hub's STATS with its raw counters (None without a hub)."""
        if self.hub is None:
            return None
        client = observer_client(self.hub.address, timeout_s=30, name="bench")
        try:
            return msgspec.to_builtins(client.request(StatsQuery(counters=True)).body)
        finally:
            client.close()

    def verify_counters(self) -> tuple[float, float]:
        """Batched verify passes and the requests in them, summed over the servers."""
        passes = rows = 0.0
        for url in self.urls:
            samples = scrape(url + "/metrics")
            passes += samples.get("starhub_serve_verify_passes_total", 0.0)
            rows += samples.get("starhub_serve_verify_rows_total", 0.0)
        return passes, rows


def conversations(prompts: list) -> list[list[dict]]:
    """Chat messages for each prompt of ``read_prompts``: a text becomes one user turn."""
    return [[{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            for _, p in prompts]


def warm_up(fleet: Fleet, model: str, convs: list[list[dict]], tokens: int) -> None:
    """One unmeasured request per server, all at once: the first forward passes of a fresh
    process are slow, and the hub's cost model learns from its first rounds."""
    outs = drive(fleet.urls, model, [Arrival(0.0, i, 0) for i in range(len(fleet.urls))],
                 convs, tokens)
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"{fleet.mode} servers failed their warm-up request: {failed[0]}")


def measure(fleet: Fleet, model: str, load: tuple[str, float], schedule: list[Arrival],
            convs: list[list[dict]], cfg: ServeConfig) -> tuple[dict, list[Outcome]]:
    """One row: the schedule's requests against ``fleet`` at ``load`` (("rate", r) or
    ("concurrency", c)), with the hub's and the servers' counters read just before and
    after."""
    kind, value = load
    closed = int(value) if kind == "concurrency" else None
    h0, v0 = fleet.hub_stats(), fleet.verify_counters()
    outs = drive(fleet.urls, model, schedule, convs, cfg.max_new_tokens, concurrency=closed)
    time.sleep(0.2)  # the last COMMITs and CLOSEs reach the hub
    h1, v1 = fleet.hub_stats(), fleet.verify_counters()
    row = {"mode": fleet.mode, "load": value, "rate": None if closed else value,
           "concurrency": closed, "targets": cfg.targets, **summarize(outs),
           **(spec_summary(outs) if fleet.mode == "star" else
              dict.fromkeys(("tau", "spec_rounds", "plain_token_share", "hub_requests"))),
           "mean_verify_batch": (v1[1] - v0[1]) / (v1[0] - v0[0]) if v1[0] > v0[0] else None,
           "threads": {"servers": fleet.threads,
                       "hub": h1.get("threads") if h1 is not None else None}}
    row.update(hub_window(h0, h1, cfg.targets))
    if cfg.slo:
        row.update(slo_summary(outs, cfg.slo))
    row["per_request"] = per_request(outs)
    return row, outs


HUB_KEYS = {"load": "hub_load", "r_q": "hub_r_q", "t_s_ms": "hub_t_s_ms",
            "mean_accept_len": "hub_tau", "batch_mean": "hub_batch_mean",
            "plain_rounds": "hub_plain_rounds", "rounds": "hub_rounds",
            "choices": "hub_choices"}


def hub_window(h0: dict | None, h1: dict | None, n: int) -> dict:
    """The hub's figures over a row's window (None for plain rows)."""
    if h0 is None or h1 is None:
        return dict.fromkeys(HUB_KEYS.values())
    window = derive(h0["counters"], h1["counters"], targets=n)
    out = {name: window.get(key) for key, name in HUB_KEYS.items()}
    out.update(hub_admitted=h1.get("admitted"), hub_n_max=h1.get("n_max"))
    return out


def check_lossless(rows: list[dict], outcomes: list[list[Outcome]],
                   generated: dict[int, list[int]]) -> None:
    """Set each row's ``lossless``: every finished request's token ids equal the first
    plain output for its prompt, and ``generate()``'s where that prompt was generated."""
    plain: dict[int, list[int]] = {}
    for row, outs in zip(rows, outcomes, strict=True):
        if row["mode"] == "plain":
            for o in outs:
                if o.error is None:
                    plain.setdefault(o.prompt, o.token_ids)
    for row, outs in zip(rows, outcomes, strict=True):
        mismatches, compared = [], 0
        for o in outs:
            if o.error is not None:
                continue
            refs = [r for r in (plain.get(o.prompt), generated.get(o.prompt)) if r is not None]
            compared += bool(refs)
            if any(o.token_ids != r for r in refs) or not o.token_ids:
                mismatches.append(o.index)
        row.update(lossless=bool(compared) and not mismatches, lossless_compared=compared,
                   lossless_mismatches=mismatches)


def generate_references(cfg: ServeConfig, outcomes: list[list[Outcome]],
                        threads: int) -> dict:
    """``generate()``'s greedy tokens, in this process with ``threads`` torch threads (a
    server's: on a shared host more threads than a server's can run much slower), for up
    to ``GENERATE_SAMPLE`` distinct prompts, from the prompt ids the servers reported."""
    # deferred: torch and transformers load only when this runs
    from starhub.models.loading import load_model, set_threads

    prompt_ids: dict[int, list[int]] = {}
    for o in (o for outs in outcomes for o in outs):
        if o.error is None and o.prompt_token_ids:
            prompt_ids.setdefault(o.prompt, o.prompt_token_ids)
    sample = sorted(prompt_ids)[:GENERATE_SAMPLE]
    if not sample:
        return {}
    previous = set_threads(None)
    try:
        set_threads(threads)
        model, _ = load_model(cfg.model, dtype=cfg.dtype, linear=cfg.linear)
        runs = hf_generate(model, [(p, prompt_ids[p]) for p in sample], cfg.max_new_tokens)
    finally:
        set_threads(previous)
    return {r.id: r.output_ids for r in runs}


def merge_runs(runs: list[dict]) -> list[dict]:
    """One row per (rate, mode) from the runs of each: its median run by output tok/s, with
    every run's request counts and losslessness, so that no run's failure or mismatch is
    lost with the runs the median leaves out."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["load"], run["mode"]), []).append(run)
    rows = []
    for group in groups.values():
        row = median_run(group, "output_tok_s")
        if len(group) > 1:
            row = {**row, **{key: sum(run[key] for run in group)
                             for key in ("requests", "completed", "failed")},
                   "lossless": all(run["lossless"] for run in group),
                   "lossless_compared": sum(run["lossless_compared"] for run in group),
                   "lossless_mismatches": sorted({i for run in group
                                                  for i in run["lossless_mismatches"]})}
        rows.append(row)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each row against the plain row at its load (and, with repeated runs, each run
    against the plain run of the same repeat): throughput, and TPOT and end-to-end latency
    (plain's over its own: above 1, this row is faster)."""
    plain = {r["load"]: r for r in rows if r["mode"] == "plain"}
    for row in rows:
        base = plain.get(row["load"])
        row["tok_s_vs_plain"] = (row["output_tok_s"] / base["output_tok_s"]
                                 if base and base["output_tok_s"] else None)
        if base and "output_tok_s_runs" in row:
            row["tok_s_vs_plain_runs"] = [
                mine / theirs if theirs else None for mine, theirs in
                zip(row["output_tok_s_runs"], base["output_tok_s_runs"], strict=True)]
        for key in ("tpot_p50_ms", "e2e_p50_ms"):
            mine, theirs = row.get(key), base.get(key) if base else None
            row[key.replace("_ms", "_vs_plain")] = theirs / mine if mine and theirs else None


def run_serve(cfg: ServeConfig, progress: bool = True) -> dict:
    """Both fleets, every rate in both modes (``repeat`` times), then the lossless check."""
    prompts = read_prompts(cfg.prompts)
    if not prompts:
        raise ValueError(f"--prompts: {cfg.prompts} holds no prompts")
    convs = conversations(prompts)
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="starhub-bench-serve-")
    os.makedirs(log_dir, exist_ok=True)
    threads = resolve_threads(cfg.threads, sharing=cfg.targets)
    loadavg = list(os.getloadavg())

    def say(text: str) -> None:
        if progress:
            print(f"serve: {text}", file=sys.stderr, flush=True)

    rows: list[dict] = []
    outcomes: list[list[Outcome]] = []
    say(f"starting {cfg.targets} star servers and their hub, and {cfg.targets} plain "
        f"servers (logs in {log_dir})")
    with Fleet("star", cfg, threads, log_dir) as star, \
            Fleet("plain", cfg, threads, log_dir) as plain:
        model = star.model_name()
        for fleet in (star, plain):
            warm_up(fleet, model, convs, WARMUP_TOKENS)
        hub_threads = (star.hub_stats() or {}).get("threads")
        for run in range(cfg.repeat):
            of = f" (run {run + 1} of {cfg.repeat})" if cfg.repeat > 1 else ""
            loads = [("concurrency", c) for c in cfg.concurrency] or \
                [("rate", r) for r in cfg.rates]
            for k, load in enumerate(loads):
                if load[0] == "rate":
                    schedule = poisson_schedule(load[1], cfg.requests, cfg.targets,
                                                len(convs), cfg.seed)
                    what = (f"at {load[1]:g} requests/s{of}: {cfg.requests} requests "
                            f"(~{schedule[-1].at_s:.0f}s of arrivals)")
                else:
                    schedule = closed_schedule(cfg.requests, cfg.targets, len(convs),
                                               cfg.seed)
                    what = f"with {load[1]} clients{of}: {cfg.requests} requests, closed loop"
                for fleet in (star, plain) if (k + run) % 2 == 0 else (plain, star):
                    say(f"{fleet.mode} {what}")
                    row, outs = measure(fleet, model, load, schedule, convs, cfg)
                    rows.append(row)
                    outcomes.append(outs)
    say(f"generate() for up to {GENERATE_SAMPLE} prompts")
    check_lossless(rows, outcomes, generate_references(cfg, outcomes, threads))
    records = request_records(rows, outcomes)
    rows = merge_runs(rows)
    rows.sort(key=lambda r: (r["load"], MODES.index(r["mode"])))
    add_ratios(rows)
    config = {k: v for k, v in asdict(cfg).items() if k != "log_dir"}
    config.update(mode="serve", served_model=model, n_prompts=len(prompts),
                  threads_resolved={"cores": usable_cores(), "servers": threads,
                                    "hub": hub_threads, "generate": threads},
                  threads_note=threads_note(cfg, threads), plain_note=PLAIN_NOTE,
                  metric_notes=SERVE_NOTES, logs=log_dir, generate_sample=GENERATE_SAMPLE,
                  warmup_tokens=WARMUP_TOKENS)
    machine = machine_info()
    machine["loadavg_at_start"] = loadavg
    doc = {"machine": machine, "config": config, "rows": rows, "requests": records}
    if cfg.slo:
        config["slo_ms"] = {key: 1e3 * limit for key, limit in cfg.slo.items()}
        doc["sustained_concurrency" if cfg.concurrency else "sustained_rate"] = \
            sustained_rates(rows)
    return doc


def request_records(rows: list[dict], outcomes: list[list[Outcome]]) -> list[dict]:
    """One record per request of every run, so that goodput at any other SLO can be
    computed from one run's file: its mode and rate, latencies, tokens and whether its
    output matched the references."""
    records = []
    for row, outs in zip(rows, outcomes, strict=True):
        wrong = set(row["lossless_mismatches"])
        for o in outs:
            e2el = None if o.done is None else o.done - o.sent
            records.append({
                "mode": row["mode"], "rate": row["rate"], "concurrency": row.get("concurrency"),
                "server": o.server,
                "prompt": o.prompt, "ttft_ms": _ms(o.ttft_s), "tpot_ms": _ms(o.tpot_s),
                "e2el_ms": _ms(e2el), "output_tokens": o.tokens,
                "lossless": o.error is None and o.index not in wrong, "error": o.error})
    return records


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 2)


def threads_note(cfg: ServeConfig, threads: int) -> str:
    why = ("--threads auto: the usable cores over N" if str(cfg.threads) == AUTO
           else f"--threads {cfg.threads}")
    return (f"each of the {cfg.targets} servers per mode runs {threads} torch thread(s) "
            f"({why}), the hub "
            f"{cfg.hub_threads} (--hub-threads); child processes get matching "
            f"OMP_NUM_THREADS/MKL_NUM_THREADS. Both modes' servers stay up for the whole run, "
            f"one mode loaded at a time; the load generator shares the same cores; "
            f"generate() runs afterwards in this process, with a server's threads")
