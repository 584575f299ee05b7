"""``starhub verifier`` and ``starhub drafter``: the edge topology's two processes."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from starhub.launch import READY
from starhub.models.prompts import encode_prompt, read_prompts
from starhub.options import AUTO, TreeShape, resolve_threads
from starhub.server.limits import SessionLimits
from starhub.settings.cli import add_settings
from starhub.settings.processes import DrafterSettings, VerifierSettings, drafter_args, weight_args
from starhub.wire import security


def add_parsers(sub) -> None:
    ver = sub.add_parser(
        "verifier", help="edge: hold the target and verify many drafters' trees in batches",
        description="Bind a verifier that holds the target model. Drafters (`starhub "
                    "drafter`) connect, open sessions with their prompts and send draft "
                    "trees; each forward pass verifies several sessions' trees at once. "
                    "Prints 'STARHUB READY <address>' on stdout once it serves.")
    add_settings(ver, VerifierSettings)
    dr = sub.add_parser(
        "drafter", help="edge: draft for a prompt file against a remote verifier",
        description="Run a drafter next to its users' prompts. Each tree goes to the "
                    "verifier; only the tokens it commits are written, in the same JSONL "
                    "format as `starhub target`.")
    add_settings(dr, DrafterSettings)


def cmd_verifier(args: argparse.Namespace) -> int:
    # deferred: torch and transformers load only when this runs
    from starhub.models.loading import load_model, set_threads
    from targets.verifier import Verifier, VerifierConfig

    secure = security.ServerSecurity.from_args(args)
    security.check_bind(args.bind, secure)  # before the model loads: fail at once
    threads = set_threads(resolve_threads(args.threads))
    model, tokenizer = load_model(**weight_args(args.settings))
    config = VerifierConfig(bind=args.bind, budget=0 if args.budget == AUTO else args.budget,
                            max_batch=0 if args.max_batch == AUTO else args.max_batch,
                            schedule=str(args.schedule), nodes=args.nodes, max_nodes=args.max_nodes,
                            ttl_s=args.ttl, max_depth=args.max_depth,
                            max_message_bytes=int(args.max_message_mb * (1 << 20)),
                            limits=SessionLimits(**args.settings.limit_values()), security=secure)
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

    secure = security.ClientSecurity.from_args(args, [args.verifier])
    secure.keys()  # a keystore that cannot be used fails here, before the drafter loads
    threads = set_threads(resolve_threads(args.threads))
    index, count = args.shard
    items = read_prompts(args.prompts)[index::count]
    name = args.name or f"drafter{index}"
    tokenizer = load_tokenizer(args.model)
    drafter = make_drafter(**drafter_args(args.settings))
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
            ids = encode_prompt(tokenizer, prompt, args.chat_template)
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
