"""Helpers for tests of ``starhub serve``: ports, Prometheus scrapes, HTTP as clients send it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from email.message import Message

import torch

from bench.serve_checks import free_port, scrape  # noqa: F401  (re-exported for tests)
from starhub.launch.status import server_health as health  # noqa: F401


def post(url: str, path: str, body: dict | bytes) -> tuple[int, dict, Message]:
    """(status, JSON body, headers) of a POST, errors included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def reference(model, ids: list[int], new: int) -> list[int]:
    """Stock transformers' greedy continuation of ``ids``."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def wait_until(check, timeout_s: float = 15.0, every_s: float = 0.1):
    """Poll ``check()`` until it returns something true; return it (or the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def hub_errors(hub_metrics: str, ignore: tuple[str, ...] = ()) -> float:
    """ERROR replies the hub has sent, every code together but those named in ``ignore``
    (its Prometheus endpoint)."""
    return sum(v for k, v in scrape(hub_metrics).items()
               if k.startswith("starhub_errors_total{")
               and not any(f'code="{code}"' in k for code in ignore))
