"""What one HTTP client may hold: a connection that never finishes its headers or its body
is closed, and past the connection cap the server answers 503. A real uvicorn server of
the tiny model (no hub), in this process, with its deadlines shortened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn
from serving import free_port, post, reference, scrape, wait_until

from targets.batcher import Batcher
from targets.serve import app as app_module
from targets.serve.app import OpenAIServer
from targets.serve.limits import GuardedH11, max_connections

CONCURRENCY = 2


class QuickH11(GuardedH11):
    header_timeout_s = 1.0


@contextlib.contextmanager
def serving(tiny_model, context_len: int = 256, send_buffer: int = 0, **options):
    """A real uvicorn server of the tiny model in this process: (its URL, its port).
    ``send_buffer``: the kernel's send buffer of each connection, in bytes (0: as the
    kernel sizes it, up to megabytes on loopback), as a slow network would hold."""
    model, tokenizer = tiny_model
    batcher = Batcher(model, tokenizer)
    openai = OpenAIServer(batcher, tokenizer, "tiny", CONCURRENCY, context_len, **options)
    listener = socket.socket()
    if send_buffer:  # accepted connections inherit it
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(openai.app(), log_level="warning", http=QuickH11,
                                         limit_concurrency=max_connections(CONCURRENCY)))
    batcher.start()
    thread = threading.Thread(target=lambda: asyncio.run(http.serve([listener])),
                              daemon=True)
    thread.start()
    assert wait_until(lambda: http.started, 30)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        http.should_exit = True
        thread.join(10)
        batcher.stop()


@pytest.fixture(scope="module")
def server(tiny_model):
    with serving(tiny_model) as running:
        yield running


def test_a_host_the_server_does_not_go_by_is_refused(tiny_model):
    """DNS rebinding: a page whose own name now resolves to 127.0.0.1 reaches the socket,
    but its requests name its host, not the server's."""
    from starhub.cli.serve import allowed_hosts

    with serving(tiny_model, allowed_hosts=allowed_hosts("127.0.0.1", None)) as (url, port):
        body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 2}).encode()
        for host, status in (("evil.example", 400), (f"evil.example:{port}", 400),
                             (f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200),
                             (f"[::1]:{port}", 200)):
            request = urllib.request.Request(url + "/v1/completions", data=body, headers={
                "Host": host, "Content-Type": "application/json"})
            code, reply = _open(request)
            assert code == status, (host, reply)
            if status == 400:
                assert "--allowed-hosts" in json.loads(reply)["error"]["message"]
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("::", "a, *") is None
    assert allowed_hosts("10.0.0.5", "a.example,b.example") == ["a.example", "b.example"]


def closed_by_server(sock: socket.socket, trickle: bytes = b"", within_s: float = 30.0) -> bool:
    """Whether the server closes ``sock`` within ``within_s``, while ``trickle`` is sent a
    byte every 0.2 s (a client that keeps its connection busy without finishing)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + within_s
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
        if sent < len(trickle):
            with contextlib.suppress(OSError):
                sock.send(trickle[sent:sent + 1])
            sent += 1
    return False


def test_a_client_trickling_its_headers_is_closed_at_the_header_deadline(server):
    url, port = server
    sock = socket.create_connection(("127.0.0.1", port))
    sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert closed_by_server(sock, trickle=b"X-Slow: " + b"a" * 1000)
    sock.close()
    assert post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6],
                                         "max_tokens": 2})[0] == 200


def test_a_body_shorter_than_its_length_is_a_408_at_the_body_deadline(server, monkeypatch):
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 1.0)
    _, port = server
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\": ")
    reply = _response(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408")
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert "did not arrive" in body["error"]["message"]


def test_past_the_connection_cap_a_request_gets_503_and_room_comes_back(server):
    url, port = server
    idle = [socket.create_connection(("127.0.0.1", port))
            for _ in range(max_connections(CONCURRENCY) - 1)]
    try:
        assert wait_until(lambda: _get(url + "/health")[0] == 503, 10)
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: _get(url + "/health")[0] == 200, 10)


def _response(sock: socket.socket) -> bytes:
    """A whole HTTP response read off a raw socket: its head, then Content-Length bytes
    (they may come in separate reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _get(url: str) -> tuple[int, bytes]:
    return _open(urllib.request.Request(url))


def _open(request: urllib.request.Request) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_failed_engine_answers_its_requests_with_a_500_and_stops_the_server(tiny_model):
    """A fault inside a forward pass: the request in flight gets a 500 in the OpenAI shape,
    and the server stops (``starhub serve`` then exits non-zero for its supervisor)
    instead of answering 503 for ever."""
    model, tokenizer = tiny_model
    batcher = Batcher(model, tokenizer)

    def broken(work):
        raise MemoryError("out of memory in a pass")

    batcher.engine.verify = broken
    openai = OpenAIServer(batcher, tokenizer, "tiny", CONCURRENCY, 256)
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(openai.app(), host="127.0.0.1", port=port,
                                         log_level="warning", http=QuickH11))
    outcome: list[bool] = []

    async def serve() -> None:
        task = asyncio.create_task(http.serve())
        while not http.started:
            await asyncio.sleep(0.05)
        outcome.append(await openai.watch_engine(http, every_s=0.05))
        await task

    batcher.start()
    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: http.started, 30)
        code, reply, _ = post(f"http://127.0.0.1:{port}", "/v1/completions",
                              {"model": "tiny", "prompt": [5, 6], "max_tokens": 4})
        assert code == 500 and "out of memory" in reply["error"]["message"]
        thread.join(30)
        assert outcome == [True] and not thread.is_alive()
    finally:
        http.should_exit = True
        batcher.stop()


