"""``starhub launch``, its config schema and ``starhub status``: bad files fail before
anything starts, the shipped configs plan the right commands, the local backend brings up a
hub and two targets whose greedy output equals generate(), and SIGINT leaves nothing
behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from starhub.launch.config import ConfigError, load_config, parse_config
from starhub.launch.plan import build_plan, check_commands, describe
from starhub.settings.base import load
from starhub.settings.cli import settings_from
from starhub.settings.processes import PROCESSES

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Name a color."]
NEW = 24


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def prompts_file(tmp_path: Path, prompts: list[str] = PROMPTS) -> Path:
    return write(tmp_path / "prompts.jsonl",
                 "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))


def starhub(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "starhub", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=kw.pop("timeout", 300), **kw)


# --- the schema --------------------------------------------------------------------

@pytest.mark.parametrize("text, key, hint", [
    ('[targets]\nmodle = "default"\n', "targets.modle", "did you mean 'model'"),
    ('[targets]\nmodel = "default"\n[hub]\ntopk = "four"\n', "hub.topk",
     "Input should be a valid integer, got 'four'"),
    ('[targets]\ncount = 2\n', "targets.model", "missing"),
    ('backend = "kubernetes"\n[targets]\nmodel = "default"\n', "backend",
     "Input should be 'local' or 'ray'"),
    ('[targets]\nmodel = "default"\ncount = true\n', "targets.count",
     "Input should be a valid integer, got True"),
    ('[targets]\nmodel = "default"\n[hub]\ndepth = "deep"\n', "hub.depth", "'auto'"),
    ('[targets]\nmodel = "default"\n[hubz]\n', "hubz", "allowed here: backend"),
    ('[targets]\nmodel = "default"\n[hubs]\n', "hubs", "written [[hubs]]"),
    ('[targets]\nmodel = "default"\n[hub]\n[[hubs]]\n', "hubs", "not both"),
    ('[targets]\nmodel = "default"\n[[hubs]]\nport = 1\nbind = "tcp://127.0.0.1:2"\n'
     '[[hubs]]\n', "hubs[0].port", "bind or port"),
    ('[targets]\nmodel = "default"\ncount = 2\ngpus = [1]\n', "targets.gpus",
     "one index per process"),
    ('backend = "ray"\n[targets]\nmodel = "default"\n[hub]\ngpu = 0\n', "hub.gpu",
     "num_gpus"),
    ('[targets]\nmodel = "default"\n[verifier]\nmodel = "default"\n', "[verifier]",
     "not part of a star"),
    ('[targets]\nmodel = "default"\n[hub]\nport = 5555\nbind = "tcp://1.2.3.4:1"\n',
     "hub.port", "not both"),
])
def test_bad_configs_name_the_file_and_the_key(tmp_path, text, key, hint):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and key in message and hint in message, message


def test_a_bad_config_fails_before_anything_starts(tmp_path):
    path = write(tmp_path / "bad.toml", '[targets]\ncount = 2\nthreds = 1\nmodel = "x"\n')
    out = starhub("launch", str(path), "--prompts", str(prompts_file(tmp_path)),
                  "--out-dir", str(tmp_path / "out"))
    assert out.returncode == 2
    assert "targets.threds: unknown key (did you mean 'threads'?)" in out.stderr
    assert "started" not in out.stderr and not (tmp_path / "out").exists()


def test_overrides_are_checked_like_the_file(tmp_path):
    dep = load_config(CONFIGS / "local-cpu.toml", ["targets.count=3", "hub.depth=5",
                                                   "targets.prompts=p.jsonl"])
    assert (dep.targets.count, dep.hub.depth, dep.targets.prompts) == (3, 5, "p.jsonl")
    with pytest.raises(ConfigError, match="targets.count: Input should be a valid integer"):
        load_config(CONFIGS / "local-cpu.toml", ["targets.count=many"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(CONFIGS / "local-cpu.toml", ["targets.count"])


def test_targets_without_prompts_are_refused_and_zero_targets_only_serve():
    dep = parse_config({"targets": {"model": "default", "count": 2}}, "x.toml")
    with pytest.raises(ConfigError, match="targets.prompts: .*pass --prompts FILE"):
        build_plan(dep)
    dep = parse_config({"targets": {"model": "default", "count": 0}}, "x.toml")
    assert build_plan(dep).workers == []


# --- plans and the shipped configs ---------------------------------------------------

@pytest.mark.parametrize("name", ["local-cpu", "single-host-gpus", "ray-cluster", "edge"])
def test_every_shipped_config_is_valid_and_plans_its_processes(name):
    from starhub.cli.main import build_parser

    dep = load_config(CONFIGS / f"{name}.toml")
    plan = build_plan(dep, "prompts.jsonl")
    assert len(plan.workers) == dep.workers.count >= 2
    assert [p.config["shard"] for p in plan.workers] == \
        [f"{i}/{len(plan.workers)}" for i in range(len(plan.workers))]
    text = describe(plan, "out", "10.0.0.1:6379")
    assert text.count(" -m starhub ") == len(plan.processes)
    parser = build_parser()
    check_commands(plan, parser)
    for spec in plan.processes:  # each process reads its config (a GPU config's device too)
        env = spec.environment(hub="tcp://10.0.0.1:5555", prompts="p.jsonl", out="o.jsonl")
        settings = load(PROCESSES[spec.role], {}, environ=env)
        assert spec.command()[-1] == spec.role
        assert settings.threads == spec.threads


def test_single_host_config_pins_one_gpu_per_process():
    plan = build_plan(load_config(CONFIGS / "single-host-gpus.toml"), "p.jsonl")
    assert [p.gpu for p in plan.processes] == list(range(8))


def test_ray_config_asks_ray_for_resources_and_binds_every_interface():
    plan = build_plan(load_config(CONFIGS / "ray-cluster.toml"), "p.jsonl")
    hub = plan.server
    assert hub.ray_options == {"num_cpus": 4, "num_gpus": 1.0,
                               "label_selector": {"role": "draft"}}
    assert hub.config["bind"] == "tcp://0.0.0.0:5555"
    assert all(t.ray_options["num_gpus"] == 1.0 for t in plan.workers)


def test_auto_threads_share_the_machine_locally_and_follow_num_cpus_on_ray(monkeypatch):
    import starhub.options

    monkeypatch.setattr(starhub.options, "usable_cores", lambda: 8)

    def threads(plan):
        return [(p.threads, str(p.config["threads"])) for p in plan.processes]

    local = build_plan(load_config(CONFIGS / "local-cpu.toml", ["targets.count=3"]), "p.jsonl")
    assert threads(local) == [(2, "2")] * 4  # 8 cores over a hub and 3 targets
    edge = build_plan(load_config(CONFIGS / "edge.toml"), "p.jsonl")
    assert {t for t, _ in threads(edge)} == {1}  # 8 cores over 5 processes
    assert edge.server.config["budget"] == "auto"
    pinned = load_config(CONFIGS / "local-cpu.toml", ["targets.threads=3"])
    assert [t for t, _ in threads(build_plan(pinned, "p.jsonl"))] == [2, 3, 3]
    ray = load_config(CONFIGS / "local-cpu.toml", ["backend=ray", "targets.num_cpus=6",
                                                    "hub.bind=tcp://127.0.0.1:0"])
    plan = build_plan(ray, "p.jsonl")
    assert threads(plan) == [(1, "1"), (6, "6"), (6, "6")]
    assert plan.workers[0].ray_options["num_cpus"] == 6


def test_edge_configs_need_the_edge_commands(tmp_path):
    import argparse

    plan = build_plan(load_config(CONFIGS / "edge.toml"), "p.jsonl")
    assert plan.server.role == "verifier" and {p.role for p in plan.workers} == {"drafter"}
    older = argparse.ArgumentParser()
    older.add_subparsers().add_parser("hub")
    with pytest.raises(ConfigError, match="edge launch needs `starhub verifier`"):
        check_commands(plan, older)


def test_dry_run_prints_each_exact_command_and_starts_nothing(tmp_path):
    prompts = prompts_file(tmp_path)
    out = starhub("launch", "configs/local-cpu.toml", "--prompts", str(prompts), "--out-dir",
                  str(tmp_path / "out"), "--dry-run", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    commands = [shlex.split(line) for line in lines if " -m starhub " in line]
    assert len(commands) == 3
    configs = [json.loads(c[1].removeprefix("STARHUB_CONFIG=")) for c in commands]
    assert commands[0][-1] == "hub" and configs[0]["bind"] == "tcp://127.0.0.1:0"
    assert (configs[0]["model"], configs[0]["drafter"]) == ("default", "eagle")
    for i in range(2):
        assert commands[i + 1][-1] == "target"
        assert configs[i + 1]["shard"] == f"{i}/2"
        assert configs[i + 1]["out"] == str(tmp_path / "out" / f"target{i}.jsonl")
        assert configs[i + 1]["prompts"] == str(prompts)
    assert not (tmp_path / "out").exists()


def test_help_answers_without_torch_or_transformers():
    code = ("import sys\nfrom starhub.cli.main import main\n"
            "for argv in (['--help'], ['launch', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0\n"
            "import bench.cli\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--dry-run" in out.stdout and "--out-dir" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_bench_cli_no_longer_imports_the_starhub_cli():
    code = "import sys, bench.cli\nprint('starhub.cli.main' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    from bench.cli import hub_defaults
    from starhub.cli.main import build_parser

    args = build_parser().parse_args(["hub"])
    hub = settings_from(args)
    assert hub_defaults() == {k: getattr(hub, k) for k in hub_defaults()}



# --- placement on Ray, and collecting outputs --------------------------------------

def ray_node(ip: str, cpus: float, gpus: float = 0.0, **labels: str) -> dict:
    resources = {"CPU": cpus, "memory": 1e10, f"node:{ip}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    return {"Alive": True, "NodeManagerAddress": ip, "Resources": resources,
            "Labels": {"ray.io/node-id": "x", **labels}}


def test_a_gpu_deployment_on_a_cpu_cluster_is_refused_naming_what_no_node_has():
    from starhub.launch.ray_backend import placement_problems

    plan = build_plan(load_config(CONFIGS / "ray-cluster.toml"), "p.jsonl")
    problems = placement_problems(plan.processes, [ray_node("10.0.0.1", 16)])
    assert problems == [
        "hub asks for 4 CPU, 1 GPU on a node labelled role=draft: no node has 1 GPU; "
        "no node has the label role=draft",
        "8 processes (target0 .. target7) each ask for 4 CPU, 1 GPU: no node has 1 GPU"]
    gpu_nodes = [ray_node("10.0.0.1", 8, 1, role="draft"),
                 *[ray_node(f"10.0.1.{i}", 8, 2) for i in range(4)]]
    assert placement_problems(plan.processes, gpu_nodes) == []
    dead = [{**n, "Alive": False} for n in gpu_nodes]
    assert len(placement_problems(plan.processes, dead)) == 2


def test_a_deployment_larger_than_the_whole_cluster_is_refused_with_the_totals():
    from starhub.launch.ray_backend import placement_problems

    dep = load_config(CONFIGS / "local-cpu.toml", ["backend=ray", "hub.num_cpus=1",
                                                    "targets.num_cpus=1", "targets.count=4",
                                                    "hub.bind=tcp://127.0.0.1:0"])
    plan = build_plan(dep, "p.jsonl")
    assert placement_problems(plan.processes, [ray_node("10.0.0.1", 4)]) == [
        "the 5 processes run at once and together ask for 5 CPU: more CPU than the whole "
        "cluster has"]
    assert placement_problems(plan.processes, [ray_node("10.0.0.1", 4),
                                               ray_node("10.0.0.2", 1)]) == []


def test_ray_label_selectors_match_like_rays():
    from starhub.launch.ray_backend import label_matches

    labels = {"role": "draft", "zone": "b"}
    assert label_matches(labels, "role", "draft")
    assert not label_matches(labels, "role", "!draft")
    assert label_matches(labels, "zone", "in(a, b)")
    assert not label_matches(labels, "zone", "!in(a,b)")
    assert not label_matches(labels, "gpu", "a100") and label_matches(labels, "gpu", "!a100")


class FakeHandle:
    """A process that reports what the launcher does with it in ``events``."""

    def __init__(self, name: str, events: list, done) -> None:
        self.name, self.events, self.done, self.where = name, events, done, {}
        self.exited = False

    def tick(self, since: int) -> dict:
        code = 0 if self.done() else None
        if code == 0 and not self.exited:
            self.exited = True
            self.events.append(("exited", self.name))
        return {"lines": [], "next": 0, "code": code,
                "address": "tcp://127.0.0.1:1" if self.name == "hub" else None}

    def stop(self) -> None:
        self.events.append(("stop", self.name))

    def fetch_output(self, spec, out_dir: Path) -> None:
        self.events.append(("fetch", self.name))
        (out_dir / spec.out_name).write_text("")

    def close(self) -> None:
        self.events.append(("close", self.name))


class FakeBackend:
    """target0 finishes at once; target1 only after target0's output was fetched (or
    after many polls, when it never is)."""

    poll_s = 0.0

    def __init__(self, refuse: str = "") -> None:
        self.events: list = []
        self.refuse = refuse
        self.polls = 0

    def check(self, processes) -> None:
        from starhub.launch.runner import CannotPlace

        if self.refuse:
            raise CannotPlace(self.refuse)

    def _target1_done(self) -> bool:
        self.polls += 1
        return ("fetch", "target0") in self.events or self.polls > 200

    def start(self, spec, hub):
        done = {"hub": lambda: False, "target0": lambda: True,
                "target1": self._target1_done}[spec.name]
        self.events.append(("start", spec.name))
        return FakeHandle(spec.name, self.events, done)

    def close(self) -> None:
        self.events.append(("backend closed", ""))


def fake_launch(tmp_path: Path, backend: FakeBackend) -> tuple[int, str]:
    import io

    from starhub.launch.runner import Launcher

    dep = load_config(CONFIGS / "local-cpu.toml", ["status_interval_s=0"])
    stream = io.StringIO()
    code = Launcher(build_plan(dep, "p.jsonl"), backend, tmp_path, stream).run()
    return code, stream.getvalue()


def test_each_output_is_collected_and_its_host_released_as_soon_as_it_finishes(tmp_path):
    backend = FakeBackend()
    code, log = fake_launch(tmp_path, backend)
    assert code == 0, log
    events = backend.events
    assert events.index(("close", "target0")) < events.index(("exited", "target1"))
    assert events.index(("fetch", "target0")) < events.index(("close", "target0"))
    # a finished target is neither polled nor stopped again; the hub is stopped last
    assert ("stop", "target0") not in events and events.count(("close", "target0")) == 1
    assert events[-3:] == [("stop", "hub"), ("close", "hub"), ("backend closed", "")]
    assert (tmp_path / "target0.jsonl").exists() and "target0 done" in log


def test_a_plan_the_backend_cannot_place_starts_nothing_and_fails(tmp_path):
    backend = FakeBackend(refuse="no node has 1 GPU")
    code, log = fake_launch(tmp_path, backend)
    assert code == 1 and "no node has 1 GPU" in log
    assert backend.events == [("backend closed", "")]

# --- starhub status ----------------------------------------------------------------

def test_status_prints_a_row_per_target_from_stats(tiny_model, ngram_hub):
    from targets.generate import SpeculativeGenerator

    model, tok = tiny_model
    gen = SpeculativeGenerator(model, tok, ngram_hub.address, name="probe-target")
    gen.generate(tok("a b a b a b", add_special_tokens=False)["input_ids"], 8)
    out = starhub("status", ngram_hub.address, timeout=120)
    gen.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"hub {ngram_hub.address}: ngram drafter")
    row = next(line for line in out.stdout.splitlines() if line.startswith("probe-target"))
    assert int(row.split()[2]) > 0  # rounds


# --- the local backend, end to end --------------------------------------------------

def launch(tmp_path: Path, prompts: list[str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "starhub", "launch", "configs/local-cpu.toml", "--prompts",
         str(prompts_file(tmp_path, prompts)), "--out-dir", str(tmp_path / "out"), *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """A suite started in the background (``make test &``) ignores SIGINT, and so would
    the launch it starts; a user's Ctrl-C reaches a launch that does not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def started_pids(log: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"started (\w+) on .*, pid (\d+)", log)}


