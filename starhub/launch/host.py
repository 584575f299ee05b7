"""One process of a deployment, owned by whoever runs it: the launcher itself (local
backend) or a Ray actor on some node (the Ray backend wraps this very class).

It starts ``python -m starhub ...`` in a fresh session, keeps the lines it prints, notices
``STARHUB READY <address>``, and stops the whole process group. Every method returns at
once, so one actor thread can serve them all and the launcher polls.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from starhub.launch.spawn import READY, die_with_parent

WORKDIR = "{workdir}"
"""In arguments: this host's scratch folder (prompts shipped in, outputs fetched back)."""
WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")
KEEP_LINES = 5000
DRAIN_S = 2.0
"""Once the process has exited: how long ``tick`` waits for the last of its output."""


def node_ip() -> str:
    """This machine's address as other nodes see it: Ray's view where Ray runs us."""
    if "ray" in sys.modules:
        with contextlib.suppress(Exception):
            import ray

            node = ray.get_runtime_context().get_node_id()
            return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    return "127.0.0.1"


def advertise(address: str, host: str) -> str:
    """``tcp://0.0.0.0:PORT`` is where a server listens; peers must dial ``host``."""
    scheme, sep, rest = address.partition("://")
    where, _, port = rest.rpartition(":")
    if sep and where in WILDCARD_HOSTS:
        return f"{scheme}://{host}:{port}"
    return address


class ProcessHost:
    def __init__(self, name: str, advertise_host: str | None = "127.0.0.1"):
        self.name = name
        self.advertise_host = advertise_host
        self.proc: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix=f"starhub-{name}-")
        self.lines: list[str] = []
        self.dropped = 0
        self.address: str | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def put_file(self, name: str, text: str) -> str:
        """Write a file into this host's scratch folder (prompts shipped from the launcher)."""
        path = Path(self.workdir) / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    def start(self, args: list[str], env: dict[str, str]) -> dict:
        """Run ``python -m starhub ARGS`` with ``env`` over this host's environment
        (``{workdir}`` in either stands for this host's folder)."""
        full_env = {**os.environ, **{k: v.replace(WORKDIR, self.workdir)
                                      for k, v in env.items()}}
        argv = [sys.executable, "-m", "starhub",
                *[a.replace(WORKDIR, self.workdir) for a in args]]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, errors="replace",
                                     env=full_env, start_new_session=True,
                                     preexec_fn=die_with_parent())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self.where()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            with self._lock:
                if line.startswith(READY) and self.address is None:
                    found = line[len(READY):].strip()
                    host = self.advertise_host or node_ip()
                    self.address = advertise(found, host)
                self.lines.append(line)
                if len(self.lines) > KEEP_LINES:
                    cut = len(self.lines) - KEEP_LINES
                    del self.lines[:cut]
                    self.dropped += cut

    def where(self) -> dict:
        return {"host": socket.gethostname(), "ip": self.advertise_host or node_ip(),
                "pid": self.proc.pid if self.proc else None,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def ready(self) -> str | None:
        """The address the server announced, once it has (None until then)."""
        return self.address

    def read_log(self, since: int) -> tuple[list[str], int]:
        """Lines from number ``since`` on, and the number to ask from next time."""
        with self._lock:
            start = max(since - self.dropped, 0)
            return self.lines[start:], self.dropped + len(self.lines)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def read_file(self, name: str) -> str | None:
        path = Path(self.workdir) / name
        return path.read_text(encoding="utf-8") if path.exists() else None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                proc.wait()
        return None if proc is None else proc.returncode

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def tick(self, since: int) -> dict:
        """One poll for the launcher: new log lines, the exit code, the announced address.
        With the exit code come the process's last lines: the reader is given ``DRAIN_S`` to
        reach the end of its output (once; a grandchild that holds the pipe open does not
        hold up the code)."""
        code = self.poll()
        if code is not None and self._reader is not None:
            self._reader.join(DRAIN_S)
            self._reader = None
        lines, upto = self.read_log(since)
        return {"lines": lines, "next": upto, "code": code, "address": self.address}
