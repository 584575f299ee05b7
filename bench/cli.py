"""``starhub bench``: its arguments and handler (registered by ``starhub.cli.main``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from msgspec import Meta

from bench.defaults import BASELINES, DEFAULT_PROMPTS, DEFAULT_REPLAY_PROMPTS
from bench.emulate import EmulateOptions, EmulateSpec, emulated_doc
from bench.plot import plot, plot_edge, plot_serve
from bench.report import markdown_table, text_table
from starhub.options import (
    AMOUNT,
    COUNT,
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    DEFAULT_THREADS,
    DRAFT_DTYPES,
    DTYPES,
    LINEARS,
    PORT,
    POSITIVE,
    SCHEDULES,
    SECONDS,
    TREE,
    Number,
    auto_on_off_arg,
    auto_or_count,
    batch_arg,
    budget_arg,
    depth_arg,
    max_targets_arg,
    on_off_arg,
    resolve_threads,
    threads_arg,
    tree_defaults,
)

SERVE_TARGETS = 2
SERVE_REQUESTS = 30
RATE = Number(float, Meta(gt=0))
"""A request rate, in requests per second."""

TREE_ARGS = ("drafter", "draft", "depth", "topk", "max_nodes", "draft_dtype")
PREDRAFT_DEFAULT = "on" if DEFAULT_PREDRAFT else "off"
LOOKUP_DEFAULT = "on" if DEFAULT_LOOKUP else "off"
PRUNE_DEFAULT = "on" if DEFAULT_PRUNE else "off"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="round speeds, idle time and throughput against N, with baselines",
        description="For each N, start a fresh hub and N target processes on loopback, run "
                    "the prompts split across them, and print one row per N (StarSD "
                    "Table 1 layout) next to baselines measured on the same prompts. With "
                    "--emulate, model compute is replaced by calibrated waits so that N can "
                    "reach hundreds on one machine, and the analytical model's prediction "
                    "is printed beside each row. With --serve, `starhub serve` processes "
                    "with and without a hub are driven by Poisson arrivals instead.")
    p.add_argument("--targets", default=None,
                   help="comma-separated values of N (default 1,2,3,4,6,8; --serve: one N, "
                        f"default {SERVE_TARGETS})")
    p.add_argument("--model", default="default", help="the targets' model")
    p.add_argument("--drafter", default=None, help="the hub's drafter (default: the hub's)")
    p.add_argument("--draft", default=None,
                   help="comma list of drafter weights, as for `starhub hub` (e.g. two EAGLE "
                        "heads); each value gets its own star rows, the colocated baseline "
                        "uses the first")
    p.add_argument("--depth", default=None,
                   help="comma list of tree depths or 'auto' (e.g. 2,4,6,auto); each value "
                        "gets its own star row for every N, measured in the same run "
                        "(default: the hub's; emulation: the spec's depth=)")
    p.add_argument("--max-targets", default=None,
                   help="comma list of the hub's admission setting (0, N or auto); each value "
                        "gets its own star row for every N (default 0)")
    p.add_argument("--batch", default=None,
                   help="comma list of the hub's --batch (auto or N); each value gets its own "
                        "star or hub-load row for every N (default: auto)")
    p.add_argument("--predraft", default=None,
                   help="comma list of the hub's --predraft (on, off); each value gets its "
                        f"own star or hub-load row for every N (default: {PREDRAFT_DEFAULT}, "
                        "as `starhub hub`)")
    p.add_argument("--lookup", default=None,
                   help="comma list of the hub's --lookup (on, off); each value gets its own "
                        f"star or hub-load row for every N (default: {LOOKUP_DEFAULT}, as "
                        "`starhub hub`)")
    p.add_argument("--prune", default=None,
                   help="comma list of the hub's --prune (on, off); each value gets its own "
                        f"star or hub-load row for every N (default: {PRUNE_DEFAULT}, as "
                        "`starhub hub`)")
    p.add_argument("--draft-process", default=None,
                   help="comma list of the hub's --draft-process (auto, on, off); each value "
                        "gets its own star or hub-load row for every N (default: "
                        f"{DEFAULT_DRAFT_PROCESS}, as `starhub hub`)")
    p.add_argument("--topk", default=None,
                   help="comma list of the hub's --topk; each value gets its own star or "
                        "hub-load row for every N (default: the hub's)")
    p.add_argument("--max-nodes", default=None,
                   help="comma list of the hub's --max-nodes, the tree's node budget (e.g. "
                        "10,16,24); each value gets its own star or hub-load row for every N "
                        "(default: the hub's)")
    p.add_argument("--draft-dtype", default=None, choices=DRAFT_DTYPES,
                   help="the hub's drafter weights, as for `starhub hub` (the colocated "
                        "baseline uses the same)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights of the targets and of every baseline. auto is float32 on CPU; "
                        "with bfloat16, tree verification rounds differently from generate()'s "
                        "one-token steps, so the lossless column may read False")
    p.add_argument("--linear", default="auto", choices=LINEARS,
                   help="matrix-multiply kernel of the targets and of every baseline, as for "
                        "`starhub target`")
    p.add_argument("--prompts", default=None,
                   help=f"JSONL prompt file (default {DEFAULT_PROMPTS.name}; --hub-load: "
                        f"{DEFAULT_REPLAY_PROMPTS.name})")
    p.add_argument("--max-new-tokens", type=POSITIVE.arg, default=None,
                   help="per prompt (default 64); emulated sessions default to 512, "
                        "--hub-load recordings to 128")
    p.add_argument("--threads", type=threads_arg, default=DEFAULT_THREADS,
                   help="torch threads of each target and of the baselines. auto (default): "
                        "the usable cores split evenly between a row's N targets; the "
                        "baselines, one process, get them all (the bench prints the counts)")
    p.add_argument("--hub-threads", type=COUNT.arg, default=1,
                   help="torch threads of the hub, as for `starhub hub --threads`")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help="comma-separated subset of hf-generate, hf-prompt-lookup, colocated "
                        "('' for none)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG like StarSD's Figure 5")
    p.add_argument("--markdown", default=None, help="write the table as Markdown")
    p.add_argument("--emulate", default=None, metavar="SPEC",
                   help="e.g. t_s=1.4ms,t_v=25ms,t_c=1ms,beta=0.8,depth=6; add trace=RUN.json "
                        "to replay a real run's accepted lengths instead of beta")
    p.add_argument("--duration", type=SECONDS.arg, default=3.0,
                   help="emulation and --hub-load: measured seconds per row (emulation: "
                        "longer where N is large)")
    p.add_argument("--warmup", type=AMOUNT.arg, default=1.0,
                   help="emulation and --hub-load: unmeasured seconds first")
    p.add_argument("--emulate-procs", type=POSITIVE.arg, default=1,
                   help="emulation: processes the targets are spread over")
    p.add_argument("--metrics-port", type=PORT.arg, default=0,
                   help="emulation: the hub serves Prometheus text on this port")
    load = p.add_argument_group(
        "hub load", "--hub-load: a real hub and drafter, and N replay clients that compute "
        "nothing: they answer each PROPOSE from a recorded greedy run of --model (recorded "
        "once, then cached), at once or after --emulate t_v=TIME. One row per N and "
        "combination of --depth, --max-targets, --batch, --predraft, --lookup, --prune and "
        "--draft-process")
    load.add_argument("--hub-load", action="store_true")
    load.add_argument("--repeat", type=POSITIVE.arg, default=1, metavar="R",
                      help="--hub-load and --serve: run every row R times, all rows and then "
                           "all again, and show each row's median run (by r_q, or by "
                           "output_tok_s for --serve; r_q_runs and output_tok_s_runs list "
                           "them all): on a shared machine a single run can be far off "
                           "(default 1)")
    load.add_argument("--record-prompts", type=POSITIVE.arg, default=8,
                      help="prompts of --prompts to record and replay")
    load.add_argument("--replay-cache", default=None,
                      help="where recordings are cached (default "
                           "$XDG_CACHE_HOME/starhub/hub-load)")
    edge = p.add_argument_group(
        "edge topology", "--topology edge: one verifier and N drafters instead of one hub and "
        "N targets; one row per combination of --drafters, --schedule and --max-batch")
    edge.add_argument("--topology", choices=("star", "edge"), default="star")
    edge.add_argument("--drafters", default="4", help="comma list of drafter counts N")
    edge.add_argument("--schedule", default="goodspeed",
                      help="comma list of verifier schedules: fifo, goodspeed, slo, random")
    edge.add_argument("--max-batch", default="auto",
                      help="comma list of the verifier's sessions per pass (auto or N)")
    edge.add_argument("--budget", default="auto",
                      help="the verifier's tokens per forward pass (C), or auto (as "
                           "`starhub verifier`; emulated: where a pass costs 1.5x one token)")
    edge.add_argument("--nodes", type=TREE.arg, default=None,
                      help="tree nodes per draft (fifo's fixed S_i; default: --max-nodes)")
    edge.add_argument("--verifier-threads", type=threads_arg, default=DEFAULT_THREADS,
                      help="torch threads of the verifier process. auto (default): every "
                           "core, as `starhub verifier`; the drafters, standing in for devices "
                           "of their own, run at a lower priority")
    serve = p.add_argument_group(
        "serving", "--serve: N `starhub serve` processes sharing one hub (star) against the "
        "same N servers without a hub (plain), driven open-loop by seeded Poisson arrivals "
        "at each --rate, streamed by the openai client; one row per mode and rate, every "
        "output checked against the plain rows' and generate()'s. The hub runs its defaults "
        "unless a hub flag (--drafter, --depth, ...) is given, one value each")
    serve.add_argument("--serve", action="store_true")
    serve.add_argument("--rate", default="0.5,1,2",
                       help="comma list of request rates: requests per second in total, sent "
                            "round-robin to the N servers (default 0.5,1,2)")
    serve.add_argument("--requests", type=POSITIVE.arg, default=SERVE_REQUESTS,
                       help=f"requests per rate and mode (default {SERVE_REQUESTS})")
    serve.add_argument("--seed", type=COUNT.arg, default=0,
                       help="seed of the arrival times and the prompts drawn (default 0)")
    serve.add_argument("--slo", default=None,
                       help="service-level objectives, ttft=MS,tpot=MS[,e2el=MS] (any of "
                            "them): each row adds its goodput (requests/s meeting every one) "
                            "and attainment, and the run the highest rate each mode "
                            "sustains (90%% attainment). Choose them from what your users "
                            "need, or from the plain servers' unloaded figures (a row at a "
                            "low rate): e.g. TPOT at 1.5x plain's p50 at rate 0.5")
    serve.add_argument("--max-concurrency", type=POSITIVE.arg, default=None,
                       help="each server's --max-concurrency (default: the server's)")
    serve.add_argument("--speculate", choices=("auto", "always"), default="auto",
                       help="the star servers' --speculate: auto (default) uses the hub only "
                            "while trees serve a batch faster than plain batching; always "
                            "uses it for every request")
    p.add_argument("--log-dir", default=None, help="hub and target logs (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true")
    return p


def hub_defaults() -> dict:
    """The tree settings `starhub hub` uses when given none, so both always agree."""
    defaults = tree_defaults()
    return {k: defaults[k] for k in TREE_ARGS}


def draft_processes(args: argparse.Namespace) -> list[bool | str]:
    """The hub's ``--draft-process`` values, one row each."""
    return parse_list(args.draft_process or DEFAULT_DRAFT_PROCESS, auto_on_off_arg,
                      "--draft-process")


