"""A serving target's Prometheus metrics: requests, queue, latency, speculation.

Per request: TTFT (arrival to first token), TPOT (each later token), end-to-end time,
prompt and output tokens. From the batcher, read at scrape time: requests running and
waiting for prefill, verify passes and the rows in them (mean verify batch), rounds and
the tokens they committed (τ), plain steps, whether the hub is connected, and output
tokens per second over the last scrape interval.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from targets.batcher import Batcher

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    def __init__(self, batcher: Batcher):
        self.registry = CollectorRegistry()
        self.requests = Counter("starhub_serve_requests", "HTTP requests answered, by route "
                                "and status code", ["route", "status"], registry=self.registry)
        self.ttft = Histogram("starhub_serve_ttft_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("starhub_serve_tpot_seconds", "time per output token after the "
                              "first, per request", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("starhub_serve_request_seconds", "request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("starhub_serve_prompt_tokens", "prompt tokens prefilled",
                                     registry=self.registry)
        self.registry.register(BatcherCollector(batcher))

    def finished(self, arrived: float, first_at: float | None, tokens: int,
                 prompt_tokens: int) -> None:
        now = time.perf_counter()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(now - arrived)
        if first_at is not None:
            self.ttft.observe(first_at - arrived)
            if tokens > 1:
                self.tpot.observe((now - first_at) / (tokens - 1))


class BatcherCollector:
    """The batcher's totals as metrics, read when Prometheus scrapes."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self._last = (time.monotonic(), 0)

    def collect(self):
        s = self.batcher.stats
        yield _gauge("starhub_serve_running", "requests decoding now", s.running)
        yield _gauge("starhub_serve_waiting", "requests waiting for their prefill", s.waiting)
        yield _gauge("starhub_serve_active_sessions", "requests in flight (decoding or "
                     "prefilling)", self.batcher.active)
        yield _gauge("starhub_serve_hub_connected", "1 while a hub drafts for this server",
                     int(self.batcher.hub_connected))
        yield _counter("starhub_serve_verify_passes", "batched forward passes", s.passes)
        yield _counter("starhub_serve_verify_rows", "requests verified, summed over passes",
                       s.rows)
        yield _gauge("starhub_serve_mean_verify_batch", "requests per verify pass since start",
                     s.rows / s.passes if s.passes else 0.0)
        yield _counter("starhub_serve_spec_rounds", "rounds that verified a hub tree", s.rounds)
        yield _counter("starhub_serve_spec_committed_tokens", "tokens those rounds produced, "
                       "bonus included", s.committed)
        yield _gauge("starhub_serve_mean_accept_len", "τ: tokens per verified round",
                     s.committed / s.rounds if s.rounds else 0.0)
        yield _counter("starhub_serve_plain_steps", "tokens decoded without a tree",
                       s.plain_steps)
        yield _counter("starhub_serve_requests_alone", "requests decoded without the hub "
                       "because plain batching served their batch faster",
                       s.gated)
        yield _counter("starhub_serve_generation_tokens", "output tokens", s.tokens)
        now = time.monotonic()
        then, tokens = self._last
        self._last = (now, s.tokens)
        yield _gauge("starhub_serve_tokens_per_second", "output tokens per second since the "
                     "last scrape", (s.tokens - tokens) / max(now - then, 1e-9))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
