"""Checks of one ``starhub serve`` process under load, driven by the official ``openai``
client, each against a hub and a server started with their default flags.

``burst``: N prompts streamed one at a time, then all at once: both equal to generate(),
the wall times, and the mean verify batch of the concurrent run.

``load``: a bounded loopback load test: many streamed requests at a fixed concurrency, a
share of them abandoned at a random point. It counts failures, waits for the server's and
the hub's sessions to reach 0, compares the server's RSS with its RSS after a warm-up at the
same concurrency (the allocator's high-water mark for that batch size), and
checks one more request against generate().

``fair``: a long prompt, then a short request a few seconds later, while the long one
prefills: the short request's time beside it against its time alone (both outputs equal to
generate()).

``big``: huge prompts (4 MB, refused by their length before tokenizing, and 600 KB, which
is tokenized before its token count refuses it), completions and chat, while a poller
times ``/health`` every 20 ms: the statuses, the slowest ``/health``, and the server's RSS
before and after.

    python -m bench.serve_checks burst --prompts 8 --max-tokens 64
    python -m bench.serve_checks load --requests 1000 --concurrency 8 --abandon 0.33
    python -m bench.serve_checks fair --long-tokens 8150 --after 3
    python -m bench.serve_checks big --megabytes 4
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.codec import cpu_model
from bench.defaults import DEFAULT_PROMPTS
from starhub.launch.spawn import spawn_hub, spawn_serve
from starhub.models.loading import DEFAULT_NAME, load_model
from starhub.models.prompts import encode_prompt, read_prompts
from starhub.options import resolve_threads


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, keyed by its name and ``labels``."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name + labels(s.labels): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def labels(pairs: dict[str, str]) -> str:
    """A sample's labels as Prometheus writes them: ``{code="STALE"}`` (empty: none)."""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}" if pairs else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """A default hub (with metrics) and a default server, on loopback."""

    def __init__(self, threads: int):
        self.metrics_port = free_port()
        self.hub = spawn_hub(["--metrics-port", str(self.metrics_port)])
        self.server = spawn_serve(["--hub", self.hub.address], threads=threads)
        self.api = OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0,
                          timeout=300)

    def hub_metrics(self) -> dict[str, float]:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def server_metrics(self) -> dict[str, float]:
        return scrape(self.server.url + "/metrics")

    def rss_mb(self) -> float:
        return psutil.Process(self.server.proc.pid).memory_info().rss / 2 ** 20

    def close(self) -> None:
        self.server.stop()
        self.hub.stop()


