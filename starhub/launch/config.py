"""The deployment file: a TOML schema, checked in full before any process starts.

Every table is a dataclass; its fields are the keys a user may write, with their types,
defaults and allowed values. A typo, an unknown key, a wrong type or a missing field is a
``ConfigError`` that names the file, the key and what is allowed.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from starhub.options import AUTO, DEFAULT_SHAPE, DRAFTERS, DTYPES, LINEARS, SCHEDULES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BACKENDS = ("local", "ray")
TOPOLOGIES = ("star", "edge")
LOG_LEVELS = ("debug", "info", "warning", "error")


AUTO_THREADS = ("torch threads; auto: on the local backend, the usable cores shared evenly by "
                "every process of the deployment; on Ray, num_cpus (or 1)")


class ConfigError(ValueError):
    """A deployment file that cannot run as written."""


def _opt(default: Any = MISSING, *, choices: tuple | None = None, minimum: float | None = None,
         auto: bool = False, doc: str = "") -> Any:
    """A schema field: ``choices`` for strings, ``minimum`` for numbers, ``auto`` where the
    string 'auto' may stand for a number."""
    meta = {"choices": choices, "minimum": minimum, "auto": auto, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class Placement:
    """Where a process may run. Ray places by the first four; the local backend pins GPUs."""

    num_cpus: float | None = _opt(None, minimum=0, doc="Ray CPUs reserved (default: threads)")
    num_gpus: float = _opt(0.0, minimum=0, doc="Ray GPUs reserved; Ray sets "
                                               "CUDA_VISIBLE_DEVICES")
    resources: dict[str, float] = _opt({}, doc="Ray custom resources, e.g. {gpu_host = 1}")
    labels: dict[str, str] = _opt({}, doc="Ray node labels to match (ray start --labels)")
    device: str | None = _opt(None, doc="passed as --device (cpu, cuda, cuda:N, auto)")


@dataclass(kw_only=True)
class ServerKeys:
    """``starhub hub`` and ``starhub verifier``'s security options (README, "Security")."""

    curve_secret: str | None = _opt(None, doc="--curve-secret: the server's secret "
                                              "certificate")
    curve_allow: str | None = _opt(None, doc="--curve-allow: folder of allowed clients' "
                                             "public certificates")
    insecure: bool = _opt(False, doc="--insecure: serve a non-loopback address without CURVE")


@dataclass(kw_only=True)
class ClientKeys:
    curve_secret: str | None = _opt(None, doc="--curve-secret: the processes' secret "
                                              "certificate")
    curve_server: str | None = _opt(None, doc="--curve-server: the server's public "
                                              "certificate")


@dataclass(kw_only=True)
class HubSection(ServerKeys, Placement):
    model: str | None = _opt(None, doc="the targets' model, for --draft self "
                                       "(default: targets.model)")
    drafter: str = _opt("eagle", choices=DRAFTERS)
    draft: str | None = None
    depth: int | str = _opt(AUTO, minimum=1, auto=True)
    topk: int = _opt(DEFAULT_SHAPE.topk, minimum=1)
    max_nodes: int = _opt(DEFAULT_SHAPE.max_nodes, minimum=1)
    draft_dtype: str = _opt("auto", choices=DTYPES)
    max_targets: int | str = _opt(0, minimum=0, auto=True)
    bind: str | None = _opt(None, doc="ZeroMQ address (default: loopback locally, every "
                                      "interface on Ray, port 0 = free)")
    port: int | None = _opt(None, minimum=0, doc="shorthand for bind on the default host")
    metrics_port: int = _opt(0, minimum=0)
    threads: int | str = _opt(1, minimum=1, auto=True, doc=AUTO_THREADS)
    ttl: float = _opt(120.0, minimum=0)
    max_message_mb: float = _opt(64.0, minimum=0)
    gpu: int | None = _opt(None, minimum=0, doc="local backend: CUDA_VISIBLE_DEVICES")


