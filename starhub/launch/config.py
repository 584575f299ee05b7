"""The deployment file: a TOML schema, checked in full before any process starts.

Every table is a ``msgspec.Struct``; its fields are the keys a user may write, with their
types, defaults, bounds and allowed values, and ``msgspec.convert`` checks a file against
them. A typo, an unknown key, a wrong type, a value out of range or a missing field is a
``ConfigError`` that names the file, the key and what is allowed.
"""

import difflib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
from msgspec import Meta, Struct

from starhub.options import (
    AMOUNT,
    AUTO,
    BUDGET,
    COUNT,
    DEFAULT_SHAPE,
    DRAFT_DTYPES,
    DRAFTERS,
    DTYPES,
    LINEARS,
    MESSAGE_MB,
    PORT,
    POSITIVE,
    SCHEDULES,
    SECONDS,
    SEED,
    TEMPERATURE,
    TOK_S,
    TOP_P,
    TREE,
    TTL,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BACKENDS = ("local", "ray")
TOPOLOGIES = ("star", "edge")
LOG_LEVELS = ("debug", "info", "warning", "error")

Count = COUNT.type
Positive = POSITIVE.type
Amount = AMOUNT.type
"""A number >= 0. Every number in a deployment must also be finite and within the bounds
its flag has (``starhub.options``: one ``Number`` for both)."""
Port = PORT.type
Tree = TREE.type
Ttl = TTL.type
Auto = Literal["auto"]
Drafter = Literal[DRAFTERS]
Dtype = Literal[DTYPES]
DraftDtype = Literal[DRAFT_DTYPES]
Linear = Literal[LINEARS]


def doc(text: str) -> Meta:
    """A key's help, shown by ``starhub launch --schema`` and in errors about the key."""
    return Meta(description=text)


AUTO_THREADS = doc("torch threads; auto: on the local backend, the usable cores shared "
                   "evenly by every process of the deployment; on Ray, num_cpus (or 1)")
DEVICE_MAP = doc("--device-map: 'auto' spreads the model over every GPU the process sees "
                 "(on Ray, the num_gpus it reserved), or GPU indices such as '0,1'")


class ConfigError(ValueError):
    """A deployment file that cannot run as written."""


class Table(Struct, kw_only=True, forbid_unknown_fields=True):
    """A table of the deployment file: unknown keys are errors."""


class Placement(Table, kw_only=True):
    """Where a process may run. Ray places by the first four; the local backend pins GPUs."""

    num_cpus: Annotated[Amount | None, doc("Ray CPUs reserved (default: threads)")] = None
    num_gpus: Annotated[Amount, doc("Ray GPUs reserved; Ray sets CUDA_VISIBLE_DEVICES")] = 0.0
    resources: Annotated[dict[str, Amount],
                         doc("Ray custom resources, e.g. {gpu_host = 1}")] = {}
    labels: Annotated[dict[str, str], doc("Ray node labels to match (ray start --labels)")] = {}
    device: Annotated[str | None, doc("passed as --device (cpu, cuda, cuda:N, auto)")] = None


class ServerSection(Placement, kw_only=True):
    """What the hub and the verifier share: placement and ``starhub hub`` and ``starhub
    verifier``'s security options (README, "Security")."""

    curve_secret: Annotated[str | None,
                            doc("--curve-secret: the server's secret certificate")] = None
    curve_allow: Annotated[str | None, doc("--curve-allow: folder of allowed clients' public "
                                           "certificates")] = None
    insecure: Annotated[bool, doc("--insecure: serve a non-loopback address without "
                                  "CURVE")] = False


class WorkerSection(Placement, kw_only=True):
    """What targets and drafters share: how many, their prompts, sampling and keys."""

    count: Count = 1
    threads: Annotated[Positive | Auto, AUTO_THREADS] = AUTO
    prompts: Annotated[str | None, doc("JSONL prompts (--prompts overrides)")] = None
    max_new_tokens: Positive = 128
    temperature: TEMPERATURE.type = 0.0
    top_p: TOP_P.type = 1.0
    seed: SEED.type = 0
    chat_template: bool = True
    gpus: Annotated[list[Count], doc("local backend: one GPU index per process, in order")] = []
    curve_secret: Annotated[str | None,
                            doc("--curve-secret: the processes' secret certificate")] = None
    curve_server: Annotated[str | None,
                            doc("--curve-server: the server's public certificate")] = None


class HubSection(ServerSection, kw_only=True):
    model: Annotated[str | None, doc("the targets' model, for --draft self (default: "
                                     "targets.model)")] = None
    drafter: Drafter = "eagle"
    draft: str | None = None
    depth: Tree | Auto = AUTO
    topk: Tree = DEFAULT_SHAPE.topk
    max_nodes: Tree = DEFAULT_SHAPE.max_nodes
    draft_dtype: DraftDtype = "auto"
    max_targets: Count | Auto = 0
    bind: Annotated[str | None, doc("ZeroMQ address (default: loopback locally, every "
                                    "interface on Ray, port 0 = free)")] = None
    port: Annotated[Port | None, doc("shorthand for bind on the default host")] = None
    metrics_port: Port = 0
    threads: Annotated[Positive | Auto, AUTO_THREADS] = 1
    ttl: Ttl = 120.0
    max_message_mb: MESSAGE_MB.type = 64.0
    gpu: Annotated[Count | None, doc("local backend: CUDA_VISIBLE_DEVICES")] = None


class TargetsSection(WorkerSection, kw_only=True):
    model: Annotated[str, doc("'default', a model folder, a .gguf file or a cached model id")]
    name: Annotated[str, doc("process names are NAME0, NAME1, ...")] = "target"
    dtype: Dtype = "auto"
    linear: Linear = "auto"
    device_map: Annotated[str | None, DEVICE_MAP] = None
    serve: Annotated[bool, doc("run each target as `starhub serve`, an OpenAI-compatible "
                               "HTTP server, until stopped (no prompts needed)")] = False
    http_host: Annotated[str | None, doc("serve: address to listen on (default: loopback "
                                         "locally, every interface on Ray)")] = None
    http_port: Annotated[Port,
                         doc("serve: target i listens on http_port + i (0: free ports)")] = 0
    max_concurrency: Annotated[Positive, doc("serve: requests in flight per target; past "
                                             "it, 429")] = 16


class VerifierSection(ServerSection, kw_only=True):
    model: Annotated[str, doc("the target model the verifier holds")]
    bind: str | None = None
    port: Port | None = None
    budget: Annotated[BUDGET.type | Auto, doc("tokens one pass may feed; auto: measured at "
                                              "start")] = AUTO
    max_batch: Positive | Auto = AUTO
    schedule: Literal[SCHEDULES] = "goodspeed"
    nodes: Tree = DEFAULT_SHAPE.max_nodes
    max_nodes: Tree = 32
    ttl: Ttl = 120.0
    dtype: Dtype = "auto"
    linear: Linear = "auto"
    device_map: Annotated[str | None, DEVICE_MAP] = None
    threads: Annotated[Positive | Auto, AUTO_THREADS] = AUTO
    gpu: Count | None = None


class DraftersSection(WorkerSection, kw_only=True):
    model: Annotated[str | None, doc("the verifier's model (default: verifier.model)")] = None
    name: str = "drafter"
    drafter: Drafter = "eagle"
    draft: str | None = None
    draft_dtype: DraftDtype = "auto"
    depth: Tree = DEFAULT_SHAPE.depth
    topk: Tree = DEFAULT_SHAPE.topk
    max_nodes: Tree = DEFAULT_SHAPE.max_nodes
    target_tok_s: TOK_S.type = 0.0
    timeout: SECONDS.type = 30.0
    retries: Count = 3


class RaySection(Table, kw_only=True):
    address: Annotated[str | None, doc("the cluster to attach to; RAY_ADDRESS wins")] = None
    namespace: str = "starhub"


class Deployment(Table, kw_only=True):
    backend: Literal[BACKENDS] = "local"
    topology: Annotated[Literal[TOPOLOGIES] | None,
                        doc("star (hub + targets) or edge (verifier + drafters); default: "
                            "from the tables present")] = None
    name: Annotated[str, doc("prefix of Ray actor names")] = "starhub"
    out_dir: Annotated[str, doc("outputs and logs (--out-dir overrides)")] = "out/launch"
    log_level: Literal[LOG_LEVELS] = "info"
    ready_timeout_s: Annotated[float, Meta(ge=1)] = 600.0
    status_interval_s: Annotated[Amount, doc("live status line (0: off)")] = 2.0
    hub: HubSection | None = None
    targets: TargetsSection | None = None
    verifier: VerifierSection | None = None
    drafters: DraftersSection | None = None
    ray: RaySection = msgspec.field(default_factory=RaySection)
    source: str = "<config>"
    """The file it was read from (not a key of the file)."""

    @property
    def server(self) -> HubSection | VerifierSection:
        return self.hub if self.topology == "star" else self.verifier

    @property
    def workers(self) -> TargetsSection | DraftersSection:
        return self.targets if self.topology == "star" else self.drafters


INTERNAL = ("source",)
"""Deployment fields that are not keys of the file."""


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
    for key in INTERNAL:
        if key in raw:
            raise ConfigError(_unknown_key(source, [], key))
    try:
        dep = msgspec.convert(_auto_spelled(raw, Deployment), Deployment)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), raw, source)) from None
    dep.source = source
    _check_finite(dep, "", source)
    _check_topology(dep, raw, source)
    _check_placement(dep, source)
    return dep


