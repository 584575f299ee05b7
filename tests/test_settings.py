"""Every number a user gives starhub, as a flag, a deployment key or a config built in code,
is finite and in range, and a value that is not is refused with a message naming it: NaN
passes no comparison and infinity passes every lower bound, so neither may slip through."""

from __future__ import annotations

import argparse
import math

import msgspec.inspect as mi
import pytest

from starhub.cli.main import build_parser
from starhub.hub.config import HubConfig
from starhub.launch.config import ConfigError, Deployment, parse_config
from starhub.options import TreeShape
from starhub.server.limits import SessionLimits
from targets.verifier_state import VerifierConfig

REQUIRED = {"target": ["--prompts", "p", "--out", "o"], "generate": ["hello"],
            "drafter": ["--verifier", "tcp://127.0.0.1:1", "--prompts", "p", "--out", "o"],
            "status": ["tcp://127.0.0.1:1"]}
"""What each command needs besides the flag under test."""


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _numeric_flags() -> list[tuple[str, str, type]]:
    """(command, flag, int or float) of each flag read by a ``starhub.options.Number``."""
    return [(command, action.option_strings[-1], action.type.__self__.kind)
            for command, parser in _commands().items() for action in parser._actions
            if hasattr(getattr(action.type, "__self__", None), "problem")]


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_no_flag_reads_a_bare_number():
    """``type=float`` takes nan and inf, ``type=int`` any size: every numeric flag has a
    ``Number`` (or an auto-or-count type) that states its range."""
    bare = [f"starhub {command} {action.option_strings[-1]}"
            for command, parser in _commands().items() for action in parser._actions
            if action.type in (int, float)]
    assert not bare


def test_every_numeric_flag_refuses_nan_and_infinity_by_name(capsys):
    flags = _numeric_flags()
    assert len(flags) > 30  # hub, target, generate, demo, verifier, drafter, status, bench
    for command, flag, kind in flags:
        for text in ("nan", "inf", "-inf"):
            err = _usage_error(capsys, [command, *REQUIRED.get(command, []), f"{flag}={text}"])
            expected = "finite" if kind is float else "whole number"
            assert f"argument {flag}: " in err and expected in err, (command, flag, err)


@pytest.mark.parametrize("argv, message", [
    (["hub", "--max-message-mb", "inf"], "argument --max-message-mb: must be a finite number"),
    (["hub", "--ttl", "nan"], "argument --ttl: must be a finite number"),
    (["hub", "--ttl", "0"], "argument --ttl: must be at least 0.1, got 0"),
    (["hub", "--metrics-port", "99999"], "argument --metrics-port: must be at most 65535"),
    (["hub", "--max-nodes", "5000"], "argument --max-nodes: must be at most 1024"),
    (["hub", "--depth", "5000"], "argument --depth: depth must be at most 1024"),
    (["target", *REQUIRED["target"], "--top-p", "7"], "argument --top-p: must be at most 1"),
    (["target", *REQUIRED["target"], "--hub-timeout", "0"],
     "argument --hub-timeout: must be greater than 0"),
    (["verifier", "--ttl", "-1"], "argument --ttl: must be at least 0.1"),
    (["drafter", *REQUIRED["drafter"], "--target-tok-s", "1e7"],
     "argument --target-tok-s: must be less than 1e+06"),
    (["drafter", *REQUIRED["drafter"], "--temperature", "-0.5"],
     "argument --temperature: must be at least 0"),
    (["drafter", *REQUIRED["drafter"], "--seed", str(1 << 64)], "argument --seed: must be at "
                                                                 "most"),
    (["status", "tcp://127.0.0.1:1", "--timeout", "nan"], "argument --timeout: must be a finite"),
    (["bench", "--duration", "inf"], "argument --duration: must be a finite number"),
])
def test_out_of_range_flags_are_usage_errors_that_name_the_flag(capsys, argv, message):
    assert message in _usage_error(capsys, argv)


def test_flags_in_range_are_read_as_numbers():
    args = build_parser().parse_args(["hub", "--ttl", "0.3", "--max-message-mb", "0.5",
                                      "--metrics-port", "65535", "--max-nodes", "1024"])
    assert (args.ttl, args.max_message_mb, args.metrics_port, args.max_nodes) == \
        (0.3, 0.5, 65535, 1024)


# --- deployment files ---------------------------------------------------------------

def _tables() -> dict[str, mi.StructType]:
    return {f.name: next(t for t in _types(f.type) if isinstance(t, mi.StructType))
            for f in mi.type_info(Deployment).fields
            if any(isinstance(t, mi.StructType) for t in _types(f.type))}


def _types(tp: mi.Type) -> list[mi.Type]:
    if isinstance(tp, mi.Metadata):
        return _types(tp.type)
    if isinstance(tp, mi.UnionType):
        return [t for member in tp.types for t in _types(member)]
    return [tp]


def _numeric_keys() -> list[tuple[str, mi.IntType | mi.FloatType]]:
    keys = []
    for name, table in [("", mi.type_info(Deployment)), *_tables().items()]:
        for field in table.fields:
            for tp in _types(field.type):
                for inner in (tp, getattr(tp, "item_type", None), getattr(tp, "value_type", None)):
                    if isinstance(inner, (mi.IntType, mi.FloatType)):
                        keys.append((f"{name}.{field.name}".lstrip("."), inner))
    return keys


