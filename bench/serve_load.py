"""An open-loop load generator for OpenAI-compatible servers: requests arrive by a seeded
Poisson process, whatever the servers' progress, and each is streamed by the official
``openai`` client, which times its first token and its tokens after that."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when it is sent (seconds after the start), to which
    server, with which prompt (an index into the prompt list)."""

    at_s: float
    server: int
    prompt: int


def poisson_schedule(rate: float, requests: int, servers: int, prompts: int,
                     seed: int) -> list[Arrival]:
    """``requests`` arrivals at ``rate`` requests/s in total (exponential gaps, the first at
    0), spread round-robin over ``servers``; each draws its prompt uniformly from
    ``prompts``. The same (rate, requests, servers, prompts, seed) give the same schedule,
    so every mode is driven by the same arrivals."""
    if rate <= 0:
        raise ValueError(f"a request rate must be positive, got {rate}")
    rng = np.random.default_rng([seed, round(rate * 1e6)])
    gaps = rng.exponential(1.0 / rate, size=requests)
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if requests else []
    picks = rng.integers(prompts, size=requests)
    return [Arrival(float(t), i % servers, int(p))
            for i, (t, p) in enumerate(zip(starts, picks, strict=True))]


@dataclass
class Outcome:
    """One streamed request as its client saw it; times in seconds on the driver's
    ``perf_counter`` clock."""

    index: int
    server: int
    prompt: int
    sent: float = 0.0
    lag_s: float = 0.0
    """How late the driver sent it after its scheduled arrival."""
    first: float | None = None
    """When the first chunk with text arrived."""
    done: float | None = None
    """When the last chunk (the one with ``finish_reason``) arrived."""
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    spec: dict = field(default_factory=dict)
    """The response's ``spec_decode`` extension (rounds, mean_accept_len, ...)."""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, over the whole request."""
        if self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)


async def _one(client, model: str, messages: list[dict], max_tokens: int,
               out: Outcome, start: float, at_s: float) -> None:
    delay = start + at_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    out.sent = time.perf_counter()
    out.lag_s = max(0.0, out.sent - start - at_s)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            if out.first is None and choice.delta and choice.delta.content:
                out.first = now
            if choice.finish_reason is not None:
                out.done = now
                out.finish_reason = choice.finish_reason
                extra = choice.model_extra or {}
                out.token_ids = list(extra.get("token_ids") or [])
                top = chunk.model_extra or {}
                out.prompt_token_ids = list(top.get("prompt_token_ids") or [])
                out.spec = dict(top.get("spec_decode") or {})
        if out.done is None:
            out.error = "the stream ended without a finish_reason"
        elif out.first is None and out.tokens:
            out.first = out.done  # every token's text was empty (or held back to the end)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        out.error = f"{type(exc).__name__}: {exc}"


def closed_schedule(requests: int, servers: int, prompts: int, seed: int) -> list[Arrival]:
    """``requests`` requests for a closed loop (each sent when a client is free), spread
    round-robin over ``servers``, prompts drawn as ``poisson_schedule`` draws them."""
    rng = np.random.default_rng([seed, 0])
    picks = rng.integers(prompts, size=requests)
    return [Arrival(0.0, i % servers, int(p)) for i, p in enumerate(picks)]


async def _drive(urls: list[str], model: str, schedule: list[Arrival],
                 conversations: list[list[dict]], max_tokens: int,
                 timeout_s: float, concurrency: int | None = None) -> list[Outcome]:
    # deferred: openai is a [dev] dependency, needed only by this benchmark
    from openai import AsyncOpenAI

    for name in ("httpx", "httpx2"):  # the openai client's HTTP library logs every request
        logging.getLogger(name).setLevel(logging.WARNING)
    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           timeout=timeout_s) for url in urls]
    outs = [Outcome(i, a.server, a.prompt) for i, a in enumerate(schedule)]
    start = time.perf_counter() + 0.05
    clients_free = asyncio.Semaphore(concurrency) if concurrency else None

    async def send(a: Arrival, out: Outcome) -> None:
        if clients_free is None:  # open loop: at its arrival time
            return await _one(clients[a.server], model, conversations[a.prompt], max_tokens,
                              out, start, a.at_s)
        async with clients_free:  # closed loop: as soon as a client is free, in order
            await _one(clients[a.server], model, conversations[a.prompt], max_tokens, out,
                       start, max(0.0, time.perf_counter() - start))

    try:
        await asyncio.gather(*(send(a, out) for a, out in zip(schedule, outs, strict=True)))
    finally:
        for client in clients:
            await client.close()
    return outs


def drive(urls: list[str], model: str, schedule: list[Arrival],
          conversations: list[list[dict]], max_tokens: int,
          timeout_s: float = 600.0, concurrency: int | None = None) -> list[Outcome]:
    """Send ``schedule``'s requests (greedy chat completions, streamed, with their token
    ids) and wait for all of them; failures are outcomes with ``error``. Open loop at their
    arrival times, or with ``concurrency``, closed loop: that many clients, each sending
    its next request when its last one ends."""
    return asyncio.run(_drive(urls, model, schedule, conversations, max_tokens, timeout_s,
                              concurrency))


def percentile_ms(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation) in milliseconds; None if empty."""
    return float(1e3 * np.percentile(values, q)) if values else None


