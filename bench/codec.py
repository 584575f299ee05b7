"""The wire codec's cost: encode plus decode of one round's messages, and a loopback round.

A round's codec work is one COMMIT (target to hub) and one PROPOSE (hub to target), each
encoded on one side and decoded, with full validation, on the other. This times
``decode(encode(msg))`` for

* ``PROPOSE-60``: a greedy 60-node tree (tokens and parents, int32[60]);
* ``PROPOSE-60+dist``: the same tree with sampling distributions (int32/float32 [61, 16]);
* ``COMMIT-4+features``: 4 new tokens with float32[4, 576] features (EAGLE), held as
  torch tensors as a target holds them;
* ``COMMIT-4+bf16``: the same with bfloat16 features, sent as raw bits;

each ``--number`` times per repeat, ``--repeat`` repeats, and reports the median and the best
repeat in µs per encode+decode. ``loopback`` is one COMMIT in and one PROPOSE out through
a DEALER and a ROUTER socket over TCP on 127.0.0.1, both codecs included (the median
of single round trips). Torch's thread count is set with ``--threads``. The CPU model
(``lscpu``'s "Model name") is printed with the figures: they mean little without it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from starhub.wire.codec import decode, encode
from starhub.wire.messages import Commit, Message, Propose

NODES = 60
TOPK = 16
FEATURE_WIDTH = 576  # SmolLM2-135M's hidden size


def tree_parents(nodes: int, width: int = 4) -> np.ndarray:
    """A valid tree: node i hangs off -1 for the first ``width`` nodes, else an earlier one."""
    idx = np.arange(nodes, dtype=np.int32)
    return np.where(idx < width, -1, (idx - width) // width).astype(np.int32)


def messages(nodes: int = NODES, width: int = FEATURE_WIDTH) -> dict[str, Message]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, nodes, dtype=np.int32)
    parents = tree_parents(nodes)
    dist_ids = rng.integers(0, 49152, (nodes + 1, TOPK), dtype=np.int32)
    dist_probs = rng.random((nodes + 1, TOPK), dtype=np.float32)
    # as a target builds them: torch tensors (the hub's trees are numpy arrays)
    features = torch.from_numpy(rng.standard_normal((4, width), dtype=np.float32))
    commit_tokens = torch.tensor([17, 4, 99, 3], dtype=torch.int32)
    return {
        f"PROPOSE-{nodes}": Propose(tag=7, seq=12, ref=11, tokens=tokens, parents=parents),
        f"PROPOSE-{nodes}+dist": Propose(tag=7, seq=12, ref=11, tokens=tokens, parents=parents,
                                         dist_ids=dist_ids, dist_probs=dist_probs),
        "COMMIT-4+features": Commit(tag=7, seq=11, accepted=3, verify_ms=12.5, step_ms=9.25,
                                    tokens=commit_tokens, features=features),
        "COMMIT-4+bf16": Commit(tag=7, seq=11, accepted=3, verify_ms=12.5, step_ms=9.25,
                                tokens=commit_tokens,
                                features=features.bfloat16()),
    }


def cpu_model() -> str:
    """``lscpu``'s "Model name" (``/proc/cpuinfo``'s where there is no lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_per_call(fn: Callable[[], object], number: int, repeat: int) -> tuple[float, float]:
    """(median, best) over ``repeat`` repeats of the mean µs per call across ``number``."""
    fn()  # warm
    per_call = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(per_call), min(per_call)


def roundtrip(msg: Message) -> Callable[[], Message]:
    def go() -> Message:
        return decode(encode(msg))
    return go


def loopback(commit: Commit, propose: Propose, rounds: int) -> tuple[float, float]:
    """(median, best) µs of COMMIT out, decoded at a ROUTER, PROPOSE back, decoded here."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    samples = []
    try:
        for i in range(rounds + 50):
            t0 = time.perf_counter()
            dealer.send_multipart(encode(commit), copy=False)
            ident, *frames = router.recv_multipart(copy=False)
            decode(frames)
            router.send_multipart([ident, *encode(propose)], copy=False)
            decode(dealer.recv_multipart(copy=False))
            if i >= 50:  # the first rounds warm the connection
                samples.append((time.perf_counter() - t0) * 1e6)
    finally:
        dealer.close()
        router.close()
        ctx.term()
    return statistics.median(samples), min(samples)


def run(number: int, repeat: int, rounds: int) -> dict:
    msgs = messages()
    for name, msg in msgs.items():  # the benchmark itself must round-trip correctly
        back = decode(encode(msg))
        assert type(back) is type(msg) and back.tag == msg.tag, name
    rows = {}
    for name, msg in msgs.items():
        med, best = time_per_call(roundtrip(msg), number, repeat)
        rows[name] = {"median_us": round(med, 2), "best_us": round(best, 2)}
    if rounds:
        med, best = loopback(msgs["COMMIT-4+features"], msgs[f"PROPOSE-{NODES}"], rounds)
        rows["loopback COMMIT->PROPOSE"] = {"median_us": round(med, 2), "best_us": round(best, 2)}
    return {
        "what": "µs per encode+decode (loopback: per round trip, both codecs)",
        "number": number, "repeat": repeat, "loopback_rounds": rounds,
        "torch_threads": torch.get_num_threads(), "cpu": cpu_model(),
        "python": platform.python_version(), "numpy": np.__version__,
        "torch": torch.__version__, "pyzmq": zmq.__version__,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--number", type=int, default=2000, help="calls per repeat (default 2000)")
    p.add_argument("--repeat", type=int, default=7, help="repeats (default 7)")
    p.add_argument("--loopback", type=int, default=2000, metavar="ROUNDS",
                   help="loopback round trips to time (0: skip; default 2000)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads before timing (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if args.number < 1 or args.repeat < 1 or args.loopback < 0 or args.threads < 1:
        p.error("--number, --repeat and --threads must be positive, --loopback >= 0")
    torch.set_num_threads(args.threads)
    doc = run(args.number, args.repeat, args.loopback)
    print(f"cpu: {doc['cpu']}")
    print(f"torch threads: {doc['torch_threads']}   number={args.number} repeat={args.repeat}  "
          f"(python {doc['python']}, numpy {doc['numpy']}, pyzmq {doc['pyzmq']})")
    print(f"{'message':<26}{'median µs':>12}{'best µs':>12}")
    for name, row in doc["rows"].items():
        print(f"{name:<26}{row['median_us']:>12.1f}{row['best_us']:>12.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
