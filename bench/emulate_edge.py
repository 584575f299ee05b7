"""Emulated edge runs: the real verifier loop, scheduler and sockets over an engine that
waits instead of computing, fed by drafters of different acceptance and drafting speed.

The emulated target's next token depends only on its position, ``truth(n)``. A drafter
with acceptance beta proposes a chain whose k-th token is right with probability beta
(given the ones before it), so acceptance comes from the drafter and the verifier checks
it as it checks a real tree: the longest right prefix, then the target's own next token.
A pass costs ``t_v + t_tok·fed + t_attn·sum(cached·new)``; a drafted token costs ``t_d``.

``python -m bench.emulate_edge verifier`` is the verifier process; ``run_edge_emulated``
runs it once per (N, schedule, max-batch) with N drafter threads in this process.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import threading
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np

from bench.edge import EDGE_NOTES, batch_flag, edge_row, jain
from bench.emulate import _spawn_ready, _stop
from bench.emulate_spec import VOCAB, _seconds
from bench.run import machine_info
from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.drafters.emulated import CalibratedSleep
from starhub.edge.drafter import EdgeDrafter
from starhub.launch import READY
from starhub.launch.status import observer_client
from starhub.options import AUTO, Positive, auto_or
from starhub.settings.cli import value_type
from starhub.wire.messages import StatsQuery, TargetCard
from starhub.wire.tree import DraftTree, chain_tree, children
from targets.cost import BatchStats
from targets.prefill import ChunkedPrefill
from targets.verifier import Verifier, VerifierConfig
from targets.verify import Verdict

KEYS = ("t_v", "t_tok", "t_attn", "t_d", "beta", "slo", "prompt")


def truth(position: int) -> int:
    """The emulated target's token at ``position``."""
    return (position * 7919 + 17) % VOCAB


def _range(key: str, value: str, parse) -> tuple[float, float]:
    lo, dots, hi = value.partition("..")
    low, high = parse(key, lo), parse(key, hi) if dots else None
    high = low if high is None else high
    if high < low:
        raise ValueError(f"--emulate: {key}=LO..HI needs LO <= HI")
    return low, high


@dataclass
class EdgeSpec:
    """``t_v=20ms,t_tok=0.5ms,t_attn=0us,t_d=1ms..4ms,beta=0.5..0.9,slo=0,prompt=64``.
    ``LO..HI`` ranges give each drafter its own value, spread over the range; ``slo``
    is a ``/``-separated list of speeds (tok/s, 0 for none) dealt round-robin."""

    t_v: float = 20e-3
    t_tok: float = 0.5e-3
    t_attn: float = 0.0
    t_d: tuple[float, float] = (1e-3, 4e-3)
    beta: tuple[float, float] = (0.5, 0.9)
    slo: tuple[float, ...] = (0.0,)
    prompt: int = 64

    @classmethod
    def parse(cls, text: str) -> EdgeSpec:
        spec = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--emulate: '{item}' is not key=value")
            if key in ("t_v", "t_tok", "t_attn"):
                setattr(spec, key, _seconds(key, value))
            elif key == "t_d":
                spec.t_d = _range(key, value, _seconds)
            elif key == "beta":
                spec.beta = _range(key, value, lambda k, v: float(v))
                if not 0 <= spec.beta[0] <= spec.beta[1] < 1:
                    raise ValueError("--emulate: beta must lie in [0, 1)")
            elif key == "slo":
                spec.slo = tuple(float(v) for v in value.split("/"))
            elif key == "prompt":
                spec.prompt = int(value)
            else:
                raise ValueError(f"--emulate: unknown key '{key}' for the edge ({', '.join(KEYS)})")
        return spec

    def text(self) -> str:
        def ms(v: float) -> str:
            return f"{v * 1e3:g}ms"

        d = ms(self.t_d[0]) + (f"..{ms(self.t_d[1])}" if self.t_d[1] != self.t_d[0] else "")
        b = f"{self.beta[0]:g}" + (f"..{self.beta[1]:g}" if self.beta[1] != self.beta[0] else "")
        return (f"t_v={ms(self.t_v)},t_tok={ms(self.t_tok)},t_attn={self.t_attn * 1e6:g}us,"
                f"t_d={d},beta={b},slo={'/'.join(f'{v:g}' for v in self.slo)},"
                f"prompt={self.prompt}")

    @property
    def budget(self) -> int:
        """``--budget auto`` here: the most tokens a pass feeds for 1.5x one token's cost."""
        return max(2, int(0.5 * self.t_v / max(self.t_tok, 1e-9) + 1.5))

    def drafter(self, index: int, count: int) -> tuple[float, float, float]:
        """(beta, t_d, slo) of drafter ``index`` of ``count``: betas spread evenly from LO
        to HI, draft times from HI to LO in a shuffled order (so that speed and acceptance
        are not tied), SLO classes dealt round-robin. The same in every row of a run."""
        def spread(lo: float, hi: float, k: int) -> float:
            return lo + (hi - lo) * k / max(count - 1, 1)

        order = list(range(count))
        random.Random(count).shuffle(order)
        return (spread(*self.beta, index), spread(*self.t_d, order[index]),
                self.slo[index % len(self.slo)])


