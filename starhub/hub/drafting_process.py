"""A drafter in a process of its own, so that drafting never waits on the hub's event loop.

In one process, every COMMIT the event loop decodes and every PROPOSE it encodes holds the
interpreter lock that the drafting thread needs between two tensor operations, so a busy
loop keeps drafting off the CPU (``docs/benchmarks.md`` has the runs that measured it).
Here the drafter runs in a child (``python -m
starhub.hub.drafting_child``) and the hub holds a ``RemoteDrafter``:
the same ``Drafter`` interface, each call a message on a ZeroMQ PAIR socket over a
private ipc:// path. The child keeps the sessions' drafting state; every job carries the
tokens and feature rows its session gained since the one before, and a session the hub
lets go of is forgotten there too. The messages (``starhub.hub.drafting_messages``) are
typed as on the wire, a msgpack header and raw array frames: nothing is pickled.

All of ``RemoteDrafter``'s socket work happens on the hub's one drafting thread; the
event loop only calls ``wake`` (a byte down a pipe) when it hands a running batch more
jobs.

The hub watches its child (``Watch``): a thread of the child beats on a socket of its own
whatever its drafting does, so a child that was stopped or froze is found within seconds
even in the middle of a long draft, and each call has a deadline derived from the longest
wait a call has needed so far. A child that exited, stopped beating or missed a call's
deadline raises ``DrafterLost``; ``restart`` kills what is left of it and starts a fresh
one, which holds no sessions.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from starhub.drafters.base import DraftContext, Drafter, DrafterLost, TargetNeeds, TreeShape
from starhub.hub.drafting_messages import (
    BEAT_DECODER,
    HUB_DECODER,
    LINK_LIMITS,
    Done,
    Draft,
    End,
    Failed,
    Jobs,
    More,
    Predraft,
    Predrafted,
    Quit,
    Ready,
    SessionJob,
    Stop,
    ToChild,
    owned,
)
from starhub.settings.processes import DRAFTER_KEYS, HubSettings
from starhub.wire.codec import encode
from starhub.wire.messages import Framed, ProtocolError
from starhub.wire.tree import DraftTree

log = logging.getLogger("starhub.hub")

Job = tuple[DraftContext, TreeShape]
WAKE = object()
POLL_MS = 1000
"""How often a waiting side looks whether the other one is still alive."""
PREDRAFT_POLL_MS = 1
"""While pre-drafting, how often the hub looks whether a real request arrived."""
BEAT_S = 0.2
"""How often the child's beating thread says it is alive."""
HANG_FLOOR_S = 2.0
"""Without a sign of life for this long (or ``WATCH_FACTOR`` times the longest gap between
two of its beats, if longer) the child counts as hung: stopped, or frozen as a whole. The
beats come from a thread that needs the interpreter only for a moment, so ten missed ones
mean the process no longer runs; a child whose beats came late (a loaded machine) is
given ten times its longest gap."""
CALL_FLOOR_S = 60.0
"""A call the child has not answered for this long (or ``WATCH_FACTOR`` times the longest
wait a call has needed, if longer) counts as stuck though the child still beats. Generous:
a session's first job carries its whole prompt."""
WATCH_FACTOR = 10.0
CHECK_EVERY_S = 0.1
"""How often a waiting call looks at the child's process and beats (at most)."""


class Watch:
    """Tells a slow drafting process from a dead or hung one, from what it sends. Times are
    ``time.monotonic()``, which the child's beats also carry (one machine, one clock)."""

    def __init__(self, now: float, longest_gap: float = BEAT_S, longest_wait: float = 0.0):
        self.alive_at = now
        """The newest sign of life: a beat, or any message."""
        self.longest_gap = longest_gap
        """The longest gap between two beats the child has reported."""
        self.longest_wait = longest_wait
        """The longest a call has waited for the child's next message and got it."""
        self.waiting_since: float | None = None
        """In a call: since when it waits for the child's next message."""

    def beat(self, at: float, gap: float) -> None:
        self.alive_at = max(self.alive_at, at)
        self.longest_gap = max(self.longest_gap, gap)

    def heard(self, now: float) -> None:
        """A message from the child."""
        self.alive_at = max(self.alive_at, now)
        if self.waiting_since is not None:
            self.longest_wait = max(self.longest_wait, now - self.waiting_since)
            self.waiting_since = now

    def call(self, now: float | None) -> None:
        """A call begins (``now``) or ends (None)."""
        self.waiting_since = now

    @property
    def hang_s(self) -> float:
        return max(HANG_FLOOR_S, WATCH_FACTOR * self.longest_gap)

    @property
    def call_s(self) -> float:
        return max(CALL_FLOOR_S, WATCH_FACTOR * self.longest_wait)

    def verdict(self, now: float) -> str | None:
        """Why the child counts as lost at ``now``, or None."""
        if now - self.alive_at > self.hang_s:
            return f"stopped answering: no sign of life for {now - self.alive_at:.1f}s"
        if self.waiting_since is not None and now - self.waiting_since > self.call_s:
            return (f"did not answer a drafting call for {now - self.waiting_since:.1f}s, "
                    f"though it still beats")
        return None