@pytest.mark.slow
def test_local_launch_serves_the_prompts_identically_to_generate(tmp_path):
    from tests.test_e2e_default_model import assert_identical_to_generate

    proc = launch(tmp_path, PROMPTS, "--set", f"targets.max_new_tokens={NEW}")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    assert "hub ready at tcp://127.0.0.1:" in log
    assert set(started_pids(log)) == {"hub", "target0", "target1"}
    assert "[target1] " in log and "all 2 done" in log
    rows = [json.loads(line) for i in range(2)
            for line in (tmp_path / "out" / f"target{i}.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(PROMPTS)))
    assert_identical_to_generate(rows, NEW)
    assert (tmp_path / "out" / "logs" / "hub.log").read_text().count("STARHUB READY") == 1
    assert not any(psutil.pid_exists(p) for p in started_pids(log).values())


@pytest.mark.slow
def test_sigint_mid_run_stops_every_process(tmp_path):
    long = ["Write a very long story about a dragon who learns to cook, in many chapters."] * 2
    proc = launch(tmp_path, long, "--set", "targets.max_new_tokens=2048")
    lines: list[str] = []
    decoding = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if re.match(r"\[target\d\] .* prompts?, .* weights", line):
                decoding.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert decoding.wait(300), "".join(lines)
    pids = started_pids("".join(lines))
    assert set(pids) == {"hub", "target0", "target1"}
    assert all(psutil.pid_exists(p) for p in pids.values())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 130
    reader.join(30)
    log = "".join(lines)
    assert "interrupted: stopping every process" in log
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [name for name, p in pids.items() if psutil.pid_exists(p)]
    assert not left, f"still running after SIGINT: {left}"
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(tmp_path) in " ".join(p.info["cmdline"] or [])]


def test_serve_config_plans_http_servers_on_consecutive_ports():
    from starhub.cli.main import build_parser

    dep = load_config(CONFIGS / "serve-cpu.toml")
    plan = build_plan(dep)  # serving targets need no prompts
    assert [p.role for p in plan.workers] == ["serve", "serve"] and plan.prompts is None
    assert [p.config["port"] for p in plan.workers] == [8000, 8001]
    parser = build_parser()
    check_commands(plan, parser)
    for spec in plan.processes:
        load(PROCESSES[spec.role], {}, environ=spec.environment(hub="tcp://10.0.0.1:5555"))
    with pytest.raises(ConfigError, match="targets.http_port"):
        build_plan(load_config(CONFIGS / "serve-cpu.toml", ["targets.http_port=65535"]))


def test_a_serving_launch_prints_each_url_serves_it_and_stops_on_sigint(tmp_path, tiny_dir):
    from openai import OpenAI

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "starhub", "launch", "configs/serve-cpu.toml", "--out-dir",
         str(tmp_path / "out"), "--set", f"targets.model={json.dumps(str(tiny_dir))}",
         "--set", "hub.drafter=ngram", "--set", "targets.http_port=0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint)
    lines: list[str] = []
    urls: dict[str, str] = {}
    both = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"\] (target\d) serving at (http://\S+)", line):
                urls[m[1]] = m[2]
                if len(urls) == 2:
                    both.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert both.wait(300), "".join(lines)
        for url in urls.values():
            api = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            reply = api.completions.create(model=tiny_dir.name, prompt="one two three",
                                           max_tokens=8, temperature=0)
            assert reply.usage.completion_tokens == 8
            status = subprocess.run([sys.executable, "-m", "starhub", "status", url],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0 and "(connected)" in status.stdout, status.stdout
        pids = started_pids("".join(lines))
        assert set(pids) == {"hub", "target0", "target1"}
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n, p in pids.items() if psutil.pid_exists(p)]


def test_the_summarys_tau_counts_rounds_not_prompts_that_ran_plain(tmp_path):
    from starhub.launch.runner import summary_line

    stats = [{"rounds": 4, "accept_len_hist": {"2": 2, "4": 2}, "wall_s": 1.0},
             {"rounds": 0, "accept_len_hist": {}, "wall_s": 1.0}]
    out = tmp_path / "t.jsonl"
    out.write_text("".join(json.dumps({"output_ids": [1, 2], "stats": s}) + "\n"
                           for s in stats))
    assert "mean accepted length 3.00" in summary_line("t", out)
