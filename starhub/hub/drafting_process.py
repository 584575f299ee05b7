"""A drafter in a process of its own, so that drafting never waits on the hub's event loop.

In one process, every COMMIT the event loop decodes and every PROPOSE it encodes holds the
interpreter lock that the drafting thread needs between two tensor operations: at eight
busy targets the loop's 0.5 ms of Python a round kept the drafting thread off the CPU for
a tenth of its time, and batched drafting made about a fifth fewer rounds than it does in a
process of its own. Here the drafter runs in a child (``python -m
starhub.hub.drafting_child``) and the hub holds a ``RemoteDrafter``:
the same ``Drafter`` interface, each call a message on a ZeroMQ PAIR socket over a
private ipc:// path. The child keeps the sessions' drafting state; every job carries the
tokens and feature rows its session gained since the one before, and a session the hub
lets go of is forgotten there too. The messages (``starhub.hub.drafting_messages``) are
typed as on the wire, a msgpack header and raw array frames: nothing is pickled.

All of ``RemoteDrafter``'s socket work happens on the hub's one drafting thread; the
event loop only calls ``wake`` (a byte down a pipe) when it hands a running batch more
jobs.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
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

from starhub.drafters.base import DraftContext, Drafter, TargetNeeds, TreeShape
from starhub.hub.drafting_messages import (
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
from starhub.wire.codec import encode
from starhub.wire.messages import Framed
from starhub.wire.tree import DraftTree

log = logging.getLogger("starhub.hub")

Job = tuple[DraftContext, TreeShape]
WAKE = object()
POLL_MS = 1000
"""How often a waiting side looks whether the other one is still alive."""
PREDRAFT_POLL_MS = 1
"""While pre-drafting, how often the hub looks whether a real request arrived."""


# -- the hub's side --------------------------------------------------------------------------

@dataclass
class Mirror:
    """A session's handle on the child's copy of it, kept in the hub's ``ctx.state``."""

    sid: int
    synced: int = 0
    """Tokens the child has been sent."""
    probe: bool = False


class RemoteDrafter(Drafter):
    """A drafter in a child process (see the module docstring). ``argv`` says which one, as
    ``python -m starhub.hub.drafting_child --help`` explains; ``threads`` are its torch
    threads."""

    def __init__(self, argv: list[str], threads: int = 1, start_timeout_s: float = 600.0):
        self._dir = tempfile.mkdtemp(prefix="starhub-draft-")
        os.chmod(self._dir, 0o700)
        self._zmq = zmq.Context()
        self._link = self._zmq.socket(zmq.PAIR)
        self._link.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{self._dir}/link"
        self._link.bind(endpoint)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ids = itertools.count(1)
        self._forgotten: collections.deque[int] = collections.deque()
        self._batch = 0
        self._busy = threading.Lock()
        """Held while a call talks to the child, so that ``close`` never pulls the link
        from under one (a hub that stops mid-batch closes from another thread)."""
        self._closed = False
        self._proc = subprocess.Popen([sys.executable, "-m", "starhub.hub.drafting_child",
                                       "--link", endpoint, "--threads", str(threads), *argv])
        try:
            ready = self._recv(start_timeout_s, starting=True)
        except BaseException:
            self.close()  # no child, socket or folder outlives a failed start
            raise
        if not isinstance(ready, Ready):
            self.close()
            raise RuntimeError(f"the drafting process began with {type(ready).__name__}")
        self.name = ready.name
        self.label = ready.label
        self.dtype = ready.dtype
        self.feature_layers = ready.feature_layers
        self.feature_size = ready.feature_size
        self.lookup_branches = ready.lookup_branches
        self.batches = ready.batches
        self._predrafts = ready.predrafts
        self._needs: TargetNeeds = ready.needs
        log.info("drafting in process %d (%s drafter)", self._proc.pid, self.name)

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
            return self._propose_batch(jobs, admit, finished)

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
            return self._predraft(ctx, tree, shape, stop)

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

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child and let go of the link. A call still running on another thread
        (a hub stopped mid-batch) ends with an error once the child is gone; the link is
        then left open rather than closed under it, and a later ``close`` closes it."""
        self._closed = True
        idle = self._busy.acquire(timeout=0.1)
        if self._proc.poll() is None:
            try:
                if idle:
                    self._send(Quit())
                else:
                    self._proc.terminate()
                self._proc.wait(timeout_s)
            except (zmq.ZMQError, RuntimeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if not idle:
            idle = self._busy.acquire(timeout=2 * POLL_MS / 1e3)
        if idle:
            if not self._link.closed:
                self._link.close(0)
                self._zmq.term()
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            self._busy.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _mirror(self, ctx: DraftContext, probe: bool = False) -> Mirror:
        """The session's handle; the child forgets the session once the hub drops it."""
        if ctx.state is None:
            ctx.state = Mirror(next(self._ids), probe=probe)
            weakref.finalize(ctx, self._forgotten.append, ctx.state.sid)
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
        code = self._proc.poll()
        if code is not None:
            when = "before it was ready" if starting else "while drafting"
            raise RuntimeError(f"the drafting process exited with code {code} {when} "
                               f"(its log is above)")

    def _recv(self, timeout_s: float | None = None, wake: bool = False, quiet: bool = False,
              starting: bool = False) -> Framed | object | None:
        """The child's next message; WAKE when ``wake`` and the event loop handed work
        over; None after ``timeout_s`` when ``quiet``. A child that exits raises."""
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
                if isinstance(msg, Failed):
                    raise RuntimeError(f"the drafting process failed: {msg.error}")
                return msg
            if wake and self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                return WAKE
            self._check_alive(starting)
            if deadline is not None and time.monotonic() >= deadline:
                if quiet:
                    return None
                raise TimeoutError(f"the drafting process did not answer in {timeout_s:g}s")
