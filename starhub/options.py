"""Choices and defaults that the command line, the benchmark and deployment configs share.

Nothing here imports torch or transformers, so ``starhub --help`` and ``starhub launch``
answer at once, and ``bench`` can agree with ``starhub hub`` without importing its CLI.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta

from starhub.wire import messages as wire
from starhub.wire.messages import MAX_DIST_WIDTH, MAX_TREE_NODES

AUTO = "auto"
"""The value of every option that leaves the choice to starhub."""
MAX_AUTO_DEPTH = 8
"""Deepest tree ``--depth auto`` may choose, and how deep the hub tracks acceptance."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_DTYPES = (*DTYPES, "int8")
"""A drafter's weights may also be ``int8``: an EAGLE head's linear layers then hold int8
weights (``starhub.models.loading.quantize_linears``)."""
LINEARS = ("auto", "onednn", "torch")
DRAFTERS = ("eagle", "ngram", "model")
DEFAULT_DEVICE = "auto"
"""The first visible GPU where there is one, else the CPU."""


# --- numbers -------------------------------------------------------------------------

@dataclass(frozen=True)
class Number:
    """What a numeric setting may hold, stated once for its flag (``arg``, an argparse
    type), its key in a deployment file (``type``, checked by msgspec) and the configs built
    in code (``check``). Every number must also be finite: NaN passes no bound and infinity
    passes every lower one."""

    kind: type
    """int (a whole number) or float."""
    meta: Meta
    """The bounds, as msgspec states them: ``ge``, ``gt``, ``le``, ``lt``."""

    @property
    def type(self) -> Any:
        """The annotation a deployment file's key is checked against."""
        return Annotated[self.kind, self.meta]

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed, or None."""
        whole = self.kind is int
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            return f"expected {'a whole number' if whole else 'a number'}, got {value!r}"
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        m = self.meta
        for bound, holds, words in ((m.ge, lambda b: value >= b, "at least"),
                                    (m.gt, lambda b: value > b, "greater than"),
                                    (m.le, lambda b: value <= b, "at most"),
                                    (m.lt, lambda b: value < b, "less than")):
            if bound is not None and not holds(bound):
                return f"must be {words} {_plain(bound)}, got {_plain(value)}"
        return None

    def check(self, value: Any, name: str) -> Any:
        """``value`` if it is allowed, else ``ValueError`` naming the setting ``name``."""
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{name}: {problem}")
        return value

    def arg(self, text: str) -> int | float:
        """An argparse type: the flag's text read and checked (argparse names the flag)."""
        try:
            value = self.kind(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if self.kind is int else 'a number'}, "
                f"got '{text}'") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