def summarize(outs: list[Outcome]) -> dict:
    """A row's client-side figures: throughput over the span from the first send to the
    last finish, TTFT and TPOT percentiles over the requests that finished."""
    ok = [o for o in outs if o.error is None]
    span = (max(o.done for o in ok) - min(o.sent for o in outs)) if ok else 0.0
    tokens = sum(o.tokens for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    e2e = [o.done - o.sent for o in ok]
    return {
        "requests": len(outs), "completed": len(ok), "failed": len(outs) - len(ok),
        "errors": sorted({o.error for o in outs if o.error})[:5],
        "span_s": span,
        "request_throughput": len(ok) / span if span else 0.0,
        "output_tokens": tokens,
        "output_tok_s": tokens / span if span else 0.0,
        "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
        "tpot_p50_ms": percentile_ms(tpot, 50), "tpot_p99_ms": percentile_ms(tpot, 99),
        "e2e_p50_ms": percentile_ms(e2e, 50), "e2e_p99_ms": percentile_ms(e2e, 99),
        "max_send_lag_ms": 1e3 * max((o.lag_s for o in outs), default=0.0),
    }


def per_request(outs: list[Outcome]) -> list[dict]:
    """Each request's own figures, in the order of the schedule (times in ms, ``sent_s``
    from the first send)."""
    t0 = min((o.sent for o in outs), default=0.0)

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(1e3 * seconds, 1)

    return [{"server": o.server, "prompt": o.prompt, "sent_s": round(o.sent - t0, 3),
             "ttft_ms": ms(o.ttft_s), "tpot_ms": ms(o.tpot_s),
             "e2e_ms": ms(None if o.done is None else o.done - o.sent), "tokens": o.tokens,
             "rounds": o.spec.get("rounds"), "plain_steps": o.spec.get("plain_steps"),
             "error": o.error} for o in outs]


def spec_summary(outs: list[Outcome]) -> dict:
    """τ (tokens per verified round, bonus included) and the share of output tokens the
    servers decoded without a tree, from the responses' ``spec_decode`` fields."""
    specs = [o.spec for o in outs if o.error is None and o.spec]
    rounds = sum(s.get("rounds", 0) for s in specs)
    accepted = sum(s.get("accepted_draft_tokens", 0) for s in specs)
    plain = sum(s.get("plain_steps", 0) for s in specs)
    tokens = sum(o.tokens for o in outs if o.error is None)
    return {"tau": (rounds + accepted) / rounds if rounds else None,
            "spec_rounds": rounds,
            "plain_token_share": plain / tokens if tokens else None,
            "hub_requests": sum(bool(s.get("hub")) for s in specs)}


SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2el_s"}
"""What an SLO may bound, each in milliseconds on the command line: time to first token,
time per output token after it, and the whole request's latency."""
SUSTAINED = 0.9
"""A rate is sustained where at least this share of its requests meets every SLO."""


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=MS,tpot=MS[,e2el=MS]`` (any of them) as seconds by key."""
    slo: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo: '{part}' is not KEY=MS with KEY one of "
                             f"{', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key}={value} is not a number of milliseconds") from None
        if not 0 < ms < 1e9:
            raise ValueError(f"--slo: {key} must be a positive number of milliseconds")
        slo[key] = ms / 1e3
    if not slo:
        raise ValueError("--slo: give at least one of ttft=MS, tpot=MS, e2el=MS")
    return slo


def meets(o: Outcome, slo: dict[str, float]) -> bool:
    """Whether a request finished and met every SLO (a one-token answer has no TPOT to
    miss)."""
    if o.error is not None or o.done is None:
        return False
    measured = {"ttft": o.ttft_s, "tpot": o.tpot_s, "e2el": o.done - o.sent}
    return all(measured[key] is None or measured[key] <= limit for key, limit in slo.items())


def slo_summary(outs: list[Outcome], slo: dict[str, float]) -> dict:
    """Goodput (requests a second that met every SLO, over the row's span, as DistServe
    and vLLM's ``--goodput`` count it) and SLO attainment (their share of the requests)."""
    ok = [o for o in outs if o.error is None and o.done is not None]
    span = (max(o.done for o in ok) - min(o.sent for o in outs)) if ok else 0.0
    good = sum(meets(o, slo) for o in outs)
    return {"goodput_rps": good / span if span else 0.0,
            "slo_attainment": good / len(outs) if outs else 0.0}


def sustained_rates(rows: list[dict]) -> dict:
    """Per mode, the highest offered load (rate, or closed-loop concurrency) whose
    attainment is at least ``SUSTAINED`` (None: none is), and star's over plain's."""
    best: dict[str, float | None] = {}
    for mode in ("star", "plain"):
        rates = [r["load"] for r in rows if r["mode"] == mode
                 and (r.get("slo_attainment") or 0.0) >= SUSTAINED]
        best[mode] = max(rates, default=None)
    star, plain = best["star"], best["plain"]
    return {**best, "star_vs_plain": star / plain if star and plain else None}