@dataclass(kw_only=True)
class WorkerSection(Placement):
    """What targets and drafters share: how many, their prompts and sampling."""

    count: int = _opt(1, minimum=0)
    threads: int | str = _opt(AUTO, minimum=1, auto=True, doc=AUTO_THREADS)
    prompts: str | None = _opt(None, doc="JSONL prompts (--prompts overrides)")
    max_new_tokens: int = _opt(128, minimum=1)
    temperature: float = _opt(0.0, minimum=0)
    top_p: float = _opt(1.0, minimum=0)
    seed: int = 0
    chat_template: bool = True
    gpus: list[int] = _opt([], doc="local backend: one GPU index per process, in order")


@dataclass(kw_only=True)
class TargetsSection(ClientKeys, WorkerSection):
    model: str = _opt(doc="'default', a model folder, a .gguf file or a cached model id")
    name: str = _opt("target", doc="process names are NAME0, NAME1, ...")
    dtype: str = _opt("auto", choices=DTYPES)
    linear: str = _opt("auto", choices=LINEARS)
    device_map: str | None = _opt(None, doc="--device-map: 'auto' spreads the model over every "
                                            "GPU the process sees (on Ray, the num_gpus it "
                                            "reserved), or GPU indices such as '0,1'")


@dataclass(kw_only=True)
class VerifierSection(ServerKeys, Placement):
    model: str = _opt(doc="the target model the verifier holds")
    bind: str | None = None
    port: int | None = _opt(None, minimum=0)
    budget: int | str = _opt(AUTO, minimum=1, auto=True,
                             doc="tokens one pass may feed; auto: measured at start")
    max_batch: int | str = _opt(AUTO, minimum=1, auto=True)
    schedule: str = _opt("fifo", choices=SCHEDULES)
    nodes: int = _opt(DEFAULT_SHAPE.max_nodes, minimum=1)
    max_nodes: int = _opt(32, minimum=1)
    ttl: float = _opt(120.0, minimum=0)
    dtype: str = _opt("auto", choices=DTYPES)
    linear: str = _opt("auto", choices=LINEARS)
    device_map: str | None = _opt(None, doc="--device-map: 'auto' spreads the model over every "
                                            "GPU the process sees (on Ray, the num_gpus it "
                                            "reserved), or GPU indices such as '0,1'")
    threads: int | str = _opt(AUTO, minimum=1, auto=True, doc=AUTO_THREADS)
    gpu: int | None = _opt(None, minimum=0)


@dataclass(kw_only=True)
class DraftersSection(ClientKeys, WorkerSection):
    model: str | None = _opt(None, doc="the verifier's model (default: verifier.model)")
    name: str = "drafter"
    drafter: str = _opt("eagle", choices=DRAFTERS)
    draft: str | None = None
    draft_dtype: str = _opt("auto", choices=DTYPES)
    depth: int = _opt(DEFAULT_SHAPE.depth, minimum=1)
    topk: int = _opt(DEFAULT_SHAPE.topk, minimum=1)
    max_nodes: int = _opt(DEFAULT_SHAPE.max_nodes, minimum=1)
    target_tok_s: float = _opt(0.0, minimum=0)
    timeout: float = _opt(30.0, minimum=0)
    retries: int = _opt(3, minimum=0)


@dataclass(kw_only=True)
class RaySection:
    address: str | None = _opt(None, doc="the cluster to attach to; RAY_ADDRESS wins")
    namespace: str = "starhub"