def exit_reason(code: int) -> str:
    """How a process ended, from its ``returncode``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} (its log is above)"


# -- the hub's side --------------------------------------------------------------------------

@dataclass
class Mirror:
    """A session's handle on the child's copy of it, kept in the hub's ``ctx.state``."""

    sid: int
    start: int
    """Which of the drafter's child processes holds it (``RemoteDrafter.starts``)."""
    synced: int = 0
    """Tokens the child has been sent."""
    probe: bool = False


class RemoteDrafter(Drafter):
    """A drafter in a child process (see the module docstring): the one ``settings`` (the
    hub's) pick, with ``threads`` torch threads, logging at ``log_level``."""

    supervised = True

    def __init__(self, settings: HubSettings, threads: int = 1, log_level: str = "info",
                 start_timeout_s: float = 600.0):
        self._argv = ["--threads", str(threads), "--log-level", str(log_level), "--settings",
                      settings.model_dump_json(include=set(DRAFTER_KEYS))]
        self._start_timeout_s = start_timeout_s
        self._dir = tempfile.mkdtemp(prefix="starhub-draft-")
        os.chmod(self._dir, 0o700)
        self._zmq = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ids = itertools.count(1)
        self._forgotten: collections.deque[int] = collections.deque()
        self._batch = 0
        self._busy = threading.Lock()
        """Held while a call talks to the child, so that ``close`` never pulls the link
        from under one (a hub that stops mid-batch closes from another thread)."""
        self._spawning = threading.Lock()
        """Orders a (re)start's spawn against ``close``: no child is started once closed."""
        self._closed = False
        self._link: zmq.Socket | None = None
        self._beats: zmq.Socket | None = None
        self._proc: subprocess.Popen | None = None
        self._checked_at = 0.0
        self.starts = 0
        """Child processes started so far."""
        self.watch = Watch(time.monotonic())
        try:
            self._start()
        except BaseException:
            self.close()  # no child, socket or folder outlives a failed start
            raise
        log.info("drafting in process %d (%s drafter)", self.pid, self.name)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    @property
    def predrafts(self) -> bool:
        return self._predrafts

    def needs(self) -> TargetNeeds:
        return self._needs

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (a full pipe), or closed

    def probe_context(self) -> DraftContext:
        ctx = DraftContext(tokens=[])
        self._mirror(ctx, probe=True)
        return ctx

    def propose(self, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        result = self.propose_batch([(ctx, shape)])[0]
        if isinstance(result, Exception):
            raise result
        if result is None:
            raise RuntimeError("the drafting process skipped a job")
        return result

    def propose_batch(self, jobs: list[Job], admit: Callable[[], list[Job]] | None = None,
                      finished: Callable[[int, DraftTree | Exception, float, float], None]
                      | None = None) -> list[DraftTree | Exception]:
        """Draft in the child. Jobs ``admit()`` hands over go to it at once; those it
        took no more when its batch ended are left out of the result (their sessions are
        in step in the child all the same, and the hub drafts them next)."""
        with self._busy:
            self._check_open()
            self.watch.call(time.monotonic())
            try:
                return self._propose_batch(jobs, admit, finished)
            finally:
                self.watch.call(None)

    def _propose_batch(self, jobs: list[Job], admit: Callable[[], list[Job]] | None,
                       finished: Callable[[int, DraftTree | Exception, float, float], None]
                       | None) -> list[DraftTree | Exception]:
        self._batch += 1
        results: list[DraftTree | Exception | None] = [None] * len(jobs)
        self._send(self._jobs(Draft(batch=self._batch, admit=admit is not None), jobs))
        while True:
            msg = self._recv(wake=admit is not None)
            if msg is WAKE:
                more = admit() if admit is not None else []
                if more:
                    results.extend([None] * len(more))
                    self._send(self._jobs(More(batch=self._batch), more))
                continue
            if isinstance(msg, Done):
                result = (RuntimeError(msg.error) if msg.error or msg.tree is None
                          else owned(msg.tree))
                results[msg.k] = result
                if finished is not None:
                    finished(msg.k, result, msg.seconds, msg.shared)
            elif isinstance(msg, End):
                if msg.error:
                    raise RuntimeError(f"the drafting process failed a batch: {msg.error}")
                return results[:msg.admitted]  # type: ignore[return-value]

    def predraft(self, ctx: DraftContext, tree: DraftTree, shape: TreeShape,
                 stop: Callable[[], bool]) -> dict[tuple[int, ...], DraftTree]:
        with self._busy:
            self._check_open()
            self.watch.call(time.monotonic())
            try:
                return self._predraft(ctx, tree, shape, stop)
            finally:
                self.watch.call(None)

    def _predraft(self, ctx: DraftContext, tree: DraftTree, shape: TreeShape,
                  stop: Callable[[], bool]) -> dict[tuple[int, ...], DraftTree]:
        self._send(self._jobs(Predraft(tree=tree), [(ctx, shape)]))
        stopping = False
        while True:
            msg = self._recv(PREDRAFT_POLL_MS / 1e3, quiet=True)
            if msg is None:
                if not stopping and stop():
                    self._send(Stop())
                    stopping = True
                continue
            if isinstance(msg, Predrafted):
                if msg.error:
                    raise RuntimeError(msg.error)
                return {tuple(key): owned(tree) for key, tree in msg.trees}

    def check(self) -> None:
        """``DrafterLost`` if the child exited or stopped beating (between calls)."""
        with self._busy:
            self._check_open()
            self._checked_at = 0.0
            self._check_alive()

    def restart(self) -> None:
        """Kill what is left of a lost child and start a fresh one. It holds no sessions:
        the hub lets go of every session first (a session from before the restart is
        refused). A start that fails raises, and leaves no child behind."""
        with self._busy:
            self._check_open()
            self._stop_child()
            self._drain_wake()
            self._start()
        log.info("drafting in process %d again (start %d)", self.pid, self.starts)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child and let go of the link. A call still running on another thread
        (a hub stopped mid-batch) ends with an error once the child is gone; the link is
        then left open rather than closed under it, and a later ``close`` closes it."""
        with self._spawning:
            self._closed = True
        idle = self._busy.acquire(timeout=0.1)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                if idle and self._link is not None:
                    self._send(Quit())
                else:
                    proc.terminate()
                proc.wait(timeout_s)
            except (zmq.ZMQError, RuntimeError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if not idle:
            idle = self._busy.acquire(timeout=2 * POLL_MS / 1e3)
        if idle:
            if not self._zmq.closed:
                self._close_sockets()
                self._zmq.term()
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            self._busy.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _start(self) -> None:
        """Start child number ``starts + 1`` on links of its own and take on what it says
        of itself."""
        self.starts += 1
        link, beats = (f"ipc://{self._dir}/{kind}{self.starts}" for kind in ("link", "beat"))
        self._link = self._zmq.socket(zmq.PAIR)
        self._link.setsockopt(zmq.LINGER, 0)
        self._link.bind(link)
        self._beats = self._zmq.socket(zmq.PULL)
        self._beats.setsockopt(zmq.CONFLATE, 1)  # only the newest beat matters
        self._beats.setsockopt(zmq.LINGER, 0)
        self._beats.bind(beats)
        with self._spawning:
            if self._closed:
                raise RuntimeError("the drafting process has been stopped")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "starhub.hub.drafting_child", "--link", link,
                 "--beats", beats, *self._argv])
        try:
            ready = self._recv(self._start_timeout_s, starting=True)
            if not isinstance(ready, Ready):
                raise RuntimeError(f"the drafting process began with {type(ready).__name__}")
        except BaseException:
            self._stop_child()
            raise
        self.watch = Watch(time.monotonic(), self.watch.longest_gap, self.watch.longest_wait)
        self.name = ready.name
        self.label = ready.label
        self.weights = ready.weights
        self.feature_layers = ready.feature_layers
        self.feature_size = ready.feature_size
        self.lookup_branches = ready.lookup_branches
        self.calibrated = ready.calibrated
        self.batches = ready.batches
        self._predrafts = ready.predrafts
        self._needs: TargetNeeds = ready.needs

    def _stop_child(self) -> None:
        """Kill the child if it still runs (a hung one, stopped or not) and close its links."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._link, self._beats):
            if sock is not None and not sock.closed:
                sock.close(0)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _mirror(self, ctx: DraftContext, probe: bool = False) -> Mirror:
        """The session's handle; the child forgets the session once the hub drops it."""
        if ctx.state is None:
            ctx.state = Mirror(next(self._ids), self.starts, probe=probe)
            weakref.finalize(ctx, self._forgotten.append, ctx.state.sid)
        elif ctx.state.start != self.starts:
            raise RuntimeError("this session was drafted by a drafting process that has "
                               "since been restarted")
        return ctx.state

    def _jobs(self, msg: Jobs, jobs: list[Job]) -> Jobs:
        """``msg`` with each job and what its session gained since the child last heard of
        it. Feature rows are taken before tokens: a COMMIT the event loop is adding
        meanwhile then shows up as tokens first, which the child's catch-up tolerates when
        pre-drafting (the only time a session is not busy while sent)."""
        for ctx, shape in jobs:
            mirror = self._mirror(ctx)
            take = len(ctx.features)
            features = ctx.features[:take]
            del ctx.features[:take]
            end = len(ctx.tokens)
            msg.jobs.append(SessionJob(
                sid=mirror.sid, tokens=np.asarray(ctx.tokens[mirror.synced:end], np.int64),
                features=len(features), shape=shape, temperature=ctx.temperature,
                seed=ctx.seed, probe=mirror.probe))
            mirror.synced = end
            msg.features.extend(features)
        return msg

    def _send(self, msg: ToChild) -> None:
        while self._forgotten:
            msg.forget.append(self._forgotten.popleft())
        frames = encode(msg)
        while not self._link.poll(POLL_MS, zmq.POLLOUT):  # a PAIR without its peer blocks
            self._check_alive()
        self._link.send_multipart(frames, copy=False)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the drafting process has been stopped")

    def _check_alive(self, starting: bool = False) -> None:
        """Raise if the child exited; once it has started, ``DrafterLost`` also when it
        stopped beating or missed a call's deadline (``Watch``)."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY_S:
            return
        self._checked_at = now
        code = self._proc.poll()
        if code is not None:
            if starting:
                raise RuntimeError(f"the drafting process exited with code {code} before it "
                                   f"was ready (its log is above)")
            raise DrafterLost(f"the drafting process (pid {self._proc.pid}) "
                              f"{exit_reason(code)}")
        if starting:
            return
        while True:
            try:
                frames = self._beats.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                beat = BEAT_DECODER.decode(frames, LINK_LIMITS)
            except ProtocolError:
                continue
            self.watch.beat(beat.at, beat.gap)
        verdict = self.watch.verdict(time.monotonic())
        if verdict is not None:
            raise DrafterLost(f"the drafting process (pid {self._proc.pid}) {verdict}")

    def _recv(self, timeout_s: float | None = None, wake: bool = False, quiet: bool = False,
              starting: bool = False) -> Framed | object | None:
        """The child's next message; WAKE when ``wake`` and the event loop handed work
        over; None after ``timeout_s`` when ``quiet``. A child that exits or hangs raises
        (``_check_alive``)."""
        poller = zmq.Poller()
        poller.register(self._link, zmq.POLLIN)
        if wake:
            poller.register(self._wake_r, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = POLL_MS if deadline is None else max(0, deadline - time.monotonic()) * 1e3
            ready = dict(poller.poll(min(wait, POLL_MS)))
            if self._link in ready:
                msg = HUB_DECODER.decode(self._link.recv_multipart(copy=False), LINK_LIMITS)
                self.watch.heard(time.monotonic())
                if isinstance(msg, Failed):
                    raise RuntimeError(f"the drafting process failed: {msg.error}")
                return msg
            if wake and self._wake_r in ready:
                self._drain_wake()
                return WAKE
            self._check_alive(starting)
            if deadline is not None and time.monotonic() >= deadline:
                if quiet:
                    return None
                raise TimeoutError(f"the drafting process did not answer in {timeout_s:g}s")
