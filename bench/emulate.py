"""Emulated accelerators: the real hub, sockets, scheduling and metrics, with model compute
replaced by calibrated waits, so one small machine can show how the star topology scales
to hundreds of GPUs.

The hub process runs ``Hub`` with an ``EmulatedDrafter`` (it sleeps ``depth · t_s``).
Target processes run many emulated targets on one asyncio loop, each with its own DEALER
socket: a target waits ``t_v`` to "verify" every proposal and ``t_c`` for the link (less
the loopback round trip the real sockets already add), then commits an accepted length
drawn per token with probability ``beta`` or replayed from a real run's histogram.

``python -m bench.emulate hub|targets`` are the two process entry points; ``run_emulated``
drives them for each N and returns the benchmark's rows.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.model import StarModel, expected_accepted

VOCAB = 32000
PROMPT_LEN = 16
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass
class EmulateSpec:
    """``t_s=1.4ms,t_v=25ms,t_c=1ms,beta=0.8,depth=6[,trace=run.json]``; times in seconds."""

    t_s: float = 1.4e-3
    t_v: float = 25e-3
    t_c: float = 1e-3
    beta: float = 0.8
    depth: int = 6
    trace: str | None = None
    accept_hist: dict[int, int] = field(default_factory=dict)
    """Committed length (accepted + bonus) -> count, from ``trace``; empty draws by beta."""

    @classmethod
    def parse(cls, text: str) -> EmulateSpec:
        spec = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--emulate: '{item}' is not key=value")
            if key in ("t_s", "t_v", "t_c"):
                setattr(spec, key, _seconds(key, value))
            elif key == "beta":
                spec.beta = float(value)
                if not 0 <= spec.beta <= 1:
                    raise ValueError("--emulate: beta must lie in [0, 1]")
            elif key == "depth":
                spec.depth = int(value)
                if spec.depth < 1:
                    raise ValueError("--emulate: depth must be at least 1")
            elif key == "trace":
                spec.trace = value
                spec.accept_hist = load_trace(value)
            else:
                raise ValueError(f"--emulate: unknown key '{key}' (t_s, t_v, t_c, beta, "
                                 f"depth, trace)")
        if spec.t_s <= 0:
            raise ValueError("--emulate: t_s must be positive")
        return spec

    def text(self) -> str:
        accept = f"trace={self.trace}" if self.trace else f"beta={self.beta:g}"
        return (f"t_s={self.t_s * 1e3:g}ms,t_v={self.t_v * 1e3:g}ms,t_c={self.t_c * 1e3:g}ms,"
                f"{accept},depth={self.depth}")

    @property
    def tau(self) -> float:
        """Expected committed tokens per round, the bonus token included."""
        if self.accept_hist:
            hist = {k: v for k, v in self.accept_hist.items()}
            clipped = {min(k, self.depth + 1): 0 for k in hist}
            for k, v in hist.items():
                clipped[min(k, self.depth + 1)] += v
            return sum(k * v for k, v in clipped.items()) / max(sum(clipped.values()), 1)
        return 1 + expected_accepted(self.beta, self.depth)

    def model(self) -> StarModel:
        return StarModel(t_s=self.t_s, depth=self.depth, t_c=self.t_c, t_v=self.t_v,
                         tau=self.tau)

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        """Draws accepted draft tokens per round (the bonus token not counted)."""
        if self.accept_hist:
            lengths = list(self.accept_hist)
            weights = [self.accept_hist[k] for k in lengths]
            return lambda: max(0, min(rng.choices(lengths, weights)[0] - 1, self.depth))

        def by_token() -> int:
            n = 0
            while n < self.depth and rng.random() < self.beta:
                n += 1
            return n

        return by_token


def _seconds(key: str, value: str) -> float:
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us)?\s*", value)
    if not match:
        raise ValueError(f"--emulate: {key}={value} is not a time such as 1.4ms")
    return float(match.group(1)) * _UNITS[match.group(2) or "ms"]


def load_trace(path: str) -> dict[int, int]:
    """Accepted-length histogram of a real run: a benchmark JSON (its star rows summed) or
    any JSON object with an ``accept_len_hist``."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows", [data]) if isinstance(data, dict) else data
    hist: dict[int, int] = {}
    for row in rows:
        if row.get("mode", "star") == "star" and not row.get("emulated"):
            for k, v in (row.get("accept_len_hist") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + int(v)
    if not hist:
        raise ValueError(f"{path} holds no accept_len_hist from a real star run")
    return hist


# --- the hub process -------------------------------------------------------------------

def hub_main(args: argparse.Namespace) -> int:
    from starhub.drafters.base import TreeShape
    from starhub.drafters.emulated import EmulatedDrafter
    from starhub.hub import Hub, HubConfig
    from starhub.launch import READY
    from starhub.models import set_threads

    set_threads(args.threads)
    shape = TreeShape(depth=args.depth, topk=1, max_nodes=args.depth)
    hub = Hub(EmulatedDrafter(args.t_s, VOCAB),
              HubConfig(bind=args.bind, shape=shape, metrics_port=args.metrics_port,
                        log_every_s=args.log_every))

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


# --- the target processes --------------------------------------------------------------

class CalibratedWait:
    """``asyncio.sleep`` until a deadline, woken early by the loop's learned lateness."""

    def __init__(self, smoothing: float = 0.05):
        self.lateness = 0.0
        self.smoothing = smoothing
        self.samples = 0
        self.total_late = 0.0

    async def until(self, deadline: float) -> None:
        delay = deadline - time.monotonic() - self.lateness
        if delay > 0:
            await asyncio.sleep(delay)
        late = time.monotonic() - deadline
        self.lateness = min(max(self.lateness + self.smoothing * late, -1e-3), 2e-3)
        self.samples += 1
        self.total_late += late


@dataclass
class TargetTotals:
    targets: int = 0
    rounds: int = 0
    tokens: int = 0
    sessions: int = 0
    errors: int = 0
    link_rtt_ms: float = 0.0
    link_delay_ms: float = 0.0
    mean_late_ms: float = 0.0
    threads: int = 0


class EmulatedTargets:
    """``count`` targets on one event loop, each a DEALER socket with one session at a time."""

    def __init__(self, hub: str, spec: EmulateSpec, count: int, first: int = 0,
                 max_new_tokens: int = 64, seed: int = 0, share: float = 1.0):
        import zmq.asyncio

        self.hub, self.spec, self.count, self.first = hub, spec, count, first
        self.max_new_tokens = max_new_tokens
        self.ctx = zmq.asyncio.Context()
        self.wait = CalibratedWait()
        self.rng = random.Random(seed + first)
        self.draw = spec.sampler(self.rng)
        self.totals = TargetTotals(targets=count)
        self.link_delay = spec.t_c
        self.share = share
        """This process's part of the correction when several processes calibrate."""
        self.refs = itertools.count(1)
        self.go = asyncio.Event()
        self.stop = asyncio.Event()

    async def _after_go(self, coro) -> None:
        await self.go.wait()
        await coro

    def socket(self, index: int):
        import zmq

        from starhub.transport import Limits, configure_socket

        sock = self.ctx.socket(zmq.DEALER)
        configure_socket(sock, Limits())
        sock.setsockopt(zmq.IDENTITY, f"emu{index}-{os.getpid()}".encode())
        sock.connect(self.hub)
        return sock

    async def ask(self, sock, msg):
        from starhub.transport import decode, encode

        await sock.send_multipart(encode(msg), copy=False)
        return decode(await sock.recv_multipart(copy=False))

    async def connect(self) -> list:
        from starhub.protocol import Hello, Ping, Welcome

        socks = [self.socket(self.first + i) for i in range(self.count)]
        welcomes = await asyncio.gather(*(
            self.ask(s, Hello(name=f"emu{self.first + i}", vocab_size=VOCAB))
            for i, s in enumerate(socks)))
        for w in welcomes:
            if not isinstance(w, Welcome):
                raise RuntimeError(f"hub refused an emulated target: {w}")
        rtts = []
        for nonce in range(30):
            start = time.monotonic()
            await self.ask(socks[0], Ping(nonce=nonce))
            rtts.append(time.monotonic() - start)
        rtt = sorted(rtts[5:])[len(rtts[5:]) // 2]
        self.link_delay = max(0.0, self.spec.t_c - rtt)
        self.totals.link_rtt_ms, self.totals.link_delay_ms = 1e3 * rtt, 1e3 * self.link_delay
        return socks

    async def calibrate_link(self, period_s: float = 0.2, gain: float = 0.5) -> None:
        """Steer the added link delay so that the return time the hub measures (from a
        draft finishing to that session's next request) is the model's Z = t_c + t_v: the
        real sockets' latency is part of t_c, never added on top of it. Where hundreds of
        targets crowd a few cores their wake-ups alone can exceed t_c; the delay then goes
        negative (shortening the emulated verification), and the row reports it."""
        from starhub.protocol import Stats

        sock = self.socket(-1)
        before = None
        try:
            while True:
                stats = await self.ask(sock, Stats(body={"counters": True}))
                now = stats.body["counters"]
                if before is not None and now["returns"] - before["returns"] >= 4:
                    z = (now["return_s"] - before["return_s"]) / (now["returns"]
                                                                  - before["returns"])
                    step = gain * self.share * (self.spec.t_c + self.spec.t_v - z)
                    self.link_delay = min(max(self.link_delay + step, -self.spec.t_v / 2),
                                          self.spec.t_c)
                before = now
                await asyncio.sleep(period_s)
        finally:
            sock.close(0)

    def open_message(self, index: int):
        import numpy as np

        from starhub.protocol import Open

        tokens = (np.arange(PROMPT_LEN + 1, dtype=np.int32) * 7 + index) % VOCAB
        return Open(ref=next(self.refs), prompt_len=PROMPT_LEN, tokens=tokens)

    async def run_one(self, index: int, sock) -> None:
        import numpy as np

        from starhub.protocol import Close, Commit, Propose
        from starhub.transport import decode, encode

        await self.go.wait()
        await sock.send_multipart(encode(self.open_message(index)), copy=False)
        produced = 0
        while not self.stop.is_set():
            msg = decode(await sock.recv_multipart(copy=False))
            arrived = time.monotonic()
            if not isinstance(msg, Propose):
                self.totals.errors += 1
                logging.warning("emulated target %d got %s", index, msg)
                await asyncio.sleep(0.1)
                produced = self.max_new_tokens
                await sock.send_multipart(encode(self.open_message(index)), copy=False)
                continue
            accepted = min(self.draw(), len(msg.tokens))
            bonus = (int(msg.tokens[accepted - 1]) + 7 if accepted else index) % VOCAB
            tokens = np.append(msg.tokens[:accepted], np.int32(bonus)).astype(np.int32)
            produced += len(tokens)
            await self.wait.until(arrived + self.spec.t_v + self.link_delay)
            if self.stop.is_set():
                break
            self.totals.rounds += 1
            self.totals.tokens += len(tokens)
            if produced >= self.max_new_tokens:
                await sock.send_multipart(encode(Close(tag=msg.tag)), copy=False)
                await sock.send_multipart(encode(self.open_message(index)), copy=False)
                self.totals.sessions += 1
                produced = 0
            else:
                await sock.send_multipart(encode(Commit(tag=msg.tag, seq=msg.seq,
                                                        accepted=accepted, tokens=tokens)),
                                          copy=False)

    async def main(self, commands: asyncio.Queue) -> TargetTotals:
        socks = await self.connect()
        tasks = [asyncio.create_task(self.run_one(self.first + i, s))
                 for i, s in enumerate(socks)]
        tasks.append(asyncio.create_task(self._after_go(self.calibrate_link())))
        print("READY " + json.dumps({"link_rtt_ms": self.totals.link_rtt_ms}), flush=True)
        while True:
            command = await commands.get()
            if command == "go":
                self.go.set()
            elif command in ("stop", ""):
                break
        self.stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in socks:
            s.close(0)
        self.ctx.term()
        import torch

        self.totals.link_delay_ms = 1e3 * self.link_delay
        self.totals.threads = torch.get_num_threads()
        self.totals.mean_late_ms = 1e3 * self.wait.total_late / max(self.wait.samples, 1)
        return self.totals


def targets_main(args: argparse.Namespace) -> int:
    spec = EmulateSpec.parse(args.spec)
    spec.depth = args.depth or spec.depth

    async def main() -> None:
        loop = asyncio.get_running_loop()
        commands: asyncio.Queue[str] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, line.strip())
            loop.call_soon_threadsafe(commands.put_nowait, "")

        threading.Thread(target=read, daemon=True).start()
        targets = EmulatedTargets(args.hub, spec, args.count, args.first, args.max_new_tokens,
                                  args.seed, share=1.0 / max(args.procs, 1))
        totals = await targets.main(commands)
        print("RESULT " + json.dumps(asdict(totals)), flush=True)

    asyncio.run(main())
    return 0


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
    from starhub.launch import child_env

    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                stdin=subprocess.PIPE if stdin else None, env=child_env(1))
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(("READY", "STARHUB READY")) and not found:
                found.append(line.split(" ", 2 if line.startswith("STARHUB") else 1)[-1])
                break

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd[:4])} did not start (exit {proc.poll()}); "
                           f"see {log_path}")
    return proc, found[0].strip()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_point(spec: EmulateSpec, n: int, opts: EmulateOptions, log_dir: str,
              tick: Callable[[float], None] = lambda _: None) -> dict:
    """One N: a fresh hub process, N emulated targets, a measured window between two STATS
    readings after a warm-up; returns the benchmark row with the model's prediction."""
    from starhub.metrics import derive
    from starhub.protocol import Stats
    from targets.client import HubClient

    model = spec.model()
    hub_cmd = [sys.executable, "-m", "bench.emulate", "hub", "--bind", "tcp://127.0.0.1:0",
               "--t-s", repr(spec.t_s), "--depth", str(spec.depth), "--threads", "1",
               "--metrics-port", str(opts.metrics_port)]
    hub, address = _spawn_ready(hub_cmd, f"{log_dir}/hub-n{n}.log")
    procs: list[subprocess.Popen] = []
    try:
        shares = [len(range(i, n, min(opts.procs, n))) for i in range(min(opts.procs, n))]
        first = 0
        for share in shares:
            cmd = [sys.executable, "-m", "bench.emulate", "targets", "--hub", address,
                   "--spec", spec.text(), "--count", str(share), "--first", str(first),
                   "--max-new-tokens", str(opts.max_new_tokens), "--seed", str(opts.seed),
                   "--procs", str(len(shares))]
            proc, _ = _spawn_ready(cmd, f"{log_dir}/targets-n{n}.log", stdin=True)
            procs.append(proc)
            first += share
        client = HubClient(address, timeout_s=30)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        iteration = model.iteration(n)
        _sleep(max(opts.warmup_s, 1.5 * iteration), tick)
        c0 = client.request(Stats(body={"counters": True})).body
        _sleep(max(opts.duration_s, opts.min_iterations * iteration), tick)
        c1 = client.request(Stats(body={"counters": True})).body
        client.close()
        totals = []
        for proc in procs:
            out, _ = proc.communicate("stop\n", timeout=30)
            totals += [json.loads(line[7:]) for line in out.splitlines()
                       if line.startswith("RESULT ")]
    finally:
        for proc in procs:
            _stop(proc)
        _stop(hub)
    return emulated_row(spec, n, derive(c0["counters"], c1["counters"], targets=n), c1,
                        totals, model)


