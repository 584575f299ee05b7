"""Emulated accelerators: the real hub, sockets, scheduling and metrics, with model compute
replaced by calibrated waits, so one small machine can show how the star topology scales
to hundreds of GPUs.

The hub process runs ``Hub`` with an ``EmulatedDrafter`` (it sleeps ``depth · t_s``), and
its real controller: ``--depth auto`` and ``--max-targets`` work as in a real hub. Target
processes (``bench.emulate_targets``) run many emulated targets on one asyncio loop.

``python -m bench.emulate hub|targets`` are the two process entry points; ``run_emulated``
drives them for each N, depth and admission setting and returns the benchmark's rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import pairwise

import msgspec

from bench.emulate_spec import VOCAB, EmulateSpec, load_trace
from bench.emulate_targets import PLACEMENTS, targets_main
from bench.model import StarModel
from bench.notes import METRIC_NOTES
from bench.settings import hub_value
from starhub.hub.metrics import derive
from starhub.launch import READY, child_env
from starhub.launch.spawn import wait_ready
from starhub.launch.status import observer_client
from starhub.options import AUTO, MAX_AUTO_DEPTH
from starhub.wire.messages import StatsQuery

__all__ = ["EmulateOptions", "EmulateSpec", "emulated_doc", "load_trace", "model_check",
           "run_emulated"]

# --- the hub process -------------------------------------------------------------------

def hub_main(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from starhub.drafters.base import TreeShape
    from starhub.drafters.emulated import EmulatedDrafter
    from starhub.hub.server import Hub, HubConfig
    from starhub.models.loading import set_threads

    set_threads(args.threads)
    adaptive = args.depth == AUTO
    depth = MAX_AUTO_DEPTH if adaptive else int(args.depth)
    shape = TreeShape(depth=depth, topk=1, max_nodes=depth)
    hub = Hub(EmulatedDrafter(args.t_s, VOCAB),
              HubConfig(bind=args.bind, shape=shape, adaptive=adaptive,
                        max_targets=hub_value("max_targets")(args.max_targets),
                        metrics_port=args.metrics_port, log_every_s=args.log_every))

    async def main() -> None:
        task = asyncio.create_task(hub.serve())
        await hub.ready.wait()
        print(READY + hub.bound, flush=True)
        await task

    _run_loop(main())
    return 0


def _run_loop(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass


# --- the driver ------------------------------------------------------------------------

@dataclass
class EmulateOptions:
    duration_s: float = 3.0
    """Measured seconds per N; stretched so that every target verifies several rounds."""
    warmup_s: float = 1.0
    """Unmeasured seconds first, while the link calibrates and the schedule settles."""
    procs: int = 1
    """Processes the emulated targets are spread over."""
    max_new_tokens: int = 512
    """Session length; a session's last round is verified but never committed."""
    metrics_port: int = 0
    seed: int = 0
    min_iterations: int = 4
    log_dir: str | None = None


