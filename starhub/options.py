"""The values every setting of starhub is made of: the sets of choices (enums), the
bounded numbers, and the defaults the processes share.

Each process's settings (``starhub.settings``) are typed with these, and so are the
checks of the configs built in code (``check``), so a bound is stated once for a flag, a
launch-file key, an environment variable and a ``HubConfig``. Nothing here imports torch
or transformers, so ``starhub --help`` and ``starhub launch`` answer at once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PlainSerializer,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from starhub.wire import messages as wire
from starhub.wire.messages import MAX_DIST_WIDTH, MAX_TREE_NODES

AUTO = "auto"
"""The value of every option that leaves the choice to starhub."""
MAX_AUTO_DEPTH = 8
"""Deepest tree ``--depth auto`` may choose, and how deep the hub tracks acceptance."""


# --- sets of values --------------------------------------------------------------------

class Choice(str, Enum):
    """One of a set of values; it is its value wherever text is expected."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Drafter(Choice):
    EAGLE = "eagle"
    """A trained EAGLE head over the target's features."""
    NGRAM = "ngram"
    """Prompt lookup, no model."""
    MODEL = "model"
    """An independent causal LM."""


class Dtype(Choice):
    AUTO = AUTO
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


DraftDtype = Choice("DraftDtype", {**{m.name: m.value for m in Dtype}, "INT8": "int8"})
"""A drafter's weights may also be ``int8``: an EAGLE head's linear layers then hold int8
weights (``starhub.models.loading.quantize_linears``)."""


class Linear(Choice):
    AUTO = AUTO
    ONEDNN = "onednn"
    TORCH = "torch"


class Schedule(Choice):
    """How the edge verifier sizes and orders the trees of one forward pass."""

    FIFO = "fifo"
    GOODSPEED = "goodspeed"
    SLO = "slo"
    RANDOM = "random"


class Speculate(Choice):
    """``starhub serve --speculate``: when requests use the hub's trees."""

    AUTO = AUTO
    ALWAYS = "always"


class SharedCores(Choice):
    """``--shared-cores``: whether a target computes on its hub's CPU cores."""

    AUTO = AUTO
    YES = "yes"
    NO = "no"


class LogLevel(Choice):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


DTYPES = tuple(Dtype)
DRAFT_DTYPES = tuple(DraftDtype)
LINEARS = tuple(Linear)
DRAFTERS = tuple(Drafter)
SCHEDULES = tuple(Schedule)
DEFAULT_DEVICE = AUTO
"""The first visible GPU where there is one, else the CPU."""


# --- numbers ---------------------------------------------------------------------------

def _number(kind: type, **bounds: float) -> Any:
    """A number with its bounds; a float must also be finite (NaN passes no bound and
    infinity every lower one)."""
    if kind is float:
        bounds["allow_inf_nan"] = False
    return Annotated[kind, Field(**bounds)]


def _wire(meta) -> dict:
    """A wire field's msgspec bounds as keyword arguments."""
    return {k: getattr(meta, k) for k in ("ge", "gt", "le", "lt") if getattr(meta, k) is not None}


Count = _number(int, ge=0)
Positive = _number(int, ge=1)
Amount = _number(float, ge=0)
"""A quantity >= 0 (CPUs, seconds that may be 0)."""
Seconds = _number(float, gt=0)
"""A time limit: more than nothing."""
Port = _number(int, ge=0, le=65535)
"""A TCP port; 0 picks a free one or, for metrics, serves none."""
Ttl = _number(float, ge=0.1)
"""Seconds without messages before a server releases a session. Servers sweep for them
every quarter TTL (at most every second), so a TTL near 0 would keep them sweeping."""
MessageMb = _number(float, ge=0.01, le=4096)
"""--max-message-mb: the largest message a server takes, in MiB."""
MessageBytes = _number(int, ge=10 << 10, le=4096 << 20)
"""The same, in bytes."""
Tree = _number(int, ge=1, le=MAX_TREE_NODES)
"""A tree's depth, its top-k, or its node budget: no tree holds more than the wire's
``MAX_TREE_NODES`` nodes."""
Support = _number(int, ge=1, le=MAX_DIST_WIDTH)
"""Entries of a sampled tree's draft distributions, within what ``Propose`` carries."""
Temperature = _number(float, **_wire(wire.TEMPERATURE))
TopP = _number(float, **_wire(wire.TOP_P))
TokS = _number(float, **_wire(wire.TOK_S))
"""The sampling settings an OPEN carries, bounded as the wire bounds them."""
Seed = _number(int, ge=-(1 << 63), le=(1 << 63) - 1)
"""A sampling seed: a 64-bit integer, as the wire carries it."""
Fraction = _number(float, ge=0, le=1)
Budget = _number(int, ge=2)
"""The verifier's tokens per pass: a tree of one node and the token before it."""
Rate = _number(float, gt=0)
"""A request rate, in requests per second."""


