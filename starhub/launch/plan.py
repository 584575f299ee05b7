"""From a validated deployment to the processes it starts: each one's command, the
validated settings it runs on (handed over as ``STARHUB_CONFIG``), threads, GPU pin and
Ray resources. Both backends and ``--dry-run`` use this."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from starhub.launch.config import LAUNCHER_CHOSEN, ConfigError, Deployment, Placement
from starhub.options import AUTO, resolve_threads
from starhub.settings.base import CONFIG_ENV, Settings, explain
from starhub.settings.processes import PROCESSES
from starhub.wire.security import SecurityError, is_loopback, load_certificate, server_files

HUB = "{hub}"
PROMPTS = "{prompts}"
OUT = "{out}"
"""Placeholders a backend fills in: the server's address once it is ready (a pool's
addresses, comma-separated), and where the prompt and output files are on the machine the
process runs on."""


TABLE_OF = {"hub": "hub", "target": "targets", "serve": "targets", "verifier": "verifier",
            "drafter": "drafters"}
"""The deployment table (``LAUNCHER_CHOSEN``'s key) each role's settings come from."""


@dataclass
class ProcessSpec:
    name: str
    role: str
    """hub, target, serve, verifier or drafter: also the ``starhub`` subcommand."""
    config: dict
    """The process's validated settings as JSON values, with placeholders."""
    log_level: str
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

    def command(self, python: str = sys.executable) -> list[str]:
        """The argv: the command alone; its settings come in ``environment``."""
        return [python, "-m", "starhub", "--log-level", self.log_level, self.role]

    def environment(self, **values: str) -> dict[str, str]:
        """``STARHUB_CONFIG``: the settings, with the placeholders named in ``values``
        (hub, prompts, out) filled in."""
        fill = {HUB: values.get("hub"), PROMPTS: values.get("prompts"), OUT: values.get("out")}
        config = {k: fill.get(v) or v if isinstance(v, str) else v
                  for k, v in self.config.items()}
        return {CONFIG_ENV: json.dumps(config, separators=(",", ":"))}


@dataclass
class Plan:
    deployment: Deployment
    servers: list[ProcessSpec]
    """The hubs of the pool (one, or several), or the verifier: started first."""
    workers: list[ProcessSpec]
    prompts: str | None

    @property
    def server(self) -> ProcessSpec:
        return self.servers[0]

    @property
    def processes(self) -> list[ProcessSpec]:
        return [*self.servers, *self.workers]


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
    if dep.topology == "star":
        servers = [_hub(dep, i) for i in range(len(dep.hubs))]
        procs = [_target(dep, i) for i in range(workers.count)]
    else:
        servers = [_verifier(dep)]
        procs = [_drafter(dep, i) for i in range(workers.count)]
    return Plan(dep, servers, procs, prompts)


def _bind(dep: Deployment, section) -> str:
    host = "0.0.0.0" if dep.backend == "ray" else "127.0.0.1"
    if section.bind:
        return section.bind
    return f"tcp://{host}:{section.port or 0}"


def _check_security(dep: Deployment) -> None:
    """The loopback rule and the keys' pairing, before anything starts (the processes
    check the key files themselves: on Ray they live on the nodes)."""
    workers, src = dep.workers, dep.source
    group = "targets" if dep.topology == "star" else "drafters"
    if bool(workers.curve_secret) != bool(workers.curve_server):
        raise ConfigError(f"{src}: {group}.curve_secret and {group}.curve_server go together")
    for name, server in _named_servers(dep):
        if bool(server.curve_secret) != bool(server.curve_allow):
            raise ConfigError(f"{src}: {name}.curve_secret and {name}.curve_allow go together")
        curve, bind = bool(server.curve_secret), _bind(dep, server)
        if not curve and not server.insecure and not is_loopback(bind):
            raise ConfigError(f"{src}: {name}.bind: {bind} is reachable from other machines; "
                              f"set {name}.curve_secret and {name}.curve_allow (keys from "
                              f"`starhub keys generate`), or {name}.insecure = true on a "
                              f"network you trust")
    if len({(bool(s.curve_secret), s.insecure) for s in dep.servers}) > 1:
        raise ConfigError(f"{src}: hubs: the hubs of a pool differ in how they are reached: "
                          f"some with keys of their own (curve_secret), some with the local "
                          f"keys or insecure; its targets connect to all of them the same "
                          f"way, so every hub needs keys of its own, or none does")
    curve, name = bool(dep.server.curve_secret), _named_servers(dep)[0][0]
    if curve != bool(workers.curve_secret) and workers.count:
        raise ConfigError(f"{src}: {group}.curve_secret: the {name} "
                          f"{'uses' if curve else 'does not use'} CURVE, so its {group} "
                          f"{'need' if curve else 'take no'} curve_secret and curve_server")
    if curve and workers.curve_server:
        _check_server_keys(dep, group)


def _check_server_keys(dep: Deployment, group: str) -> None:
    """``curve_server`` lists one public certificate every server holds, or one per hub in
    ``[[hubs]]`` order; where this machine can read both files (the local backend: the
    processes run here), each listed key must be its hub's own."""
    src, servers = dep.source, _named_servers(dep)
    files = server_files(dep.workers.curve_server)
    if len(files) not in (1, len(servers)):
        how = (f"{len(servers)} hubs: give one certificate that every hub holds, or one per "
               f"hub, comma-separated, in [[hubs]] order" if len(servers) > 1 else
               f"one {servers[0][0]}: give its public certificate (NAME.key) alone")
        raise ConfigError(f"{src}: {group}.curve_server lists {len(files)} public "
                          f"certificates for {how}")
    if dep.backend != "local":
        return  # the files live on the nodes, at the same paths: the processes check them
    for i, (name, server) in enumerate(servers):
        listed = files[i] if len(files) > 1 else files[0]
        want, got = _public_key(server.curve_secret), _public_key(listed)
        if want is None or got is None or want == got:
            continue  # a file this machine cannot read: the process says so itself
        entry = f"entry {i + 1} of {len(files)}, {listed}" if len(files) > 1 else listed
        hint = ("list each hub's public certificate (NAME.key), comma-separated, in [[hubs]] "
                "order" if len(servers) > 1 else "give the hub's public certificate, NAME.key")
        raise ConfigError(f"{src}: {group}.curve_server: {entry} is not the public key of "
                          f"{name}.curve_secret ({server.curve_secret}): {hint}")


def _public_key(path: str) -> bytes | None:
    """The public key in a certificate file, or None where this machine cannot read it."""
    try:
        return load_certificate(path, "curve_server", secret=False)[0]
    except SecurityError:
        return None


def _named_servers(dep: Deployment) -> list[tuple[str, object]]:
    """Each server's table with the name an error gives it: ``hub``, ``hubs[i]`` in a pool,
    or ``verifier``."""
    if dep.topology != "star":
        return [("verifier", dep.verifier)]
    if len(dep.hubs) == 1:
        return [("hub", dep.hub)]
    return [(f"hubs[{i}]", hub) for i, hub in enumerate(dep.hubs)]


def _plain(dep: Deployment, section) -> bool:
    """Workers of a server that runs without CURVE connect without it too; given no keys and
    no ``insecure``, both sides use the local keystore (``starhub.wire.security``)."""
    return section.insecure or (dep.server.insecure and not dep.server.curve_secret)


def _threads(dep: Deployment, section) -> int:
    """A process's torch threads. ``auto``: on the local backend, this machine's usable cores
    shared evenly by every process of the deployment (they all compute at once); on Ray,
    the CPUs the process reserves (``num_cpus``), or 1."""
    if str(section.threads).lower() != AUTO:
        return int(section.threads)
    if dep.backend == "ray":
        return max(1, int(section.num_cpus or 1))
    return resolve_threads(AUTO, sharing=len(dep.servers) + dep.workers.count)


def _ray_options(p: Placement, threads: int) -> dict:
    opts: dict = {"num_cpus": threads if p.num_cpus is None else p.num_cpus,
                  "num_gpus": p.num_gpus}
    if p.resources:
        opts["resources"] = dict(p.resources)
    if p.labels:
        opts["label_selector"] = dict(p.labels)
    return opts


def _settings(dep: Deployment, role: str, table: str, section, chosen: dict) -> dict:
    """The settings a process of ``role`` runs on: its table's values for every setting the
    process has, and what the launcher ``chosen`` for it, validated as the process will."""
    model: type[Settings] = PROCESSES[role]
    launcher = LAUNCHER_CHOSEN[TABLE_OF[role]]
    values = {k: getattr(section, k) for k in model.model_fields
              if k in type(section).model_fields and k not in launcher}
    try:
        settings = model.model_validate({**values, **chosen})
    except ValidationError as exc:
        raise ConfigError(explain(exc, lambda loc: f"{dep.source}: {table}.{loc[0]}",
                                  model)) from None
    return settings.model_dump(mode="json")


def _spec(dep: Deployment, name: str, role: str, table: str, chosen: dict, threads: int,
          gpu: int | None, section=None) -> ProcessSpec:
    """``table``: the section's name in errors and ``--dry-run``; ``section``: its settings
    (default: the deployment's table of that name)."""
    section = getattr(dep, table) if section is None else section
    if section is dep.workers:
        chosen = {**chosen, "insecure": _plain(dep, section)}
    config = _settings(dep, role, table, section, {**chosen, "threads": threads})
    return ProcessSpec(name, role, config, str(dep.log_level), threads,
                       role in ("hub", "serve", "verifier"), table, gpu,
                       _ray_options(section, threads))


def _hub(dep: Deployment, i: int) -> ProcessSpec:
    table, h = _named_servers(dep)[i]
    name = "hub" if len(dep.hubs) == 1 else f"hub{i}"
    return _spec(dep, name, "hub", table, {"bind": _bind(dep, h), "model": h.model},
                 _threads(dep, h), h.gpu, h)


def _gpu(w, index: int) -> int | None:
    return w.gpus[index] if w.gpus else None


def _target(dep: Deployment, i: int) -> ProcessSpec:
    t, threads = dep.targets, _threads(dep, dep.targets)
    name = f"{t.name}{i}"
    if t.serve:  # it prints its URL when ready and runs until stopped
        host = t.http_host or ("0.0.0.0" if dep.backend == "ray" else "127.0.0.1")
        chosen = {"hub": HUB, "name": name, "host": host,
                  "port": t.http_port + i if t.http_port else 0}
        return _spec(dep, name, "serve", "targets", chosen, threads, _gpu(t, i))
    chosen = {"hub": HUB, "prompts": PROMPTS, "out": OUT, "name": name,
              "shard": (i, t.count)}
    return _spec(dep, name, "target", "targets", chosen, threads, _gpu(t, i))


def _verifier(dep: Deployment) -> ProcessSpec:
    v = dep.verifier
    return _spec(dep, "verifier", "verifier", "verifier", {"bind": _bind(dep, v)},
                 _threads(dep, v), v.gpu)


def _drafter(dep: Deployment, i: int) -> ProcessSpec:
    d = dep.drafters
    name = f"{d.name}{i}"
    chosen = {"verifier": HUB, "model": d.model, "prompts": PROMPTS, "out": OUT,
              "name": name, "shard": (i, d.count)}
    return _spec(dep, name, "drafter", "drafters", chosen, _threads(dep, d), _gpu(d, i))


def check_commands(plan: Plan, parser: argparse.ArgumentParser) -> None:
    """Every command the plan starts must exist in this starhub, so that a config written
    for a newer one fails here, before anything starts (each process's settings were
    checked by its own model when the plan was built)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for spec in plan.processes:
        if spec.role not in sub.choices:
            need = ("edge launch needs `starhub verifier` and `starhub drafter`"
                    if spec.role in ("verifier", "drafter") else f"needs `starhub {spec.role}`")
            raise ConfigError(f"{plan.deployment.source}: [{spec.section}]: {need}, which "
                              f"this starhub does not have")


def describe(plan: Plan, out_dir: str, ray_address: str | None) -> str:
    """What ``--dry-run`` prints: where each process would start and its exact command."""
    dep = plan.deployment
    kind = "hub" if dep.topology == "star" else "verifier"
    group = "targets" if dep.topology == "star" else "drafters"
    kinds = kind if len(plan.servers) == 1 else f"{kind}s (a pool)"
    lines = [f"{dep.source}: {dep.topology} topology, {dep.backend} backend: "
             f"{len(plan.servers)} {kinds} and {len(plan.workers)} {group}"]
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
        when = "" if spec in plan.servers else \
            f", once the {kind}{'s are' if len(plan.servers) > 1 else ' is'} ready"
        lines.append(f"{spec.name}: {where}{when}")
        env = spec.environment(hub=f"<{kind} address>", prompts=prompts, out=out)
        lines.append("  " + shlex.join(["env", *(f"{k}={v}" for k, v in env.items()),
                                        *spec.command(python)]))
    return "\n".join(lines)