@dataclass(kw_only=True)
class Deployment:
    backend: str = _opt("local", choices=BACKENDS)
    topology: str | None = _opt(None, choices=TOPOLOGIES,
                                doc="star (hub + targets) or edge (verifier + drafters); "
                                    "default: from the tables present")
    name: str = _opt("starhub", doc="prefix of Ray actor names")
    out_dir: str = _opt("out/launch", doc="outputs and logs (--out-dir overrides)")
    log_level: str = _opt("info", choices=LOG_LEVELS)
    ready_timeout_s: float = _opt(600.0, minimum=1)
    status_interval_s: float = _opt(2.0, minimum=0, doc="live status line (0: off)")
    hub: HubSection | None = None
    targets: TargetsSection | None = None
    verifier: VerifierSection | None = None
    drafters: DraftersSection | None = None
    ray: RaySection = field(default_factory=RaySection)
    source: str = field(default="<config>", metadata={"internal": True})

    @property
    def server(self) -> HubSection | VerifierSection:
        return self.hub if self.topology == "star" else self.verifier

    @property
    def workers(self) -> TargetsSection | DraftersSection:
        return self.targets if self.topology == "star" else self.drafters


def load_config(path: str | Path, overrides: list[str] | tuple = ()) -> Deployment:
    """Read and validate a deployment file, with ``KEY=VALUE`` overrides applied first;
    every problem is a ``ConfigError``."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(raw, item, str(path))
    return parse_config(raw, str(path))


def apply_override(raw: dict, item: str, source: str) -> None:
    """``targets.count=4``: the value is read as TOML (``4``, ``true``, ``[1, 2]``,
    ``"x"``), or else taken as a bare string (``hub.depth=auto``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{source}: --set {item!r}: expected KEY=VALUE, e.g. "
                          f"targets.count=4")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    *tables, last = key.split(".")
    table = raw
    for i, name in enumerate(tables):
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {'.'.join(tables[:i + 1])}: is a value, not a "
                              f"table (--set {item})")
    table[last] = value


def parse_config(raw: dict, source: str = "<config>") -> Deployment:
    dep = _build(Deployment, raw, "", source)
    dep.source = source
    _check_topology(dep, raw, source)
    _check_placement(dep, source)
    return dep


# --- generic checks, driven by the dataclasses' fields ---------------------------------

def _keys(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if not f.metadata.get("internal")]


def _build(cls: type, table: Any, where: str, source: str):
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {where}: expected a table, got {_kind(table)}")
    allowed = _keys(cls)
    for key in table:
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{source}: {_join(where, key)}: unknown key{hint}; allowed "
                              f"here: {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        key = _join(where, f.name)
        if f.name not in table:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{source}: {key}: missing; {_describe(hints[f.name], f)} "
                                  f"is required")
            continue
        values[f.name] = _value(hints[f.name], f, table[f.name], key, source)
    return cls(**values)


def _value(hint: Any, f, value: Any, key: str, source: str) -> Any:
    meta = f.metadata
    args = set(typing.get_args(hint)) if _is_union(hint) else {hint}
    args.discard(type(None))
    if meta.get("auto") and isinstance(value, str):
        if value.strip().lower() != AUTO:
            raise ConfigError(f"{source}: {key}: expected 'auto' or a whole number, "
                              f"got '{value}'")
        return AUTO
    base = next(iter(args)) if len(args) == 1 else int
    if isinstance(base, type) and hasattr(base, "__dataclass_fields__"):
        return _build(base, value, key, source)
    if not _matches(base, value):
        raise ConfigError(f"{source}: {key}: expected {_describe(hint, f)}, got "
                          f"{_kind(value)} {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{source}: {key}: '{value}' is not allowed; choose from "
                          f"{', '.join(meta['choices'])}")
    if meta.get("minimum") is not None and isinstance(value, (int, float)) \
            and value < meta["minimum"]:
        raise ConfigError(f"{source}: {key}: must be at least {meta['minimum']}, got {value}")
    return float(value) if base is float else value


