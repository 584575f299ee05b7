"""Deployments: start a hub and its targets (or a verifier and its drafters) from one TOML
file, as local subprocesses or as Ray actors, and the helpers that spawn single processes.

Importing this package loads neither torch nor transformers."""

from starhub.launch.spawn import (
    READY,
    HubProcess,
    child_env,
    die_with_parent,
    spawn_hub,
    target_command,
)

__all__ = ["READY", "HubProcess", "child_env", "die_with_parent", "spawn_hub",
           "target_command"]