def stream_chat(api: OpenAI, prompt, max_tokens: int, stop_after: int | None = None
                ) -> list[int] | None:
    """A greedy streamed chat completion's token ids; with ``stop_after``, the stream is
    dropped after that many chunks (the client goes away) and None is returned."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    stream = api.chat.completions.create(model=DEFAULT_NAME, messages=messages,
                                         max_tokens=max_tokens, temperature=0, stream=True,
                                         extra_body={"return_token_ids": True})
    ids = None
    for n, chunk in enumerate(stream):
        if stop_after is not None and n >= stop_after:
            stream.close()
            return None
        if chunk.choices and chunk.choices[0].finish_reason:
            ids = chunk.choices[0].model_extra["token_ids"]
    return ids


def expected_ids(prompts: list, max_tokens: int) -> list[list[int]]:
    model, tokenizer = load_model("default")
    out = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        out.append(model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                                  do_sample=False)[0, len(ids):].tolist())
    return out


def burst(args: argparse.Namespace) -> dict:
    prompts = [p for _, p in read_prompts(args.prompt_file)][:args.prompts]
    expected = expected_ids(prompts, args.max_tokens)
    stack = Stack(args.threads)
    try:
        stream_chat(stack.api, prompts[0], 8)  # warm-up
        start = time.perf_counter()
        one = [stream_chat(stack.api, p, args.max_tokens) for p in prompts]
        sequential = time.perf_counter() - start
        before = stack.server_metrics()
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: stream_chat(stack.api, p, args.max_tokens),
                                     prompts))
        concurrent = time.perf_counter() - start
        after = stack.server_metrics()
    finally:
        stack.close()
    passes = after["starhub_serve_verify_passes_total"] - before[
        "starhub_serve_verify_passes_total"]
    rows = after["starhub_serve_verify_rows_total"] - before["starhub_serve_verify_rows_total"]
    return {"check": "burst", "prompts": len(prompts), "max_tokens": args.max_tokens,
            "sequential_s": round(sequential, 2), "concurrent_s": round(concurrent, 2),
            "speedup": round(sequential / concurrent, 2),
            "mean_verify_batch": round(rows / max(passes, 1), 2),
            "identical_sequential": one == expected, "identical_concurrent": together == expected}


def load(args: argparse.Namespace) -> dict:
    prompts = [p for _, p in read_prompts(args.prompt_file)]
    (final,) = expected_ids(prompts[:1], args.max_tokens)
    stack = Stack(args.threads)
    rng = random.Random(args.seed)
    failures: list[str] = []
    lock = threading.Lock()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:  # the same load, briefly
            list(pool.map(lambda i: stream_chat(stack.api, prompts[i % len(prompts)],
                                                args.max_tokens), range(args.warmup)))
        warm_rss = stack.rss_mb()
        trace: list[float] = []
        plan = [(prompts[i % len(prompts)],
                 rng.randint(1, args.max_tokens) if rng.random() < args.abandon else None)
                for i in range(args.requests)]
        peak = warm_rss

        def one(item) -> None:
            nonlocal peak
            prompt, stop_after = item
            try:
                ids = stream_chat(stack.api, prompt, args.max_tokens, stop_after)
                if stop_after is None and not ids:
                    raise RuntimeError("a finished stream carried no token ids")
            except Exception as exc:  # every failure is counted and shown
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
            with lock:
                peak = max(peak, stack.rss_mb())

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool, \
                tqdm(total=len(plan), unit="req", file=sys.stderr) as bar:
            for done, _ in enumerate(pool.map(one, plan), 1):
                bar.update(1)
                if done % 100 == 0:
                    trace.append(round(stack.rss_mb(), 1))
        took = time.perf_counter() - start
        settle = time.perf_counter()
        while True:
            hub_active = stack.hub_metrics()["starhub_active_sessions"]
            server_active = stack.server_metrics()["starhub_serve_active_sessions"]
            if (hub_active == 0 and server_active == 0) or time.perf_counter() - settle > 30:
                break
            time.sleep(0.1)
        settled_s = time.perf_counter() - settle
        end_rss = stack.rss_mb()
        last = stream_chat(stack.api, prompts[0], args.max_tokens)
    finally:
        stack.close()
    return {"check": "load", "requests": args.requests, "concurrency": args.concurrency,
            "abandoned": sum(s is not None for _, s in plan), "failures": len(failures),
            "failure_examples": failures[:5], "wall_s": round(took, 1),
            "sessions_zero_after_s": round(settled_s, 2), "hub_active": hub_active,
            "server_active": server_active, "rss_after_warmup_mb": round(warm_rss, 1),
            "rss_peak_mb": round(peak, 1), "rss_end_mb": round(end_rss, 1),
            "rss_growth": round(end_rss / warm_rss - 1, 4), "rss_every_100_mb": trace,
            "last_identical": last == final}


def complete_ids(api: OpenAI, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """A greedy completion of a token-id prompt: its output ids and its seconds."""
    start = time.perf_counter()
    out = api.completions.create(model=DEFAULT_NAME, prompt=ids, max_tokens=max_tokens,
                                 temperature=0, extra_body={"return_token_ids": True})
    return out.choices[0].model_extra["token_ids"], time.perf_counter() - start


def fair(args: argparse.Namespace) -> dict:
    model, tokenizer = load_model("default")
    texts = [p if isinstance(p, str) else p[-1]["content"]
             for _, p in read_prompts(args.prompt_file)]
    long_ids: list[int] = []
    while len(long_ids) < args.long_tokens:
        long_ids += tokenizer(" ".join(texts))["input_ids"]
    long_ids = long_ids[:args.long_tokens]
    short_ids = tokenizer(" ".join(reversed(texts)))["input_ids"][:args.short_tokens]
    expected = [model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens,
                               do_sample=False)[0, len(ids):].tolist()
                for ids in (long_ids, short_ids)]
    del model
    stack = Stack(args.threads)
    try:
        complete_ids(stack.api, short_ids, 8)  # warm-up
        alone = [complete_ids(stack.api, short_ids, args.max_tokens) for _ in range(2)]
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(complete_ids, stack.api, long_ids, args.max_tokens)
            time.sleep(args.after)
            short = complete_ids(stack.api, short_ids, args.max_tokens)
            long_out, long_s = long.result()
    finally:
        stack.close()
    alone_s = min(s for _, s in alone)
    return {"check": "fair", "long_tokens": len(long_ids), "short_tokens": len(short_ids),
            "max_tokens": args.max_tokens, "short_alone_s": round(alone_s, 2),
            "short_beside_s": round(short[1], 2), "ratio": round(short[1] / alone_s, 2),
            "long_s": round(long_s, 2),
            "identical": [long_out, short[0]] == expected and
            all(out == expected[1] for out, _ in alone)}


def post_status(url: str, body: dict) -> int | str:
    """The HTTP status of a JSON POST (or why there was none)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError as err:  # closed before the whole body was sent
        return f"no reply: {err.reason}"


