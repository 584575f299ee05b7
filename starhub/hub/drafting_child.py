"""The child side of ``starhub.hub.drafting_process``: it holds the hub's drafter and every
session's drafting state, and drafts what the hub sends over its private link."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import asdict
from typing import Any

import numpy as np
import zmq

from starhub.drafters import make_drafter
from starhub.drafters.base import DraftContext, Drafter, TreeShape
from starhub.hub.drafting_process import POLL_MS, Job, pack, tree_in, tree_out, unpack
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
            header, arrays = unpack(self.link.recv_multipart())
            op = header["op"]
            jobs = self.absorb(header, arrays)
            if op == "quit":
                return
            if op == "jobs":
                self.batch = header["batch"]
                self.draft(jobs, header["admit"])
            elif op == "predraft":
                self.predraft(jobs[0], header["tree"])
            # "more" after a batch ended and "stop" after a pre-draft only bring sessions
            # up to date (``absorb``)

    def absorb(self, header: dict, arrays: list[np.ndarray]) -> list[Job]:
        """Apply what the hub's message says of its sessions; its jobs."""
        for sid in header.get("forget", []):
            self.sessions.pop(sid, None)
        jobs, rows = [], iter(arrays)
        for entry in header.get("jobs", []):
            ctx = self.sessions.get(entry["sid"])
            if ctx is None:
                if entry.get("probe"):
                    ctx = self.drafter.probe_context()
                else:
                    ctx = DraftContext(tokens=[], temperature=entry.get("temperature", 0.0),
                                       seed=entry.get("seed"))
                self.sessions[entry["sid"]] = ctx
            ctx.tokens.extend(entry["tokens"])
            ctx.features.extend(next(rows) for _ in range(entry["features"]))
            jobs.append((ctx, TreeShape(*entry["shape"])))
        return jobs

    def admit(self) -> list[Job]:
        """Between tree layers: the jobs the hub has added to this batch."""
        more = []
        while self.link.poll(0):
            header, arrays = unpack(self.link.recv_multipart())
            jobs = self.absorb(header, arrays)
            if header["op"] == "more" and header["batch"] == self.batch:
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
            reply = {"op": "done", "k": k, "seconds": seconds, "shared": shared}
            if isinstance(result, Exception):
                reply["error"] = f"{type(result).__name__}: {result}"
            else:
                reply["tree"] = tree_out(result)
            self.link.send_multipart(pack(reply))

        error = None
        try:
            self.drafter.propose_batch(jobs, admit=take if admit else None, finished=finished)
        except Exception as exc:  # the hub fails this batch's rounds, and drafting goes on
            log.exception("drafting a batch failed")
            error = f"{type(exc).__name__}: {exc}"
        self.link.send_multipart(pack({"op": "end", "admitted": counted["admitted"],
                                        "error": error}))

    def predraft(self, job: Job, tree: dict) -> None:
        ctx, shape = job
        reply: dict[str, Any] = {"op": "predrafted", "trees": []}
        try:
            found = self.drafter.predraft(ctx, tree_in(tree), shape,
                                          lambda: bool(self.link.poll(0)))
            reply["trees"] = [[list(key), tree_out(t)] for key, t in found.items()]
        except Exception as exc:
            log.exception("pre-drafting failed")
            reply["error"] = f"{type(exc).__name__}: {exc}"
        self.link.send_multipart(pack(reply))


def ready_message(drafter: Drafter) -> dict:
    """What the hub's ``RemoteDrafter`` takes on from the drafter it stands for."""
    needs = drafter.needs()
    return {"op": "ready", "name": drafter.name, "label": getattr(drafter, "label", drafter.name),
            "dtype": str(getattr(drafter, "dtype", "none")),
            "feature_layers": list(drafter.feature_layers),
            "feature_size": drafter.feature_size, "lookup_branches": drafter.lookup_branches,
            "batches": drafter.batches, "predrafts": drafter.predrafts,
            "needs": asdict(needs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m starhub.hub.drafting_child",
        description="The hub's drafter in a process of its own. `starhub hub` starts it; "
                    "it serves only the hub that started it, over --link.")
    parser.add_argument("--link", required=True, help="the hub's ipc:// endpoint")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for drafting")
    parser.add_argument("--drafter", default="eagle")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--model", default="default")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--device", default="cpu")
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
        drafter = make_drafter(args.drafter, args.draft, args.model, args.draft_dtype,
                               args.device)
    except Exception as exc:
        log.error("could not load the drafter: %s", exc)
        link.send_multipart(pack({"op": "failed", "error": str(exc)}))
        link.close()
        return 2
    link.send_multipart(pack(ready_message(drafter)))
    DraftingServer(drafter, link).serve()
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
