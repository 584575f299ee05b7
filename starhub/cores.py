"""Whether a target shares CPU cores with its hub, and a clock that sees through it.

On one host the hub's drafting runs on the cores its targets decode on. A target that times
its plain steps by the wall clock while the hub drafts next to it measures a standalone
speed slowed by the hub, and would then keep trees that are slower than decoding alone
really is. So a target that shares cores with its hub times its plain steps by its own CPU
time (what the step costs when nothing else runs), and its tree rounds by the wall clock
(what they cost under the sharing): every decision compares speculation as it runs, with
the hub's compute charged to it, against plain decoding as it would run without the hub.

Sharing is read from the cards: the hub's DRAFTER_CARD names its host (boot id and host
name) and the CPUs it may run on; a target on the same host whose CPUs overlap shares them.
``--shared-cores yes|no`` overrides that (containers can hide a shared host).

A target whose cores are its own loads its model on a thread that ends (``on_passing_thread``),
so that its engine thread's OpenMP workers are the process's only ones.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TypeVar

from starhub.options import AUTO

T = TypeVar("T")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@cache
def host_id() -> str:
    """This host, as a short digest of its boot id and host name: two processes with the
    same one run on the same kernel."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:  # not Linux: the host name alone
        boot = ""
    return hashlib.sha256(f"{boot}/{socket.gethostname()}".encode()).hexdigest()[:16]


def cpu_ids() -> list[int]:
    """The CPUs this process may run on (every CPU where affinity is not supported)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def shares_cores(host: str, cpus: list[int], setting: str = AUTO) -> bool:
    """Whether a peer on ``host`` running on ``cpus`` computes on this process's cores:
    ``setting`` yes or no says so; auto reads it from the host and the CPU sets."""
    if setting != AUTO:
        return setting == "yes"
    return bool(host) and host == host_id() and bool(set(cpus) & set(cpu_ids()))


def on_passing_thread(work: Callable[[], T]) -> T:
    """``work()``, run on a thread that ends with it (its exception raised here).

    PyTorch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that
    has started a parallel region, for as long as that thread lives, and where a process's
    pools hold more threads than it has cores, every pool's workers sleep between regions
    instead of spinning, so each of a pass's few hundred products waits for its workers to
    wake. Loading and timing a model runs such regions; done on the main thread, they leave
    a second pool beside the engine thread's, which then runs every pass that way (figures
    in docs/benchmarks.md). A pool whose workers spin takes its cores from other processes
    between passes, so a target that shares its cores with a hub keeps the sleeping pools
    (``own_cores``)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="load")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def own_cores(hub: object, setting: str = AUTO) -> bool:
    """Whether a target with this hub setting (None or empty: no hub) and ``--shared-cores``
    has its cores to itself when it loads: with no hub, or where told its hub computes
    elsewhere (a hub given and ``auto``: its card, which says, comes after loading)."""
    return not hub or setting == "no"


def load_target(work: Callable[[], T], hub: object, setting: str = AUTO) -> T:
    """``work()`` (a target's loading and the building of its core), on a passing thread
    where the target has its cores to itself (``own_cores``), else on this one."""
    return on_passing_thread(work) if own_cores(hub, setting) else work()


@dataclass
class CoreClock:
    """Times the compute of this thread. ``shared`` (cores shared with a hub, on a CPU
    device): ``lap`` also returns the stretch's CPU time, the time it takes with the cores
    to itself; otherwise both figures are the wall time. With several torch threads the
    calling thread's CPU time stands for the pass's: it runs its share of every parallel
    region and waits for the rest."""

    shared: bool = False
    setting: str = AUTO
    """``--shared-cores``: auto, yes or no."""
    on_cpu: bool = True
    """The model computes on the CPU (a GPU's passes share no cores with a hub's)."""
    _wall: float = field(default=0.0, repr=False)
    _cpu: float = field(default=0.0, repr=False)

    @classmethod
    def for_target(cls, on_cpu: bool, hub: bool, setting: str = AUTO) -> CoreClock:
        """A target's clock. Until its hub's card says where the hub runs, a CPU target
        with a hub assumes it may share its cores."""
        return cls(shared=hub and on_cpu and setting != "no", setting=setting, on_cpu=on_cpu)

    def follow(self, host: str, cpus: list[int]) -> bool:
        """Share or not as a hub on ``host`` computing on ``cpus`` makes us; True when that
        changed."""
        shared = self.on_cpu and shares_cores(host, cpus, self.setting)
        changed, self.shared = shared != self.shared, shared
        return changed

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def lap(self) -> tuple[float, float]:
        """(wall seconds, alone seconds) since ``start``; alone <= wall."""
        wall = time.perf_counter() - self._wall
        if not self.shared:
            return wall, wall
        return wall, min(wall, time.thread_time() - self._cpu)