def big(args: argparse.Namespace) -> dict:
    stack = Stack(args.threads)
    slowest, stop = [0.0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(stack.server.url + "/health", timeout=30):
                pass
            slowest[0] = max(slowest[0], time.perf_counter() - start)
            stop.wait(0.02)

    statuses = {}
    try:
        stack.api.completions.create(model=DEFAULT_NAME, prompt="Hi", max_tokens=4)  # warm-up
        time.sleep(1)
        before = stack.rss_mb()
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for size in (args.megabytes * 1e6, 600e3):
            text = "hello " * (int(size) // 6)
            label = f"{len(text) / 1e6:.2f} MB"
            statuses[f"completions {label}"] = post_status(
                stack.server.url + "/v1/completions",
                {"model": DEFAULT_NAME, "prompt": text, "max_tokens": 4})
            statuses[f"chat {label}"] = post_status(
                stack.server.url + "/v1/chat/completions",
                {"model": DEFAULT_NAME, "max_tokens": 4,
                 "messages": [{"role": "user", "content": text}]})
        time.sleep(1)
        stop.set()
        poller.join()
        after = stack.rss_mb()
    finally:
        stop.set()
        stack.close()
    return {"check": "big", "statuses": statuses, "health_max_ms": round(1e3 * slowest[0], 1),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_growth_mb": round(after - before, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_checks",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="check", required=True)
    for name in ("burst", "load", "fair", "big"):
        p = sub.add_parser(name)
        p.add_argument("--prompt-file", default=str(DEFAULT_PROMPTS))
        p.add_argument("--max-tokens", type=int,
                       default={"burst": 64, "load": 16, "fair": 30, "big": 4}[name])
        p.add_argument("--threads", default="auto",
                       help="torch threads of the server (auto: every usable core); the hub "
                            "drafts with its default 1")
        p.add_argument("--json", action="store_true")
    sub.choices["burst"].add_argument("--prompts", type=int, default=8)
    p = sub.choices["load"]
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--abandon", type=float, default=1 / 3)
    p.add_argument("--warmup", type=int, default=64,
                   help="requests at the same concurrency before the RSS reference")
    p.add_argument("--seed", type=int, default=0)
    p = sub.choices["fair"]
    p.add_argument("--long-tokens", type=int, default=8150)
    p.add_argument("--short-tokens", type=int, default=48)
    p.add_argument("--after", type=float, default=3.0,
                   help="seconds between the long request and the short one")
    sub.choices["big"].add_argument("--megabytes", type=float, default=4.0)
    args = parser.parse_args(argv)
    args.threads = resolve_threads(args.threads)
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}; server torch threads={args.threads}, hub threads=1",
          file=sys.stderr)
    result = {"burst": burst, "load": load, "fair": fair, "big": big}[args.check](args)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in
                                                          result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
