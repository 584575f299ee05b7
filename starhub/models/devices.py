"""Where a process's model lives: ``--device`` and ``--device-map`` resolved against the
GPUs this process can see.

A GPU that is not there is a clear error at load time, not a CUDA assertion deep inside a
forward pass. Everything past loading is device-agnostic: inputs follow the model's first
parameter, and tensors cross to the CPU once, where they meet the wire (``to_wire``).
"""

from __future__ import annotations

import os

import torch

from starhub.options import AUTO


def _no_gpu(flag: str) -> ValueError:
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={seen!r}" if seen is not None else "no CUDA_VISIBLE_DEVICES"
    return ValueError(f"{flag}: no CUDA GPU is visible to this process (torch "
                      f"{torch.__version__}, {where}); use --device cpu or auto")


def resolve_device(spec: str = AUTO) -> str:
    """``auto`` is ``cuda:0`` where a GPU is visible, else ``cpu``; ``cuda`` is ``cuda:0``."""
    spec = str(spec).strip().lower()
    if spec == "cpu" or (spec == AUTO and not torch.cuda.is_available()):
        return "cpu"
    if spec == AUTO:
        return "cuda:0"
    kind, _, index = spec.partition(":")
    if kind != "cuda" or not (index.isdigit() or index == ""):
        raise ValueError(f"--device: expected cpu, cuda, cuda:N or auto, got '{spec}'")
    if not torch.cuda.is_available():
        raise _no_gpu(f"--device {spec}")
    n = int(index or 0)
    if n >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: this process sees {torch.cuda.device_count()} "
                         f"GPU(s), numbered from 0")
    return f"cuda:{n}"


def device_map_kwargs(spec: str | None) -> dict:
    """``from_pretrained`` arguments that spread a model over GPUs with accelerate: ``auto``
    over every visible GPU, ``0,1`` over those. Never onto the CPU or disk: a model that does
    not fit fails to load instead of decoding a hundred times slower."""
    if not spec:
        return {}
    if not torch.cuda.is_available():
        raise _no_gpu(f"--device-map {spec}")
    count = torch.cuda.device_count()
    if str(spec).strip().lower() == AUTO:
        gpus = list(range(count))
    else:
        try:
            gpus = [int(g) for g in str(spec).split(",") if g.strip()]
        except ValueError:
            raise ValueError(f"--device-map: expected 'auto' or GPU indices such as 0,1, "
                             f"got '{spec}'") from None
        if not gpus or min(gpus) < 0 or max(gpus) >= count:
            raise ValueError(f"--device-map {spec}: this process sees {count} GPU(s), "
                             f"numbered from 0")
    return {"device_map": "auto",
            "max_memory": {g: torch.cuda.mem_get_info(g)[0] for g in gpus}}


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model takes its inputs: its first parameter's device (under a device map,
    the embedding's GPU; accelerate's hooks move activations on from there)."""
    return next(model.parameters()).device
