"""``starhub launch`` and ``starhub status``: their arguments and handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from starhub.client.pool import pool_addresses
from starhub.launch.config import Deployment, load_config, schema_text
from starhub.launch.plan import build_plan, check_commands, describe
from starhub.launch.ray_backend import RayBackend, ray_address
from starhub.launch.runner import ADDRESS_FILE, Launcher, LocalBackend
from starhub.launch.status import (
    ask_each,
    pool_report,
    query_stats,
    report,
    serve_report,
    server_health,
    status_security,
)
from starhub.models.prompts import read_prompts
from starhub.options import Seconds
from starhub.settings.cli import add_settings, value_type
from starhub.settings.processes import ClientKeys
from starhub.wire.security import ClientSecurity

LAUNCH_EPILOG = """\
a deployment file (see configs/) looks like:

  backend = "local"            # or "ray": attach to a running Ray cluster
  [hub]
  drafter = "eagle"
  threads = 1
  [targets]
  count = 2
  model = "default"
  threads = 1

`starhub launch --schema` lists every key. Exit status: 0 when every target finished,
1 when a process failed (its last log lines are printed) or Ray cannot place one (what it
asks for and what the cluster has are printed), 2 for a bad config, 130 when stopped with
Ctrl-C or SIGTERM."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="start a whole deployment (hub + targets, or verifier + drafters) "
                       "from one TOML file, locally or on a Ray cluster",
        description="Start the processes a deployment file describes: the hub (or an edge "
                    "verifier) first, then, once it is ready, the targets (or drafters) with "
                    "its address. Logs are streamed with a prefix per process and kept under "
                    "OUT_DIR/logs; a status line shows the targets up, rounds per second and "
                    "tau. With prompts, the targets split them and each writes NAME.jsonl "
                    "under OUT_DIR, and the launch ends when they finish. Ctrl-C stops "
                    "everything. The file is checked in full before anything starts.",
        epilog=LAUNCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="deployment file (TOML), e.g. "
                                             "configs/local-cpu.toml")
    p.add_argument("--prompts", default=None,
                   help='JSONL prompts ({"id", "prompt"} or MT-Bench lines), split across the '
                        "targets; overrides targets.prompts")
    p.add_argument("--out-dir", default=None,
                   help="where each target writes NAME.jsonl and logs/NAME.log (default: the "
                        "config's out_dir, out/launch)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   dest="overrides",
                   help="override a key of the file, checked like the file: e.g. "
                        "targets.count=4, hub.depth=5, backend=ray (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print where each process would start and its exact command, and exit")
    p.add_argument("--schema", action="store_true",
                   help="print every table and key a deployment file may hold, and exit")

    s = sub.add_parser(
        "status", help="a running hub's (or verifier's, or server's) targets and key metrics",
        description="Ask a hub or an edge verifier for STATS and print its settings, load "
                    "and one row per target: rounds, tokens, speed, its standalone speed "
                    "and t_c. It sends an OBSERVER_CARD (no admission slot, no session), "
                    "which the server asks before it shows per-target entries. Given a serving "
                    "target's URL (http://HOST:PORT), it shows that server's model, hub, load "
                    "and tau from its /health.")
    s.add_argument("address", help="e.g. tcp://127.0.0.1:5555 or http://127.0.0.1:8000 (the "
                                   "address its 'STARHUB READY' line or `starhub launch` "
                                   "printed); a pool's hubs separated by commas show the "
                                   "pool: each hub's load, admitted targets, N_max and which "
                                   "targets it serves; or a deployment file whose launch runs "
                                   "(configs/pool-cpu.toml): its servers, with its targets' "
                                   "keys")
    s.add_argument("--timeout", type=value_type(Seconds), default=5.0,
                   help="seconds to wait for a reply")
    s.add_argument("--json", action="store_true", help="print the raw STATS body as JSON")
    add_settings(s, ClientKeys)


def cmd_launch(args: argparse.Namespace) -> int:
    if args.schema:
        print(schema_text())
        return 0
    if not args.config:
        raise ValueError("starhub launch needs a deployment file, e.g. configs/local-cpu.toml")
    dep = load_config(args.config, args.overrides)
    plan = build_plan(dep, args.prompts)
    out_dir = Path(args.out_dir or dep.out_dir)
    address = ray_address(dep.ray.address) if dep.backend == "ray" else None
    if args.dry_run:
        print(describe(plan, str(out_dir), address))
    check_commands(plan, args.cli_parser)
    if plan.prompts:
        _check_prompts(plan.prompts)
    if args.dry_run:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)

    if dep.backend == "ray":
        backend = RayBackend(address, dep.ray.namespace, dep.name, plan.prompts,
                             dep.ready_timeout_s)
    else:
        backend = LocalBackend(plan.prompts, out_dir)
    return Launcher(plan, backend, out_dir).run()


def _check_prompts(path: str) -> None:
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    read_prompts(path)


def running_deployment(path: str) -> tuple[Deployment, str]:
    """A deployment file and the addresses its running launch wrote (its output folder's
    ``address``): ``starhub status FILE`` asks those servers, with its workers' keys."""
    dep = load_config(path)
    written = Path(dep.out_dir) / ADDRESS_FILE
    try:
        return dep, written.read_text().strip()
    except OSError:
        raise ValueError(f"{path}: no running launch found ({written} is written while its "
                         f"servers run, and removed when the launch ends; a launch given "
                         f"--out-dir writes it there); start it with `starhub launch "
                         f"{path}`, or give the addresses it printed") from None


def cmd_status(args: argparse.Namespace) -> int:
    # deferred: torch load only when this runs
    from starhub.client.connection import HubUnavailable

    if args.address.startswith(("http://", "https://")):
        try:
            body = server_health(args.address, args.timeout)
        except (OSError, ValueError) as exc:
            print(f"starhub status: no answer from {args.address}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(body, indent=1, sort_keys=True) if args.json
              else serve_report(args.address, body))
        return 0
    deployment = None
    if args.address.endswith(".toml"):
        deployment, args.address = running_deployment(args.address)
    addresses = pool_addresses(args.address)
    secure = ClientSecurity.from_args(args, addresses)
    if deployment is not None and not (args.curve_secret or args.insecure):
        secure = status_security(deployment.server, deployment.workers, addresses) or secure
    answers = ask_each(addresses, lambda address: query_stats(
        address, args.timeout, peers=True, security=secure))
    found: dict = {}
    for address, answer in answers.items():
        if isinstance(answer, HubUnavailable):
            if len(addresses) == 1:
                print(f"starhub status: {answer}", file=sys.stderr)
                return 1
            answer = f"no answer: {answer}"
        elif isinstance(answer, BaseException):
            raise answer
        found[address] = answer
    if args.json:
        body = {a: msgspec.to_builtins(b) for a, b in found.items()}
        print(json.dumps(body if len(found) > 1 else body[addresses[0]], indent=1,
                         sort_keys=True))
    elif len(found) > 1:
        print(pool_report(found))
    else:
        print(report(addresses[0], found[addresses[0]]))
    return 0 if any(not isinstance(b, str) for b in found.values()) else 1


COMMANDS = {"launch": cmd_launch, "status": cmd_status}
