"""``starhub bench``: its arguments and handler (registered by ``starhub.cli.main``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.defaults import BASELINES, DEFAULT_PROMPTS, DEFAULT_REPLAY_PROMPTS
from bench.emulate import EmulateOptions, EmulateSpec, emulated_doc
from bench.emulate_pool import pool_doc
from bench.plot import plot, plot_edge, plot_pool, plot_serve
from bench.report import markdown_table, text_table
from bench.settings import SERVE_TARGETS, Bench, hub_value, rate, setting_value
from starhub.options import (
    AUTO,
    DEFAULT_DRAFT_PROCESS,
    DEFAULT_LOOKUP,
    DEFAULT_PREDRAFT,
    DEFAULT_PRUNE,
    resolve_threads,
)
from starhub.settings.cli import add_settings
from starhub.settings.processes import HubSettings, ServeSettings, VerifierSettings

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
    add_settings(p, Bench)
    return p


def verifier_value(name: str):
    """A reader of one value of ``starhub verifier``'s setting ``name``."""
    return setting_value(VerifierSettings, name)


def on_off(args: argparse.Namespace) -> dict[str, list[bool]]:
    """The hub's on/off comparison options, one row per value each."""
    defaults = {"predraft": PREDRAFT_DEFAULT, "lookup": LOOKUP_DEFAULT, "prune": PRUNE_DEFAULT}
    return {key: parse_list(getattr(args, key) or default, hub_value(key),
                            "--" + key) for key, default in defaults.items()}


def budget(text: str) -> int:
    """The verifier's ``--budget``: a token count, or 0 for auto (measured at start)."""
    value = parse_list(text, verifier_value("budget"), "--budget")[0]
    return 0 if value == AUTO else value


def hub_defaults() -> dict:
    """The tree settings `starhub hub` uses when given none, so both always agree."""
    return {k: HubSettings.model_fields[k].default for k in TREE_ARGS}


def draft_processes(args: argparse.Namespace) -> list[bool | str]:
    """The hub's ``--draft-process`` values, one row each."""
    return parse_list(args.draft_process or DEFAULT_DRAFT_PROCESS, hub_value("draft_process"),
                      "--draft-process")