def test_every_numeric_key_has_a_range():
    unbounded = [key for key, tp in _numeric_keys() if tp.ge is None and tp.gt is None]
    assert not unbounded


def _raw(key: str, value) -> dict:
    edge = key.split(".")[0] in ("verifier", "drafters")
    raw = {"verifier": {"model": "m"}} if edge else {"targets": {"model": "m"}}
    *tables, last = key.split(".")
    table = raw
    for name in tables:
        table = table.setdefault(name, {})
    if last in ("resources",):
        value = {"custom": value}
    elif last in ("gpus",):
        value = [value]
    table[last] = value
    return raw


def test_every_float_key_refuses_nan_and_infinity_by_name():
    keys = [key for key, tp in _numeric_keys() if isinstance(tp, mi.FloatType)]
    assert len(keys) > 10
    for key in keys:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError) as err:
                parse_config(_raw(key, value), "d.toml")
            assert str(err.value).startswith(f"d.toml: {key}") and \
                ("finite" in str(err.value) or "at least" in str(err.value)), str(err.value)


@pytest.mark.parametrize("key, value, message", [
    ("hub.ttl", math.nan, "must be a finite number, got nan"),
    ("hub.ttl", 0.0, "must be at least 0.1, got 0.0"),
    ("verifier.ttl", 0.0, "must be at least 0.1"),
    ("hub.port", 99999, "must be at most 65535, got 99999"),
    ("hub.metrics_port", 70000, "must be at most 65535"),
    ("targets.top_p", 7.0, "must be at most 1.0, got 7.0"),
    ("targets.top_p", 0.0, "must be greater than 0.0"),
    ("hub.max_message_mb", math.inf, "must be a finite number, got inf"),
    ("hub.max_nodes", 5000, "must be at most 1024"),
    ("drafters.target_tok_s", 1e7, "must be less than"),
    ("drafters.timeout", 0.0, "must be greater than 0.0"),
    ("verifier.budget", 1, "must be at least 2"),
    ("targets.seed", 1 << 64, "must be at most"),
])
def test_out_of_range_keys_name_the_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        parse_config(_raw(key, value), "d.toml")
    assert str(err.value).startswith(f"d.toml: {key}: ") and message in str(err.value), \
        str(err.value)


# --- configs built in code ------------------------------------------------------------

@pytest.mark.parametrize("make, name", [
    (lambda: HubConfig(ttl_s=math.nan), "ttl_s"),
    (lambda: HubConfig(ttl_s=0.0), "ttl_s"),
    (lambda: HubConfig(max_message_bytes=0), "max_message_bytes"),
    (lambda: HubConfig(metrics_port=99999), "metrics_port"),
    (lambda: HubConfig(retry_after_s=math.inf), "retry_after_s"),
    (lambda: HubConfig(shape=TreeShape(depth=0)), "shape.depth"),
    (lambda: HubConfig(shape=TreeShape(support=1 << 20)), "shape.support"),
    (lambda: HubConfig(max_targets=-1), "max_targets"),
    (lambda: VerifierConfig(ttl_s=math.inf), "ttl_s"),
    (lambda: VerifierConfig(nodes=0), "nodes"),
    (lambda: VerifierConfig(budget=1), "budget"),
    (lambda: VerifierConfig(gather_fraction=math.nan), "gather_fraction"),
    (lambda: SessionLimits(max_sessions=0), "max_sessions"),
])
def test_configs_built_in_code_refuse_what_the_flags_refuse(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_default_configs_are_valid():
    HubConfig()
    VerifierConfig()
    SessionLimits()


SAME_MEANING = {
    ("hub", "device"), ("targets", "device"), ("verifier", "device"), ("drafters", "device"),
    ("hub", "model"), ("drafters", "model"), ("targets", "model"), ("verifier", "model"),
    ("hub", "bind"), ("verifier", "bind"), ("targets", "name"), ("drafters", "name"),
    ("verifier", "budget"), ("verifier", "max_batch"),
}
"""Keys whose file default reads differently from their flag's, with one meaning: a device
and a bind address the launcher chooses for each backend (the flags' auto and loopback),
models a file must name or takes from the other table, process names the launcher numbers,
and auto, which the verifier's flags spell 0."""


def test_a_launch_file_defaults_every_key_it_shares_with_a_flag_as_the_flag_does():
    """Every key of a launch file's process tables (read from the schema, so that a new one
    is checked too) against its process's flag: a file that leaves a key out runs what the
    command line runs. The verifier's schedule read fifo from a file and goodspeed from
    the command line."""
    import msgspec

    from starhub.launch import config

    commands = _commands()
    drift = []
    for table, section, command in (("hub", config.HubSection, "hub"),
                                    ("targets", config.TargetsSection, "target"),
                                    ("verifier", config.VerifierSection, "verifier"),
                                    ("drafters", config.DraftersSection, "drafter")):
        flags = {o: a for a in commands[command]._actions for o in a.option_strings}
        for field in msgspec.structs.fields(section):
            action = flags.get("--" + field.name.replace("_", "-"))
            if action is None or (table, field.name) in SAME_MEANING:
                continue
            default = field.default_factory() if field.default is msgspec.NODEFAULT \
                else field.default
            if str(default) != str(action.default):
                drift.append(f"{table}.{field.name} = {default!r}, --{field.name} "
                             f"{action.default!r}")
    assert not drift