def _raw_post(port: int, body: bytes) -> int:
    """The status of a POST of ``body`` as it is, whatever it holds."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        return int(_response(sock).split(b" ", 2)[1])


def test_greedy_output_stays_the_targets_own_while_hostile_clients_hit_the_same_server(
        server, tiny_model, monkeypatch):
    """Malformed bodies, a 4 MB prompt, headers sent a byte at a time and a body that never
    ends, all at once beside greedy requests: each hostile one is refused or closed, and
    every greedy request gets ``generate()``'s tokens."""
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 1.0)
    url, port = server
    model, _ = tiny_model
    bad = [b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
           b"[" * 200_000 + b"]" * 200_000, b'{"model": "\\ud800", "prompt": "a"}',
           b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
           json.dumps({"model": "tiny", "prompt": "hello " * 650_000}).encode()]
    statuses: list[int] = []
    slow: list[bool] = []

    def hostile() -> None:
        for body in bad:
            statuses.append(_raw_post(port, body))

    def trickler() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append(closed_by_server(sock, trickle=b"X-Slow: " + b"a" * 1000))

    def short_body() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 900\r\n\r\n{")
            slow.append(_response(sock).startswith(b"HTTP/1.1 408"))

    attackers = [threading.Thread(target=f) for f in (hostile, trickler, short_body)]
    for thread in attackers:
        thread.start()
    prompts = [[5, 9, 13, 17], [7, 3, 11], [21, 4, 8, 30, 2, 6]]
    got = []
    while any(thread.is_alive() for thread in attackers) or not got:
        for ids in prompts:
            code, reply, _ = post(url, "/v1/completions", {
                "model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True})
            assert code == 200, reply
            got.append((ids, reply["choices"][0]["token_ids"]))
    for thread in attackers:
        thread.join(60)
    assert statuses and all(400 <= code < 500 for code in statuses), statuses
    assert slow == [True, True], slow
    assert len(got) >= len(prompts)
    for ids, tokens in got:
        assert tokens == reference(model, ids, 12)


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_place_given_back(
        tiny_model, monkeypatch):
    """A streaming client that reads nothing is dropped once a write has waited
    ``WRITE_TIMEOUT_S``: its request ends before its 2,000 tokens (about 2 MB of events
    with their logprobs, past the buffers), and the server has room for as many others as
    before. Greedy, so that every run decodes the same tokens: a sampled stream has a fresh
    seed each run, and one that drew the end-of-sequence token early would fit the buffers."""
    monkeypatch.setattr(app_module, "WRITE_TIMEOUT_S", 1.0)
    body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 2000, "stream": True,
                       "logprobs": 20, "temperature": 0}).encode()
    with serving(tiny_model, context_len=2048, send_buffer=16384) as (url, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        with sock:
            assert wait_until(lambda: _inflight(url) == 1, 30), "the stream never started"
            assert wait_until(lambda: _inflight(url) == 0, 60), "the stalled stream holds on"
            sock.settimeout(30)
            received = b""
            while chunk := sock.recv(1 << 16):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received[:300]
        assert b"[DONE]" not in received, \
            f"the stream ran to its end ({len(received)} bytes): it was never dropped"
        replies = [post(url, "/v1/completions", {"model": "tiny", "prompt": [5, 6],
                                                 "max_tokens": 2})[0]
                   for _ in range(CONCURRENCY + 1)]
        assert replies == [200] * (CONCURRENCY + 1)


def _inflight(url: str) -> float:
    """Requests the server holds now (its Prometheus gauge)."""
    return scrape(url + "/metrics").get("starhub_serve_active_sessions", -1)
