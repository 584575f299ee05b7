"""``starhub serve``: a target behind an OpenAI-compatible HTTP server.

It prints ``STARHUB READY http://HOST:PORT`` on stdout once it answers requests."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from starhub.client.pool import pool_addresses
from starhub.launch import READY
from starhub.settings.cli import add_settings
from starhub.settings.processes import ServeSettings, weight_args
from starhub.wire import security

log = logging.getLogger("starhub.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server for a target, drafted for by a hub",
        description="Serve a target model over HTTP: POST /v1/completions and "
                    "/v1/chat/completions (streaming or not), GET /v1/models, /health and "
                    "/metrics (Prometheus). Requests in flight are verified together in "
                    "one forward pass per round, and each is a session at the hub, which "
                    "drafts their trees together. Without a hub, or while it is away, "
                    "requests are decoded on their own (still batched); the output is the "
                    "same either way. Prints 'STARHUB READY http://HOST:PORT' when ready.")
    add_settings(p, ServeSettings)


def allowed_hosts(host: str, given: str | None) -> list[str] | None:
    """The Host header names a server answers (None: any)."""
    if given is not None:
        names = [name.strip() for name in given.split(",") if name.strip()]
        return None if "*" in names else names
    if host in ("0.0.0.0", "::", ""):
        return None  # every interface: the names clients use cannot be known here
    return sorted({"localhost", "127.0.0.1", "::1", host})


def hub_addresses(hub: str | None) -> list[str]:
    """The addresses of ``--hub`` (none, one, or a pool's), in its order: a ``--curve-server``
    that lists a certificate per hub follows it."""
    return pool_addresses(hub) if hub else []


def served_name(spec: str) -> str:
    if spec == "default":
        from starhub.models.loading import DEFAULT_NAME  # deferred: loads torch

        return DEFAULT_NAME
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else spec


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    # deferred: torch, transformers and the HTTP stack load only when this runs
    import uvicorn

    from starhub.cores import load_target
    from starhub.models.loading import load_model, set_threads
    from starhub.options import resolve_threads
    from targets.batcher import Batcher
    from targets.serve.app import OpenAIServer
    from targets.serve.limits import GuardedH11, max_connections

    secure = security.ClientSecurity.from_args(args, hub_addresses(args.hub))
    if args.hub:
        secure.keys()  # a keystore that cannot be used fails here, not while serving
    security.use_client_security(secure)
    threads = set_threads(resolve_threads(args.threads))

    def load() -> tuple:
        model, tokenizer = load_model(**weight_args(args.settings))
        return model, tokenizer, Batcher(
            model, tokenizer, args.hub, name=args.name, timeout_s=args.hub_timeout,
            prefill_chunk=args.prefill_chunk, speculate=str(args.speculate),
            shared_cores=str(args.shared_cores))
    model, tokenizer, batcher = load_target(load, args.hub, str(args.shared_cores))
    name = args.served_model_name or served_name(args.model)
    context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
    server = OpenAIServer(batcher, tokenizer, name, args.max_concurrency, context,
                          chat_template=args.chat_template,
                          allowed_hosts=allowed_hosts(args.host, args.allowed_hosts))
    batcher.start()
    log.info("serving '%s' (%s weights, torch threads=%d), hub=%s%s, max concurrency %d",
             name, model.dtype, threads, args.hub or "none",
             "" if batcher.hub_connected or not args.hub else " (not reachable yet)",
             args.max_concurrency)
    config = uvicorn.Config(server.app(), host=args.host, port=args.port,
                            log_level="warning", timeout_graceful_shutdown=30,
                            access_log=False, http=GuardedH11,
                            limit_concurrency=max_connections(args.max_concurrency))
    http = uvicorn.Server(config)
    server.stopping = lambda: http.should_exit

    async def main() -> bool:
        """Serve until stopped; True if the engine failed."""
        task = asyncio.create_task(http.serve())
        while not http.started and not task.done():
            await asyncio.sleep(0.05)
        failed = False
        if http.started:
            host, port = http.servers[0].sockets[0].getsockname()[:2]
            print(f"{READY}http://{host}:{port}", flush=True)
            log.info("listening on http://%s:%d", host, port)
            failed = await server.watch_engine(http)
        await task
        return failed

    failed = False
    try:
        failed = asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        batcher.stop()
    return 0 if http.started and not failed else 1