def parse_list(text: str, parse, flag: str) -> list:
    """A comma list of values for one comparison option; each value gets its own rows."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        try:
            out.append(parse(item))
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    if not out:
        raise ValueError(f"{flag} needs at least one value")
    return out


def single(text: str | None, flag: str) -> int | None:
    """A tree option where the bench compares no values (the edge topology): one count."""
    if text is None:
        return None
    values = parse_list(text, hub_value("topk"), flag)
    if len(values) > 1:
        raise ValueError(f"{flag} takes one value with --topology edge (got {text})")
    return values[0]


def hub_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} hubs: give 1 or more")
    return value


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

    tree = hub_defaults()
    ns_edge = parse_targets(args.drafters)
    cfg = EdgeConfig(drafters=ns_edge,
                     schedules=parse_list(args.schedule, verifier_value("schedule"),
                                          "--schedule"),
                     max_batch=parse_list(args.max_batch, verifier_value("max_batch"),
                                          "--max-batch"),
                     drafter=args.drafter or tree["drafter"], draft=args.draft,
                     model=args.model, prompts=args.prompts or str(DEFAULT_PROMPTS),
                     max_new_tokens=args.max_new_tokens or 64,
                     threads=resolve_threads(args.threads, sharing=max(ns_edge) + 1),
                     verifier_threads=resolve_threads(args.verifier_threads),
                     budget=budget(args.budget),
                     nodes=args.nodes or single(args.max_nodes, "--max-nodes")
                     or tree["max_nodes"],
                     depth=int(args.depth) if args.depth else 5,
                     topk=single(args.topk, "--topk") or tree["topk"], log_dir=args.log_dir,
                     baselines=[b for b in args.baselines.split(",") if b == "hf-generate"])
    if args.emulate:
        # deferred: torch and transformers load only when this runs
        from bench.emulate_edge import EdgeSpec, run_edge_emulated

        return run_edge_emulated(cfg, EdgeSpec.parse(args.emulate), args.warmup,
                                 args.duration, progress=args.progress)
    return run_edge_real(cfg, progress=args.progress)


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
                        batch=parse_list(args.batch or "auto", hub_value("batch"), "--batch"),
                        **on_off(args),
                        draft_process=draft_processes(args),
                        warmup_s=args.warmup, duration_s=args.duration,
                        t_v=parse_t_v(args.emulate), cache=args.replay_cache,
                        repeat=args.repeat,
                        log_dir=args.log_dir, **tree)
    if cfg.record_prompts < 1:
        raise ValueError("--record-prompts must be at least 1")
    return run_hub_load(cfg, progress=args.progress)


SERVE_HUB_FLAGS = ("drafter", "draft", "depth", "topk", "max_nodes", "max_targets", "batch",
                   "predraft", "lookup", "prune", "draft_process", "draft_dtype")
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
    for key in SERVE_HUB_FLAGS:
        parse = str if key == "draft" else hub_value(key)
        value = getattr(args, key)
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if len(parse_list(value, parse, flag)) > 1:
            raise ValueError(f"{flag} takes one value with --serve (got {value})")
        hub_args += [flag, str(value).strip()]
    clients = parse_list(args.concurrency, setting_value(ServeSettings, "max_concurrency"),
                         "--concurrency") if args.concurrency else []
    cfg = ServeConfig(targets=ns[0], rates=parse_list(args.rate, rate, "--rate"),
                      concurrency=clients,
                      requests=args.requests, model=args.model,
                      prompts=args.prompts or str(DEFAULT_PROMPTS),
                      max_new_tokens=args.max_new_tokens or 64, threads=args.threads,
                      hub_threads=args.hub_threads, hub_args=hub_args, seed=args.seed,
                      max_concurrency=args.max_concurrency, speculate=args.speculate,
                      dtype=args.dtype, linear=args.linear, repeat=args.repeat,
                      slo=parse_slo(args.slo) if args.slo else {}, log_dir=args.log_dir)
    return run_serve(cfg, progress=args.progress)


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
    depths = parse_list(args.depth, hub_value("depth"), "--depth") if args.depth else None
    admission = parse_list(args.max_targets or "0", hub_value("max_targets"), "--max-targets")
    tree = tree_options(args, depths)
    if args.hub_load:
        return write(args, hub_load_doc(args, ns, tree, admission))
    if args.hubs and not (args.emulate and not args.hub_load):
        raise ValueError("--hubs runs an emulated pool: give --emulate SPEC (a real pool of "
                         "hubs runs with `starhub launch`)")
    if args.emulate:
        spec = EmulateSpec.parse(args.emulate)
        opts = EmulateOptions(duration_s=args.duration, warmup_s=args.warmup,
                              procs=args.emulate_procs,
                              max_new_tokens=args.max_new_tokens or 512,
                              metrics_port=args.metrics_port, log_dir=args.log_dir)
        if args.hubs:
            if depths or len(admission) > 1:
                raise ValueError("--hubs takes the spec's depth and one --max-targets")
            hubs = parse_list(args.hubs, hub_count, "--hubs")
            doc = pool_doc(spec, ns, hubs, opts, progress=args.progress,
                           max_targets=admission[0])
        else:
            doc = emulated_doc(spec, ns, opts, progress=args.progress,
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
                          batch=parse_list(args.batch or "auto", hub_value("batch"), "--batch"),
                          **on_off(args),
                          draft_process=draft_processes(args),
                          baselines=baselines, log_dir=args.log_dir, dtype=args.dtype,
                          linear=args.linear, **tree)
        doc = run_real(cfg, progress=args.progress)
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
        tree[key] = (parse_list(getattr(args, key), hub_value("topk"), flag)
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
        mode = "pool" if doc["config"].get("mode") == "pool" else mode
        {"serve": plot_serve, "edge": plot_edge, "pool": plot_pool}.get(mode, plot)(doc,
                                                                                   args.plot)
    for path in filter(None, (args.json_out, args.markdown, args.plot)):
        print(f"wrote {path}", file=sys.stderr)
    return 0
