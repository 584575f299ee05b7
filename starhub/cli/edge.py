"""``starhub verifier`` and ``starhub drafter``: the edge topology's two processes."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from starhub.launch import READY
from starhub.models.prompts import encode_prompt, read_prompts
from starhub.options import (
    COUNT,
    DEFAULT_SHAPE,
    DEFAULT_THREADS,
    DRAFT_DTYPES,
    DRAFTERS,
    DTYPES,
    LINEARS,
    MESSAGE_MB,
    POSITIVE,
    SCHEDULES,
    SECONDS,
    SEED,
    TEMPERATURE,
    TOK_S,
    TOP_P,
    TREE,
    TTL,
    TreeShape,
    add_device_args,
    budget_arg,
    max_batch_arg,
    resolve_threads,
    shard_arg,
    threads_arg,
)
from starhub.server.limits import VERIFIER_LIMITS, add_limit_args, limits_from_args
from starhub.wire import security


def add_parsers(sub) -> None:
    ver = sub.add_parser(
        "verifier", help="edge: hold the target and verify many drafters' trees in batches",
        description="Bind a verifier that holds the target model. Drafters (`starhub "
                    "drafter`) connect, open sessions with their prompts and send draft "
                    "trees; each forward pass verifies several sessions' trees at once. "
                    "Prints 'STARHUB READY <address>' on stdout once it serves.")
    ver.add_argument("--bind", default="tcp://127.0.0.1:5556",
                     help="ZeroMQ address to bind (port 0 picks a free one)")
    ver.add_argument("--model", default="default",
                     help="'default' (the embedded SmolLM2-135M-Instruct), a model folder, a "
                          ".gguf file, or a model id already in the local Hugging Face cache")
    ver.add_argument("--budget", type=budget_arg, default=0,
                     help="tokens one forward pass may feed, summed over its sessions (C): "
                          "each session's tree nodes plus one. auto (default): the most a "
                          "pass feeds for about the price of one token, measured at start "
                          "(about 16 on a small CPU, hundreds on a GPU)")
    ver.add_argument("--max-batch", type=max_batch_arg, default=0,
                     help="sessions per forward pass. auto (default): as many as the budget "
                          "holds; 1 verifies one session at a time")
    ver.add_argument("--schedule", choices=SCHEDULES, default="goodspeed",
                     help="goodspeed (default): split the budget into per-drafter tree "
                          "sizes for proportional fairness (GoodSpeed), so that every "
                          "waiting drafter fits one pass. fifo: arrival order, every drafter "
                          "--nodes nodes. slo: sessions that ask for a "
                          "speed are served by deadline (WISP). random: random tree sizes, a "
                          "baseline for comparisons")
    ver.add_argument("--nodes", type=TREE.arg, default=DEFAULT_SHAPE.max_nodes,
                     help="tree nodes a session may draft at first, and always under fifo")
    ver.add_argument("--max-nodes", type=TREE.arg, default=32,
                     help="the most nodes goodspeed grants one tree; larger trees are refused")
    ver.add_argument("--max-depth", type=TREE.arg, default=16,
                     help="deeper trees are refused with an ERROR (TOO_LARGE)")
    ver.add_argument("--max-message-mb", type=MESSAGE_MB.arg, default=64.0,
                     help="larger messages are refused with an ERROR")
    add_limit_args(ver, VERIFIER_LIMITS)
    ver.add_argument("--ttl", type=TTL.arg, default=120.0,
                     help="seconds without messages after which a session is released")
    ver.add_argument("--dtype", choices=DTYPES, default="auto")
    ver.add_argument("--linear", choices=LINEARS, default="auto")
    add_device_args(ver, "the target model", device_map=True)
    ver.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                     help="torch threads for verification. auto (default): every core this "
                          "process may use; the verifier is the one shared server")
    security.add_server_args(ver)

    dr = sub.add_parser(
        "drafter", help="edge: draft for a prompt file against a remote verifier",
        description="Run a drafter next to its users' prompts. Each tree goes to the "
                    "verifier; only the tokens it commits are written, in the same JSONL "
                    "format as `starhub target`.")
    dr.add_argument("--verifier", required=True, help="verifier address, e.g. "
                                                      "tcp://127.0.0.1:5556")
    dr.add_argument("--model", default="default",
                    help="the verifier's target model, for the tokenizer, end-of-sequence ids "
                         "and (model and eagle drafters) the weights a draft borrows")
    dr.add_argument("--drafter", choices=DRAFTERS, default="eagle")
    dr.add_argument("--draft", default=None,
                    help="eagle: a head folder (default: the shipped head). model: "
                         "'self:layers=K' (default 8) or a model spec")
    dr.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto")
    add_device_args(dr, "the drafter")
    dr.add_argument("--depth", type=TREE.arg, default=DEFAULT_SHAPE.depth)
    dr.add_argument("--topk", type=TREE.arg, default=DEFAULT_SHAPE.topk)
    dr.add_argument("--max-nodes", type=TREE.arg, default=DEFAULT_SHAPE.max_nodes,
                    help="nodes of a session's first tree where the verifier names none; "
                         "trees follow the verifier's budget")
    dr.add_argument("--prompts", required=True,
                    help='JSONL: {"id", "prompt"} or MT-Bench {"question_id", "turns"}')
    dr.add_argument("--out", required=True, help="JSONL output, as `starhub target` writes")
    dr.add_argument("--max-new-tokens", type=POSITIVE.arg, default=128)
    dr.add_argument("--temperature", type=TEMPERATURE.arg, default=0.0,
                    help="0 decodes greedily")
    dr.add_argument("--top-p", type=TOP_P.arg, default=1.0)
    dr.add_argument("--seed", type=SEED.arg, default=0)
    dr.add_argument("--target-tok-s", type=TOK_S.arg, default=0.0,
                    help="the speed to ask the verifier for (its slo schedule serves by it)")
    dr.add_argument("--timeout", type=SECONDS.arg, default=30.0,
                    help="seconds to wait for a reply before reconnecting")
    dr.add_argument("--retries", type=COUNT.arg, default=3,
                    help="reconnections (with doubling backoff) before a request fails")
    dr.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                    help="torch threads for drafting. auto (default): every core this process "
                         "may use, as on a device of its own; give 1 to drafters that share "
                         "a host")
    dr.add_argument("--name", default=None)
    dr.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                    help="I/N: take every N-th prompt starting at I")
    dr.add_argument("--no-chat-template", action="store_true")
    security.add_client_args(dr)


def cmd_verifier(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from starhub.models.loading import load_model, set_threads
    from targets.verifier import Verifier, VerifierConfig

    secure = security.ServerSecurity.from_args(args)
    security.check_bind(args.bind, secure)  # before the model loads: fail at once
    threads = set_threads(resolve_threads(args.threads))
    model, tokenizer = load_model(args.model, dtype=args.dtype, linear=args.linear,
                                  device=args.device, device_map=args.device_map)
    config = VerifierConfig(bind=args.bind, budget=args.budget, max_batch=args.max_batch,
                            schedule=args.schedule, nodes=args.nodes, max_nodes=args.max_nodes,
                            ttl_s=args.ttl, max_depth=args.max_depth,
                            max_message_bytes=int(args.max_message_mb * (1 << 20)),
                            limits=limits_from_args(args), security=secure)
    verifier = Verifier.for_model(model, tokenizer, config)
    logging.getLogger("starhub.verifier").info("torch threads=%d, %s weights", threads,
                                               model.dtype)
    try:
        verifier.serve(ready=lambda address: print(READY + address, flush=True))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_drafter(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    # deferred: torch and transformers load only when this runs
    from starhub.drafters import make_drafter
    from starhub.edge.drafter import EdgeDrafter, VerifierUnavailable, result_json
    from starhub.models.loading import eos_ids, load_tokenizer, set_threads

    secure = security.ClientSecurity.from_args(args)
    secure.keys()  # a keystore that cannot be used fails here, before the drafter loads
    threads = set_threads(resolve_threads(args.threads))
    index, count = args.shard
    items = read_prompts(args.prompts)[index::count]
    name = args.name or f"drafter{index}"
    tokenizer = load_tokenizer(args.model)
    drafter = make_drafter(args.drafter, args.draft, args.model, args.draft_dtype, args.device)
    shape = TreeShape(args.depth, args.topk, args.max_nodes)
    edge = EdgeDrafter(drafter, args.verifier, shape, eos_ids(args.model), name=name,
                       timeout_s=args.timeout, retries=args.retries, security=secure)
    log = logging.getLogger("starhub.drafter")
    log.info("%s: %d prompts, %s drafter, torch threads=%d", name, len(items), drafter.name,
             threads)
    failed = 0
    with open(args.out, "w", encoding="utf-8") as fh, \
            tqdm(total=len(items), desc=name, unit="prompt", file=sys.stderr) as bar:
        for id_, prompt in items:
            ids = encode_prompt(tokenizer, prompt, not args.no_chat_template)
            try:
                out, stats = edge.generate(ids, args.max_new_tokens, args.temperature,
                                           args.top_p, args.seed, args.target_tok_s)
            except VerifierUnavailable as exc:
                log.error("%s: prompt %s failed: %s", name, id_, exc)
                fh.write(json.dumps({"id": id_, "prompt_ids": ids, "error": str(exc)}) + "\n")
                failed += 1
                bar.update(1)
                continue
            text = tokenizer.decode(out, skip_special_tokens=True)
            fh.write(json.dumps(result_json(id_, ids, out, text, stats)) + "\n")
            fh.flush()
            bar.update(1)
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", tau=f"{stats.mean_accept_len:.2f}")
    edge.close()
    return 1 if failed else 0


COMMANDS = {"verifier": cmd_verifier, "drafter": cmd_drafter}