def _matches(base: Any, value: Any) -> bool:
    origin = typing.get_origin(base)
    if origin is list:
        (item,) = typing.get_args(base)
        return isinstance(value, list) and all(_matches(item, v) for v in value)
    if origin is dict:
        _, item = typing.get_args(base)
        return isinstance(value, dict) and all(_matches(item, v) for v in value.values())
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _describe(hint: Any, f) -> str:
    meta = f.metadata
    if meta.get("choices"):
        return "one of " + ", ".join(f"'{c}'" for c in meta["choices"])
    args = [a for a in (typing.get_args(hint) if _is_union(hint) else (hint,))
            if a is not type(None)]
    base = args[0]
    names = {int: "a whole number", float: "a number", str: "a string", bool: "true or false",
             list[int]: "a list of whole numbers", dict[str, float]: "a table of numbers",
             dict[str, str]: "a table of strings"}
    text = names.get(base, getattr(base, "__name__", str(base)))
    if meta.get("auto"):
        text = "'auto' or " + text
    if meta.get("doc"):
        text += f" ({meta['doc']})"
    return text


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


# --- checks across tables ---------------------------------------------------------------

def _check_topology(dep: Deployment, raw: dict, source: str) -> None:
    star = [k for k in ("hub", "targets") if k in raw]
    edge = [k for k in ("verifier", "drafters") if k in raw]
    if dep.topology is None:
        dep.topology = "edge" if edge and not star else "star"
    wanted, other = (("hub", "targets"), edge) if dep.topology == "star" \
        else (("verifier", "drafters"), star)
    if other:
        raise ConfigError(f"{source}: [{other[0]}]: not part of a {dep.topology} deployment; a "
                          f"star deployment has [hub] and [targets], an edge one [verifier] "
                          f"and [drafters]")
    if dep.topology == "star" and dep.targets is None:
        raise ConfigError(f"{source}: targets: missing; a star deployment needs a [targets] "
                          f"table with at least model = \"...\"")
    if dep.topology == "edge" and dep.verifier is None:
        raise ConfigError(f"{source}: verifier: missing; an edge deployment needs a "
                          f"[verifier] table with at least model = \"...\"")
    if dep.topology == "star":
        dep.hub = dep.hub or HubSection()
        dep.hub.model = dep.hub.model or dep.targets.model
    else:
        dep.drafters = dep.drafters or DraftersSection()
        dep.drafters.model = dep.drafters.model or dep.verifier.model
    for section in wanted:
        table = getattr(dep, section)
        if getattr(table, "bind", None) and getattr(table, "port", None) is not None:
            raise ConfigError(f"{source}: {section}.port: give bind or port, not both")


def _check_placement(dep: Deployment, source: str) -> None:
    server, workers = dep.server, dep.workers
    name = "hub" if dep.topology == "star" else "verifier"
    group = "targets" if dep.topology == "star" else "drafters"
    if dep.backend == "ray":
        for key, table in ((f"{name}.gpu", server.gpu), (f"{group}.gpus", workers.gpus)):
            if table not in (None, []):
                raise ConfigError(f"{source}: {key}: GPU pins are for the local backend; on "
                                  f"Ray ask for num_gpus and Ray assigns the GPUs")
        return
    if workers.gpus and len(workers.gpus) != workers.count:
        raise ConfigError(f"{source}: {group}.gpus: lists {len(workers.gpus)} GPUs for "
                          f"{workers.count} processes; give one index per process")


def schema_text() -> str:
    """Every table and key with its type and default, for ``starhub launch --schema``."""
    lines = []
    for title, cls in (("(top level)", Deployment), ("[hub]", HubSection),
                       ("[targets]", TargetsSection), ("[verifier]", VerifierSection),
                       ("[drafters]", DraftersSection), ("[ray]", RaySection)):
        lines.append(title)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata.get("internal") or f.name in ("hub", "targets", "verifier",
                                                        "drafters", "ray"):
                continue
            if f.default is not MISSING:
                default = f" = {f.default!r}"
            elif f.default_factory is not MISSING:
                default = f" = {f.default_factory()!r}"
            else:
                default = "  (required)"
            lines.append(f"  {f.name}: {_describe(hints[f.name], f)}{default}")
    return "\n".join(lines)
