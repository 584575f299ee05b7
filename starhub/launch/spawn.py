"""Start hubs and targets as real processes on loopback, for the CLI, benchmark and tests.
Each one dies with the process that started it (``die_with_parent``), so a parent killed
outright leaves no hub running."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

READY = "STARHUB READY "

try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None
PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when the process
    that starts it dies, even by SIGKILL, and so stops as it would on Ctrl-C. None where
    the system has no such call (not Linux): there a child outlives a parent killed
    outright. libc is loaded before the fork: the child only makes the call.

    Linux ties the signal to the thread that forks: start children from a thread that
    lives as long as they should."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


@dataclass
class HubProcess:
    proc: subprocess.Popen
    address: str

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> HubProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def child_env(threads: int) -> dict[str, str]:
    """Thread settings for a hub or target process that shares cores with its peers.

    libgomp's own spin count is kept. A shorter one (30,000) made idle threads sleep inside
    a forward pass: with prepacked linears a 2-thread target verified about 15% slower
    through the hub than the same verification in the benchmark's own process.
    """
    return {**os.environ, **thread_settings(threads)}


def thread_settings(threads: int) -> dict[str, str]:
    """The variables ``child_env`` sets over the parent's environment."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def spawn_hub(args: list[str], threads: int = 1, timeout_s: float = 180.0,
              log_file=None, pre_args: list[str] | None = None) -> HubProcess:
    """Run ``starhub hub ARGS`` on an ephemeral port and wait until it serves."""
    cmd = [sys.executable, "-m", "starhub", *(pre_args or []), "hub", "--bind", "tcp://127.0.0.1:0",
           "--threads", str(threads), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                            env=child_env(threads), preexec_fn=die_with_parent())
    return HubProcess(proc, wait_ready(proc, "hub", timeout_s))


@dataclass
class ServeProcess(HubProcess):
    """A ``starhub serve`` process; ``address`` is its base URL (http://HOST:PORT)."""

    @property
    def url(self) -> str:
        return self.address


def spawn_serve(args: list[str], threads: int = 1, timeout_s: float = 180.0,
                log_file=None) -> ServeProcess:
    """Run ``starhub serve ARGS`` on an ephemeral loopback port and wait until it answers."""
    return spawn_servers([args], threads, timeout_s, log_file)[0]


def spawn_servers(many: list[list[str]], threads: int = 1, timeout_s: float = 180.0,
                  log_file=None) -> list[ServeProcess]:
    """``spawn_serve`` for each argument list, all started at once (they load their models
    side by side) from this thread, which they die with; if one fails, all are stopped."""
    procs = [subprocess.Popen([sys.executable, "-m", "starhub", "serve", "--host", "127.0.0.1",
                               "--port", "0", "--threads", str(threads), *args],
                              stdout=subprocess.PIPE, stderr=log_file, text=True,
                              env=child_env(threads), preexec_fn=die_with_parent())
             for args in many]
    try:
        return [ServeProcess(proc, wait_ready(proc, "serve", timeout_s)) for proc in procs]
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise


def wait_ready(proc: subprocess.Popen, what: str, timeout_s: float,
               prefixes: tuple[str, ...] = (READY,), drain: bool = True) -> str:
    """Wait for ``proc``'s first stdout line that starts with one of ``prefixes``; return
    the rest of it. ``drain`` keeps reading (and dropping) its stdout afterwards, so the
    child never blocks on a full pipe; without it the caller reads the rest. A child that
    exits first raises RuntimeError; one still silent after ``timeout_s`` is killed and
    raises TimeoutError."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if not found and (prefix := next(filter(line.startswith, prefixes), None)):
                found.append(line[len(prefix):].strip())
                if not drain:
                    return

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not found:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was "
                               f"ready: {' '.join(proc.args)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{what} did not start within {timeout_s:.0f}s")
        time.sleep(0.05)
    return found[0]


def target_command(hub: str, prompts: str, out: str, threads: int = 1,
                   extra: list[str] | None = None,
                   pre_args: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "starhub", *(pre_args or []), "target", "--hub", hub,
            "--prompts", prompts, "--out", out, "--threads", str(threads), *(extra or [])]
