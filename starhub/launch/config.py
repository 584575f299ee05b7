"""The deployment file: a TOML schema, checked in full before any process starts.

Each process table holds the settings of the process it starts (``starhub.settings``:
the same names, types, bounds, defaults and help as its flags), less those the launcher
chooses for each process (its address, prompts, output, name and shard), plus where it
runs (``Placement``) and how many. A typo, an unknown key, a wrong type, a value out of
range or a missing field is a ``ConfigError`` that names the file, the key and what is
allowed.
"""

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, create_model

from starhub.options import Amount, Choice, Count, LogLevel, Port
from starhub.settings.base import Settings, explain
from starhub.settings.processes import (
    DrafterSettings,
    HubSettings,
    ServeSettings,
    TargetSettings,
    VerifierSettings,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class Backend(Choice):
    LOCAL = "local"
    RAY = "ray"


class Topology(Choice):
    STAR = "star"
    EDGE = "edge"


THREADS_HELP = ("torch threads; auto: on the local backend, the usable cores shared evenly by "
                "every process of the deployment; on Ray, num_cpus (or 1)")


class ConfigError(ValueError):
    """A deployment file that cannot run as written."""


class Placement(Settings):
    """Where a process may run. Ray places by these; the local backend pins GPUs."""

    num_cpus: Amount | None = Field(None, description="Ray CPUs reserved (default: threads)")
    num_gpus: Amount = Field(0.0, description="Ray GPUs reserved; Ray sets "
                                              "CUDA_VISIBLE_DEVICES")
    resources: dict[str, Amount] = Field({}, description="Ray custom resources, e.g. "
                                                         "{gpu_host = 1}")
    labels: dict[str, str] = Field({}, description="Ray node labels to match (ray start "
                                                   "--labels)")


LAUNCHER_CHOSEN: dict[str, set[str]] = {
    "hub": {"bind", "model"},
    "targets": {"hub", "prompts", "out", "name", "shard", "host", "port"},
    "verifier": {"bind"},
    "drafters": {"verifier", "prompts", "out", "name", "shard", "model"},
}
"""The process settings each table leaves to the launcher, which sets them per process
(from the table's own keys where it has one of the same name: ``bind``, ``model``,
``prompts``, ``name`` mean what the launcher makes of them)."""


def _section(table: str, doc: str, processes: tuple[type[Settings], ...],
             own: dict[str, tuple]) -> type[Settings]:
    """A table holding ``processes``' settings (but ``LAUNCHER_CHOSEN``) and ``own`` keys."""
    fields: dict[str, Any] = {}
    for process in processes:
        for key, field in process.model_fields.items():
            if key not in LAUNCHER_CHOSEN[table] and key not in fields:
                fields[key] = (field.annotation, field)
    fields.update(own)
    return create_model(f"{table.title()}Table", __base__=Placement, __doc__=doc, **fields)


def _key(annotation: Any, default: Any, text: str) -> tuple:
    return (annotation, Field(default, description=text))


BIND = _key(str | None, None, "ZeroMQ address (default: loopback locally, every interface on "
                              "Ray, port 0 = free)")
PORT = _key(Port | None, None, "shorthand for bind on the default host")
GPU = _key(Count | None, None, "local backend: CUDA_VISIBLE_DEVICES")
COUNT = _key(Count, 1, "processes to start")
GPUS = _key(list[Count], [], "local backend: one GPU index per process, in order")
PROMPTS = _key(str | None, None, "JSONL prompts (--prompts overrides)")

HubSection = _section(
    "hub", "[hub]: the star's hub (`starhub hub`).", (HubSettings,), dict(
        bind=BIND, port=PORT, gpu=GPU,
        model=_key(str | None, None, "the targets' model, for --draft self (default: "
                                     "targets.model)")))
TargetsSection = _section(
    "targets", "[targets]: the star's targets (`starhub target`, or `starhub serve`).",
    (TargetSettings, ServeSettings), dict(
        count=COUNT, gpus=GPUS, prompts=PROMPTS,
        name=_key(str, "target", "process names are NAME0, NAME1, ..."),
        serve=_key(bool, False, "run each target as `starhub serve`, an OpenAI-compatible "
                                "HTTP server, until stopped (no prompts needed)"),
        http_host=_key(str | None, None, "serve: address to listen on (default: loopback "
                                         "locally, every interface on Ray)"),
        http_port=_key(Port, 0, "serve: target i listens on http_port + i (0: free ports)"),
        model=(str, Field(description="'default', a model folder, a .gguf file or a cached "
                                      "model id"))))
VerifierSection = _section(
    "verifier", "[verifier]: the edge topology's verifier (`starhub verifier`).",
    (VerifierSettings,), dict(
        bind=BIND, port=PORT, gpu=GPU,
        model=(str, Field(description="the target model the verifier holds"))))
DraftersSection = _section(
    "drafters", "[drafters]: the edge topology's drafters (`starhub drafter`).",
    (DrafterSettings,), dict(
        count=COUNT, gpus=GPUS, prompts=PROMPTS,
        name=_key(str, "drafter", "process names are NAME0, NAME1, ..."),
        model=_key(str | None, None, "the verifier's model (default: verifier.model)")))


class RaySection(Settings):
    address: str | None = Field(None, description="the cluster to attach to; RAY_ADDRESS "
                                                  "wins")
    namespace: str = "starhub"


class Deployment(Settings):
    backend: Backend = Backend.LOCAL
    topology: Topology | None = Field(None, description="star (hub + targets) or edge "
                                      "(verifier + drafters); default: from the tables present")
    name: str = Field("starhub", description="prefix of Ray actor names")
    out_dir: str = Field("out/launch", description="outputs and logs (--out-dir overrides)")
    log_level: LogLevel = LogLevel.INFO
    ready_timeout_s: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 600.0
    status_interval_s: Amount = Field(2.0, description="live status line (0: off)")
    hub: HubSection | None = None
    hubs: list[HubSection] | None = Field(
        None, description="[[hubs]]: a pool of hubs instead of one [hub], each table with "
        "its own settings, device and port; every target is given the pool and opens its "
        "sessions on the hub that offers it most (see docs/deployment.md)")
    targets: TargetsSection | None = None
    verifier: VerifierSection | None = None
    drafters: DraftersSection | None = None
    ray: RaySection = Field(default_factory=RaySection)
    _source: str = PrivateAttr("<config>")

    @property
    def source(self) -> str:
        """The file it was read from (not a key of the file)."""
        return self._source

    @property
    def server(self):
        """The (first) hub, or the verifier."""
        return self.hub if self.topology == Topology.STAR else self.verifier

    @property
    def servers(self) -> list:
        """Every hub of the pool, or the verifier."""
        return list(self.hubs) if self.topology == Topology.STAR else [self.verifier]

    @property
    def workers(self):
        return self.targets if self.topology == Topology.STAR else self.drafters


TABLES = {"hub": HubSection, "targets": TargetsSection, "verifier": VerifierSection,
          "drafters": DraftersSection, "ray": RaySection}
"""The tables a deployment holds once each (``[[hubs]]``, a pool, holds ``[hub]``'s keys)."""


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
    """A deployment from a file's tables, typed as the file wrote them (``"4"`` is not a
    number); its processes' settings checked as their flags check them."""
    if isinstance(raw.get("hubs"), dict):
        raise ConfigError(f"{source}: hubs: a pool of hubs is written [[hubs]], one table per "
                          f"hub (one hub: [hub])")
    try:
        dep = Deployment.model_validate_json(json.dumps(raw, default=str), strict=True)
    except ValidationError as exc:
        where = lambda loc: f"{source}: {'.'.join(map(str, loc))}"  # noqa: E731
        raise ConfigError(explain(exc, where, Deployment)) from None
    dep._source = source
    _check_topology(dep, raw, source)
    _check_placement(dep, source)
    return dep


# --- checks across tables ---------------------------------------------------------------

def _check_topology(dep: Deployment, raw: dict, source: str) -> None:
    star = [k for k in ("hub", "hubs", "targets") if k in raw]
    edge = [k for k in ("verifier", "drafters") if k in raw]
    if dep.topology is None:
        dep.topology = Topology.EDGE if edge and not star else Topology.STAR
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
        if dep.hub is not None and dep.hubs is not None:
            raise ConfigError(f"{source}: hubs: give one [hub] or a pool of [[hubs]], not both")
        if dep.hubs == []:
            raise ConfigError(f"{source}: hubs: an empty pool; give at least one [[hubs]] "
                              f"table")
        dep.hubs = dep.hubs or [dep.hub or HubSection()]
        dep.hub = dep.hubs[0]
        for hub in dep.hubs:
            hub.model = hub.model or dep.targets.model
    else:
        dep.drafters = dep.drafters or DraftersSection()
        dep.drafters.model = dep.drafters.model or dep.verifier.model
    tables = [(section, getattr(dep, section)) for section in wanted]
    if dep.topology == "star" and len(dep.hubs) > 1:
        tables = [(f"hubs[{i}]", hub) for i, hub in enumerate(dep.hubs)] + tables[1:]
    for section, table in tables:
        if getattr(table, "bind", None) and getattr(table, "port", None) is not None:
            raise ConfigError(f"{source}: {section}.port: give bind or port, not both")


def _check_placement(dep: Deployment, source: str) -> None:
    workers = dep.workers
    name = "hub" if dep.topology == "star" else "verifier"
    group = "targets" if dep.topology == "star" else "drafters"
    if dep.backend == "ray":
        pins = [(f"{name}.gpu" if len(dep.servers) == 1 else f"hubs[{i}].gpu", s.gpu)
                for i, s in enumerate(dep.servers)]
        for key, table in (*pins, (f"{group}.gpus", workers.gpus)):
            if table not in (None, []):
                raise ConfigError(f"{source}: {key}: GPU pins are for the local backend; on "
                                  f"Ray ask for num_gpus and Ray assigns the GPUs")
        return
    if workers.gpus and len(workers.gpus) != workers.count:
        raise ConfigError(f"{source}: {group}.gpus: lists {len(workers.gpus)} GPUs for "
                          f"{workers.count} processes; give one index per process")


def schema_text() -> str:
    """Every table and key with its type, default and help, for ``starhub launch
    --schema``."""
    lines = []
    for title, cls in (("(top level)", Deployment), *((f"[{k}]", t) for k, t in TABLES.items())):
        if title == "[targets]":
            lines.append("[[hubs]]  (instead of [hub]: a pool of hubs, one table per hub, "
                         "each with [hub]'s keys)")
        lines.append(title)
        for name, field in cls.model_fields.items():
            if name in TABLES or name == "hubs":
                continue
            default = "  (required)" if field.is_required() else \
                f" = {_toml(field.get_default(call_default_factory=True))}"
            help_ = f"\n      {field.description}" if field.description else ""
            lines.append(f"  {name}: {_words(TypeAdapter(_typed(field)).json_schema())}"
                         f"{default}{help_}")
    return "\n".join(lines)


def _typed(field) -> Any:
    meta = [m for m in field.metadata if not hasattr(m, "switch")]
    return Annotated[(field.annotation, *meta)] if meta else field.annotation


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Choice):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