# --- msgspec's findings, told in the file's terms ------------------------------------------

ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
PART = re.compile(r"\.(\w+)|\[([^\]]*)\]")


def _explain(message: str, raw: dict, source: str) -> str:
    """A ``msgspec.ValidationError`` message as a ``ConfigError`` message: the key as the
    file spells it, what it may hold, and what it holds."""
    found = ERROR.match(message)
    what = found["what"]
    parts = PART.findall(found["path"] or "")
    tables = [name for name, _ in parts if name]
    index = any(not name for name, _ in parts)
    if m := re.match(r"Object contains unknown field `(.+)`", what):
        return _unknown_key(source, tables, m[1])
    if m := re.match(r"Object missing required field `(.+)`", what):
        key = _join(tables + [m[1]])
        return f"{source}: {key}: missing; {_describe(_field(tables + [m[1]]))} is required"
    key = _join(tables)
    field = _field(tables)
    value = _lookup(raw, tables)
    if (field is not None and _auto(field.type) and isinstance(value, str)
            and not index):
        return f"{source}: {key}: expected 'auto' or a whole number, got '{value}'"
    if m := re.match(r"Invalid enum value (.+)", what):
        return (f"{source}: {key}: {m[1]} is not allowed; choose from "
                f"{', '.join(_choices(field.type))}")
    if isinstance(value, float) and not math.isfinite(value):
        return f"{source}: {key}: must be a finite number, got {value}"
    if m := re.match(r"Expected `.+` (>=|>|<=|<) (\S+)", what):
        words = {">=": "at least", ">": "greater than", "<=": "at most", "<": "less than"}
        return f"{source}: {key}: must be {words[m[1]]} {m[2]}, got {value}"
    if what.startswith("Expected"):
        return f"{source}: {key}: expected {_describe(field)}, got {_kind(value)} {value!r}"
    return f"{source}: {key}: {what}"


