"""The Ray backend: every process of a deployment is a Ray actor that runs the same
``starhub`` command as the local backend, placed by the resources its config asks for.

The launcher attaches to an existing cluster (``RAY_ADDRESS`` wins over ``ray.address``),
ships each worker its prompts, learns the hub's address from the hub actor (the hub binds
every interface and the actor reports its node's IP), and fetches each worker's output
file as soon as it finishes. Actors are owned by the launcher: it kills them when it stops
(a finished target's at once, which frees its resources), and Ray kills them if the launcher
dies; their processes die with them.

Before any actor is asked for, the plan's demands are held against the cluster's nodes
(``placement_problems``): a process that no node could ever host (a GPU config on a CPU
cluster, a label no node has) or a deployment that needs more than the whole cluster has
fails at once, naming what is asked and what the cluster has. A request that the cluster
could meet but that stays pending (other jobs hold the resources) times out with the same
account.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path

from starhub.launch.host import WORKDIR, ProcessHost
from starhub.launch.plan import ProcessSpec
from starhub.launch.runner import CannotPlace, process_env

log = logging.getLogger("starhub.launch")
CALL_TIMEOUT_S = 60.0
PLACE_POLL_S = 1.0
PENDING_NOTE_S = 30.0
"""While an actor waits to be placed: how often to look, and to say what it waits for."""
SHOWN_NODES = 4
EPS = 1e-9


def ray_address(configured: str | None) -> str | None:
    return os.environ.get("RAY_ADDRESS") or configured


def import_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend = \"ray\" needs the ray package on this machine and on "
                           "every node: pip install 'starhub[ray]'") from None
    return ray


def demand(options: dict) -> dict[str, float]:
    """The Ray resources an actor started with ``options`` reserves, by Ray's names."""
    need = {"CPU": float(options.get("num_cpus") or 0),
            "GPU": float(options.get("num_gpus") or 0),
            **{k: float(v) for k, v in (options.get("resources") or {}).items()}}
    return {k: v for k, v in need.items() if v > 0}


def label_matches(labels: dict[str, str], key: str, want: str) -> bool:
    """Ray's label selector for one key: ``value``, ``!value``, ``in(a,b)``, ``!in(a,b)``."""
    negate = want.startswith("!")
    body = want[1:] if negate else want
    if body.startswith("in(") and body.endswith(")"):
        values = {v.strip() for v in body[3:-1].split(",")}
    else:
        values = {body}
    return (labels.get(key) in values) != negate


def _has(node: dict, resource: str, amount: float) -> bool:
    return (node.get("Resources") or {}).get(resource, 0.0) + EPS >= amount


def _labelled(node: dict, key: str, want: str) -> bool:
    return label_matches(node.get("Labels") or {}, key, want)


def _amount(value: float) -> str:
    return f"{value:g}"


def _describe(need: dict[str, float], selector: dict[str, str] | None = None) -> str:
    text = ", ".join(f"{_amount(v)} {k}" for k, v in need.items()) or "no resources"
    if selector:
        text += " on a node labelled " + ", ".join(f"{k}={v}" for k, v in selector.items())
    return text


def _node_text(node: dict, keys: list[str]) -> str:
    have = node.get("Resources") or {}
    res = ", ".join(f"{_amount(have.get(k, 0.0))} {k}" for k in keys)
    labels = {k: v for k, v in (node.get("Labels") or {}).items()
              if not k.startswith("ray.io/")}
    lab = ", ".join(f"{k}={v}" for k, v in labels.items()) or "none"
    return f"{node.get('NodeManagerAddress', '?')} ({res}; labels: {lab})"


def cluster_text(nodes: list[dict], keys: list[str]) -> str:
    """The alive nodes and what each offers of ``keys``, for an error message."""
    alive = [n for n in nodes if n.get("Alive")]
    keys = list(dict.fromkeys(["CPU", "GPU", *keys]))
    total = {k: sum((n.get("Resources") or {}).get(k, 0.0) for n in alive) for k in keys}
    shown = "; ".join(_node_text(n, keys) for n in alive[:SHOWN_NODES])
    more = f"; and {len(alive) - SHOWN_NODES} more" if len(alive) > SHOWN_NODES else ""
    return (f"the cluster has {_describe(total) if alive else 'nothing'} on {len(alive)} "
            f"alive node{'' if len(alive) == 1 else 's'}" + (f": {shown}{more}" if alive else ""))


def placement_problems(processes: list[ProcessSpec], nodes: list[dict]) -> list[str]:
    """Why the cluster of ``nodes`` (``ray.nodes()``) can never run every process of a plan
    at once, in words; empty when it may. Only certain refusals: a process that no alive
    node could host on its own, then demands that add up to more than all nodes have."""
    alive = [n for n in nodes if n.get("Alive")]
    problems: list[str] = []
    groups: dict[tuple, list[str]] = {}
    for spec in processes:
        need = demand(spec.ray_options)
        selector = dict(spec.ray_options.get("label_selector") or {})
        groups.setdefault((spec.section, tuple(need.items()), tuple(selector.items())),
                          []).append(spec.name)
    for (_section, need_items, selector_items), names in groups.items():
        need, selector = dict(need_items), dict(selector_items)
        if any(all(_has(n, k, v) for k, v in need.items())
               and all(_labelled(n, k, w) for k, w in selector.items()) for n in alive):
            continue
        missing = [f"{_amount(v)} {k}" for k, v in need.items()
                   if not any(_has(n, k, v) for n in alive)]
        missing += [f"the label {k}={w}" for k, w in selector.items()
                    if not any(_labelled(n, k, w) for n in alive)]
        why = ("; ".join(f"no node has {m}" for m in missing) if missing
               else "no one node has all of that")
        who = (f"{names[0]} asks" if len(names) == 1
               else f"{len(names)} processes ({names[0]} .. {names[-1]}) each ask")
        problems.append(f"{who} for {_describe(need, selector)}: {why}")
    if not problems:
        asked: dict[str, float] = {}
        for spec in processes:
            for k, v in demand(spec.ray_options).items():
                asked[k] = asked.get(k, 0.0) + v
        total = {k: sum((n.get("Resources") or {}).get(k, 0.0) for n in alive) for k in asked}
        short = [k for k, v in asked.items() if v > total[k] + EPS]
        if short:
            problems.append(f"the {len(processes)} processes run at once and together ask for "
                            f"{_describe(asked)}: more {' and '.join(short)} than the whole "
                            f"cluster has")
    return problems