WORDS = {"integer": "a whole number", "number": "a number", "string": "a string",
         "boolean": "true or false", "null": "unset", "object": "a table", "array": "a list"}


def _words(schema: dict, defs: dict | None = None) -> str:
    """A JSON schema in words: 'a whole number in [1, 1024]', "'auto' or ..."."""
    defs = {**(defs or {}), **schema.get("$defs", {})}
    if "$ref" in schema:
        return _words(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "anyOf" in schema:
        return " or ".join(_words(s, defs) for s in schema["anyOf"] if s.get("type") != "null")
    if "const" in schema:
        return f"'{schema['const']}'"
    if "enum" in schema:
        return "one of " + ", ".join(f"'{v}'" for v in schema["enum"])
    text = WORDS.get(schema.get("type"), "a value")
    low = [(k, schema[k]) for k in ("minimum", "exclusiveMinimum") if k in schema]
    high = [(k, schema[k]) for k in ("maximum", "exclusiveMaximum") if k in schema]
    if low and high:
        text += (f" in {'[' if low[0][0] == 'minimum' else '('}{_num(low[0][1])}, "
                 f"{_num(high[0][1])}{']' if high[0][0] == 'maximum' else ')'}")
    elif low:
        text += f" {'>=' if low[0][0] == 'minimum' else '>'} {_num(low[0][1])}"
    elif high:
        text += f" {'<=' if high[0][0] == 'maximum' else '<'} {_num(high[0][1])}"
    return text


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
