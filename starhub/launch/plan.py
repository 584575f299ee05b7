"""From a validated deployment to the processes it starts: each one's exact ``starhub``
command, threads, GPU pin and Ray resources. Both backends and ``--dry-run`` use this."""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from starhub.launch.config import ConfigError, Deployment, Placement
from starhub.options import AUTO, resolve_threads
from starhub.wire.security import is_loopback

HUB = "{hub}"
PROMPTS = "{prompts}"
OUT = "{out}"
"""Placeholders a backend fills in: the server's address once it is ready, and where the
prompt and output files are on the machine the process runs on."""


@dataclass
class ProcessSpec:
    name: str
    role: str
    """hub, target, serve, verifier or drafter: also the ``starhub`` subcommand."""
    args: list[str]
    """Everything after ``python -m starhub``, with placeholders."""
    threads: int
    serves: bool
    """Prints ``STARHUB READY <address>`` and runs until stopped (hub, verifier, serving
    targets)."""
    section: str
    gpu: int | None = None
    ray_options: dict = field(default_factory=dict)

    @property
    def out_name(self) -> str:
        return f"{self.name}.jsonl"

    def command(self, python: str = sys.executable, **values: str) -> list[str]:
        """The argv, with the placeholders named in ``values`` filled in."""
        fill = {HUB: values.get("hub"), PROMPTS: values.get("prompts"), OUT: values.get("out")}
        return [python, "-m", "starhub", *[fill.get(a) or a for a in self.args]]


@dataclass
class Plan:
    deployment: Deployment
    server: ProcessSpec
    workers: list[ProcessSpec]
    prompts: str | None

    @property
    def processes(self) -> list[ProcessSpec]:
        return [self.server, *self.workers]


def build_plan(dep: Deployment, prompts: str | None = None) -> Plan:
    """The processes of ``dep``; ``prompts`` (from the command line) wins over the config's."""
    workers = dep.workers
    prompts = prompts or workers.prompts
    serving = dep.topology == "star" and dep.targets.serve
    if serving and dep.targets.http_port and dep.targets.http_port + workers.count > 65536:
        raise ConfigError(f"{dep.source}: targets.http_port: {dep.targets.http_port} + "
                          f"{workers.count} targets runs past port 65535")
    if workers.count and not prompts and not serving:
        group = "targets" if dep.topology == "star" else "drafters"
        raise ConfigError(f"{dep.source}: {group}.prompts: the {workers.count} {group} need "
                          f"prompts; pass --prompts FILE or set {group}.prompts (or set "
                          f"{group}.count = 0 to serve only)")
    _check_security(dep)
    pre = ["--log-level", dep.log_level]
    if dep.topology == "star":
        server = _hub(dep, pre)
        procs = [_target(dep, pre, i) for i in range(workers.count)]
    else:
        server = _verifier(dep, pre)
        procs = [_drafter(dep, pre, i) for i in range(workers.count)]
    return Plan(dep, server, procs, prompts)


def _bind(dep: Deployment, section) -> str:
    host = "0.0.0.0" if dep.backend == "ray" else "127.0.0.1"
    if section.bind:
        return section.bind
    return f"tcp://{host}:{section.port or 0}"


def _check_security(dep: Deployment) -> None:
    """The loopback rule and the keys' pairing, before anything starts (the processes
    check the key files themselves: on Ray they live on the nodes)."""
    server, workers, src = dep.server, dep.workers, dep.source
    name = "hub" if dep.topology == "star" else "verifier"
    group = "targets" if dep.topology == "star" else "drafters"
    if bool(server.curve_secret) != bool(server.curve_allow):
        raise ConfigError(f"{src}: {name}.curve_secret and {name}.curve_allow go together")
    if bool(workers.curve_secret) != bool(workers.curve_server):
        raise ConfigError(f"{src}: {group}.curve_secret and {group}.curve_server go together")
    curve, bind = bool(server.curve_secret), _bind(dep, server)
    if not curve and not server.insecure and not is_loopback(bind):
        raise ConfigError(f"{src}: {name}.bind: {bind} is reachable from other machines; set "
                          f"{name}.curve_secret and {name}.curve_allow (keys from `starhub "
                          f"keys generate`), or {name}.insecure = true on a network you trust")
    if curve != bool(workers.curve_secret) and workers.count:
        raise ConfigError(f"{src}: {group}.curve_secret: the {name} "
                          f"{'uses' if curve else 'does not use'} CURVE, so its {group} "
                          f"{'need' if curve else 'take no'} curve_secret and curve_server")


def _server_keys(s) -> list[tuple[str, object]]:
    return [("--curve-secret", s.curve_secret), ("--curve-allow", s.curve_allow)]