def _spawn_ready(cmd: list[str], log_path: str, timeout_s: float = 120.0,
                 stdin: bool = False) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` and wait for its first line that starts with READY."""

    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                stdin=subprocess.PIPE if stdin else None, env=child_env(1))
    try:
        found = wait_ready(proc, cmd[2], timeout_s, prefixes=(READY, "READY "), drain=False)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd[:4])} did not start (exit {proc.poll()}); "
                           f"see {log_path}") from None
    return proc, found


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_point(spec: EmulateSpec, n: int, opts: EmulateOptions, log_dir: str,
              tick: Callable[[float], None] = lambda _: None, depth: int | str | None = None,
              max_targets: int | str = 0) -> dict:
    """One N: a fresh hub process, N emulated targets, a measured window between two STATS
    readings after a warm-up; returns the benchmark row with the model's prediction.
    ``depth`` (a number or ``auto``) overrides the spec's."""

    depth = spec.depth if depth is None else depth
    if depth != "auto":
        spec = replace(spec, depth=int(depth))
    windows, totals = measure_point(spec, n, opts, log_dir, tick, depth, max_targets)
    ((c0, c1),) = windows
    model = spec.model()
    row = emulated_row(spec, n, derive(c0["counters"], c1["counters"], targets=n), c1,
                       totals, None if depth == "auto" else model)
    row.update(depth=depth, max_targets=max_targets)
    return row


def measure_point(spec: EmulateSpec, n: int, opts: EmulateOptions, log_dir: str,
                  tick: Callable[[float], None], depth: int | str, max_targets: int | str,
                  hubs: int = 1, placement: str = "admission") -> tuple[list, list[dict]]:
    """A fresh hub process for each of ``hubs``, N emulated targets placed over them, and a
    measured window between two STATS readings of each hub after a warm-up. Returns each
    hub's (first, last) STATS as plain data and the target processes' totals."""
    name = f"n{n}-d{depth}-m{max_targets}" + (f"-h{hubs}-{placement}" if hubs > 1 else "")
    hub_cmd = [sys.executable, "-m", "bench.emulate", "hub", "--bind", "tcp://127.0.0.1:0",
               "--t-s", repr(spec.t_s), "--depth", str(depth), "--threads", "1",
               "--max-targets", str(max_targets)]
    servers: list[subprocess.Popen] = []
    procs: list[subprocess.Popen] = []
    try:
        addresses = []
        for h in range(hubs):
            port = str(opts.metrics_port + h if opts.metrics_port else 0)
            hub, address = _spawn_ready([*hub_cmd, "--metrics-port", port],
                                        f"{log_dir}/hub{h}-{name}.log")
            servers.append(hub)
            addresses.append(address)
        shares = [len(range(i, n, min(opts.procs, n))) for i in range(min(opts.procs, n))]
        first = 0
        for share in shares:
            cmd = [sys.executable, "-m", "bench.emulate", "targets", "--hub", ",".join(addresses),
                   "--placement", placement, "--spec", spec.text(), "--count", str(share),
                   "--first", str(first), "--max-new-tokens", str(opts.max_new_tokens),
                   "--seed", str(opts.seed), "--procs", str(len(shares))]
            proc, _ = _spawn_ready(cmd, f"{log_dir}/targets-{name}.log", stdin=True)
            procs.append(proc)
            first += share
        clients = [observer_client(address, timeout_s=30, name="bench")
                   for address in addresses]
        _command(procs, "go")
        iteration = spec.model().iteration(-(-n // hubs))
        _sleep(max(opts.warmup_s, 1.5 * iteration), tick)
        _command(procs, "mark")
        before = [msgspec.to_builtins(c.request(StatsQuery(counters=True)).body)
                  for c in clients]
        _sleep(max(opts.duration_s, opts.min_iterations * iteration), tick)
        _command(procs, "mark")
        after = [msgspec.to_builtins(c.request(StatsQuery(counters=True)).body)
                 for c in clients]
        for client in clients:
            client.close()
        totals = []
        for proc in procs:
            out, _ = proc.communicate("stop\n", timeout=60)
            totals += [json.loads(line[7:]) for line in out.splitlines()
                       if line.startswith("RESULT ")]
    finally:
        for proc in procs:
            _stop(proc)
        for hub in servers:
            _stop(hub)
    return list(zip(before, after, strict=True)), totals


def _command(procs: list[subprocess.Popen], command: str) -> None:
    for proc in procs:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()


def _sleep(seconds: float, tick: Callable[[float], None]) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        step = min(left, 0.25)
        time.sleep(step)
        tick(step)


def per_target(spec: EmulateSpec, totals: list[dict]) -> list[dict]:
    """Each emulated target's speed over the marked window, admitted or not."""
    out = []
    for t in totals:
        (t0, before), (t1, after) = t["marks"][0], t["marks"][-1]
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            out.append({"name": f"emu{t['first'] + i}", "tok_s": (a - b) / max(t1 - t0, 1e-9),
                        "admitted": t["admitted"][i], "beta": t["betas"][i],
                        "standalone_tok_s": 1.0 / spec.step})
    return out


def emulated_row(spec: EmulateSpec, n: int, measured: dict, hub_stats: dict,
                 totals: list[dict], model: StarModel | None) -> dict:
    """The row: the hub's window metrics, but throughput from the targets' own counts, so
    that targets decoding on their own (rejected, or plain) are counted too."""
    rounds = max(measured["rounds"], 1)
    busy_s = measured["wall_s"] * (1 - measured["hub_split"]["idle"])
    round_ms = 1e3 * busy_s / rounds
    s_eff, z_eff = round_ms / 1e3, measured["z_ms"] / 1e3
    targets = per_target(spec, totals)
    system = sum(t["tok_s"] for t in targets)
    row = {
        "mode": "star",
        "emulated": True,
        "targets": n,
        "drafter": "emulated",
        "depth": spec.depth,
        **{k: measured[k] for k in METRIC_KEYS},
        "system_tok_s": system,
        "per_target_tok_s": system / max(len(targets), 1),
        "hub_system_tok_s": measured["system_tok_s"],
        "admitted": sum(t["admitted"] for t in targets),
        "rejected": sum(not t["admitted"] for t in targets),
        "n_max": hub_stats.get("n_max"),
        "n_full": hub_stats.get("n_full"),
        "per_target": targets,
        "choices": measured["choices"],
        "control": hub_stats.get("control"),
        "plain_tokens": measured["plain_tokens"],
        "t_idle_gap_ms": measured["t_idle_gap_ms"],
        "t_sched_ms": measured["t_sched_ms"],
        "z_ms": measured["z_ms"],
        "round_ms": round_ms,
        "overhead_ms": round_ms - 1e3 * model.S if model else None,
        "accept_rate_by_depth": measured["accept_rate_by_depth"],
        "accept_len_hist": measured["accept_len_hist"],
        "hub_split": measured["hub_split"],
        "tokens": measured["tokens"],
        "rounds": measured["rounds"],
        "wall_s": measured["wall_s"],
        "threads": {"hub": hub_stats.get("threads"),
                    "targets": [t.get("threads") for t in totals]},
        "emulated_targets": totals,
        "model": model.predict(n) if model else None,
        "model_measured_sz": StarModel(t_s=s_eff / spec.depth, depth=spec.depth, t_c=0.0,
                                       t_v=z_eff, tau=model.tau).predict(n) if model else None,
    }
    return row


METRIC_KEYS = ("system_tok_s", "per_target_tok_s", "t_s_ms", "t_wait_ms", "t_idle_ms", "r_q",
               "r_p", "load", "mean_accept_len")


def run_emulated(spec: EmulateSpec, ns: list[int], opts: EmulateOptions,
                 progress: bool = True, depths: list[int | str] | None = None,
                 max_targets: list[int | str] | None = None) -> list[dict]:
    """Rows for every N, depth and admission setting, in that order."""
    import tempfile

    from tqdm import tqdm

    depths = depths or [spec.depth]
    max_targets = max_targets or [0]
    model = spec.model()
    plan = {n: max(opts.warmup_s, 1.5 * model.iteration(n))
            + max(opts.duration_s, opts.min_iterations * model.iteration(n)) for n in ns}
    variants = len(depths) * len(max_targets)
    rows = []
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="starhub-emulate-")
    os.makedirs(log_dir, exist_ok=True)
    with tqdm(total=round(variants * sum(plan.values()), 1), unit="s", disable=not progress,
              file=sys.stderr, bar_format="{desc} {bar} {n:.0f}/{total:.0f}s") as bar:
        for n in ns:
            for depth in depths:
                for limit in max_targets:
                    bar.set_description(f"emulated N={n} depth={depth} max-targets={limit}")
                    rows.append(run_point(spec, n, opts, log_dir, tick=bar.update,
                                          depth=depth, max_targets=limit))
    return rows


def model_check(rows: list[dict], model: StarModel) -> list[str]:
    """The bounds an emulated run at the spec's depth meets when the hub behaves as the
    analytical model says, loose enough for a busy 2-core machine: one line per bound a row
    misses, none when the run follows the model. Below N_full the idle gap shrinks by S per
    added target (and agrees with the model fed the measured S and Z); from N_full on the
    hub saturates, r_q reaches 1/S(d) and r_p falls as N grows."""
    z, s = model.Z * 1e3, model.S * 1e3
    by_n = {r["targets"]: r for r in rows}
    missed = []

    def check(ok: bool, n: int, what: str) -> None:
        if not ok:
            missed.append(f"N={n}: {what}")

    for n, row in sorted(by_n.items()):
        idle = row["t_idle_ms"]
        if n < model.n_full:
            want = 1e3 * model.t_idle(n)
            check(abs(idle - want) < 0.15 * z, n, f"t_idle_ms {idle:.2f}, model {want:.2f}")
            own = row["model_measured_sz"]["t_idle_ms"]
            check(abs(idle - own) < 0.1 * z, n,
                  f"t_idle_ms {idle:.2f}, model with measured S and Z {own:.2f}")
        else:
            check(row["load"] >= 0.9, n, f"load {row['load']:.2f} < 0.9 past N_full")
            check(idle < 0.2 * s, n, f"t_idle_ms {idle:.2f} >= 0.2 S past N_full")
        check(abs(row["mean_accept_len"] - model.tau) <= 0.15 * model.tau, n,
              f"tau {row['mean_accept_len']:.2f}, model {model.tau:.2f}")
        check(row["overhead_ms"] < 5, n, f"overhead_ms {row['overhead_ms']:.2f} >= 5")
        check(abs(row["z_ms"] - z) <= 0.2 * z, n, f"z_ms {row['z_ms']:.2f}, spec {z:.2f}")
    saturated = [n for n in sorted(by_n) if n >= model.n_full]
    if saturated:
        top = by_n[saturated[-1]]
        check(abs(top["r_q"] * model.S - 1) <= 0.2, saturated[-1],
              f"r_q {top['r_q']:.1f}, 1/S {1 / model.S:.1f}")
        want = model.predict(saturated[-1])["r_p"]
        check(abs(top["r_p"] - want) <= 0.25 * want, saturated[-1],
              f"r_p {top['r_p']:.2f}, model {want:.2f}")
        below = [n for n in sorted(by_n) if n < model.n_full]
        for lower, higher in pairwise(below[-1:] + saturated):
            slack = 1.05 if lower < model.n_full else 1.0
            check(by_n[higher]["r_p"] < slack * by_n[lower]["r_p"], higher,
                  f"r_p {by_n[higher]['r_p']:.2f} does not fall below N={lower}'s")
    return missed


def emulated_doc(spec: EmulateSpec, ns: list[int], opts: EmulateOptions,
                 progress: bool = True, depths: list[int | str] | None = None,
                 max_targets: list[int | str] | None = None) -> dict:
    """The benchmark JSON for an emulated run: rows with the model's prediction beside."""
    # deferred: torch and transformers load only when this runs
    from bench.run import machine_info

    model = spec.model()
    rows = run_emulated(spec, ns, opts, progress, depths, max_targets)
    config = {
        "mode": "emulated", "emulate": spec.text(), "targets": ns, "drafter": "emulated",
        "depth": depths or [spec.depth], "max_targets": max_targets or [0],
        "beta": spec.beta, "beta_hi": spec.beta_hi, "t_step": spec.step, "trace": spec.trace,
        "options": {k: v for k, v in asdict(opts).items() if k != "log_dir"},
        "model": {"S_ms": 1e3 * model.S, "Z_ms": 1e3 * model.Z, "n_full": model.n_full,
                  "r_q_sat": 1 / model.S, "tau": model.tau},
        "threads_note": "no process computes: the hub drafts by sleeping in its one drafter "
                        "thread, targets wait on an asyncio loop; each process still runs "
                        "with 1 torch thread and OMP_NUM_THREADS=1",
        "metric_notes": {**METRIC_NOTES,
                         "window": "rates come from two readings after a warm-up, so "
                                   "start-up and shutdown are excluded: the hub's counters "
                                   "for its own metrics, the targets' token counts for "
                                   "system_tok_s and per_target (targets that decode on "
                                   "their own are counted too)",
                         "overhead_ms": "(window - idle) / rounds - S(d): what the hub's "
                                        "loop, thread hand-off and sleep precision add to "
                                        "each round",
                         "z_ms": "measured return time; the emulated link is steered so "
                                 "that it equals t_c + t_v",
                         "model_measured_sz": "the model again with the measured round "
                                              "time and return time in place of S and Z"},
    }
    doc = {"machine": machine_info(), "config": config, "rows": rows}
    if config["depth"] == [spec.depth] and config["max_targets"] == [0]:
        doc["model_check"] = model_check(rows, model)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulate")
    sub = parser.add_subparsers(dest="role", required=True)
    hub = sub.add_parser("hub", help="a real hub whose drafter sleeps depth·t_s")
    hub.add_argument("--bind", default="tcp://127.0.0.1:0")
    hub.add_argument("--t-s", type=float, required=True, help="seconds per tree layer")
    hub.add_argument("--depth", default="6", help="a depth or auto")
    hub.add_argument("--max-targets", default="0", help="0, N or auto")
    hub.add_argument("--threads", type=int, default=1)
    hub.add_argument("--metrics-port", type=int, default=0)
    hub.add_argument("--log-every", type=float, default=10.0)
    tgt = sub.add_parser("targets", help="emulated targets on one event loop")
    tgt.add_argument("--hub", required=True, help="a hub, or a pool: addresses separated "
                     "by commas")
    tgt.add_argument("--placement", choices=PLACEMENTS, default="admission",
                     help="how each target chooses its hub in a pool")
    tgt.add_argument("--spec", required=True)
    tgt.add_argument("--count", type=int, default=1)
    tgt.add_argument("--first", type=int, default=0)
    tgt.add_argument("--max-new-tokens", type=int, default=64)
    tgt.add_argument("--seed", type=int, default=0)
    tgt.add_argument("--procs", type=int, default=1, help="target processes in this run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return hub_main(args) if args.role == "hub" else targets_main(args)


if __name__ == "__main__":
    sys.exit(main())
