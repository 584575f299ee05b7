"""What ``spawn_hub``, ``spawn_serve`` and ``starhub demo`` start dies with them: a parent
killed outright (SIGKILL, no chance to clean up) leaves no hub, server or target running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
PARENT = """
import sys
from starhub.launch import spawn_hub
hub = spawn_hub(["--drafter", "ngram", "--depth", "4"])
print(hub.proc.pid, flush=True)
sys.stdin.read()  # until killed
"""
GONE_WITHIN_S = 60
"""Not a speed bound: how long a test waits before it calls a process left behind."""


def family(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def runs_a_target(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a target process; False for one that has already ended (the
    demo's baseline processes come and go before its targets start)."""
    try:
        return "target" in proc.cmdline()
    except psutil.Error:
        return False


def assert_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=GONE_WITHIN_S)
    for p in alive:  # the test fails, but leaves nothing running either
        p.kill()
    assert not alive, f"left running after their parent was killed: {alive}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_spawned_hub_dies_with_a_parent_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        hub = family(int(parent.stdout.readline()))
        assert all(p.is_running() for p in hub)
        parent.kill()
        parent.wait()
        assert_gone(hub)
    finally:
        parent.kill()
        parent.wait()


SERVE_PARENT = """
import sys
from starhub.launch.spawn import spawn_serve
server = spawn_serve(["--model", sys.argv[1]])
print(server.proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_spawned_server_dies_with_a_parent_killed_outright(tiny_dir):
    parent = subprocess.Popen([sys.executable, "-c", SERVE_PARENT, str(tiny_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        server = family(int(parent.stdout.readline()))
        parent.kill()
        parent.wait()
        assert_gone(server)
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_the_demos_hub_and_targets_die_with_a_demo_killed_outright(tmp_path):
    # one short prompt: the demo's generate() baseline, which runs before the hub and the
    # target start, is over in seconds; the test kills the demo once the target is up
    prompts = tmp_path / "one.jsonl"
    prompts.write_text('{"id": "p0", "prompt": "Write a haiku about the sea."}\n')
    demo = subprocess.Popen([sys.executable, "-m", "starhub", "demo", "--targets", "1",
                             "--prompts", str(prompts), "--max-new-tokens", "64",
                             "--drafter", "ngram"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        children: list[psutil.Process] = []
        while not any(runs_a_target(c) for c in children):
            assert demo.poll() is None and time.monotonic() < deadline, "no target started"
            time.sleep(0.2)
            children = psutil.Process(demo.pid).children(recursive=True)
        demo.kill()
        demo.wait()
        assert_gone(children)
    finally:
        demo.kill()
        demo.wait()
