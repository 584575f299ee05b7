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

AUTO = "auto"
"""The value of every option that leaves the choice to starhub."""
MAX_AUTO_DEPTH = 8
"""Deepest tree ``--depth auto`` may choose, and how deep the hub tracks acceptance."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
LINEARS = ("auto", "onednn", "torch")
DRAFTERS = ("eagle", "ngram", "model")
DEFAULT_DEVICE = "auto"
"""The first visible GPU where there is one, else the CPU."""


@dataclass
class TreeShape:
    depth: int = 5
    topk: int = 4
    max_nodes: int = 10
    support: int = 16


DEFAULT_SHAPE = TreeShape()
DEFAULT_DEPTH: int | str = AUTO
"""The hub chooses each round's depth: on prompts its head knows it drafts as deep as a
fixed tree would, and where no tree pays the target decodes plainly at its own speed."""


def auto_or_count(minimum: int, what: str):
    """An argparse type for options that take ``auto`` or a whole number >= ``minimum``."""

    def parse(text: str) -> int | str:
        if str(text).strip().lower() == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected 'auto' or a whole number >= {minimum}, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum}, got {value}")
        return value

    parse.__name__ = what
    return parse


depth_arg = auto_or_count(1, "depth")
batch_arg = auto_or_count(1, "batch")
DEFAULT_PREDRAFT = False
"""Off until it wins. On a CPU host the targets share, pre-drafting runs on cores a target
is verifying on and slows it by more than it saves: one target's round spends only 6-9%
of its time in the hub's draft. And with the shipped head only about 40% of guesses hit,
and a pre-drafted tree, grown from the head's own guesses of the target's features,
accepts fewer tokens than one drafted after the COMMIT (see ``starhub.hub.worker``)."""

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
budget_arg = auto_as_zero(2, "budget")
"""The verifier's ``--budget``: ``auto`` (0: measured at start) or a token count >= 2."""


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
    p.add_argument("--topk", type=int, default=DEFAULT_SHAPE.topk,
                   help="paths expanded per layer, and children per expanded node")
    p.add_argument("--max-nodes", type=int, default=DEFAULT_SHAPE.max_nodes,
                   help="node budget of a tree. The defaults suit a small CPU target, where a "
                        "10-node tree verifies for about 1.4 one-token steps. On GPUs, where "
                        "dozens of nodes verify for about the price of one, larger trees pay "
                        "(EAGLE-2 uses --depth 6 --topk 10 --max-nodes 60)")
    p.add_argument("--draft-dtype", choices=DTYPES, default="auto",
                   help="the drafter's weights. auto: bfloat16 for an EAGLE head where the "
                        "hardware multiplies bf16 natively (drafts may differ, output never "
                        "does), otherwise the target's dtype")


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