def _unknown_key(source: str, tables: list[str], key: str) -> str:
    allowed = [f.name for f in _struct(tables).fields if f.name not in INTERNAL]
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return (f"{source}: {_join(tables + [key])}: unknown key{hint}; allowed here: "
            f"{', '.join(allowed)}")


def _struct(tables: list[str]) -> mi.StructType:
    """The table at ``tables`` (a path of keys from the top)."""
    struct = mi.type_info(Deployment)
    for name in tables:
        field = next(f for f in struct.fields if f.name == name)
        struct = next(t for t in _options(field.type) if isinstance(t, mi.StructType))
    return struct


def _field(keys: list[str]) -> mi.Field | None:
    if not keys:
        return None
    try:
        return next(f for f in _struct(keys[:-1]).fields if f.name == keys[-1])
    except StopIteration:
        return None


def _lookup(raw: dict, keys: list[str]) -> Any:
    for key in keys:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


def _options(tp: mi.Type) -> list[mi.Type]:
    """The types a value of ``tp`` may have (its union's members, without metadata)."""
    if isinstance(tp, mi.Metadata):
        return _options(tp.type)
    if isinstance(tp, mi.UnionType):
        return [t for member in tp.types for t in _options(member)]
    return [tp]


def _auto(tp: mi.Type) -> bool:
    """Whether ``tp`` is a number that 'auto' may stand for."""
    options = _options(tp)
    return (any(isinstance(t, mi.LiteralType) and AUTO in t.values for t in options)
            and any(isinstance(t, (mi.IntType, mi.FloatType)) for t in options))


