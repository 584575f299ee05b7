"""Run a plan: start the server (or every hub of a pool), wait until it is ready, start
the workers with its address (the pool's addresses), stream every process's log with a
prefix, keep a status line, collect each worker's output as soon as it finishes (and
release its host), and stop everything when the batch is done, when a process fails, or on
Ctrl-C / SIGTERM. In a pool, a hub that exits is reported and the run goes on: its targets
carry on at the other hubs, or alone.

The supervision is the same for both backends; a backend only knows how to start one
process (``LocalBackend`` here, ``RayBackend`` in ``ray_backend``)."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

from starhub.client.round_stats import pooled_accept_len
from starhub.launch.host import ProcessHost
from starhub.launch.plan import Plan, ProcessSpec
from starhub.launch.spawn import thread_settings
from starhub.launch.status import StatusPoller, status_security
from starhub.wire.security import KEYSTORE_ENV, keystore_dir

log = logging.getLogger("starhub.launch")
TAIL_LINES = 25
ADDRESS_FILE = "address"
"""Written in the output folder while the servers run: their addresses, comma-separated, as
the workers were given them (``starhub status DEPLOYMENT.toml`` reads it)."""


class Handle(Protocol):
    name: str
    where: dict

    def tick(self, since: int) -> dict: ...
    def stop(self) -> int | None: ...
    def fetch_output(self, spec: ProcessSpec, out_dir: Path) -> None: ...
    def close(self) -> None: ...


class Backend(Protocol):
    poll_s: float

    def check(self, processes: list[ProcessSpec]) -> None:
        """Raise ``CannotPlace`` if the backend can never run these processes together."""

    def start(self, spec: ProcessSpec, hub: str | None) -> Handle: ...
    def close(self) -> None: ...


def process_env(spec: ProcessSpec) -> dict[str, str]:
    """What a launched process gets over its host's environment: its thread count, no
    progress bars (the launcher shows progress), its GPU pin if it has one, and the
    launcher's local keystore, so that a server and clients given no keys find each other
    (and the launcher's status line finds them) even where a Ray worker's environment
    would point elsewhere."""
    env = {**thread_settings(spec.threads), "TQDM_DISABLE": "1",
           KEYSTORE_ENV: str(keystore_dir())}
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
    return env


class LocalHandle:
    def __init__(self, host: ProcessHost, where: dict):
        self.host, self.name, self.where = host, host.name, where

    def tick(self, since: int) -> dict:
        return self.host.tick(since)

    def stop(self) -> int | None:
        return self.host.stop()

    def fetch_output(self, spec: ProcessSpec, out_dir: Path) -> None:
        """Local targets write straight into the output folder."""

    def close(self) -> None:
        self.host.cleanup()


class LocalBackend:
    """Subprocesses on this machine."""

    poll_s = 0.2

    def __init__(self, prompts: str | None, out_dir: Path):
        self.prompts = str(Path(prompts).resolve()) if prompts else None
        self.out_dir = out_dir

    def check(self, processes: list[ProcessSpec]) -> None:
        """This machine runs whatever it is given."""

    def start(self, spec: ProcessSpec, hub: str | None) -> LocalHandle:
        host = ProcessHost(spec.name)
        settings = spec.environment(hub=hub, prompts=self.prompts,
                                    out=str(self.out_dir.resolve() / spec.out_name))
        return LocalHandle(host, host.start(spec.command()[3:], {**process_env(spec),
                                                                  **settings}))

    def close(self) -> None:
        pass


class ProcessFailed(RuntimeError):
    pass


class CannotPlace(ProcessFailed):
    """The backend cannot give a process what it asks for (resources, labels)."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


class Launcher:
    def __init__(self, plan: Plan, backend: Backend, out_dir: Path, stream: TextIO = sys.stderr):
        self.plan, self.backend, self.out_dir, self.stream = plan, backend, out_dir, stream
        self.handles: dict[str, Handle] = {}
        self.cursor: dict[str, int] = {}
        self.tails: dict[str, collections.deque] = {}
        self.logs: dict[str, TextIO] = {}
        self.collected: set[str] = set()
        """Workers that finished: output fetched, host released, no longer polled."""
        self.width = max(len(p.name) for p in plan.processes)
        self.tty = stream.isatty()
        self.status = ""
        self._status_at = 0.0
        self.dep = plan.deployment
        self.kind = "hub" if self.dep.topology == "star" else "verifier"
        self.addresses: dict[str, str] = {}
        """Each server's address, as it announced it."""
        self.lost: set[str] = set()
        """Hubs of a pool that exited while the run went on."""
        self.urls: dict[str, str] = {}
        """Serving targets' addresses, as each announced it."""

    # --- output ----------------------------------------------------------------------
    def say(self, text: str) -> None:
        self._clear_status()
        print(f"[{'launch'.rjust(self.width)}] {text}", file=self.stream, flush=True)
        self._draw_status()

    def _clear_status(self) -> None:
        if self.tty and self.status:
            self.stream.write("\r\033[K")

    def _draw_status(self) -> None:
        if self.tty and self.status:
            self.stream.write(self.status)
            self.stream.flush()

    def _show_status(self, line: str) -> None:
        now = time.monotonic()
        if self.tty:
            self._clear_status()
            self.status = line
            self._draw_status()
        elif now - self._status_at >= max(self.dep.status_interval_s, 10.0):
            self._status_at = now
            print(f"[{'status'.rjust(self.width)}] {line}", file=self.stream, flush=True)

    def pump(self) -> dict[str, int | None]:
        """Print new lines of every process; return each one's exit code (None: running)."""
        codes: dict[str, int | None] = {}
        for name, handle in self.handles.items():
            if name in self.collected:
                codes[name] = 0
                continue
            try:
                state = handle.tick(self.cursor[name])
            except Exception as exc:  # e.g. the Ray actor or its node died
                raise ProcessFailed(f"{name}: lost its host: {exc}") from None
            self.cursor[name] = state["next"]
            if state["lines"]:
                self._clear_status()
                for line in state["lines"]:
                    print(f"[{name.rjust(self.width)}] {line}", file=self.stream)
                    self.logs[name].write(line + "\n")
                    self.tails[name].append(line)
                self.logs[name].flush()
                self.stream.flush()
                self._draw_status()
            codes[name] = state["code"]
            if not state.get("address"):
                continue
            if name in self.server_names:
                self.addresses[name] = state["address"]
            elif name not in self.urls:
                self.urls[name] = state["address"]
                self.say(f"{name} serving at {state['address']}")
        return codes

    # --- lifecycle -------------------------------------------------------------------
    def _start(self, spec: ProcessSpec, hub: str | None) -> Handle:
        handle = self.backend.start(spec, hub)
        self.handles[spec.name] = handle
        self.cursor[spec.name] = 0
        self.tails[spec.name] = collections.deque(maxlen=TAIL_LINES)
        self.logs[spec.name] = open(self.out_dir / "logs" / f"{spec.name}.log", "w")
        w = handle.where
        gpus = f", CUDA_VISIBLE_DEVICES={w['cuda_visible_devices']}" \
            if w.get("cuda_visible_devices") else ""
        self.say(f"started {spec.name} on {w.get('host')} ({w.get('ip')}), pid {w.get('pid')}"
                 f"{gpus}")
        return handle

    def _failed(self, name: str, code: int | None) -> ProcessFailed:
        tail = "\n".join(f"    {line}" for line in self.tails[name]) or "    (no output)"
        what = f"exited with code {code}" if code is not None else "did not become ready"
        return ProcessFailed(f"{name} {what}; its last lines:\n{tail}")

    @property
    def server_names(self) -> list[str]:
        return [spec.name for spec in self.plan.servers]

    def _wait_ready(self) -> str:
        """Every server's address once all are ready: comma-separated for a pool."""
        deadline = time.monotonic() + self.dep.ready_timeout_s
        while True:
            codes = self.pump()
            if len(self.addresses) == len(self.server_names):
                return ",".join(self.addresses[name] for name in self.server_names)
            for name in self.server_names:
                if codes[name] is not None:
                    raise self._failed(name, codes[name])
            if time.monotonic() > deadline:
                late = [n for n in self.server_names if n not in self.addresses]
                self.say(f"{', '.join(late)} not ready after {self.dep.ready_timeout_s:.0f}s "
                         f"(ready_timeout_s)")
                raise self._failed(late[0], None)
            time.sleep(self.backend.poll_s)

    def run(self) -> int:
        """0 when every worker finished, 1 when a process failed, 130 when interrupted."""
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        previous = signal.signal(signal.SIGTERM, _raise_stopped)
        poller, wrote = None, False
        try:
            self.backend.check(self.plan.processes)
            for spec in self.plan.servers:
                self._start(spec, None)
            address = self._wait_ready()
            (self.out_dir / ADDRESS_FILE).write_text(address + "\n")
            wrote = True
            self.say(f"{self.kind} ready at {address}" if len(self.server_names) == 1 else
                     f"pool of {len(self.server_names)} hubs ready at {address}")
            for spec in self.plan.workers:
                self._start(spec, address)
            if self.dep.status_interval_s:
                poller = StatusPoller(address, self.dep.status_interval_s,
                                      len(self.plan.workers), self.kind == "verifier",
                                      status_security(self.dep.server, self.dep.workers,
                                                      address)).start()
            if not self.plan.workers or self.serving:
                self.say(f"serving at {address} until Ctrl-C")
            self._supervise(poller)
            self._finish()
            return 0
        except ProcessFailed as exc:
            self.say(str(exc))
            return 1
        except KeyboardInterrupt:
            self.say("interrupted: stopping every process")
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
            if poller is not None:
                poller.stop()
            self._stop_all()
            if wrote:  # not another launch's, in the same folder
                (self.out_dir / ADDRESS_FILE).unlink(missing_ok=True)

    @property
    def serving(self) -> bool:
        """Whether the workers are servers, which run until stopped."""
        return any(p.serves for p in self.plan.workers)

    def _supervise(self, poller: StatusPoller | None) -> None:
        workers = [p.name for p in self.plan.workers]
        while True:
            codes = self.pump()
            for spec in self.plan.workers:
                code = codes[spec.name]
                if code not in (None, 0) or (spec.serves and code == 0):
                    raise self._failed(spec.name, code)
                if code == 0 and spec.name not in self.collected:
                    self._collect(spec)
            self._check_servers(codes)
            if workers and not self.serving and all(codes[n] == 0 for n in workers):
                return
            if poller is not None and poller.line:
                if self.serving:
                    tail = f"serving {len(self.urls)}/{len(workers)}"
                else:
                    tail = f"done {sum(codes[n] == 0 for n in workers)}/{len(workers)}"
                self._show_status(f"{poller.line} | {tail}")
            time.sleep(self.backend.poll_s)

    def _check_servers(self, codes: dict[str, int | None]) -> None:
        """A lone server that exits ends the run; a hub of a pool is reported once, and its
        targets go on at the other hubs (or alone, the last one gone)."""
        for name in self.server_names:
            if codes[name] is None or name in self.lost:
                continue
            if len(self.server_names) == 1:
                raise self._failed(name, codes[name])
            self.lost.add(name)
            left = len(self.server_names) - len(self.lost)
            self.say(f"{name} exited with code {codes[name]}; its targets go on at the "
                     f"{left} other hub{'s' if left != 1 else ''} of the pool"
                     if left else f"{name} exited with code {codes[name]}; no hub of the "
                     f"pool is left, so the targets decode alone")

    def _collect(self, spec: ProcessSpec) -> None:
        """A worker finished: its output goes to the output folder now, and its host (a Ray
        actor and the resources it holds) is released."""
        handle = self.handles[spec.name]
        try:
            handle.fetch_output(spec, self.out_dir)
        except Exception as exc:
            raise ProcessFailed(f"{spec.name}: finished, but its output could not be "
                                f"fetched: {exc}") from None
        self.collected.add(spec.name)
        with contextlib.suppress(Exception):
            handle.close()
        self.say(f"{spec.name} done: {self.out_dir / spec.out_name}")

    def _finish(self) -> None:
        self._clear_status()
        self.status = ""
        self.say(f"all {len(self.plan.workers)} done; outputs in {self.out_dir}")
        for spec in self.plan.workers:
            print(summary_line(spec.name, self.out_dir / spec.out_name), flush=True)

    def _stop_all(self) -> None:
        """Workers first, then the server; then the backend's own resources."""
        self._clear_status()
        self.status = ""
        running = {n: h for n, h in self.handles.items() if n not in self.collected}
        for handle in reversed(list(running.values())):
            with contextlib.suppress(Exception):
                handle.stop()
        with contextlib.suppress(Exception):
            self.pump()
        for handle in running.values():
            with contextlib.suppress(Exception):
                handle.close()
        for log_file in self.logs.values():
            log_file.close()
        self.backend.close()


def _raise_stopped(signum, frame) -> None:
    raise Stopped()


def summary_line(name: str, path: Path) -> str:
    rows = []
    if path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = [r for r in rows if "output_ids" in r]
    tokens = sum(len(r["output_ids"]) for r in done)
    wall = sum(r["stats"]["wall_s"] for r in done)
    tau = pooled_accept_len(r["stats"] for r in done)
    failed = f", {len(rows) - len(done)} failed" if len(rows) > len(done) else ""
    return (f"{name}: {len(done)} prompts{failed}, {tokens} tokens, "
            f"{tokens / wall if wall else 0.0:.1f} tok/s, mean accepted length {tau:.2f} "
            f"-> {path}")
