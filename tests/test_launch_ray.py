"""The Ray backend against a real Ray instance started on this machine: a hub and two
targets as actors, greedy output identical to generate(), and every actor and process gone
afterwards; a deployment the cluster cannot place refused at once."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray", reason="the Ray backend's test needs the ray package "
                                  "(pip install 'starhub[ray]')")

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["What is the capital of France?", "List three prime numbers.", "Name a color."]
NEW = 24
LIST_ACTORS = """
import json, ray
ray.init(address="{address}", log_to_driver=False, logging_level="ERROR")
from ray._private import state
print(json.dumps({{"named": ray.util.list_named_actors(all_namespaces=True),
                  "alive": [a["ActorID"] for a in state.actors().values()
                            if a["State"] != "DEAD"]}}))
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def stop_cluster(temp: str) -> None:
    """Stop the Ray instance whose session lives under ``temp``, and only that one (``ray
    stop`` would stop every Ray instance on the machine)."""
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    procs = {p.pid: p for p in psutil.process_iter(["cmdline"])
             if p.pid not in skip and temp in " ".join(p.info["cmdline"] or [])}
    for p in list(procs.values()):
        try:
            procs.update({c.pid: c for c in p.children(recursive=True) if c.pid not in skip})
        except psutil.NoSuchProcess:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture
def ray_head():
    """``ray start --head`` with free ports, stopped afterwards."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    if not Path(ray_cli).exists():
        ray_cli = shutil.which("ray") or ray_cli
    gcs, agent, agent_grpc, env_agent, metrics, node, obj = free_ports(7)
    temp = tempfile.mkdtemp(prefix="shray-", dir="/tmp")  # unix socket paths must be short
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    start = [ray_cli, "start", "--head", "--port", str(gcs),
             "--dashboard-agent-listen-port",
             str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
             "--runtime-env-agent-port", str(env_agent), "--metrics-export-port",
             str(metrics), "--node-manager-port", str(node), "--object-manager-port",
             str(obj), "--num-cpus", "4", "--include-dashboard=false",
             "--object-store-memory", "80000000", "--temp-dir", temp,
             "--disable-usage-stats"]
    try:
        out = subprocess.run(start, capture_output=True, text=True, env=env, timeout=180)
        assert out.returncode == 0, f"ray start failed:\n{out.stdout}\n{out.stderr}"
        yield f"127.0.0.1:{gcs}", env
    finally:
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


HUB = """
num_cpus = 1
insecure = true           # binds every interface of the node
"""


@pytest.mark.slow
@pytest.mark.parametrize("hubs", [2], ids=["pool"])
def test_ray_launch_is_lossless_and_leaves_no_actor_behind(ray_head, tmp_path, hubs):
    """A pool of two hubs ([[hubs]]), each an actor of its own that binds every interface
    of its node; the targets get both nodes' addresses. (One [hub] runs the same plan and
    runner code; the parameter keeps that case a one-word change. Each case costs about a
    minute of the suite.)"""
    from tests.test_e2e_default_model import assert_identical_to_generate

    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    server_tables = "[hub]" + HUB if hubs == 1 else ("[[hubs]]" + HUB) * hubs
    config = tmp_path / "ray.toml"
    config.write_text(f"""
