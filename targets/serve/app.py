"""The HTTP face of a serving target: OpenAI's completions and chat completions (streamed
by server-sent events or not), models, health and Prometheus metrics, on FastAPI.

Every request becomes a ``targets.batcher.Request``; its tokens come back as events
from the engine thread, through an asyncio queue, and leave as text. A client that goes
away cancels its request at once, which frees its session here and at the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from starhub.models.prompts import encode_prompt
from targets import batcher as engine
from targets.acceptance import Sampling
from targets.serve.limits import BODY_TIMEOUT_S, WRITE_TIMEOUT_S
from targets.serve.metrics import ServeMetrics
from targets.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    SamplingRequest,
    shown,
)
from targets.serve.text import TextStream
from targets.stats import GenerationStats
from targets.verify import TokenLogprob

log = logging.getLogger("starhub.serve")

DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 4 << 20
"""A request body past this is refused (413) before it is read any further."""


class OpenAIServer:
    """``batcher`` runs the model; this answers HTTP for it. ``model_name`` is what
    requests must name; ``max_concurrency`` requests may be in flight, more get 429."""

    def __init__(self, batcher: engine.Batcher, tokenizer, model_name: str,
                 max_concurrency: int = 16, context_len: int = 2048,
                 chat_template: bool = True, allowed_hosts: list[str] | None = None):
        self.batcher = batcher
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_concurrency = max_concurrency
        self.context_len = context_len
        self.chat_template = chat_template
        self.allowed_hosts = None if allowed_hosts is None else \
            {h.lower().strip("[]") for h in allowed_hosts}
        """The names the Host header may give (None: any)."""
        self.metrics = ServeMetrics(batcher)
        self.inflight = 0
        self.stopping: Callable[[], bool] = lambda: False
        """Whether the HTTP server has begun its graceful shutdown (set by its runner)."""
        self.created = int(time.time())
        self.token_chars = max(map(len, tokenizer.get_vocab()), default=1) or 1
        """The longest token's text: a prompt holds at least its length over this in
        tokens, which refuses a prompt far past the context before it is tokenized."""
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        """Prompts are tokenized here, in turn, never on the event loop."""

    async def watch_engine(self, http, every_s: float = 0.5) -> bool:
        """Until the HTTP server ``http`` (a ``uvicorn.Server``) stops: True, once it is
        told to, if the engine thread failed. The requests it held have had their errors;
        a server that cannot decode any more exits for its supervisor to restart it, rather
        than answer 503 for ever."""
        while not http.should_exit:
            if self.batcher.failed:
                log.error("%s; stopping the server so that it can be restarted",
                          self.batcher.failed)
                http.should_exit = True
                return True
            await asyncio.sleep(every_s)
        return False

    @property
    def shutting_down(self) -> bool:
        return self.stopping() or bool(self.batcher.failed)

    # -- the app ----------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="starhub serve", version="1",
                      description="OpenAI-compatible speculative decoding target",
                      docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(OpenAIError, self._on_error)
        if self.allowed_hosts is not None:
            app.middleware("http")(self._check_host)
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)
        app.api_route("/health", methods=["GET", "HEAD"])(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app

    async def _check_host(self, request: Request, call_next) -> Response:
        """Refuse a Host header this server does not go by: a page that rebinds a name of
        its own to a loopback address reaches the socket, but not the API."""
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if name.lower().strip("[]") not in self.allowed_hosts:
            error = OpenAIError(400, f"this server does not answer for the host "
                                     f"'{shown(host)}' (--allowed-hosts)")
            self.metrics.requests.labels("other", "400").inc()
            return JSONResponse(error.body(), status_code=400)
        return await call_next(request)

    async def _on_http_error(self, request: Request, exc: StarletteHTTPException
                             ) -> JSONResponse:
        """What the framework refuses before our handlers run (an unknown path, a wrong
        method), in the OpenAI error shape like every other; counted under one label, so
        that no client can add metric series by path. Our own errors are ``OpenAIError``s,
        counted by route."""
        self.metrics.requests.labels("other", str(exc.status_code)).inc()
        error = OpenAIError(exc.status_code, f"{request.method} {shown(request.url.path)}: "
                            f"{exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def _on_error(self, request: Request, exc: OpenAIError) -> JSONResponse:
        self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        headers = {}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def health(self) -> JSONResponse:
        s = self.batcher.stats
        status = "failed" if self.batcher.failed else "shutting_down" if self.stopping() \
            else "ok"
        body = {"status": status, "error": self.batcher.failed or None,
                "model": self.model_name, "hub": self.batcher.hub,
                "hub_connected": self.batcher.hub_connected, "running": s.running,
                "waiting": s.waiting, "inflight": self.inflight,
                "max_concurrency": self.max_concurrency,
                "mean_accept_len": s.committed / s.rounds if s.rounds else 0.0,
                "mean_verify_batch": s.rows / s.passes if s.passes else 0.0,
                "output_tokens": s.tokens}
        return JSONResponse(body, status_code=503 if self.shutting_down else 200)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "starhub", "max_model_len": self.context_len}]}

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_length(len(prompt), "prompt")
            ids = (await self._off_loop(self.tokenizer, prompt,
                                        add_special_tokens=True))["input_ids"]
        else:
            ids = [int(t) for t in prompt]
            vocab = self.batcher.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise OpenAIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        return await self._respond(request, body, ids, body.max_tokens, chat=False,
                                   echo=echo)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        conversation = body.conversation()
        self._check_length(sum(len(m["content"]) for m in conversation), "messages")
        try:
            ids = await self._off_loop(encode_prompt, self.tokenizer, conversation,
                                       self.chat_template)
        except Exception as exc:  # the model's chat template refuses this conversation
            raise OpenAIError(400, f"messages: the chat template refused them: {exc}",
                              "messages") from None
        return await self._respond(request, body, ids, body.limit, chat=True)

    async def _off_loop(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, functools.partial(fn, *args, **kwargs))

    def _check_length(self, chars: int, param: str) -> None:
        """Refuse a prompt whose ``chars`` characters cannot fit the context in any
        tokenization (each token covers at most ``token_chars`` of them)."""
        least = chars // self.token_chars
        if least > self.context_len:
            raise OpenAIError(400, f"this model's context is {self.context_len} tokens and "
                              f"the prompt has at least {least}", param)

    # -- one request ------------------------------------------------------------------
    async def _parse(self, request: Request, schema: type[SamplingRequest]) -> SamplingRequest:
        if self.batcher.failed:
            raise OpenAIError(503, f"the server cannot serve: {self.batcher.failed}")
        if self.shutting_down:
            raise OpenAIError(503, "the server is shutting down", retry_after_s=5)
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            raise OpenAIError(415, f"the body must be JSON, sent as Content-Type: "
                              f"application/json (not '{shown(kind)}')")
        raw = _json(await _read_body(request))
        try:
            body = schema.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            message = err["msg"].removeprefix("Value error, ")
            param = ".".join(str(p) for p in err["loc"]) or None
            if param is not None:
                message = f"{param}: {message}"
            else:  # a check across fields starts its message with the field
                named, sep, _ = message.partition(":")
                names = {f.alias or key for key, f in schema.model_fields.items()}
                param = named if sep and named in names else None
            raise OpenAIError(400, message, param) from None
        if body.model != self.model_name:
            raise OpenAIError(404, f"the model '{shown(body.model)}' does not exist; this "
                              f"server serves '{self.model_name}'", "model", "model_not_found")
        return body

    async def _respond(self, request: Request, body: SamplingRequest, ids: list[int],
                       max_tokens: int | None, chat: bool, echo: str | None = None
                       ) -> Response:
        if not ids:
            raise OpenAIError(400, "the prompt is empty", "prompt" if not chat else "messages")
        room = self.context_len - len(ids)
        if room < 1:
            raise OpenAIError(400, f"this model's context is {self.context_len} tokens and "
                              f"the prompt has {len(ids)}", "messages" if chat else "prompt")
        max_tokens = max_tokens if max_tokens is not None else room
        if max_tokens > room:
            raise OpenAIError(400, f"this model's context is {self.context_len} tokens; the "
                              f"prompt has {len(ids)} and max_tokens asks {max_tokens} more",
                              "max_tokens")
        if self.inflight >= self.max_concurrency:
            raise OpenAIError(429, f"the server is at its {self.max_concurrency} concurrent "
                              f"requests (--max-concurrency); retry shortly", retry_after_s=1)
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7])
        req = engine.Request(prompt=ids, max_tokens=max_tokens,
                             sampling=Sampling(body.temperature, body.top_p), seed=seed,
                             logprobs=body.top_logprobs, echo=echo is not None)
        call = Call(self, request, req, body, chat, echo)
        if body.stream:
            return EventStream(call)
        try:
            return JSONResponse(await call.whole())
        finally:
            call.release()


class EventStream(StreamingResponse):
    """A call's server-sent events; whatever becomes of the stream (a client gone before
    its first byte included), the call's place in ``inflight`` is given back."""

    def __init__(self, call: Call):
        super().__init__(call.sse(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_drop(message) -> None:
            try:
                await asyncio.wait_for(send(message), WRITE_TIMEOUT_S)
            except TimeoutError:
                raise SlowReader from None

        try:
            await super().__call__(scope, receive, send_or_drop)
        except SlowReader:  # the server closes the connection when this returns
            log.info("dropped a client that read nothing of its stream for %g s",
                     WRITE_TIMEOUT_S)
            await self.body_iterator.aclose()  # which cancels its request
        finally:
            self.call.release()


class SlowReader(Exception):
    """A client read nothing of its stream for ``WRITE_TIMEOUT_S``."""


class Call:
    """One request from arrival to its last byte."""

    def __init__(self, server: OpenAIServer, http: Request, req: engine.Request,
                 body: SamplingRequest, chat: bool, echo: str | None = None):
        self.server = server
        self.http = http
        self.req = req
        self.body = body
        self.chat = chat
        self.route = http.url.path
        self.arrived = time.perf_counter()
        self.first_at: float | None = None
        self.text = TextStream(server.tokenizer, body.stops)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.finish_reason: str | None = None
        self.stats: GenerationStats | None = None
        self.logprobs: list[TokenLogprob] = []
        """Each token's log-probability, as the engine sent them (where asked for)."""
        self.logprobs_shown = 0
        self.echo = echo
        """The prompt's text, which an ``echo`` response begins with."""
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.server.inflight += 1  # counted from admission, so that 429 sees bursts
        self.released = False

    def release(self) -> None:
        """Give back the call's place in ``inflight`` (once, whoever calls first)."""
        if not self.released:
            self.released = True
            self.server.inflight -= 1

    async def events(self) -> AsyncIterator[str]:
        """Text pieces as the engine commits tokens; sets ``finish_reason`` at the end.
        Leaving early (a stop string, a client gone) cancels the request."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[engine.Event] = asyncio.Queue()
        def sink(event: engine.Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(inbox.put_nowait, event)

        self.req.sink = sink
        rid = self.server.batcher.submit(self.req)
        done = False
        try:
            while True:
                event = await inbox.get()
                if event.tokens and self.first_at is None:
                    self.first_at = time.perf_counter()
                if event.logprobs:
                    self.logprobs.extend(event.logprobs)
                if event.prompt_logprobs:
                    self.prompt_logprobs = event.prompt_logprobs
                piece = self.text.push(event.tokens)
                if event.done:
                    done = True
                    self.stats = event.stats
                    if event.done == "error":
                        raise OpenAIError(500, event.error)
                    self.finish_reason = "stop" if self.text.stopped else event.done
                    piece += self.text.flush()
                    if piece:
                        yield piece
                    return
                if piece:
                    yield piece
                if self.text.stopped:
                    self.finish_reason = "stop"
                    return
        finally:
            if not done:
                self.server.batcher.cancel(rid)
            self.release()
            self.server.metrics.finished(self.arrived, self.first_at, len(self.text.ids),
                                         len(self.req.prompt))

    async def whole(self) -> dict:
        """The complete response; a client that disconnects first cancels the request."""
        async def collect() -> str:
            pieces = []
            async with contextlib.aclosing(self.events()) as events:
                async for piece in events:
                    pieces.append(piece)
            return "".join(pieces)

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await self.http.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self.server.metrics.requests.labels(self.route, "499").inc()
                return {}
        text = task.result()
        self.server.metrics.requests.labels(self.route, "200").inc()
        choice = {"index": 0, "finish_reason": self.finish_reason,
                  "logprobs": self._logprobs()}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (self.echo or "") + text
        if self.body.return_token_ids:
            choice["token_ids"] = list(self.text.ids)
        return self._envelope([choice], usage=self.usage(), spec=True,
                              prompt_ids=self.body.return_token_ids)

    async def sse(self) -> AsyncIterator[str]:
        status = "200"
        try:
            if self.chat:
                yield self._chunk({"role": "assistant", "content": ""}, None)
            async with contextlib.aclosing(self.events()) as events:
                async for piece in events:
                    yield self._chunk({"content": piece} if self.chat else piece, None)
            yield self._chunk({} if self.chat else "", self.finish_reason, last=True)
            if self.body.include_usage:
                yield _sse(self._envelope([], usage=self.usage(), chunk=True))
        except OpenAIError as exc:
            status = str(exc.status)
            yield _sse(exc.body())
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            self.server.metrics.requests.labels(self.route, status).inc()
        yield "data: [DONE]\n\n"

    # -- shapes -----------------------------------------------------------------------
    def _logprobs(self) -> dict | None:
        """The log-probabilities of the tokens kept since the last call (None where the
        request did not ask), in the completions shape (``tokens``, ``token_logprobs``,
        ``top_logprobs``, ``text_offset``) or the chat one (``content``)."""
        if self.req.logprobs is None:
            return None
        kept = min(len(self.logprobs), len(self.text.ids))
        ids, entries = self.text.ids[self.logprobs_shown:kept], \
            self.logprobs[self.logprobs_shown:kept]
        self.logprobs_shown = max(self.logprobs_shown, kept)
        word = self._token_text
        if self.chat:
            return {"content": [
                {"token": word(t), "logprob": e.logprob, "bytes": list(word(t).encode()),
                 "top_logprobs": [{"token": word(i), "logprob": lp,
                                   "bytes": list(word(i).encode())} for i, lp in e.top]}
                for t, e in zip(ids, entries, strict=True)]}
        if self.echo is not None and self.prompt_logprobs and not self._echoed:
            self._echoed = True
            ids, entries = list(self.req.prompt) + ids, self.prompt_logprobs + entries
        words = [word(t) for t in ids]
        offsets, at = [], self._text_offset
        for w in words:
            offsets.append(at)
            at += len(w)
        self._text_offset = at
        return {"tokens": words,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else
                                 {word(i): lp for i, lp in e.top} | {w: e.logprob}
                                 for w, e in zip(words, entries, strict=True)],
                "text_offset": offsets}

    _text_offset = 0
    _echoed = False

    def _token_text(self, token: int) -> str:
        return self.server.tokenizer.decode([token])

    def _chunk(self, delta: dict | str, finish: str | None, last: bool = False) -> str:
        choice = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs()}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        if last and self.body.return_token_ids:
            choice["token_ids"] = list(self.text.ids)
        body = self._envelope([choice], spec=last, chunk=True,
                              prompt_ids=last and self.body.return_token_ids)
        if self.body.include_usage:
            body["usage"] = None
        return _sse(body)

    def _envelope(self, choices: list[dict], usage: dict | None = None, spec: bool = False,
                  chunk: bool = False, prompt_ids: bool = False) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.id, "object": obj + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if spec:
            body["spec_decode"] = self.spec()
            if self.stats is not None:
                body["metrics"] = {"speculative_decoding": self.speculative_decoding()}
        if prompt_ids:
            body["prompt_token_ids"] = list(self.req.prompt)
        return body

    def usage(self) -> dict:
        prompt, out = len(self.req.prompt), len(self.text.ids)
        return {"prompt_tokens": prompt, "completion_tokens": out,
                "total_tokens": prompt + out}

    def speculative_decoding(self) -> dict:
        """The request's rounds in vLLM's per-request shape (``metrics.speculative_decoding``,
        which AIPerf reads): a step is a verified hub tree; its draft tokens are the tree's
        nodes, so ``num_draft_tokens`` sums them, and ``num_spec_tokens`` is the deepest
        tree's depth, the most draft tokens one step could accept (the histogram's last
        index)."""
        s = self.stats
        accepted = sum((int(k) - 1) * v for k, v in s.accept_len_hist.items())
        return {
            "mean_acceptance_length": 1 + accepted / s.rounds if s.rounds else 0.0,
            "draft_acceptance_rate": accepted / s.tree_nodes if s.tree_nodes else 0.0,
            "acceptance_histogram": [s.accept_len_hist.get(str(n + 1), 0)
                                     for n in range(s.max_depth + 1)],
            "num_spec_steps": s.rounds, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": s.tree_nodes, "num_spec_tokens": s.max_depth}

    def spec(self) -> dict:
        """Per-request speculation figures (an extension field, as vLLM reports them)."""
        s = self.stats
        if s is None:
            return {}
        committed = sum(int(k) * v for k, v in s.accept_len_hist.items())
        return {"rounds": s.rounds, "mean_accept_len": round(s.mean_accept_len, 3),
                "accepted_draft_tokens": committed - s.rounds, "draft_tokens": s.tree_nodes,
                "plain_steps": max(0, s.new_tokens - committed - 1),
                "hub": s.rounds > 0 or s.plain_rounds > 0}


async def _read_body(request: Request) -> bytes:
    """The body, read no further than ``MAX_BODY_BYTES`` whatever its headers say."""
    too_big = OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    parts, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise too_big
                parts.append(part)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} "
                          f"s") from None
    return b"".join(parts)


def _json(body: bytes) -> dict:
    """The body's JSON object, or a 400 saying why not: not JSON (or not UTF-8), NaN or
    Infinity, a number too long to convert, nesting too deep to parse, or a string holding
    an unpaired surrogate, which no tokenizer or response could encode."""
    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        raw = json.loads(body, parse_constant=no_constant)
        json.dumps(raw, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise OpenAIError(400, "the body holds an unpaired UTF-16 surrogate (such as "
                          "\\ud800) in a string") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else shown(str(exc))
        raise OpenAIError(400, f"the body is not valid JSON: {reason}") from None
    if not isinstance(raw, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return raw


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
