"""The ``starhub`` command: hub, target, generate, demo, bench, train-eagle, the edge
topology's verifier and drafter, launch and status for whole deployments, and keys.

Every handler imports what it needs itself, so ``starhub --help`` loads no model code."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from bench import cli as bench_cli
from starhub.cli import edge as edge_cli
from starhub.cli import launch as launch_cli
from starhub.cli import serve as serve_cli
from starhub.cli.demo import run_demo
from starhub.cores import add_shared_cores_arg
from starhub.hub.shutdown import drain
from starhub.launch import READY, spawn_hub
from starhub.options import (  # noqa: F401  (re-exported: earlier homes of these names)
    AUTO,
    COUNT,
    DEFAULT_DEPTH,
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    DEFAULT_SHAPE,
    DEFAULT_THREADS,
    DTYPES,
    LINEARS,
    MAX_AUTO_DEPTH,
    MESSAGE_MB,
    PORT,
    POSITIVE,
    SECONDS,
    SEED,
    TEMPERATURE,
    TOP_P,
    TTL,
    add_device_args,
    auto_on_off_arg,
    auto_or_count,
    batch_arg,
    depth_arg,
    draft_process_for,
    max_targets_arg,
    on_off_arg,
    resolve_threads,
    shard_arg,
    threads_arg,
)
from starhub.options import add_tree_args as _add_tree_args
from starhub.server.limits import add_limit_args, limits_from_args
from starhub.wire import security

DEMO_PROMPTS = Path(__file__).resolve().parents[2] / "scripts" / "prompts" / "demo.jsonl"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _add_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the target's weights. auto: float32 on CPU, where greedy output then "
                        "matches generate() bit for bit; bfloat16 on GPU. On CPUs with "
                        "AVX512-BF16 or AMX, bfloat16 verifies a tree for little more than "
                        "the cost of one token")
    p.add_argument("--linear", choices=LINEARS, default="auto",
                   help="the target's matrix-multiply kernel. auto: oneDNN on CPU, for float32 "
                        "and, where the CPU has it natively, bfloat16 (weights prepacked at "
                        "load; faster than PyTorch's default for the few-row products of "
                        "decoding and verification), torch otherwise")
    add_device_args(p, "the target model", device_map=True)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=POSITIVE.arg, default=128)
    p.add_argument("--temperature", type=TEMPERATURE.arg, default=0.0,
                   help="0 decodes greedily")
    p.add_argument("--top-p", type=TOP_P.arg, default=1.0)
    p.add_argument("--seed", type=SEED.arg, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="starhub",
        description="Distributed speculative decoding: one draft hub serves many target "
                    "processes over ZeroMQ. Output is lossless: greedy text is exactly what "
                    "the target alone produces.")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    hub = sub.add_parser("hub", help="serve drafts to targets",
                         description="Run a draft hub. It prints 'STARHUB READY <address>' on "
                                     "stdout once it accepts targets.")
    hub.add_argument("--bind", default="tcp://127.0.0.1:5555",
                     help="ZeroMQ address to bind (port 0 picks a free one)")
    hub.add_argument("--model", default="default",
                     help="the targets' model, used by --draft self ('default' is the "
                          "embedded SmolLM2-135M-Instruct)")
    _add_tree_args(hub)
    hub.add_argument("--threads", type=COUNT.arg, default=1,
                     help="torch threads for drafting. A head pass is a few small matrix "
                          "products; a second thread saves little and, on a machine the hub "
                          "shares with targets, takes cores from them")
    add_device_args(hub, "the drafter")
    hub.add_argument("--ttl", type=TTL.arg, default=120.0,
                     help="seconds without messages after which a session is released")
    hub.add_argument("--max-targets", type=max_targets_arg, default=0,
                     help="admission. auto: admit a target only while every admitted target "
                          "stays at or above its own standalone speed (the load model's "
                          "N_max); N: at most N targets; 0: no limit. A rejected target "
                          "decodes on its own and asks again later")
    hub.add_argument("--batch", type=batch_arg, default=AUTO,
                     help="requests drafted together, one pass per tree layer for all of them. "
                          "auto (default): every request waiting when the drafter frees up "
                          "(never waits for more); 1: one at a time")
    hub.add_argument("--predraft", type=on_off_arg, default=DEFAULT_PREDRAFT, metavar="on|off",
                     help="on: while a target verifies and no request waits, draft its next "
                          "tree for the likeliest outcomes of its round, so a matching COMMIT "
                          "gets its PROPOSE at once (greedy sessions; output never changes). "
                          "Off by default: with the shipped head too few guesses hit to pay")
    hub.add_argument("--lookup", type=on_off_arg, default=DEFAULT_LOOKUP, metavar="on|off",
                     help="on (default): graft onto each greedy session's tree what followed "
                          "the latest earlier occurrence of its last 2-4 tokens (prompt "
                          "lookup), one branch of at most --depth tokens, where the tree lacks "
                          "it. Pays where answers copy from their prompt: passages, code")
    hub.add_argument("--prune", type=on_off_arg, default=DEFAULT_PRUNE, metavar="on|off",
                     help="on (default): a greedy tree leaves out the nodes whose draft "
                          "probability is below what they cost, each round: the target's "
                          "measured verify time per node over its round, times the tokens a "
                          "round commits. A node is accepted about as often as that "
                          "probability says, so on a CPU target, where a node costs about a "
                          "twentieth of a step, the unlikely ones slow it; on a GPU almost "
                          "none are left out. EAGLE drafter only (its probabilities were "
                          "measured to track acceptance). Output never changes")
    hub.add_argument("--draft-process", type=auto_on_off_arg, default=DEFAULT_DRAFT_PROCESS,
                     metavar="auto|on|off",
                     help="on: draft in a process of its own, so that drafting never waits "
                          "on the hub's message handling (in one process the two share one "
                          "interpreter lock, which cost batched drafting about a fifth of "
                          "its rounds at 8 targets); off: draft in a thread of the hub's "
                          "process; auto (default): on for the eagle drafter, off for the "
                          "ngram and model drafters, which do not batch")
    hub.add_argument("--max-message-mb", type=MESSAGE_MB.arg, default=64.0,
                     help="larger messages are refused with an ERROR")
    add_limit_args(hub)
    hub.add_argument("--metrics-port", type=PORT.arg, default=0,
                     help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off)")
    security.add_server_args(hub)

    tgt = sub.add_parser("target", help="run a prompt file through one target process",
                         description="Decode every prompt of a JSONL file with drafts from a "
                                     "hub and write one JSON line per prompt.")
    tgt.add_argument("--hub", default=None,
                     help="hub address, e.g. tcp://127.0.0.1:5555 (omit to decode alone)")
    tgt.add_argument("--model", default="default",
                     help="'default', a model folder, a .gguf file, or a model id already in "
                          "the local Hugging Face cache")
    tgt.add_argument("--prompts", required=True,
                     help='JSONL: {"id", "prompt"} or MT-Bench {"question_id", "turns"}')
    tgt.add_argument("--out", required=True, help="JSONL output")
    _add_sampling_args(tgt)
    _add_weight_args(tgt)
    tgt.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                     help="torch threads for this target. auto (default): every core this "
                          "process may use (the hub drafts while the target waits, so they "
                          "take turns). Several targets on one machine should split the "
                          "cores, as `demo`, `bench` and `launch` do")
    tgt.add_argument("--no-chat-template", action="store_true",
                     help="tokenize prompts as plain text")
    tgt.add_argument("--name", default=None, help="name shown by the hub and progress bar")
    tgt.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                     help="I/N: take every N-th prompt starting at I (to split across targets)")
    tgt.add_argument("--hub-timeout", type=SECONDS.arg, default=3.0,
                     help="seconds a hub reply may take at least: past max(this, 10x the "
                          "typical round trip) the hub counts as gone; the target finishes "
                          "on its own and reconnects in the background")
    add_shared_cores_arg(tgt)
    security.add_client_args(tgt)

    gen = sub.add_parser("generate", help="one prompt through a local hub and target",
                         description="Start a hub process, decode PROMPT as a target in this "
                                     "process, and print the text as it is committed.")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="default")
    _add_tree_args(gen)
    _add_sampling_args(gen)
    _add_weight_args(gen)
    gen.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                     help="torch threads of the target (this process). auto (default): every "
                          "core it may use; the hub it starts drafts with 1")
    gen.add_argument("--no-chat-template", action="store_true")

    demo = sub.add_parser(
        "demo", help="two targets sharing one hub, with per-target speed",
        description="Start a hub and --targets target processes on this machine, each "
                    "decoding its share of --prompts; then print each target's speed "
                    "against plain generate() on the same prompts: one generate() process "
                    "per target, all at once as the targets ran (timed before and after "
                    "them, and averaged), and one at a time with the machine to itself; "
                    "and whether every output was identical.")
    demo.add_argument("--model", default="default")
    _add_tree_args(demo)
    demo.add_argument("--prompts", default=str(DEMO_PROMPTS),
                      help="JSONL prompt file (default: the 8 shipped demo prompts)")
    demo.add_argument("--max-new-tokens", type=POSITIVE.arg, default=48)
    demo.add_argument("--targets", type=POSITIVE.arg, default=2,
                      help="target processes; prompt i goes to target i mod N")
    demo.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                      help="torch threads of each target and of the generate() it is "
                           "compared with. auto (default): the usable cores split evenly "
                           "between the targets")
    _add_weight_args(demo)
    serve_cli.add_parser(sub, _add_weight_args)
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


def _tree_flags(args: argparse.Namespace) -> list[str]:
    draft = ["--draft", args.draft] if args.draft else []
    return ["--model", args.model, "--drafter", args.drafter, *draft,
            "--depth", str(args.depth), "--topk", str(args.topk),
            "--max-nodes", str(args.max_nodes), "--draft-dtype", args.draft_dtype]


def cmd_hub(args: argparse.Namespace) -> int:
    import asyncio

    # deferred: torch and transformers load only when this runs
    from starhub.drafters import TreeShape, make_drafter
    from starhub.hub.server import Hub, HubConfig
    from starhub.models.loading import set_threads

    secure = security.ServerSecurity.from_args(args)
    security.check_bind(args.bind, secure)  # before the drafter loads: fail at once
    threads = args.threads or set_threads(None)
    set_threads(1)
    if draft_process_for(args.draft_process, args.drafter):
        # deferred: torch load only when this runs
        from starhub.hub.drafting_process import RemoteDrafter

        draft = ["--draft", args.draft] if args.draft else []
        drafter = RemoteDrafter(["--drafter", args.drafter, *draft, "--model", args.model,
                                 "--draft-dtype", args.draft_dtype, "--device", args.device,
                                 "--log-level", args.log_level], threads)
    else:
        drafter = make_drafter(args.drafter, args.draft, args.model, args.draft_dtype,
                               args.device)
    adaptive = args.depth == AUTO
    shape = TreeShape(MAX_AUTO_DEPTH if adaptive else args.depth, args.topk, args.max_nodes)
    config = HubConfig(bind=args.bind, shape=shape, adaptive=adaptive,
                       ttl_s=args.ttl, max_targets=args.max_targets,
                       max_message_bytes=int(args.max_message_mb * (1 << 20)),
                       metrics_port=args.metrics_port, threads=threads,
                       limits=limits_from_args(args), security=secure,
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

    secure = security.ClientSecurity.from_args(args)
    if args.hub:
        secure.keys()  # a keystore that cannot be used fails here, not while decoding
    security.use_client_security(secure)
    return run(args.hub, args.model, args.prompts, args.out, args.max_new_tokens,
               args.temperature, args.top_p, args.seed, args.threads,
               not args.no_chat_template, args.name or f"target{args.shard[0]}",
               args.shard, args.dtype, args.linear,
               hub_timeout_s=args.hub_timeout, device=args.device, device_map=args.device_map,
               shared_cores=args.shared_cores)


def cmd_generate(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from starhub.models.loading import load_model, set_threads
    from targets.api import attach

    set_threads(resolve_threads(args.threads))
    with spawn_hub(_tree_flags(args), threads=1) as hub:
        model, tokenizer = load_model(args.model, dtype=args.dtype, linear=args.linear,
                                      device=args.device, device_map=args.device_map)
        with attach(model, tokenizer, hub.address, name="generate",
                    chat_template=not args.no_chat_template) as session:
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
    return run_demo(args, _tree_flags(args))


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
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:
        logging.getLogger("starhub").error("%s", exc)
        return 2