class EmulatedEngine:
    """``VerifyEngine``'s interface over ``truth``: waits for a pass instead of running one."""

    token_bytes = 0
    """No KV cache: a session holds only its length."""

    def __init__(self, spec: EdgeSpec):
        self.spec = spec
        self.lengths: dict[int, int] = {}
        self.sleep = CalibratedSleep()

    def open(self, sid: int, prompt: list[int], *_args, **_kwargs) -> tuple[int, None]:
        self.lengths[sid] = len(prompt) + 1
        return truth(len(prompt)), None

    def open_chunks(self, sid: int, prompt: list[int], _chunk: int, *_args, **_kwargs
                    ) -> ChunkedPrefill[tuple[int, None]]:
        """``open`` in one slice: prefilling costs nothing here."""
        def at_once() -> Generator[None, None, tuple[int, None]]:
            yield from ()
            return self.open(sid, prompt)
        return ChunkedPrefill(at_once(), len(prompt))

    def close(self, sid: int) -> None:
        self.lengths.pop(sid, None)

    def cached(self, sid: int) -> int:
        return self.lengths[sid] - 1

    def cost(self, work: list[tuple[int, DraftTree]]) -> BatchStats:
        return BatchStats.of(work, self.cached)

    def verify(self, work: list[tuple[int, DraftTree]]) -> list[Verdict]:
        cost = self.cost(work)
        spec = self.spec
        self.sleep(spec.t_v + spec.t_tok * cost.new_tokens + spec.t_attn * cost.cached_x_new)
        verdicts = []
        for sid, tree in work:
            length = self.lengths[sid]
            kids = children(tree.parents)
            path, pos = [], 0
            while True:
                want = truth(length + len(path))
                nxt = next((c for c in kids[pos] if int(tree.tokens[c]) == want), None)
                if nxt is None:
                    break
                path.append(nxt)
                pos = nxt + 1
            tokens = [int(tree.tokens[i]) for i in path] + [truth(length + len(path))]
            self.lengths[sid] = length + len(tokens)
            verdicts.append(Verdict(path, tokens, None))
        return verdicts


class EmulatedChainDrafter(Drafter):
    """Drafts a chain of the granted length, each token right with probability ``beta``."""

    name = "emulated"

    def __init__(self, beta: float, t_d: float, seed: int = 0):
        self.beta = beta
        self.t_d = t_d
        self.rng = random.Random(seed)
        self.sleep = CalibratedSleep()

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        length = len(ctx.tokens)
        count = max(1, shape.max_nodes)
        self.sleep(self.t_d * count)
        tokens, right = [], True
        for k in range(count):
            right = right and self.rng.random() < self.beta
            tokens.append(truth(length + k) if right else (truth(length + k) + 1) % VOCAB)
        return chain_tree(tokens)


# --- the verifier process -------------------------------------------------------------

def verifier_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.emulate_edge verifier")
    p.add_argument("--spec", required=True)
    p.add_argument("--schedule", default="fifo")
    p.add_argument("--max-batch", type=value_type(auto_or(Positive)), default=0)
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--nodes", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    spec = EdgeSpec.parse(args.spec)
    card = TargetCard(name="emulated", vocab_size=VOCAB, step_ms=1e3 * (spec.t_v + spec.t_tok))
    config = VerifierConfig(bind="tcp://127.0.0.1:0", budget=args.budget or spec.budget,
                            max_batch=0 if args.max_batch == AUTO else args.max_batch,
                            schedule=args.schedule, nodes=args.nodes)
    try:
        Verifier(EmulatedEngine(spec), card, config).serve(
            ready=lambda address: print(READY + address, flush=True))
    except KeyboardInterrupt:
        pass
    return 0


# --- the driver -----------------------------------------------------------------------

class _Stop(Exception):
    pass