def _client_keys(w) -> list[tuple[str, object]]:
    return [("--curve-secret", w.curve_secret), ("--curve-server", w.curve_server)]


def _plain(dep: Deployment) -> list[str]:
    """Workers of a server that runs without CURVE connect without it too; given no keys and
    no ``insecure``, both sides use the local keystore (``starhub.wire.security``)."""
    return ["--insecure"] if dep.server.insecure and not dep.server.curve_secret else []


def _threads(dep: Deployment, section) -> int:
    """A process's torch threads. ``auto``: on the local backend, this machine's usable cores
    shared evenly by every process of the deployment (they all compute at once); on Ray,
    the CPUs the process reserves (``num_cpus``), or 1."""
    if str(section.threads).lower() != AUTO:
        return int(section.threads)
    if dep.backend == "ray":
        return max(1, int(section.num_cpus or 1))
    return resolve_threads(AUTO, sharing=1 + dep.workers.count)


def _ray_options(p: Placement, threads: int) -> dict:
    opts: dict = {"num_cpus": threads if p.num_cpus is None else p.num_cpus,
                  "num_gpus": p.num_gpus}
    if p.resources:
        opts["resources"] = dict(p.resources)
    if p.labels:
        opts["label_selector"] = dict(p.labels)
    return opts


def _flags(pairs: list[tuple[str, object]]) -> list[str]:
    """``--flag value`` for each pair whose value is not None."""
    out: list[str] = []
    for flag, value in pairs:
        if value is not None:
            out += [flag, str(value)]
    return out


def _hub(dep: Deployment, pre: list[str]) -> ProcessSpec:
    h, threads = dep.hub, _threads(dep, dep.hub)
    args = [*pre, "hub", *_flags([
        ("--bind", _bind(dep, h)), ("--model", h.model), ("--drafter", h.drafter),
        ("--draft", h.draft), ("--depth", h.depth), ("--topk", h.topk),
        ("--max-nodes", h.max_nodes), ("--draft-dtype", h.draft_dtype),
        ("--max-targets", h.max_targets), ("--threads", threads), ("--ttl", h.ttl),
        ("--max-message-mb", h.max_message_mb), ("--metrics-port", h.metrics_port),
        ("--device", h.device), *_server_keys(h)])] + (["--insecure"] if h.insecure else [])
    return ProcessSpec("hub", "hub", args, threads, True, "hub", h.gpu,
                       _ray_options(h, threads))


def _sampling(w, index: int, name: str, threads: int) -> list[tuple[str, object]]:
    return [("--prompts", PROMPTS), ("--out", OUT), ("--max-new-tokens", w.max_new_tokens),
            ("--temperature", w.temperature), ("--top-p", w.top_p), ("--seed", w.seed),
            ("--threads", threads), ("--name", name), ("--shard", f"{index}/{w.count}"),
            ("--device", w.device)]


def _gpu(w, index: int) -> int | None:
    return w.gpus[index] if w.gpus else None


def _target(dep: Deployment, pre: list[str], i: int) -> ProcessSpec:
    t, threads = dep.targets, _threads(dep, dep.targets)
    name = f"{t.name}{i}"
    if t.serve:
        return _server_target(dep, pre, i, name, threads)
    args = [*pre, "target", *_flags([("--hub", HUB), ("--model", t.model),
                                     ("--dtype", t.dtype), ("--linear", t.linear),
                                     ("--device-map", t.device_map),
                                     *_sampling(t, i, name, threads), *_client_keys(t)]),
                               *_plain(dep)]
    if not t.chat_template:
        args.append("--no-chat-template")
    return ProcessSpec(name, "target", args, threads, False, "targets", _gpu(t, i),
                       _ray_options(t, threads))


def _server_target(dep: Deployment, pre: list[str], i: int, name: str,
                   threads: int) -> ProcessSpec:
    """A target as ``starhub serve``: it prints its URL when ready and runs until stopped."""
    t = dep.targets
    host = t.http_host or ("0.0.0.0" if dep.backend == "ray" else "127.0.0.1")
    args = [*pre, "serve", *_flags([
        ("--hub", HUB), ("--model", t.model), ("--dtype", t.dtype), ("--linear", t.linear),
        ("--device-map", t.device_map), ("--threads", threads), ("--name", name),
        ("--host", host), ("--port", t.http_port + i if t.http_port else 0),
        ("--max-concurrency", t.max_concurrency), ("--device", t.device),
        *_client_keys(t)]), *_plain(dep)]
    if not t.chat_template:
        args.append("--no-chat-template")
    return ProcessSpec(name, "serve", args, threads, True, "targets", _gpu(t, i),
                       _ray_options(t, threads))