def _plain(number: int | float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


COUNT = Number(int, Meta(ge=0))
POSITIVE = Number(int, Meta(ge=1))
AMOUNT = Number(float, Meta(ge=0))
"""A quantity >= 0 (CPUs, seconds that may be 0)."""
SECONDS = Number(float, Meta(gt=0))
"""A time limit: more than nothing."""
PORT = Number(int, Meta(ge=0, le=65535))
"""A TCP port; 0 picks a free one or, for metrics, serves none."""
TTL = Number(float, Meta(ge=0.1))
"""Seconds without messages before a server releases a session. Servers sweep for them
every quarter TTL (at most every second), so a TTL near 0 would keep them sweeping."""
MESSAGE_MB = Number(float, Meta(ge=0.01, le=4096))
"""--max-message-mb: the largest message a server takes, in MiB."""
MESSAGE_BYTES = Number(int, Meta(ge=10 << 10, le=4096 << 20))
"""The same, in bytes."""
TREE = Number(int, Meta(ge=1, le=MAX_TREE_NODES))
"""A tree's depth, its top-k, or its node budget: no tree holds more than the wire's
``MAX_TREE_NODES`` nodes."""
SUPPORT = Number(int, Meta(ge=1, le=MAX_DIST_WIDTH))
"""Entries of a sampled tree's draft distributions, within what ``Propose`` carries."""
TEMPERATURE = Number(float, wire.TEMPERATURE)
TOP_P = Number(float, wire.TOP_P)
TOK_S = Number(float, wire.TOK_S)
"""The sampling settings an OPEN carries, bounded as the wire bounds them."""
SEED = Number(int, Meta(ge=-(1 << 63), le=(1 << 63) - 1))
"""A sampling seed: a 64-bit integer, as the wire carries it."""
FRACTION = Number(float, Meta(ge=0, le=1))
BUDGET = Number(int, Meta(ge=2))
"""The verifier's tokens per pass: a tree of one node and the token before it."""


@dataclass
class TreeShape:
    depth: int = 5
    topk: int = 4
    max_nodes: int = 10
    support: int = 16
    """Entries of each node's draft distribution in a sampled tree (``SUPPORT``)."""
    floor: float = 0.0
    """A greedy tree leaves out nodes whose draft path probability is below this (the
    root's best child always stays): the hub sets it where a node costs the target more
    verify time than the tokens it is likely to add are worth."""

    def check(self, name: str = "shape") -> TreeShape:
        """This shape if every field is in range, else ``ValueError`` naming it."""
        for key in ("depth", "topk", "max_nodes"):
            TREE.check(getattr(self, key), f"{name}.{key}")
        SUPPORT.check(self.support, f"{name}.support")
        FRACTION.check(self.floor, f"{name}.floor")
        return self


DEFAULT_SHAPE = TreeShape()
DEFAULT_DEPTH: int | str = AUTO
"""The hub chooses each round's depth: on prompts its head knows it drafts as deep as a
fixed tree would, and where no tree pays the target decodes plainly at its own speed."""


def auto_or_count(minimum: int, what: str, maximum: int | None = None):
    """An argparse type for options that take ``auto`` or a whole number from ``minimum``
    (to ``maximum``)."""
    number = Number(int, Meta(ge=minimum, le=maximum))

    def parse(text: str) -> int | str:
        if str(text).strip().lower() == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected 'auto' or a whole number >= {minimum}, got '{text}'") from None
        problem = number.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{what} {problem}")
        return value

    parse.__name__ = what
    return parse


depth_arg = auto_or_count(1, "depth", MAX_TREE_NODES)
batch_arg = auto_or_count(1, "batch")
DEFAULT_PREDRAFT = False
"""Off until it wins. On a CPU host the targets share, pre-drafting runs on cores a target
is verifying on and slows it by more than it saves: one target's round spends only 6-9%
of its time in the hub's draft. And with the shipped head only about 40% of guesses hit,
and a pre-drafted tree, grown from the head's own guesses of the target's features,
accepts fewer tokens than one drafted after the COMMIT (see ``starhub.hub.worker``)."""

DEFAULT_PRUNE = True
"""The EAGLE head's greedy trees leave out the nodes whose draft probability is worth less
than the verify time they cost the target (``Controller.floor``). On a CPU target each
node costs about a twentieth of a plain step, and with the shipped head 40% of a ten-node
tree's nodes have a path probability under 5%, accepted about as often; on an
accelerator, where a node costs next to nothing, almost none is left out."""
DEFAULT_LOOKUP = True
"""Greedy sessions' trees also get the continuation of the latest earlier occurrence of
their last few tokens (prompt lookup), grafted on as one more branch: answers that copy
from their prompt (extraction, code fixes, summaries) accept long runs no head guesses."""


SCHEDULES = ("fifo", "goodspeed", "slo", "random")
"""How the edge verifier sizes and orders the trees of one forward pass."""


def auto_as_zero(minimum: int, what: str):
    """``auto_or_count`` with ``auto`` read as 0, which the verifier's settings use for
    "choose for me"."""
    parse = auto_or_count(minimum, what)

    def convert(text: str) -> int:
        value = parse(text)
        return 0 if value == AUTO else value

    convert.__name__ = what
    return convert


max_batch_arg = auto_as_zero(1, "max-batch")
"""The verifier's ``--max-batch``: ``auto`` (0: as many rows as the token budget holds) or a
row count >= 1."""
budget_arg = auto_as_zero(BUDGET.meta.ge, "budget")
"""The verifier's ``--budget``: ``auto`` (0: measured at start) or a token count >= 2."""


def shard_arg(text: str) -> tuple[int, int]:
    """An argparse type for ``--shard I/N``: every N-th prompt starting at I, as (I, N)."""
    index, _, count = str(text).strip().partition("/")
    try:
        shard = int(index), int(count or 1)
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got '{text}'")
    return shard


def on_off_arg(text: str) -> bool:
    """An argparse type for on/off switches that the benchmark can list (``on,off``)."""
    value = str(text).strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got '{text}'")
max_targets_arg = auto_or_count(0, "max-targets")


def auto_on_off_arg(text: str) -> bool | str:
    """An argparse type for switches whose ``auto`` leaves the choice to the hub."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        return on_off_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'on' or 'off', got '{text}'") from None


DEFAULT_DRAFT_PROCESS = AUTO
PROCESS_DRAFTERS = ("eagle",)
"""``--draft-process auto`` gives these a process of their own: their batched passes are
tensor work that the event loop's Python held back through the interpreter lock. The
n-gram drafter drafts in microseconds, less than a round trip to a child, and the model
drafter drafts one request at a time."""


def draft_process_for(setting: bool | str, drafter: str) -> bool:
    """Whether a hub with ``--draft-process setting`` drafts in a process of its own."""
    return setting is True or (setting == AUTO and drafter in PROCESS_DRAFTERS)


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """The drafter and tree options of ``starhub hub`` (``bench`` reads its defaults here)."""
    p.add_argument("--drafter", choices=DRAFTERS, default="eagle",
                   help="eagle: a trained EAGLE head over the target's features; ngram: "
                        "prompt lookup, no model; model: an independent causal LM")
    p.add_argument("--draft", default=None,
                   help="eagle: a head folder (default: the head shipped for the embedded "
                        "model). model: 'self' (the target's weights; every token is accepted, "
                        "for tests), 'self:layers=K' (its first K layers; the default), or a "
                        "model spec with the target's tokenizer")
    p.add_argument("--depth", type=depth_arg, default=DEFAULT_DEPTH,
                   help="'auto' (default): the hub picks each session's depth every round, "
                        f"up to {MAX_AUTO_DEPTH}, for the most tokens per second given its "
                        "measured acceptance, its target's verify cost and the hub's load, "
                        "and lets a session that no tree speeds up decode plainly "
                        "(re-probing it now and then). A number fixes the tree layers drafted "
                        "per round (fewer when no deeper node could make the budget)")
    p.add_argument("--topk", type=TREE.arg, default=DEFAULT_SHAPE.topk,
                   help="paths expanded per layer, and children per expanded node")
    p.add_argument("--max-nodes", type=TREE.arg, default=DEFAULT_SHAPE.max_nodes,
                   help="node budget of a tree. The defaults suit a small CPU target, where a "
                        "10-node tree verifies for about 1.4 one-token steps. On GPUs, where "
                        "dozens of nodes verify for about the price of one, larger trees pay "
                        "(EAGLE-2 uses --depth 6 --topk 10 --max-nodes 60)")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                   help="the drafter's weights (drafts may differ, output never does). auto: "
                        "for an EAGLE head, bfloat16 where the hardware multiplies bf16 "
                        "natively, else int8 where the CPU has int8 kernels (x86: float32 "
                        "activations, int8 weights per output channel; twice as fast as "
                        "float32 on an AVX2 CPU, nearly the same acceptance), else the "
                        "target's dtype")


def tree_defaults() -> dict:
    """The tree settings ``starhub hub`` uses when given none."""
    p = argparse.ArgumentParser(add_help=False)
    add_tree_args(p)
    return vars(p.parse_args([]))


def device_arg(text: str) -> str:
    """An argparse type for ``--device``: cpu, cuda, cuda:N or auto (checked for existence
    only when the model loads, so ``--help`` needs no torch)."""
    value = str(text).strip().lower()
    if value in ("cpu", "cuda", AUTO) or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got '{text}'")


def add_device_args(p: argparse.ArgumentParser, what: str, device_map: bool = False) -> None:
    """``--device`` (and, for processes that hold a target, ``--device-map``)."""
    p.add_argument("--device", type=device_arg, default=DEFAULT_DEVICE,
                   help=f"where {what} runs: cpu, cuda (the first visible GPU), cuda:N, or "
                        "auto (default: cuda where a GPU is visible, else cpu). On a GPU the "
                        "weights default to bfloat16; tensors cross to the CPU only at the "
                        "wire")
    if device_map:
        p.add_argument("--device-map", default=None, metavar="auto|I,J,...",
                       help="spread a target too large for one GPU over several with "
                            "accelerate: 'auto' uses every visible GPU, '0,1' only those. "
                            "Replaces --device")


threads_arg = auto_or_count(1, "threads")
DEFAULT_THREADS: int | str = AUTO
"""Torch threads: the cores this process may use, shared evenly by the processes that
compute at the same time. A target's forward pass is a chain of small matrix products, so
on a 2-core machine one target with 2 threads ran plain decoding 1.38x faster than with 1,
while two targets with 2 threads each would only fight over the cores."""


CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""The cgroup (v2) CPU quota: "QUOTA PERIOD" in microseconds, or "max PERIOD"."""


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (as
    containers set), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def resolve_threads(value: int | str | None, sharing: int = 1) -> int:
    """``auto`` (or None): ``usable_cores() // sharing``, at least 1, where ``sharing`` is
    how many processes compute on this machine at once. A number is kept as given."""
    if value is None or str(value).strip().lower() == AUTO:
        return max(1, usable_cores() // max(1, sharing))
    return int(value)
