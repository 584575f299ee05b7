"""Every setting of every process is declared once (``starhub.settings.processes``): its
flag, its launch-file key, its environment variable and the value the process runs on all
come from that one field, agree on its default, and refuse the same values by name. NaN
passes no comparison and infinity passes every lower bound, so neither may slip through."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from bench.settings import Bench
from starhub.cli.main import build_parser
from starhub.hub.config import HubConfig
from starhub.launch.config import LAUNCHER_CHOSEN, TABLES, ConfigError, parse_config
from starhub.launch.plan import build_plan
from starhub.options import TreeShape
from starhub.server.limits import SessionLimits
from starhub.settings.base import CONFIG_ENV, SettingsError, load
from starhub.settings.cli import settings_from
from starhub.settings.processes import PROCESSES
from targets.verifier_state import VerifierConfig

COMMANDS = {**PROCESSES, "bench": Bench}
REQUIRED = {"target": ["--prompts", "p", "--out", "o"], "generate": ["hello"],
            "drafter": ["--verifier", "tcp://127.0.0.1:1", "--prompts", "p", "--out", "o"]}
"""What each command needs besides the flag under test."""
TABLE_OF = {"hub": "hub", "target": "targets", "serve": "targets", "verifier": "verifier",
            "drafter": "drafters"}
"""The launch-file table of each process a launch starts."""


def _parse(argv: list[str], environ: dict | None = None, monkeypatch=None):
    args = build_parser().parse_args(argv)
    if environ is not None:
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
    return settings_from(args)


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _floats(model) -> list[str]:
    return [name for name, field in model.model_fields.items()
            if "float" in str(field.annotation) and model.flag(name).switch is False]


# --- one declaration, one default ---------------------------------------------------------

def _cli_defaults(command: str) -> dict:
    return dict(_parse([command, *REQUIRED.get(command, [])]))


def _launched(config: dict, role: str, prompts: str | None = "p.jsonl") -> dict:
    """The settings each process of ``role`` a launch of ``config`` starts runs on, read as
    the process reads them (its ``STARHUB_CONFIG``)."""
    plan = build_plan(parse_config(config, "d.toml"), prompts)
    specs = [spec for spec in plan.processes if spec.role == role]
    assert specs
    env = specs[0].environment(hub="tcp://127.0.0.1:1", prompts="p.jsonl", out="o.jsonl")
    return dict(load(PROCESSES[role], {}, environ=env))


MINIMAL = {"hub": {"targets": {"model": "default"}},
           "target": {"targets": {"model": "default"}},
           "serve": {"targets": {"model": "default", "serve": True}},
           "verifier": {"verifier": {"model": "default"}},
           "drafter": {"verifier": {"model": "default"}}}


@pytest.mark.parametrize("role", sorted(TABLE_OF))
def test_every_setting_defaults_alike_on_the_command_line_in_a_launch_file_and_when_launched(
        role):
    """Every field of the process's model (so that a new one is checked too): the flag's
    default, the launch table's default, and what a launched process runs on when the file
    leaves the key out. The verifier's schedule read fifo from a file and goodspeed from
    the command line."""
    model, table = PROCESSES[role], TABLE_OF[role]
    cli = _cli_defaults(role)
    launched = _launched(MINIMAL[role], role)
    section = TABLES[table].model_fields
    drift = []
    for name, field in model.model_fields.items():
        if name in LAUNCHER_CHOSEN[table] or name == "threads":  # threads: see the test below
            continue
        values = {"model": field.default, "command line": cli[name], "launched": launched[name]}
        if name in section and not section[name].is_required():  # a file must name its model
            values["launch file"] = section[name].default
        if len({json.dumps(v, default=str) for v in values.values()}) > 1:
            drift.append(f"{role}.{name}: {values}")
    assert not drift
    assert len(model.model_fields) - len(LAUNCHER_CHOSEN[table]) <= len(
        [n for n in model.model_fields if n in section]) + 1  # every other setting is a key


def test_the_launched_verifier_schedules_as_its_flag_does():
    assert _launched(MINIMAL["verifier"], "verifier")["schedule"] == \
        _cli_defaults("verifier")["schedule"] == "goodspeed"


def test_launch_threads_resolve_auto_and_keep_a_number():
    config = {"targets": {"model": "default", "threads": 3}, "hub": {"threads": "auto"}}
    assert _launched(config, "target")["threads"] == 3
    assert isinstance(_launched(config, "hub")["threads"], int)


def test_every_key_of_a_process_table_is_a_setting_of_its_process_or_of_the_launch():
    launch_only = {"num_cpus", "num_gpus", "resources", "labels", "count", "gpus", "gpu",
                   "port", "bind", "serve", "http_host", "http_port", "prompts", "name",
                   "model"}
    for table, cls in TABLES.items():
        if table == "ray":
            continue
        processes = [PROCESSES[r] for r, t in TABLE_OF.items() if t == table]
        foreign = [k for k in cls.model_fields if k not in launch_only
                   and not any(k in p.model_fields for p in processes)]
        assert not foreign, (table, foreign)


def test_a_launched_process_runs_on_what_its_table_says():
    config = {"hub": {"depth": 3, "predraft": True, "max_sessions": 9, "threads": 1},
              "targets": {"model": "default", "temperature": 0.5, "chat_template": False}}
    hub = _launched(config, "hub")
    assert (hub["depth"], hub["predraft"], hub["max_sessions"]) == (3, True, 9)
    target = _launched(config, "target")
    assert (target["temperature"], target["chat_template"], target["shard"]) == (0.5, False,
                                                                                   (0, 1))


# --- where values come from ------------------------------------------------------------------

def test_flags_win_over_the_environment_which_wins_over_a_launchers_config(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"ttl": 5.0, "topk": 2, "max_targets": 3}))
    monkeypatch.setenv("STARHUB_HUB__TOPK", "6")
    monkeypatch.setenv("STARHUB_HUB__MAX_TARGETS", "auto")
    hub = _parse(["hub", "--max-targets", "4"])
    assert (hub.ttl, hub.topk, hub.max_targets) == (5.0, 6, 4)
    assert CONFIG_ENV not in os.environ  # read once: the processes this one starts have own
    assert _parse(["hub"]).max_targets == "auto"


def test_switches_and_on_off_flags_read_as_the_field():
    args = _parse(["target", *REQUIRED["target"], "--no-chat-template", "--insecure",
                   "--shard", "1/3"])
    assert (args.chat_template, args.insecure, args.shard) == (False, True, (1, 3))
    hub = _parse(["hub", "--predraft", "on", "--lookup", "off", "--draft-process", "AUTO",
                  "--depth", " Auto "])
    assert (hub.predraft, hub.lookup, hub.draft_process, hub.depth) == (True, False, "auto",
                                                                        "auto")


# --- bad values, told by name, wherever they come from ---------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["hub", "--max-message-mb", "inf"], "argument --max-message-mb: Input should be a finite"),
    (["hub", "--ttl", "nan"], "argument --ttl: Input should be a finite number"),
    (["hub", "--ttl", "0"], "argument --ttl: Input should be greater than or equal to 0.1"),
    (["hub", "--metrics-port", "99999"], "argument --metrics-port: Input should be less than"),
    (["hub", "--max-nodes", "5000"], "argument --max-nodes: Input should be less than or equal "
                                     "to 1024"),
    (["hub", "--depth", "5000"], "argument --depth: Input should be less than or equal to 1024"),
    (["hub", "--depth", "deep"], "argument --depth: Input should be 'auto' or a valid integer"),
    (["hub", "--topk", "4.5"], "argument --topk: Input should be a valid integer"),
    (["hub", "--predraft", "maybe"], "argument --predraft: Input should be a valid boolean"),
    (["target", *REQUIRED["target"], "--top-p", "7"], "argument --top-p: Input should be less"),
    (["target", *REQUIRED["target"], "--hub-timeout", "0"],
     "argument --hub-timeout: Input should be greater than 0"),
    (["target", *REQUIRED["target"], "--shard", "3/2"], "argument --shard: expected I/N"),
    (["target", "--out", "o"], "argument --prompts: missing"),
    (["verifier", "--ttl", "-1"], "argument --ttl: Input should be greater than or equal"),
    (["drafter", *REQUIRED["drafter"], "--target-tok-s", "1e7"],
     "argument --target-tok-s: Input should be less than 1000000"),
    (["drafter", *REQUIRED["drafter"], "--temperature", "-0.5"],
     "argument --temperature: Input should be greater than or equal to 0"),
    (["drafter", *REQUIRED["drafter"], "--seed", str(1 << 64)], "argument --seed: Input should"),
    (["bench", "--duration", "inf"], "argument --duration: Input should be a finite number"),
])
def test_bad_flags_are_usage_errors_that_name_the_flag(capsys, argv, message):
    assert message in _usage_error(capsys, argv)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_float_flag_refuses_nan_and_infinity_by_name(capsys, command):
    model = COMMANDS[command]
    for name in _floats(model):
        for text in ("nan", "inf", "-inf"):
            err = _usage_error(capsys, [command, *REQUIRED.get(command, []),
                                        f"{model.option(name)}={text}"])
            assert f"argument {model.option(name)}: " in err and \
                ("finite" in err or "greater" in err), (command, name, err)


@pytest.mark.parametrize("variable, value, message", [
    ("STARHUB_HUB__TTL", "nan", "STARHUB_HUB__TTL: Input should be a finite number, got 'nan'"),
    ("STARHUB_HUB__TTL", "inf", "STARHUB_HUB__TTL: Input should be a finite number"),
    ("STARHUB_HUB__TOPK", "0", "STARHUB_HUB__TOPK: Input should be greater than or equal to 1"),
    ("STARHUB_HUB__TOPK", "four", "STARHUB_HUB__TOPK: Input should be a valid integer"),
    ("STARHUB_HUB__TOPKK", "4", "STARHUB_HUB__TOPKK: unknown setting (did you mean "
                                "STARHUB_HUB__TOPK?)"),
])
def test_bad_environment_variables_name_the_variable(variable, value, message):
    with pytest.raises(SettingsError) as err:
        load(PROCESSES["hub"], {}, environ={variable: value})
    assert message in str(err.value)


def _raw(key: str, value) -> dict:
    edge = key.split(".")[0] in ("verifier", "drafters")
    raw = {"verifier": {"model": "m"}} if edge else {"targets": {"model": "m"}}
    *tables, last = key.split(".")
    table = raw
    for name in tables:
        table = table.setdefault(name, {})
    table[last] = {"custom": value} if last == "resources" else value
    return raw


def _float_keys() -> list[str]:
    return [f"{table}.{name}" for table, cls in TABLES.items() for name in _floats(cls)]


def test_every_float_key_refuses_nan_and_infinity_by_name():
    keys = _float_keys()
    assert len(keys) > 10
    for key in keys:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError) as err:
                parse_config(_raw(key, value), "d.toml")
            assert str(err.value).startswith(f"d.toml: {key}") and \
                ("finite" in str(err.value) or "greater" in str(err.value)), str(err.value)


@pytest.mark.parametrize("key, value, message", [
    ("hub.ttl", math.nan, "Input should be a finite number, got nan"),
    ("hub.ttl", 0.0, "Input should be greater than or equal to 0.1, got 0.0"),
    ("verifier.ttl", 0.0, "greater than or equal to 0.1"),
    ("hub.port", 99999, "less than or equal to 65535, got 99999"),
    ("hub.metrics_port", 70000, "less than or equal to 65535"),
    ("targets.top_p", 7.0, "less than or equal to 1, got 7.0"),
    ("targets.top_p", 0.0, "greater than 0"),
    ("hub.max_message_mb", math.inf, "finite number, got inf"),
    ("hub.max_nodes", 5000, "less than or equal to 1024"),
    ("drafters.target_tok_s", 1e7, "less than 1000000"),
    ("drafters.timeout", 0.0, "greater than 0"),
    ("verifier.budget", 1, "greater than or equal to 2"),
    ("targets.seed", 1 << 64, "less than or equal to"),
    ("hub.topk", "4", "Input should be a valid integer, got '4'"),
    ("hub.predraft", 1, "Input should be a valid boolean, got 1"),
    ("verifier.schedule", "fast", "Input should be 'fifo', 'goodspeed', 'slo' or 'random'"),
    ("hub.topkk", 4, "unknown key (did you mean 'topk'?); allowed here:"),
    ("targets.cuont", 4, "unknown key (did you mean 'count'?)"),
])
def test_bad_keys_name_the_file_and_the_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        parse_config(_raw(key, value), "d.toml")
    assert str(err.value).startswith(f"d.toml: {key}: ") and message in str(err.value), \
        str(err.value)


def test_a_launchers_config_that_does_not_parse_is_refused():
    with pytest.raises(SettingsError, match=f"{CONFIG_ENV}: not valid JSON"):
        load(PROCESSES["hub"], {}, environ={CONFIG_ENV: "{ttl"})
    with pytest.raises(SettingsError, match=f"{CONFIG_ENV}: topk: Input should be a valid "
                                            "integer"):
        load(PROCESSES["hub"], {}, environ={CONFIG_ENV: '{"topk": "4"}'})


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
    (lambda: HubConfig(batch="many"), "batch"),
    (lambda: VerifierConfig(ttl_s=math.inf), "ttl_s"),
    (lambda: VerifierConfig(nodes=0), "nodes"),
    (lambda: VerifierConfig(budget=1), "budget"),
    (lambda: VerifierConfig(gather_fraction=math.nan), "gather_fraction"),
    (lambda: SessionLimits(max_sessions=0), "max_sessions"),
])
def test_configs_built_in_code_refuse_what_the_flags_refuse(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_default_configs_are_valid_and_take_their_defaults_from_the_settings():
    HubConfig()
    VerifierConfig()
    assert SessionLimits() == SessionLimits(**PROCESSES["hub"].default_limits())
    assert PROCESSES["verifier"].default_limits()["max_sessions"] == 256


def test_no_flag_reads_a_bare_number():
    """``type=float`` takes nan and inf, ``type=int`` any size: every flag of every command
    is read through a settings type (or a ``value_type``)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"starhub {command} {action.option_strings[-1]}"
            for command, parser in sub.choices.items() for action in parser._actions
            if action.type in (int, float)]
    assert not bare


def test_an_unknown_flag_is_a_usage_error_naming_the_nearest_known_one(capsys):
    from starhub.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--max-concurency", "3"])
    assert exc.value.code == 2
    assert "--max-concurency (did you mean --max-concurrency?)" in capsys.readouterr().err