def _sleep(seconds: float, tick: Callable[[float], None]) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        step = min(left, 0.25)
        time.sleep(step)
        tick(step)


def emulated_row(spec: EmulateSpec, n: int, measured: dict, hub_stats: dict,
                 totals: list[dict], model: StarModel) -> dict:
    rounds = max(measured["rounds"], 1)
    busy_s = measured["wall_s"] * (1 - measured["hub_split"]["idle"])
    round_ms = 1e3 * busy_s / rounds
    s_eff, z_eff = round_ms / 1e3, measured["z_ms"] / 1e3
    return {
        "mode": "star",
        "emulated": True,
        "targets": n,
        "drafter": "emulated",
        "depth": spec.depth,
        **{k: measured[k] for k in METRIC_KEYS},
        "t_idle_gap_ms": measured["t_idle_gap_ms"],
        "t_sched_ms": measured["t_sched_ms"],
        "z_ms": measured["z_ms"],
        "round_ms": round_ms,
        "overhead_ms": round_ms - 1e3 * model.S,
        "accept_rate_by_depth": measured["accept_rate_by_depth"],
        "accept_len_hist": measured["accept_len_hist"],
        "hub_split": measured["hub_split"],
        "tokens": measured["tokens"],
        "rounds": measured["rounds"],
        "wall_s": measured["wall_s"],
        "threads": {"hub": hub_stats.get("threads"),
                    "targets": [t.get("threads") for t in totals]},
        "emulated_targets": totals,
        "model": model.predict(n),
        "model_measured_sz": StarModel(t_s=s_eff / spec.depth, depth=spec.depth, t_c=0.0,
                                       t_v=z_eff, tau=model.tau).predict(n),
    }


