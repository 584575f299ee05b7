"""The ``starhub`` command: hub, target, generate, demo, bench, train-eagle, the edge
topology's verifier and drafter, launch and status for whole deployments, and keys.

Every handler imports what it needs itself, so ``starhub --help`` loads no model code."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from bench import cli as bench_cli
from starhub.cli import edge as edge_cli
from starhub.cli import launch as launch_cli
from starhub.cli import serve as serve_cli
from starhub.cli.demo import run_demo
from starhub.cli.serve import hub_addresses
from starhub.hub.shutdown import drain
from starhub.launch import READY, spawn_hub
from starhub.options import AUTO, MAX_AUTO_DEPTH, LogLevel, draft_process_for, resolve_threads
from starhub.server.limits import SessionLimits
from starhub.settings.cli import SettingsParser, add_settings, as_flags
from starhub.settings.processes import (
    DemoSettings,
    GenerateSettings,
    HubSettings,
    TargetSettings,
    TreeFields,
    drafter_args,
    weight_args,
)
from starhub.wire import security


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog="starhub",
        description="Distributed speculative decoding: one draft hub serves many target "
                    "processes over ZeroMQ. Output is lossless: greedy text is exactly what "
                    "the target alone produces.")
    parser.add_argument("--log-level", default=LogLevel.INFO, choices=[str(v) for v in LogLevel])
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=argparse.ArgumentParser)

    hub = sub.add_parser("hub", help="serve drafts to targets",
                         description="Run a draft hub. It prints 'STARHUB READY <address>' on "
                                     "stdout once it accepts targets.")
    add_settings(hub, HubSettings)
    tgt = sub.add_parser("target", help="run a prompt file through one target process",
                         description="Decode every prompt of a JSONL file with drafts from a "
                                     "hub and write one JSON line per prompt.")
    add_settings(tgt, TargetSettings)
    gen = sub.add_parser("generate", help="one prompt through a local hub and target",
                         description="Start a hub process, decode PROMPT as a target in this "
                                     "process, and print the text as it is committed.")
    add_settings(gen, GenerateSettings)
    demo = sub.add_parser(
        "demo", help="two targets sharing one hub, with per-target speed",
        description="Start a hub and --targets target processes on this machine, each "
                    "decoding its share of --prompts; then print each target's speed "
                    "against plain generate() on the same prompts: one generate() process "
                    "per target, all at once as the targets ran (timed before and after "
                    "them, and averaged), and one at a time with the machine to itself; "
                    "and whether every output was identical.")
    add_settings(demo, DemoSettings)
    serve_cli.add_parser(sub)
    edge_cli.add_parsers(sub)
    bench_cli.add_parser(sub)
    launch_cli.add_parsers(sub)
    sub.choices["launch"].set_defaults(cli_parser=parser)  # launch checks its commands

    keys = sub.add_parser("keys", help="CURVE certificates for servers and clients",
                          description="Manage the ZeroMQ CURVE certificates that servers "
                                      "(--curve-secret, --curve-allow) and clients "
                                      "(--curve-secret, --curve-server) use.")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen_keys = keys_sub.add_parser(
        "generate", help="write a key pair: DIR/NAME.key and DIR/NAME.key_secret",
        description="Write pyzmq's certificate pair: DIR/NAME.key (public: give it to the "
                    "other side; a server's allow folder holds its clients' .key files) and "
                    "DIR/NAME.key_secret (secret, readable by its owner only). Existing "
                    "files are never overwritten.")
    gen_keys.add_argument("dir", help="folder to write into (created if missing)")
    gen_keys.add_argument("name", help="file name stem, e.g. hub or target0")

    train = sub.add_parser("train-eagle", add_help=False,
                           help="train an EAGLE head for a target (see train-eagle --help)")
    train.set_defaults(train_args=[])
    return parser


def _hub_flags(args: argparse.Namespace) -> list[str]:
    """The hub ``generate`` and ``demo`` start: their drafting settings and model."""
    return as_flags(args.settings, HubSettings, [*TreeFields.model_fields, "model"])


def cmd_hub(args: argparse.Namespace) -> int:
    import asyncio

    # deferred: torch and transformers load only when this runs
    from starhub.drafters import TreeShape, make_drafter
    from starhub.hub.server import Hub, HubConfig
    from starhub.models.loading import set_threads

    secure = security.ServerSecurity.from_args(args)
    security.check_bind(args.bind, secure)  # before the drafter loads: fail at once
    threads = resolve_threads(args.threads) if args.threads == AUTO else args.threads
    threads = threads or set_threads(None)
    set_threads(1)
    if draft_process_for(args.draft_process, args.drafter):
        # deferred: torch load only when this runs
        from starhub.hub.drafting_process import RemoteDrafter

        drafter = RemoteDrafter(args.settings, threads, args.log_level)
    else:
        drafter = make_drafter(**drafter_args(args.settings))
    adaptive = args.depth == AUTO
    shape = TreeShape(MAX_AUTO_DEPTH if adaptive else args.depth, args.topk, args.max_nodes)
    config = HubConfig(bind=args.bind, shape=shape, adaptive=adaptive,
                       ttl_s=args.ttl, max_targets=args.max_targets,
                       max_message_bytes=int(args.max_message_mb * (1 << 20)),
                       metrics_port=args.metrics_port, threads=threads,
                       limits=SessionLimits(**args.settings.limit_values()), security=secure,
                       batch=args.batch, predraft=args.predraft,
                       lookup=args.lookup, prune=args.prune)
    hub = Hub(drafter, config)
    logging.getLogger("starhub.hub").info("torch threads=%d, drafter weights %s", threads,
                                          drafter.weights)

    async def main() -> None:
        import contextlib
        import signal

        task = asyncio.create_task(hub.serve())
        await hub.ready.wait()
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, lambda: asyncio.ensure_future(drain(hub, task)))
        print(READY + hub.bound, flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logging.getLogger("starhub.hub").info("stopped")

    try:
        import uvloop

        uvloop.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        drafter.close()
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from targets.runner import run

    secure = security.ClientSecurity.from_args(args, hub_addresses(args.hub))
    if args.hub:
        secure.keys()  # a keystore that cannot be used fails here, not while decoding
    security.use_client_security(secure)
    return run(args.hub, weight_args(args.settings), args.prompts, args.out,
               args.max_new_tokens, args.temperature, args.top_p, args.seed, args.threads,
               args.chat_template, args.name or f"target{args.shard[0]}",
               args.shard, hub_timeout_s=args.hub_timeout, shared_cores=args.shared_cores)


def cmd_generate(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from starhub.models.loading import load_model, set_threads
    from targets.api import attach

    set_threads(resolve_threads(args.threads))
    with spawn_hub(_hub_flags(args), threads=1) as hub:
        model, tokenizer = load_model(**weight_args(args.settings))
        with attach(model, tokenizer, hub.address, name="generate",
                    chat_template=args.chat_template) as session:
            start = time.perf_counter()
            pieces = []
            for piece in session.stream(args.prompt, args.max_new_tokens, args.temperature,
                                        args.top_p, args.seed):
                pieces.append(piece)
                print(piece, end="", flush=True)
            print()
            wall = time.perf_counter() - start
            n = len(tokenizer("".join(pieces), add_special_tokens=False)["input_ids"])
            print(f"[{args.drafter} drafter, ~{n} tokens in {wall:.2f}s, "
                  f"{n / max(wall, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args, _hub_flags(args))


def cmd_keys(args: argparse.Namespace) -> int:
    public, secret = security.generate_keys(args.dir, args.name)
    print(f"public: {public}  (copy to the other side; clients' go in a server's allow folder)")
    print(f"secret: {secret}  (stays here: --curve-secret)")
    return 0


def cmd_train_eagle(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from scripts.train_eagle import main as train_main

    train_main(args.train_args)
    return 0


COMMANDS = {"hub": cmd_hub, "target": cmd_target, "generate": cmd_generate, "demo": cmd_demo,
            "keys": cmd_keys, "bench": bench_cli.main, "train-eagle": cmd_train_eagle,
            "serve": serve_cli.cmd_serve, **edge_cli.COMMANDS, **launch_cli.COMMANDS}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train-eagle":
        args.train_args = extra
    elif extra:
        parser.unknown(args, extra)
    _setup_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:
        logging.getLogger("starhub").error("%s", exc)
        return 2