def _verifier(dep: Deployment, pre: list[str]) -> ProcessSpec:
    v, threads = dep.verifier, _threads(dep, dep.verifier)
    args = [*pre, "verifier", *_flags([
        ("--bind", _bind(dep, v)), ("--model", v.model), ("--budget", v.budget),
        ("--max-batch", v.max_batch), ("--schedule", v.schedule), ("--nodes", v.nodes),
        ("--max-nodes", v.max_nodes), ("--ttl", v.ttl), ("--dtype", v.dtype),
        ("--linear", v.linear), ("--threads", threads), ("--device", v.device),
        ("--device-map", v.device_map),
        *_server_keys(v)])] + (["--insecure"] if v.insecure else [])
    return ProcessSpec("verifier", "verifier", args, threads, True, "verifier", v.gpu,
                       _ray_options(v, threads))


def _drafter(dep: Deployment, pre: list[str], i: int) -> ProcessSpec:
    d, threads = dep.drafters, _threads(dep, dep.drafters)
    name = f"{d.name}{i}"
    args = [*pre, "drafter", *_flags([
        ("--verifier", HUB), ("--model", d.model), ("--drafter", d.drafter),
        ("--draft", d.draft), ("--draft-dtype", d.draft_dtype), ("--depth", d.depth),
        ("--topk", d.topk), ("--max-nodes", d.max_nodes), ("--target-tok-s", d.target_tok_s),
        ("--timeout", d.timeout), ("--retries", d.retries), *_sampling(d, i, name, threads),
        *_client_keys(d)]), *_plain(dep)]
    if not d.chat_template:
        args.append("--no-chat-template")
    return ProcessSpec(name, "drafter", args, threads, False, "drafters", _gpu(d, i),
                       _ray_options(d, threads))


def check_commands(plan: Plan, parser: argparse.ArgumentParser) -> None:
    """Every command and option the plan uses must exist in this starhub, so that a config
    written for a newer one fails here, before anything starts."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    source = plan.deployment.source
    for spec in plan.processes:
        command = sub.choices.get(spec.role)
        if command is None:
            need = ("edge launch needs `starhub verifier` and `starhub drafter`"
                    if spec.role in ("verifier", "drafter") else f"needs `starhub {spec.role}`")
            raise ConfigError(f"{source}: [{spec.section}]: {need}, which this starhub does "
                              f"not have")
        known = command._option_string_actions
        for arg in spec.args[spec.args.index(spec.role) + 1:]:
            if arg.startswith("--") and arg not in known:
                key = arg[2:].replace("-", "_")
                raise ConfigError(f"{source}: {spec.section}.{key}: this starhub's "
                                  f"`starhub {spec.role}` has no {arg} option")


def describe(plan: Plan, out_dir: str, ray_address: str | None) -> str:
    """What ``--dry-run`` prints: where each process would start and its exact command."""
    dep = plan.deployment
    kind = "hub" if dep.topology == "star" else "verifier"
    group = "targets" if dep.topology == "star" else "drafters"
    lines = [f"{dep.source}: {dep.topology} topology, {dep.backend} backend: 1 {kind} and "
             f"{len(plan.workers)} {group}"]
    if dep.backend == "ray":
        lines.append(f"Ray cluster: {ray_address or '(none: set ray.address or RAY_ADDRESS)'}"
                     f", namespace {dep.ray.namespace}")
    if plan.prompts:
        lines.append(f"prompts: {plan.prompts}, split {len(plan.workers)} ways; outputs and "
                     f"logs under {out_dir}")
    for spec in plan.processes:
        if dep.backend == "ray":
            opts = ", ".join(f"{k}={v}" for k, v in spec.ray_options.items())
            where = f"a Ray actor ({opts}), on the node Ray picks"
            python, prompts, out = "python", "<node copy of the prompts>", spec.out_name
        else:
            pin = "" if spec.gpu is None else f", CUDA_VISIBLE_DEVICES={spec.gpu}"
            threads = f"{spec.threads} thread{'s' if spec.threads > 1 else ''}"
            where = f"a subprocess on this machine ({socket.gethostname()}, {threads}{pin})"
            python = sys.executable
            prompts = str(Path(plan.prompts).resolve()) if plan.prompts else ""
            out = str(Path(out_dir).resolve() / spec.out_name)
        when = "" if spec is plan.server else f", once the {kind} is ready"
        lines.append(f"{spec.name}: {where}{when}")
        cmd = spec.command(python, hub=f"<{kind} address>", prompts=prompts, out=out)
        lines.append("  " + shlex.join(cmd))
    return "\n".join(lines)