backend = "ray"
name = "ray-test"
[ray]
address = "127.0.0.1:1"   # RAY_ADDRESS wins over this
{server_tables}
[targets]
count = 2
model = "default"
num_cpus = 1
max_new_tokens = {NEW}
""")
    out = subprocess.run([sys.executable, "-m", "starhub", "launch", str(config), "--prompts",
                          str(prompts), "--out-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**env, "RAY_ADDRESS": address})
    log = out.stderr
    assert out.returncode == 0, log
    assert f"attached to the Ray cluster at {address}" in log
    # each hub binds every interface; targets dial the IP of the node Ray put it on
    names = ["hub"] if hubs == 1 else [f"hub{i}" for i in range(hubs)]
    for name in names:
        assert re.search(rf"\[ *{name}\] .* listening on tcp://0\.0\.0\.0:\d+", log), log
    ready = re.search(r"(?:hub|pool of \d+ hubs) ready at (\S+)", log)
    assert ready and "0.0.0.0" not in ready[1], log
    addresses = ready[1].split(",")
    assert len(addresses) == hubs and all(
        re.fullmatch(r"tcp://\d+\.\d+\.\d+\.\d+:\d+", a) for a in addresses), log
    rows = [json.loads(line) for i in range(2)
            for line in (tmp_path / "out" / f"target{i}.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(PROMPTS)))
    assert_identical_to_generate(rows, NEW)
    assert {r["stats"]["hub"] for r in rows} <= set(addresses)

    pids = {m[1]: int(m[2]) for m in re.finditer(r"started (\w+) on .*, pid (\d+)", log)}
    assert set(pids) == {*names, "target0", "target1"}
    assert not [n for n, p in pids.items() if psutil.pid_exists(p)], "processes left behind"
    check = subprocess.run([sys.executable, "-c", LIST_ACTORS.format(address=address)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    actors = json.loads(check.stdout.strip().splitlines()[-1])
    assert actors == {"named": [], "alive": []}


def test_a_gpu_deployment_on_a_cpu_cluster_fails_at_once_naming_the_gpus(ray_head, tmp_path):
    """configs/ray-cluster.toml (a GPU per process, the hub on a labelled node) against a
    CPU-only head: refused before any actor is asked for, exit 1, nothing left behind."""
    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt": PROMPTS[0]}) + "\n")
    out = subprocess.run([sys.executable, "-m", "starhub", "launch", "configs/ray-cluster.toml",
                          "--prompts", str(prompts), "--out-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**env, "RAY_ADDRESS": address})
    log = out.stderr
    assert out.returncode == 1, log
    assert "this Ray cluster cannot place the deployment" in log
    assert "hub asks for 4 CPU, 1 GPU on a node labelled role=draft: no node has 1 GPU" in log
    assert "8 processes (target0 .. target7) each ask for 4 CPU, 1 GPU: no node has 1 GPU" \
        in log
    assert re.search(r"the cluster has 4 CPU, 0 GPU on 1 alive node", log), log
    assert " started " not in log
    check = subprocess.run([sys.executable, "-c", LIST_ACTORS.format(address=address)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout.strip().splitlines()[-1]) == {"named": [], "alive": []}


def test_ray_launch_of_serving_targets_prints_reachable_urls_and_stops_on_sigint(
        ray_head, tmp_path, tiny_dir):
    import signal
    import threading

    from openai import OpenAI

    address, env = ray_head
    config = tmp_path / "serve.toml"
    config.write_text(f"""
backend = "ray"
name = "ray-serve-test"
[hub]
drafter = "ngram"
num_cpus = 1
insecure = true
[targets]
serve = true
count = 1
model = "{tiny_dir}"
num_cpus = 1
""")
    proc = subprocess.Popen([sys.executable, "-m", "starhub", "launch", str(config),
                             "--out-dir", str(tmp_path / "out")], cwd=ROOT, text=True,
                            env={**env, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    serving = threading.Event()
    url: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"target0 serving at (http://\S+)", line):
                url.append(m[1])
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert serving.wait(300), "".join(lines)
        assert not url[0].startswith("http://0.0.0.0"), "the URL must name the node"
        api = OpenAI(base_url=url[0] + "/v1", api_key="unused", max_retries=0)
        reply = api.completions.create(model=tiny_dir.name, prompt="one two", max_tokens=6,
                                       temperature=0)
        assert reply.usage.completion_tokens == 6
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, "".join(lines)
    check = subprocess.run([sys.executable, "-c", LIST_ACTORS.format(address=address)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout.strip().splitlines()[-1]) == {"named": [], "alive": []}
