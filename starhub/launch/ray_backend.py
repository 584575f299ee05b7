"""The Ray backend: every process of a deployment is a Ray actor that runs the same
``starhub`` command as the local backend, placed by the resources its config asks for.

The launcher attaches to an existing cluster (``RAY_ADDRESS`` wins over ``ray.address``),
ships each worker its prompts, learns the hub's address from the hub actor (the hub binds
every interface and the actor reports its node's IP), and fetches each worker's output
file when it finishes. Actors are owned by the launcher: it kills them when it stops, and
Ray kills them if the launcher dies; their processes die with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

from starhub.launch.host import WORKDIR, ProcessHost
from starhub.launch.plan import ProcessSpec
from starhub.launch.runner import process_env

log = logging.getLogger("starhub.launch")
CALL_TIMEOUT_S = 60.0


def ray_address(configured: str | None) -> str | None:
    return os.environ.get("RAY_ADDRESS") or configured


def import_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend = \"ray\" needs the ray package on this machine and on "
                           "every node: pip install 'starhub[ray]'") from None
    return ray


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

    def start(self, spec: ProcessSpec, hub: str | None) -> RayHandle:
        options = dict(spec.ray_options)
        actor = self.actor_class.options(name=f"{self.prefix}-{spec.name}", max_restarts=0,
                                         **options).remote(spec.name, None)
        handle = RayHandle(self.ray, actor, spec.name, {})
        try:  # the first call returns once Ray has placed the actor on a node
            self.ray.get(actor.where.remote(), timeout=self.place_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(actor, no_restart=True)
            raise RuntimeError(f"Ray placed no actor for {spec.name} within "
                               f"{self.place_timeout_s:.0f}s: no node offers {options} "
                               f"(see `ray status`)") from None
        prompts = None
        if not spec.serves and self.prompts_text is not None:
            prompts = handle._call("put_file", "prompts.jsonl", self.prompts_text)
        argv = spec.command(hub=hub, prompts=prompts,
                            out=f"{WORKDIR}/{spec.out_name}")[3:]
        handle.where = handle._call("start", argv, process_env(spec))
        return handle

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.shutdown()