class RayHandle:
    def __init__(self, ray, actor, name: str, where: dict):
        self.ray, self.actor, self.name, self.where = ray, actor, name, where

    def _call(self, method: str, *args):
        return self.ray.get(getattr(self.actor, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def tick(self, since: int) -> dict:
        return self._call("tick", since)

    def stop(self) -> int | None:
        return self._call("stop")

    def fetch_output(self, spec: ProcessSpec, out_dir: Path) -> None:
        text = self._call("read_file", spec.out_name)
        (out_dir / spec.out_name).write_text(text or "", encoding="utf-8")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call("cleanup")
        self.ray.kill(self.actor, no_restart=True)


class RayBackend:
    poll_s = 0.5

    def __init__(self, address: str | None, namespace: str, deployment: str,
                 prompts: str | None, place_timeout_s: float = 600.0):
        ray = import_ray()
        if not address:
            raise RuntimeError("backend = \"ray\" attaches to a running cluster: set "
                               "ray.address in the config or RAY_ADDRESS (start one with "
                               "`ray start --head`)")
        self.ray, self.place_timeout_s = ray, place_timeout_s
        self.prompts_text = Path(prompts).read_text(encoding="utf-8") if prompts else None
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
        self.actor_class = ray.remote(ProcessHost)
        self.prefix = re.sub(r"[^A-Za-z0-9_.-]", "-", deployment)
        log.info("attached to the Ray cluster at %s", address)

    def check(self, processes: list[ProcessSpec]) -> None:
        """Refuse, before any actor is asked for, a plan this cluster can never run."""
        nodes = self.ray.nodes()
        problems = placement_problems(processes, nodes)
        if problems:
            keys = [k for spec in processes for k in demand(spec.ray_options)]
            raise CannotPlace("this Ray cluster cannot place the deployment:\n"
                              + "".join(f"    {p}\n" for p in problems)
                              + f"    {cluster_text(nodes, keys)} (see `ray status`)")

    def _free_text(self, need: dict[str, float]) -> str:
        try:
            free, total = self.ray.available_resources(), self.ray.cluster_resources()
        except Exception as exc:  # an account of the cluster must not hide the real error
            return f"the cluster's resources are unknown ({exc})"
        keys = list(dict.fromkeys(["CPU", *need]))
        return "free now: " + ", ".join(f"{_amount(free.get(k, 0.0))} of "
                                        f"{_amount(total.get(k, 0.0))} {k}" for k in keys)

    def _wait_placed(self, spec: ProcessSpec, actor) -> None:
        """Return once Ray has placed ``actor`` (its first call answers); say what it waits
        for every ``PENDING_NOTE_S``; give up after ``place_timeout_s``."""
        ref = actor.where.remote()
        start = time.monotonic()
        note_at = start + PENDING_NOTE_S
        need = demand(spec.ray_options)
        asks = _describe(need, spec.ray_options.get("label_selector"))
        while not self.ray.wait([ref], timeout=PLACE_POLL_S)[0]:
            now = time.monotonic()
            if now - start > self.place_timeout_s:
                raise CannotPlace(f"Ray placed no actor for {spec.name} within "
                                  f"{self.place_timeout_s:.0f}s (ready_timeout_s): it asks for "
                                  f"{asks}; {self._free_text(need)} (see `ray status`)")
            if now >= note_at:
                note_at = now + PENDING_NOTE_S
                log.info("waiting %.0fs for Ray to place %s: it asks for %s; %s",
                         now - start, spec.name, asks, self._free_text(need))
        self.ray.get(ref, timeout=CALL_TIMEOUT_S)

    def start(self, spec: ProcessSpec, hub: str | None) -> RayHandle:
        options = dict(spec.ray_options)
        actor = self.actor_class.options(name=f"{self.prefix}-{spec.name}", max_restarts=0,
                                         **options).remote(spec.name, None)
        handle = RayHandle(self.ray, actor, spec.name, {})
        try:
            self._wait_placed(spec, actor)
        except BaseException:  # not placed, or interrupted while it waited: no actor stays
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            raise
        prompts = None
        if not spec.serves and self.prompts_text is not None:
            prompts = handle._call("put_file", "prompts.jsonl", self.prompts_text)
        settings = spec.environment(hub=hub, prompts=prompts, out=f"{WORKDIR}/{spec.out_name}")
        handle.where = handle._call("start", spec.command()[3:],
                                    {**process_env(spec), **settings})
        return handle

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.shutdown()