METRIC_KEYS = ("system_tok_s", "per_target_tok_s", "t_s_ms", "t_wait_ms", "t_idle_ms", "r_q",
               "r_p", "load", "mean_accept_len")


def run_emulated(spec: EmulateSpec, ns: list[int], opts: EmulateOptions,
                 progress: bool = True) -> list[dict]:
    import tempfile

    from tqdm import tqdm

    model = spec.model()
    plan = {n: max(opts.warmup_s, 1.5 * model.iteration(n))
            + max(opts.duration_s, opts.min_iterations * model.iteration(n)) for n in ns}
    rows = []
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="starhub-emulate-")
    os.makedirs(log_dir, exist_ok=True)
    with tqdm(total=round(sum(plan.values()), 1), unit="s", disable=not progress,
              file=sys.stderr, bar_format="{desc} {bar} {n:.0f}/{total:.0f}s") as bar:
        for n in ns:
            bar.set_description(f"emulated N={n}")
            rows.append(run_point(spec, n, opts, log_dir, tick=bar.update))
    return rows


def emulated_doc(spec: EmulateSpec, ns: list[int], opts: EmulateOptions,
                 progress: bool = True) -> dict:
    """The benchmark JSON for an emulated run: rows with the model's prediction beside."""
    from bench.run import METRIC_NOTES, machine_info

    model = spec.model()
    rows = run_emulated(spec, ns, opts, progress)
    config = {
        "mode": "emulated", "emulate": spec.text(), "targets": ns, "drafter": "emulated",
        "depth": spec.depth, "beta": spec.beta, "trace": spec.trace,
        "options": {k: v for k, v in asdict(opts).items() if k != "log_dir"},
        "model": {"S_ms": 1e3 * model.S, "Z_ms": 1e3 * model.Z, "n_full": model.n_full,
                  "r_q_sat": 1 / model.S, "tau": model.tau},
        "threads_note": "no process computes: the hub drafts by sleeping in its one drafter "
                        "thread, targets wait on an asyncio loop; each process still runs "
                        "with 1 torch thread and OMP_NUM_THREADS=1",
        "metric_notes": {**METRIC_NOTES,
                         "window": "rates come from two STATS readings of the hub's counters "
                                   "after a warm-up, so start-up and shutdown are excluded",
                         "overhead_ms": "(window - idle) / rounds - S(d): what the hub's "
                                        "loop, thread hand-off and sleep precision add to "
                                        "each round",
                         "z_ms": "measured return time; the emulated link is steered so "
                                 "that it equals t_c + t_v",
                         "model_measured_sz": "the model again with the measured round "
                                              "time and return time in place of S and Z"},
    }
    return {"machine": machine_info(), "config": config, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulate")
    sub = parser.add_subparsers(dest="role", required=True)
    hub = sub.add_parser("hub", help="a real hub whose drafter sleeps depth·t_s")
    hub.add_argument("--bind", default="tcp://127.0.0.1:0")
    hub.add_argument("--t-s", type=float, required=True, help="seconds per tree layer")
    hub.add_argument("--depth", type=int, default=6)
    hub.add_argument("--threads", type=int, default=1)
    hub.add_argument("--metrics-port", type=int, default=0)
    hub.add_argument("--log-every", type=float, default=10.0)
    tgt = sub.add_parser("targets", help="emulated targets on one event loop")
    tgt.add_argument("--hub", required=True)
    tgt.add_argument("--spec", required=True)
    tgt.add_argument("--depth", type=int, default=0)
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