def _auto_or(value: Any, handler) -> Any:
    """'auto' in any spelling, else the number; one message for both."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return handler(value)
    except ValidationError as exc:
        numbers = [e for e in exc.errors() if "literal" not in str(e["loc"][-1:])]
        what = numbers[0]["msg"] if numbers else exc.errors()[0]["msg"]
        if numbers and numbers[0]["type"] in ("int_parsing", "float_parsing", "int_type",
                                              "float_type", "int_from_float"):
            what = what.replace("Input should be", "Input should be 'auto' or")
        raise PydanticCustomError("auto_or_number", what) from None


def auto_or(number: Any) -> Any:
    """``auto`` or a bounded number (``Count``, ``Positive``, ...)."""
    return Annotated[Literal["auto"] | number, WrapValidator(_auto_or)]


def _auto_on_off(value: Any, handler) -> Any:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("auto_on_off", "Input should be 'auto', 'on' or 'off'") \
            from None


AutoOnOff = Annotated[Literal["auto"] | bool, WrapValidator(_auto_on_off)]
"""A switch whose ``auto`` leaves the choice to starhub."""


def _device(value: Any, handler) -> Any:
    text = handler(value).strip().lower()
    if text in ("cpu", "cuda", AUTO) or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise PydanticCustomError("device", "expected cpu, cuda, cuda:N or auto")


Device = Annotated[str, WrapValidator(_device)]
"""cpu, cuda, cuda:N or auto, checked for existence only when the model loads."""


def _shard(value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        index, _, count = value.strip().partition("/")
        value = (index, count or "1")
    try:
        index, count = (int(v) if not isinstance(v, bool | float) else None for v in value)
    except (TypeError, ValueError):
        index = count = None
    if index is None or count is None or not 0 <= index < count:
        raise PydanticCustomError("shard", "expected I/N with 0 <= I < N")
    return index, count


Shard = Annotated[tuple[int, int], PlainValidator(_shard),
                  PlainSerializer(lambda v: f"{v[0]}/{v[1]}", return_type=str)]
"""``I/N``: every N-th prompt starting at I, as (I, N)."""

Threads = auto_or(Count)
"""Torch threads: ``auto`` or a count (0: torch's own choice)."""


@cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def check(value: Any, tp: Any, name: str) -> Any:
    """``value`` if it is a ``tp`` (one of the types above), else ``ValueError`` naming the
    setting ``name``: the configs built in code check the bounds their flags check."""
    try:
        return _adapter(tp).validate_python(value, strict=True)
    except ValidationError as exc:
        raise ValueError(f"{name}: {exc.errors()[0]['msg']}, got {value!r}") from None


# --- trees -----------------------------------------------------------------------------

@dataclass
class TreeShape:
    depth: int = 5
    topk: int = 4
    max_nodes: int = 10
    support: int = 16
    """Entries of each node's draft distribution in a sampled tree (``Support``)."""
    floor: float = 0.0
    """A greedy tree leaves out nodes whose draft path probability is below this (the
    root's best child always stays): the hub sets it where a node costs the target more
    verify time than the tokens it is likely to add are worth."""

    def check(self, name: str = "shape") -> TreeShape:
        """This shape if every field is in range, else ``ValueError`` naming it."""
        for key in ("depth", "topk", "max_nodes"):
            check(getattr(self, key), Tree, f"{name}.{key}")
        check(self.support, Support, f"{name}.support")
        check(float(self.floor), Fraction, f"{name}.floor")
        return self


DEFAULT_SHAPE = TreeShape()
DEFAULT_DEPTH: int | str = AUTO
"""The hub chooses each round's depth: on prompts its head knows it drafts as deep as a
fixed tree would, and where no tree pays the target decodes plainly at its own speed."""
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
DEFAULT_DRAFT_PROCESS = AUTO
PROCESS_DRAFTERS = (Drafter.EAGLE,)
"""``--draft-process auto`` gives these a process of their own: their batched passes are
tensor work that the event loop's Python held back through the interpreter lock. The
n-gram drafter drafts in microseconds, less than a round trip to a child, and the model
drafter drafts one request at a time."""


def draft_process_for(setting: bool | str, drafter: str) -> bool:
    """Whether a hub with ``--draft-process setting`` drafts in a process of its own."""
    return setting is True or (setting == AUTO and drafter in PROCESS_DRAFTERS)


# --- threads ---------------------------------------------------------------------------

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