def _choices(tp: mi.Type) -> list[str]:
    return [v for t in _options(tp) if isinstance(t, mi.LiteralType) for v in t.values]


def _describe(field: mi.Field | None) -> str:
    """What a key may hold, in words: 'one of ...', 'a whole number', ..."""
    if field is None:
        return "a table"
    options = [t for t in _options(field.type) if not isinstance(t, mi.NoneType)]
    literal = [t for t in options if isinstance(t, mi.LiteralType)]
    if literal and not _auto(field.type):
        text = "one of " + ", ".join(f"'{c}'" for c in _choices(field.type))
    else:
        text = " or ".join(["'auto'"] * bool(literal) + [
            _name(t) for t in options if not isinstance(t, mi.LiteralType)])
    description = (field.type.extra_json_schema or {}).get("description") \
        if isinstance(field.type, mi.Metadata) else None
    return f"{text} ({description})" if description else text


def _name(tp: mi.Type, many: bool = False) -> str:
    """``tp`` in words ('a whole number in [0, 65535]'); ``many``: plural ('whole
    numbers ...')."""
    if isinstance(tp, mi.ListType):
        return "a list of " + _name(tp.item_type, many=True)
    if isinstance(tp, mi.DictType):
        return "a table of " + _name(tp.value_type, many=True)
    name = {mi.IntType: "a whole number", mi.FloatType: "a number", mi.StrType: "a string",
            mi.BoolType: "true or false", mi.StructType: "a table"}.get(type(tp), str(tp))
    if many:
        name = name.removeprefix("a ") + "s"
    if isinstance(tp, (mi.IntType, mi.FloatType)):
        name += _range(tp)
    return name


def _range(tp: mi.IntType | mi.FloatType) -> str:
    """A number's bounds: ' >= 0.1', ' in [0, 65535]', ' in (0, 1]', or ''."""
    def text(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    low = ("[", tp.ge) if tp.ge is not None else ("(", tp.gt) if tp.gt is not None else None
    high = ("]", tp.le) if tp.le is not None else (")", tp.lt) if tp.lt is not None else None
    if low and high:
        return f" in {low[0]}{text(low[1])}, {text(high[1])}{high[0]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {text(low[1])}"
    if high:
        return f" {'<=' if high[0] == ']' else '<'} {text(high[1])}"
    return ""


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _join(keys: list[str]) -> str:
    return ".".join(keys)


def _auto_spelled(table: Any, cls: type) -> Any:
    """``table`` with 'auto' spelled as ``starhub`` spells it ('Auto', ' auto ') in the keys
    that take it, as the command line reads it."""
    if not isinstance(table, dict):
        return table
    out = dict(table)
    for field in mi.type_info(cls).fields:
        value = out.get(field.name)
        if isinstance(value, str) and _auto(field.type) and value.strip().lower() == AUTO:
            out[field.name] = AUTO
        for t in _options(field.type):
            if isinstance(t, mi.StructType) and isinstance(value, dict):
                out[field.name] = _auto_spelled(value, t.cls)
    return out


def _check_finite(table: Struct, where: str, source: str) -> None:
    """No infinity or NaN anywhere (TOML can write both)."""
    for name in table.__struct_fields__:
        value = getattr(table, name)
        key = f"{where}.{name}" if where else name
        if isinstance(value, Struct):
            _check_finite(value, key, source)
        numbers = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list) else [value]
        for number in numbers:
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"{source}: {key}: must be a finite number, got {number}")


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
        for field in mi.type_info(cls).fields:
            if field.name in INTERNAL or field.name in ("hub", "targets", "verifier",
                                                        "drafters", "ray"):
                continue
            if field.required:
                default = "  (required)"
            elif field.default_factory is not msgspec.NODEFAULT:
                default = f" = {field.default_factory()!r}"
            else:
                default = f" = {field.default!r}"
            lines.append(f"  {field.name}: {_describe(field)}{default}")
    return "\n".join(lines)
