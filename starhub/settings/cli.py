"""A process's settings as ``argparse`` flags: one flag per field, its help and default
from the model, and the values read back through the model (``starhub.settings.base.load``),
so that a flag, an environment variable and a launch file refuse the same values with the
same words."""

from __future__ import annotations

import argparse
import difflib
import enum
import os
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined

from starhub.settings.base import CONFIG_ENV, Settings, SettingsError, load


def _choices(annotation: Any) -> list[str] | None:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [member.value for member in annotation]
    return None


def _metavar(annotation: Any) -> str | None:
    args = set(typing.get_args(annotation)) | {annotation}
    if bool in args:
        return "auto|on|off" if typing.Literal["auto"] in args else "on|off"
    return None


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return "/".join(map(str, value))
    return str(value)


def add_settings(parser: argparse.ArgumentParser, model: type[Settings],
                 skip: tuple[str, ...] = ()) -> None:
    """One flag (or positional argument) per field of ``model`` but ``skip``; its value is
    read when ``settings_from`` is called."""
    groups: dict[str, Any] = {}
    names = sorted(model.model_fields, key=lambda n: model.section(n) is not None)
    for name in names:  # the command's own options first, then each section's
        field = model.model_fields[name]
        flag = model.flag(name)
        if name in skip or flag.hidden:
            continue
        where, section = parser, model.section(name)
        if section:
            if section[0] not in groups:
                groups[section[0]] = parser.add_argument_group(*section)
            where = groups[section[0]]
        text = field.description or ""
        required = field.default is PydanticUndefined
        if not required and not flag.switch and field.default is not None \
                and "default" not in text:
            text = f"{text} (default: {_shown(field.default)})" if text \
                else f"default: {_shown(field.default)}"
        text = text.replace("%", "%%")
        if flag.positional:
            where.add_argument(flag.name or name, help=text, default=argparse.SUPPRESS,
                               nargs=None if required else "?")
        elif flag.switch:
            where.add_argument(model.option(name), dest=name, help=text,
                               action="store_const", const=not field.default,
                               default=argparse.SUPPRESS)
        else:
            where.add_argument(model.option(name), dest=name, help=text,
                               default=argparse.SUPPRESS, choices=_choices(field.annotation),
                               metavar=flag.metavar or _metavar(field.annotation))
    parser.set_defaults(settings_model=model, settings_parser=parser)


def settings_from(args: argparse.Namespace) -> Settings | None:
    """The settings of the command ``args`` were parsed for (None when it has none): its
    flags over the environment over a launcher's config over the defaults. Every field is
    also set on ``args``. A value not allowed is a usage error (exit status 2)."""
    model = getattr(args, "settings_model", None)
    if model is None:
        return None
    given = {name: value for name, value in vars(args).items() if name in model.model_fields}
    try:
        settings = load(model, given)
    except SettingsError as exc:
        args.settings_parser.error(str(exc))
    os.environ.pop(CONFIG_ENV, None)  # this process's alone: not for any it starts
    vars(args).update(dict(settings))
    args.settings = settings
    return settings


def as_flags(settings: Settings, model: type[Settings], names) -> list[str]:
    """``settings``' values of the fields ``names`` as flags of the command whose settings
    are ``model`` (``starhub generate`` starting its hub with its own drafting settings):
    only those that differ from ``model``'s defaults."""
    flags: list[str] = []
    for name in names:
        value, default = getattr(settings, name), model.model_fields[name].default
        if value != default and value is not None:
            flags += [model.option(name), _shown(value)]
    return flags


class SettingsParser(argparse.ArgumentParser):
    """A command line whose subcommands' settings are read and checked as it is parsed
    (``settings_from``): ``parse_args`` returns the values the process runs on."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        settings_from(parsed)
        return parsed, extra

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.unknown(parsed, extra)
        return parsed

    def unknown(self, parsed: argparse.Namespace, extra: list[str]) -> None:
        """A usage error for arguments no option takes, naming the nearest known flag."""
        command = getattr(parsed, "settings_parser", self)
        known = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for arg in extra:
            near = difflib.get_close_matches(arg.split("=")[0], known, n=1)
            if arg.startswith("--") and near:
                hints.append(f"{arg.split('=')[0]} (did you mean {near[0]}?)")
        hint = f"; {', '.join(hints)}" if hints else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def value_type(annotation: Any, what: str = "value"):
    """An argparse type for a flag that is not a process setting (``starhub status
    --timeout``), checked by the same types."""
    adapter = TypeAdapter(annotation)

    def parse(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(f"{exc.errors()[0]['msg']}, got '{text}'") \
                from None

    parse.__name__ = what
    return parse
