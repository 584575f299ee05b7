"""What every process's settings have in common: how a field shows on the command line
(``Flag``), where values come from and in which order (``load``), and how a value that is
not allowed is told (``explain``).

A process reads, later sources winning: its fields' defaults; the validated config a
launcher handed it (``STARHUB_CONFIG``, JSON); environment variables
(``STARHUB_<PROCESS>__<FIELD>``, e.g. ``STARHUB_HUB__MAX_TARGETS=auto``); its flags. Text
(flags and environment variables) is read as the field's type reads text ("4", "auto",
"on"); JSON and launch files are typed, so ``topk = "4"`` is an error there.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

CONFIG_ENV = "STARHUB_CONFIG"
"""A launched process's whole config, as JSON: what its launcher validated."""
ENV_PREFIX = "STARHUB_"


class SettingsError(ValueError):
    """A value that is not allowed, told with where it came from."""


@dataclass(frozen=True)
class Flag:
    """How a field shows on the command line, where it differs from ``--field-name VALUE``."""

    name: str | None = None
    """The flag (``--no-chat-template``) or, with ``positional``, the argument's name."""
    metavar: str | None = None
    switch: bool = False
    """A flag without a value: it sets the field to the opposite of its default."""
    positional: bool = False
    hidden: bool = False
    """Not a flag: the launcher or the code sets it."""


class Settings(BaseModel):
    """One process's settings. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    PROCESS: ClassVar[str] = ""
    """The environment variables' infix: ``STARHUB_HUB__TTL`` for ``HUB``."""
    SECTION: ClassVar[tuple[str, str] | None] = None
    """The ``--help`` section (title, description) that lists the fields this class
    declares; a process class that declares a field again keeps it there."""

    @classmethod
    def section(cls, name: str) -> tuple[str, str] | None:
        """The ``--help`` section of field ``name`` (None: the command's own options)."""
        for base in reversed(cls.__mro__):
            if name in getattr(base, "__annotations__", {}) and base.__dict__.get("SECTION"):
                return base.__dict__["SECTION"]
        return None

    @classmethod
    def flag(cls, name: str) -> Flag:
        return next((m for m in cls.model_fields[name].metadata if isinstance(m, Flag)),
                    Flag())

    @classmethod
    def option(cls, name: str) -> str:
        """A field's flag as the command line spells it."""
        flag = cls.flag(name)
        return flag.name or "--" + name.replace("_", "-")

    @classmethod
    def env_name(cls, name: str) -> str:
        return f"{ENV_PREFIX}{cls.PROCESS}__{name.upper()}"


@cache
def adapter(model: type[BaseModel], name: str) -> TypeAdapter:
    """A validator of one field alone, with its bounds."""
    field = model.model_fields[name]
    meta = [m for m in field.metadata if not isinstance(m, Flag)]
    return TypeAdapter(Annotated[(field.annotation, *meta)] if meta else field.annotation)


def field_value(model: type[BaseModel], name: str, value: Any, typed: bool) -> Any:
    """``value`` read as field ``name``: ``typed`` values (JSON, TOML) as they are, text as
    the field reads text."""
    if typed:
        return adapter(model, name).validate_json(json.dumps(value), strict=True)
    return adapter(model, name).validate_python(value)


def explain(exc: ValidationError, key: Callable[[tuple], str], model: type[BaseModel] | None
            = None) -> str:
    """A validation error in the user's terms: the key (``key`` spells a field's path as
    its source does), what is wrong, and what it held; for an unknown key, the nearest
    known one."""
    lines = []
    for error in exc.errors():
        loc = tuple(p for p in error["loc"] if isinstance(p, str | int))
        if error["type"] == "extra_forbidden":
            lines.append(f"{key(loc)}: unknown key{_nearest(model, loc)}")
        elif error["type"] == "missing":
            lines.append(f"{key(loc)}: missing; it is required")
        else:
            lines.append(f"{key(loc)}: {error['msg']}, got {_shown(error.get('input'))}")
    return "; ".join(dict.fromkeys(lines))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _nearest(model: type[BaseModel] | None, loc: tuple) -> str:
    """' (did you mean 'x'?); allowed here: ...' for an unknown key at ``loc``."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        model = _model_of(field.annotation) if field else None
    if model is None:
        return ""
    allowed = [name for name, f in model.model_fields.items() if not f.exclude]
    near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return f"{hint}; allowed here: {', '.join(allowed)}"


def _model_of(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in getattr(tp, "__args__", ()):
        if found := _model_of(arg):
            return found
    return None


def _layer(model: type[Settings], values: Mapping[str, Any], typed: bool,
           key: Callable[[str], str]) -> dict:
    """One source's values, each checked on its own (so that the error names its source)."""
    out = {}
    for name, value in values.items():
        if name not in model.model_fields:
            near = difflib.get_close_matches(name, list(model.model_fields), n=1)
            hint = f" (did you mean {key(near[0])}?)" if near else ""
            raise SettingsError(f"{key(name)}: unknown setting{hint}")
        try:
            out[name] = field_value(model, name, value, typed)
        except ValidationError as exc:
            raise SettingsError(explain(exc, lambda loc, n=name: key(n))) from None
    return out


def load(model: type[Settings], flags: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None, flag_key: Callable[[str], str] | None = None
         ) -> Settings:
    """``model``'s settings from its defaults, a launcher's config, the environment and
    ``flags`` (text, as the command line gave it), in that order; ``SettingsError`` names
    the first value not allowed, and where it came from."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if text := environ.get(CONFIG_ENV):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{CONFIG_ENV}: not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise SettingsError(f"{CONFIG_ENV}: expected a JSON object")
        values |= _layer(model, config, True, lambda n: f"{CONFIG_ENV}: {n}")
    prefix = f"{ENV_PREFIX}{model.PROCESS}__"
    env = {name[len(prefix):].lower(): value for name, value in environ.items()
           if name.startswith(prefix)}
    values |= _layer(model, env, False, lambda n: prefix + n.upper())
    flag_key = flag_key or (lambda n: f"argument {model.option(n)}")
    values |= _layer(model, flags or {}, False, flag_key)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise SettingsError(explain(exc, lambda loc: flag_key(str(loc[0])), model)) from None