def parse_list(text: str, parse, flag: str) -> list:
    """A comma list of values for one comparison option; each value gets its own rows."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        try:
            out.append(parse(item))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    if not out:
        raise ValueError(f"{flag} needs at least one value")
    return out


def single(text: str | None, flag: str) -> int | None:
    """A tree option where the bench compares no values (the edge topology): one count."""
    if text is None:
        return None
    values = parse_list(text, TREE.arg, flag)
    if len(values) > 1:
        raise ValueError(f"{flag} takes one value with --topology edge (got {text})")
    return values[0]


def parse_targets(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--targets must be comma-separated integers, got '{text}'") from None
    if not ns or min(ns) < 1:
        raise ValueError("--targets needs at least one N >= 1")
    return ns


def edge_doc(args: argparse.Namespace) -> dict:
    # deferred: torch and transformers load only when this runs
    from bench.edge import EdgeConfig, run_edge_real

    def schedule(text: str) -> str:
        if text not in SCHEDULES:
            raise argparse.ArgumentTypeError(f"unknown schedule '{text}' ({', '.join(SCHEDULES)})")
        return text

    tree = hub_defaults()
    ns_edge = parse_targets(args.drafters)
    cfg = EdgeConfig(drafters=ns_edge,
                     schedules=parse_list(args.schedule, schedule, "--schedule"),
                     max_batch=parse_list(args.max_batch, auto_or_count(1, "max-batch"),
                                          "--max-batch"),
                     drafter=args.drafter or tree["drafter"], draft=args.draft,
                     model=args.model, prompts=args.prompts or str(DEFAULT_PROMPTS),
                     max_new_tokens=args.max_new_tokens or 64,
                     threads=resolve_threads(args.threads, sharing=max(ns_edge) + 1),
                     verifier_threads=resolve_threads(args.verifier_threads),
                     budget=parse_list(args.budget, budget_arg, "--budget")[0],
                     nodes=args.nodes or single(args.max_nodes, "--max-nodes")
                     or tree["max_nodes"],
                     depth=int(args.depth) if args.depth else 5,
                     topk=single(args.topk, "--topk") or tree["topk"], log_dir=args.log_dir,
                     baselines=[b for b in args.baselines.split(",") if b == "hf-generate"])
    if args.emulate:
        # deferred: torch and transformers load only when this runs
        from bench.emulate_edge import EdgeSpec, run_edge_emulated

        return run_edge_emulated(cfg, EdgeSpec.parse(args.emulate), args.warmup,
                                 args.duration, progress=not args.no_progress)
    return run_edge_real(cfg, progress=not args.no_progress)


def hub_load_doc(args: argparse.Namespace, ns: list[int], tree: dict,
                 admission: list) -> dict:
    # deferred: torch and transformers load only when this runs
    from bench.hub_load import HubLoadConfig, parse_t_v, run_hub_load

    cfg = HubLoadConfig(targets=ns, model=args.model, dtype=args.dtype,
                        prompts=args.prompts or str(DEFAULT_REPLAY_PROMPTS),
                        record_prompts=args.record_prompts,
                        max_new_tokens=args.max_new_tokens or 128,
                        threads=resolve_threads(args.threads),
                        hub_threads=args.hub_threads, max_targets=admission,
                        batch=parse_list(args.batch or "auto", batch_arg, "--batch"),
                        predraft=parse_list(args.predraft or PREDRAFT_DEFAULT, on_off_arg,
                                          "--predraft"),
                        lookup=parse_list(args.lookup or LOOKUP_DEFAULT, on_off_arg, "--lookup"),
                        prune=parse_list(args.prune or PRUNE_DEFAULT, on_off_arg, "--prune"),
                        draft_process=draft_processes(args),
                        warmup_s=args.warmup, duration_s=args.duration,
                        t_v=parse_t_v(args.emulate), cache=args.replay_cache,
                        repeat=args.repeat,
                        log_dir=args.log_dir, **tree)
    if cfg.record_prompts < 1:
        raise ValueError("--record-prompts must be at least 1")
    return run_hub_load(cfg, progress=not args.no_progress)


SERVE_HUB_FLAGS = {"drafter": str, "draft": str, "depth": depth_arg, "topk": TREE.arg,
                   "max_nodes": TREE.arg, "max_targets": max_targets_arg,
                   "batch": batch_arg, "predraft": on_off_arg, "lookup": on_off_arg,
                   "prune": on_off_arg,
                   "draft_process": auto_on_off_arg, "draft_dtype": str}
"""The hub flags --serve passes on, one value each, where given, with their parsers."""


def serve_doc(args: argparse.Namespace) -> dict:
    # deferred: torch and transformers load only when this runs
    from bench.serve import ServeConfig, run_serve
    from bench.serve_load import parse_slo

    others = [flag for flag, on in (("--hub-load", args.hub_load), ("--emulate", args.emulate),
                                    ("--topology edge", args.topology == "edge")) if on]
    if others:
        raise ValueError(f"--serve cannot be combined with {' or '.join(others)}")
    ns = parse_targets(args.targets or str(SERVE_TARGETS))
    if len(ns) > 1:
        raise ValueError(f"--serve takes one N in --targets (got {args.targets})")
    hub_args = []
    for key, parse in SERVE_HUB_FLAGS.items():
        value = getattr(args, key)
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if len(parse_list(value, parse, flag)) > 1:
            raise ValueError(f"{flag} takes one value with --serve (got {value})")
        hub_args += [flag, str(value).strip()]
    cfg = ServeConfig(targets=ns[0], rates=parse_list(args.rate, RATE.arg, "--rate"),
                      requests=args.requests, model=args.model,
                      prompts=args.prompts or str(DEFAULT_PROMPTS),
                      max_new_tokens=args.max_new_tokens or 64, threads=args.threads,
                      hub_threads=args.hub_threads, hub_args=hub_args, seed=args.seed,
                      max_concurrency=args.max_concurrency, speculate=args.speculate,
                      dtype=args.dtype, linear=args.linear, repeat=args.repeat,
                      slo=parse_slo(args.slo) if args.slo else {}, log_dir=args.log_dir)
    return run_serve(cfg, progress=not args.no_progress)


def main(args: argparse.Namespace) -> int:
    if args.serve:
        return write(args, serve_doc(args))
    if args.repeat != 1 and not args.hub_load:
        raise ValueError("--repeat applies to --hub-load and --serve only")
    if args.topology == "edge" or (args.emulate and not args.hub_load):
        given = [flag for flag, value in (("--batch", args.batch), ("--predraft", args.predraft),
                                          ("--lookup", args.lookup), ("--prune", args.prune),
                                          ("--draft-process", args.draft_process))
                 if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} apply to the real star bench and "
                             f"--hub-load only")
    if args.topology == "edge":
        return write(args, edge_doc(args))
    if args.emulate and not args.hub_load and (args.topk or args.max_nodes):
        raise ValueError("--topk and --max-nodes apply to the real star bench and --hub-load; "
                         "emulated trees are chains of the spec's depth")

    ns = parse_targets(args.targets or "1,2,3,4,6,8")
    depths = parse_list(args.depth, depth_arg, "--depth") if args.depth else None
    admission = parse_list(args.max_targets or "0", max_targets_arg, "--max-targets")
    tree = tree_options(args, depths)
    if args.hub_load:
        return write(args, hub_load_doc(args, ns, tree, admission))
    if args.emulate:
        spec = EmulateSpec.parse(args.emulate)
        opts = EmulateOptions(duration_s=args.duration, warmup_s=args.warmup,
                              procs=args.emulate_procs,
                              max_new_tokens=args.max_new_tokens or 512,
                              metrics_port=args.metrics_port, log_dir=args.log_dir)
        doc = emulated_doc(spec, ns, opts, progress=not args.no_progress,
                           depths=depths or [spec.depth], max_targets=admission)
    else:
        # deferred: torch and transformers load only when this runs
        from bench.run import BenchConfig, run_real

        baselines = [b for b in args.baselines.split(",") if b]
        unknown = set(baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {BASELINES}")
        cfg = BenchConfig(targets=ns, model=args.model,
                          prompts=args.prompts or str(DEFAULT_PROMPTS),
                          max_new_tokens=args.max_new_tokens or 64, threads=args.threads,
                          hub_threads=args.hub_threads, max_targets=admission,
                          batch=parse_list(args.batch or "auto", batch_arg, "--batch"),
                          predraft=parse_list(args.predraft or PREDRAFT_DEFAULT, on_off_arg,
                                              "--predraft"),
                          lookup=parse_list(args.lookup or LOOKUP_DEFAULT, on_off_arg,
                                            "--lookup"),
                          prune=parse_list(args.prune or PRUNE_DEFAULT, on_off_arg, "--prune"),
                          draft_process=draft_processes(args),
                          baselines=baselines, log_dir=args.log_dir, dtype=args.dtype,
                          linear=args.linear, **tree)
        doc = run_real(cfg, progress=not args.no_progress)
    return write(args, doc)


def tree_options(args: argparse.Namespace, depths: list | None) -> dict:
    """The hub's drafting options for the star rows: its defaults, overridden by the tree
    flags given; ``depth`` and ``draft`` are lists, one star row per value."""
    tree = hub_defaults()
    for key in TREE_ARGS:
        if key != "depth" and getattr(args, key) is not None:
            tree[key] = getattr(args, key)
    tree["depth"] = depths or [tree["depth"]]
    for key in ("topk", "max_nodes"):
        flag = "--" + key.replace("_", "-")
        tree[key] = (parse_list(getattr(args, key), TREE.arg, flag)
                     if getattr(args, key) is not None else [tree[key]])
    if args.draft and (args.hub_load or not args.emulate):
        tree["draft"] = parse_list(args.draft, str, "--draft")
    return tree


def write(args: argparse.Namespace, doc: dict) -> int:
    """Print the table (and, for an emulated run, where it strays from the model); write
    JSON, Markdown and the plot where asked."""
    print(text_table(doc))
    if "model_check" in doc:
        missed = doc["model_check"]
        print("model check: " + ("the run follows the analytical model" if not missed
                                 else "; ".join(missed)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(doc))
    if args.plot:
        mode = "serve" if doc["config"].get("mode") == "serve" else doc["config"].get("topology")
        {"serve": plot_serve, "edge": plot_edge}.get(mode, plot)(doc, args.plot)
    for path in filter(None, (args.json_out, args.markdown, args.plot)):
        print(f"wrote {path}", file=sys.stderr)
    return 0