def run_point(spec: EdgeSpec, n: int, schedule: str, max_batch: int | str, budget: int,
              nodes: int, warmup_s: float, duration_s: float, log_dir: str,
              seed: int = 0) -> dict:
    """One row: a fresh verifier, N drafter threads, a measured window after a warm-up."""

    name = f"n{n}-{schedule}-b{batch_flag(max_batch)}"
    cmd = [sys.executable, "-m", "bench.emulate_edge", "verifier", "--spec", spec.text(),
           "--schedule", schedule, "--max-batch", batch_flag(max_batch),
           "--budget", str(budget), "--nodes", str(nodes)]
    verifier, address = _spawn_ready(cmd, f"{log_dir}/verifier-{name}.log")
    stop = threading.Event()
    counts = [0] * n
    edges: list = [None] * n
    failed: list[str] = []

    def drafter(i: int) -> None:
        beta, t_d, slo = spec.drafter(i, n)

        def count(tokens: int) -> None:
            if stop.is_set():
                raise _Stop
            counts[i] += tokens

        edge = EdgeDrafter(EmulatedChainDrafter(beta, t_d, seed=seed * 1000 + i), address,
                           TreeShape(depth=64, topk=1, max_nodes=nodes), eos=set(),
                           name=f"drafter{i}", on_commit=count)
        edges[i] = edge
        prompt = [(i * 131 + k) % VOCAB for k in range(spec.prompt)]
        try:
            while not stop.is_set():
                edge.generate(prompt, 1 << 30, target_tok_s=slo)
        except _Stop:
            pass
        except Exception as exc:  # reported below: a row of a dead drafter is no row
            failed.append(f"drafter{i}: {exc}")
            stop.set()
        finally:
            edge.close()

    threads = [threading.Thread(target=drafter, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        client = observer_client(address, timeout_s=30, name="bench")
        time.sleep(warmup_s)
        c0, s0, w0 = list(counts), client.request(StatsQuery()).body, _waits(edges)
        start = time.monotonic()
        time.sleep(duration_s)
        c1, s1, w1 = list(counts), client.request(StatsQuery()).body, _waits(edges)
        window = time.monotonic() - start
        stop.set()
        for t in threads:
            t.join(10)
        client.close()
    finally:
        stop.set()
        _stop(verifier)
    if failed:
        raise RuntimeError(f"the emulated edge run N={n} {schedule} failed ("
                           f"{'; '.join(failed)}); see {log_dir}/verifier-{name}.log")
    rates = [(b - a) / window for a, b in zip(c0, c1, strict=True)]
    delta = {k: getattr(s1, k) - getattr(s0, k)
             for k in ("steps", "rounds", "committed", "slo_rounds", "slo_late", "verify_s")}
    stats = dict(msgspec.to_builtins(s1), mean_batch=delta["rounds"] / max(delta["steps"], 1),
                 verify_ms_per_step=1e3 * delta["verify_s"] / max(delta["steps"], 1),
                 slo_rounds=delta["slo_rounds"], slo_late=delta["slo_late"])
    row = edge_row(n, schedule, max_batch, [], stats, None, mode="edge-emulated")
    row.update(system_tok_s=sum(rates), per_drafter_tok_s=rates, jain=jain(rates),
               sum_log_goodput=sum(np.log(r) for r in rates) if min(rates) > 0 else None,
               tokens=sum(c1) - sum(c0), wall_s=window, rounds=delta["rounds"],
               mean_accept_len=delta["committed"] / max(delta["rounds"], 1),
               drafter_idle=(w1[0] - w0[0]) / max(w1[1] - w0[1], 1e-9),
               drafter_specs=[dict(zip(("beta", "t_d_ms", "slo"),
                                       (round(b, 3), round(d * 1e3, 3), s), strict=True))
                              for b, d, s in (spec.drafter(i, n) for i in range(n))],
               nodes=msgspec.to_builtins(s1.scheduler.sessions))
    return row


def _waits(edges: list) -> tuple[float, float]:
    """(waiting, drafting plus waiting) seconds, summed over the drafters so far."""
    live = [e for e in edges if e is not None]
    wait = sum(e.wait_s for e in live)
    return wait, wait + sum(e.draft_s for e in live)


def run_edge_emulated(cfg, spec: EdgeSpec, warmup_s: float, duration_s: float,
                      progress: bool = True) -> dict:
    from tqdm import tqdm

    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="starhub-edge-emulated-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    variants = cfg.variants()
    with tqdm(total=len(variants), unit="row", disable=not progress, file=sys.stderr) as bar:
        for n, schedule, max_batch in variants:
            bar.set_description(f"emulated edge N={n} {schedule} "
                                f"max-batch={batch_flag(max_batch)}")
            rows.append(run_point(spec, n, schedule, max_batch, cfg.budget, cfg.nodes,
                                  warmup_s, duration_s, log_dir))
            bar.update(1)
    config = {k: v for k, v in asdict(cfg).items() if k != "log_dir"}
    config.update(mode="emulated", topology="edge", emulate=spec.text(), logs=log_dir,
                  metric_notes=EDGE_NOTES, threads_note="drafters are threads of the "
                  "benchmark process (they sleep, not compute); the verifier is one process")
    return {"machine": machine_info(), "config": config, "rows": rows}


if __name__ == "__main__":
    if sys.argv[1:2] != ["verifier"]:
        sys.exit("usage: python -m bench.emulate_edge verifier --spec SPEC [...]")
    sys.exit(verifier_main(sys.argv[2:]))
