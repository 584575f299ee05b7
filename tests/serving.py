"""Helpers for tests of ``starhub serve``: ports, Prometheus scrapes, HTTP as clients send it."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from email.message import Message

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """Every unlabelled sample of a Prometheus endpoint, by sample name."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def health(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


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


def wait_until(check, timeout_s: float = 15.0, every_s: float = 0.1):
    """Poll ``check()`` until it returns something true; return it (or the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)
