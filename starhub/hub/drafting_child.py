"""The child side of ``starhub.hub.drafting_process``: it holds the hub's drafter and every
session's drafting state, and drafts what the hub sends over its private link."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import zmq

from starhub.drafters import make_drafter
from starhub.drafters.base import DraftContext, Drafter
from starhub.hub.drafting_messages import (
    CHILD_DECODER,
    LINK_LIMITS,
    Beat,
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
    ToChild,
    owned,
)
from starhub.hub.drafting_process import BEAT_S, POLL_MS, Job
from starhub.settings.base import CONFIG_ENV, load
from starhub.settings.processes import HubSettings, drafter_args
from starhub.wire.codec import encode
from starhub.wire.messages import Framed
from starhub.wire.tree import DraftTree

log = logging.getLogger("starhub.hub")


class DraftingServer:
    """The child: holds the drafter and every session's drafting state."""

    def __init__(self, drafter: Drafter, link: zmq.Socket):
        self.drafter = drafter
        self.link = link
        self.sessions: dict[int, DraftContext] = {}
        self.batch = 0

    def serve(self) -> None:
        parent = os.getppid()
        while True:
            if not self.link.poll(POLL_MS):
                if os.getppid() != parent:
                    log.warning("the hub went away; the drafting process stops")
                    return
                continue
            msg = self.recv()
            jobs = self.absorb(msg)
            if isinstance(msg, Quit):
                return
            if isinstance(msg, Draft):
                self.batch = msg.batch
                self.draft(jobs, msg.admit)
            elif isinstance(msg, Predraft):
                self.predraft(jobs[0], msg.tree)
            # ``More`` after a batch ended and ``Stop`` after a pre-draft only bring sessions
            # up to date (``absorb``)

    def recv(self) -> ToChild:
        return CHILD_DECODER.decode(self.link.recv_multipart(copy=False), LINK_LIMITS)

    def send(self, msg: Framed) -> None:
        self.link.send_multipart(encode(msg), copy=False)

    def absorb(self, msg: ToChild) -> list[Job]:
        """Apply what the hub's message says of its sessions; its jobs."""
        for sid in msg.forget:
            self.sessions.pop(sid, None)
        if not isinstance(msg, Jobs):
            return []
        jobs, rows = [], iter(msg.features)
        for job in msg.jobs:
            ctx = self.sessions.get(job.sid)
            if ctx is None:
                if job.probe:
                    ctx = self.drafter.probe_context()
                else:
                    ctx = DraftContext(tokens=[], temperature=job.temperature, seed=job.seed)
                self.sessions[job.sid] = ctx
            ctx.tokens.extend(job.tokens.tolist())
            ctx.features.extend(next(rows) for _ in range(job.features))
            jobs.append((ctx, job.shape))
        return jobs

    def admit(self) -> list[Job]:
        """Between tree layers: the jobs the hub has added to this batch."""
        more = []
        while self.link.poll(0):
            msg = self.recv()
            jobs = self.absorb(msg)
            if isinstance(msg, More) and msg.batch == self.batch:
                more += jobs
        return more

    def draft(self, jobs: list[Job], admit: bool) -> None:
        counted = {"admitted": len(jobs)}

        def take() -> list[Job]:
            more = self.admit()
            counted["admitted"] += len(more)
            return more

        def finished(k: int, result: DraftTree | Exception, seconds: float,
                     shared: float) -> None:
            if isinstance(result, Exception):
                self.send(Done(k=k, seconds=seconds, shared=shared,
                               error=f"{type(result).__name__}: {result}"))
            else:
                self.send(Done(k=k, seconds=seconds, shared=shared, tree=result))

        error = ""
        try:
            self.drafter.propose_batch(jobs, admit=take if admit else None, finished=finished)
        except Exception as exc:  # the hub fails this batch's rounds, and drafting goes on
            log.exception("drafting a batch failed")
            error = f"{type(exc).__name__}: {exc}"
        self.send(End(admitted=counted["admitted"], error=error))

    def predraft(self, job: Job, tree: DraftTree) -> None:
        ctx, shape = job
        reply = Predrafted()
        try:
            found = self.drafter.predraft(ctx, owned(tree), shape,
                                          lambda: bool(self.link.poll(0)))
            reply.trees = [(list(key), t) for key, t in found.items()]
        except Exception as exc:
            log.exception("pre-drafting failed")
            reply.error = f"{type(exc).__name__}: {exc}"
        self.send(reply)


class Beating:
    """A thread that tells the hub this process is alive every ``BEAT_S``, on a socket of
    its own, whatever drafting does meanwhile: a stopped or frozen process falls silent, a
    busy one does not."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self._sock = context.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.CONFLATE, 1)  # the hub reads only the newest
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            try:
                self._sock.send_multipart(encode(Beat(at=now, gap=now - last)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the hub is not listening yet: the next beat says the same
            last = now
            if self._stop.wait(BEAT_S):
                break
        self._sock.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ready_message(drafter: Drafter) -> Ready:
    """What the hub's ``RemoteDrafter`` takes on from the drafter it stands for."""
    return Ready(name=drafter.name, label=getattr(drafter, "label", drafter.name),
                 weights=drafter.weights,
                 feature_layers=list(drafter.feature_layers),
                 feature_size=drafter.feature_size, lookup_branches=drafter.lookup_branches,
                 calibrated=drafter.calibrated, batches=drafter.batches,
                 predrafts=drafter.predrafts, needs=drafter.needs())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m starhub.hub.drafting_child",
        description="The hub's drafter in a process of its own. `starhub hub` starts it; "
                    "it serves only the hub that started it, over --link.")
    parser.add_argument("--link", required=True, help="the hub's ipc:// endpoint")
    parser.add_argument("--beats", required=True,
                        help="the hub's ipc:// endpoint for this process's heartbeat")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for drafting")
    parser.add_argument("--settings", required=True,
                        help="the hub's settings as JSON (the drafter's fields are read)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the hub decides when its drafter stops
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    # deferred: transformers load only when this runs
    from starhub.models.loading import set_threads

    set_threads(args.threads)
    context = zmq.Context()
    link = context.socket(zmq.PAIR)
    link.setsockopt(zmq.LINGER, 1000)
    link.connect(args.link)
    try:
        settings = load(HubSettings, environ={CONFIG_ENV: args.settings})
        drafter = make_drafter(**drafter_args(settings))
    except Exception as exc:
        log.error("could not load the drafter: %s", exc)
        link.send_multipart(encode(Failed(error=str(exc))))
        link.close()
        return 2
    link.send_multipart(encode(ready_message(drafter)))
    beating = Beating(context, args.beats)
    DraftingServer(drafter, link).serve()
    beating.stop()
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
