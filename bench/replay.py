"""Recorded greedy runs of a target model, for replay clients that load a hub without
computing anything (``starhub bench --hub-load``).

A recording holds, per prompt, the prompt ids, the greedy continuation and the feature row
of every position (the hidden states the hub's DRAFTER_CARD asks for), plus the model's measured
plain step and tree verification times. Recording runs the targets' own code path
(``targets.verify.TargetModel``) once; the result is cached as ``.npz`` under
``$XDG_CACHE_HOME/starhub/hub-load/``, keyed by everything it depends on, and read back
without pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from starhub.models.prompts import encode_prompt, read_prompts
from starhub.wire.tree import DraftTree

FORMAT = 1
"""Bumped whenever what a recording holds changes, so old caches are never misread."""
VERIFY_NODES = 10
"""Nodes of the tree whose verification is timed: the hub's default node budget."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "starhub" / "hub-load"


@dataclass
class RecordingMeta:
    """What a recording was made from and what the replay clients tell the hub."""

    key: str
    model: str
    prompts: str
    prompt_names: list[str]
    """The recorded prompts' ids in the prompt file."""
    max_new_tokens: int
    feature_layers: list[int]
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer_fp: str
    step_ms: float
    """The model's measured plain one-token step (median over the recording)."""
    verify_ms: float
    """One verification of a ``verify_nodes``-node tree (median)."""
    verify_nodes: int = VERIFY_NODES
    threads: int = 1
    seconds: float = 0.0
    format: int = FORMAT


@dataclass
class Recording:
    meta: RecordingMeta
    prompts: list[np.ndarray]
    """int32 prompt ids, one array per prompt."""
    outputs: list[np.ndarray]
    """int32 greedy continuation; ``outputs[i][0]`` is the token the prefill chose."""
    features: list[np.ndarray]
    """float16 ``[len(prompt) + len(output) - 1, width]``: row j is position j's feature
    (pairs with token j + 1); ``[0, 0]`` when the hub asks for none."""
    path: Path | None = None
    reused: bool = False

    def __len__(self) -> int:
        return len(self.prompts)

    def save(self, path: Path) -> None:
        """Write atomically, so a run killed while saving never leaves a torn cache."""
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"meta": np.array(json.dumps(asdict(self.meta)))}
        for i, (p, o, f) in enumerate(zip(self.prompts, self.outputs, self.features,
                                          strict=True)):
            arrays.update({f"prompt_{i}": p, f"output_{i}": o, f"features_{i}": f})
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        tmp.replace(path)
        self.path = path

    @classmethod
    def load(cls, path: Path) -> Recording:
        with np.load(path, allow_pickle=False) as data:
            meta = RecordingMeta(**json.loads(str(data["meta"])))
            count = len(meta.prompt_names)
            return cls(meta, [data[f"prompt_{i}"] for i in range(count)],
                       [data[f"output_{i}"] for i in range(count)],
                       [data[f"features_{i}"] for i in range(count)], path=path, reused=True)


def recording_key(model: str, model_dir: Path, items: list[tuple[object, str]],
                  max_new_tokens: int, feature_layers: list[int], dtype: str) -> str:
    blob = json.dumps({"format": FORMAT, "model": model, "dir": str(model_dir),
                       "dtype": dtype, "prompts": [[str(i), t] for i, t in items],
                       "max_new_tokens": max_new_tokens,
                       "feature_layers": list(feature_layers)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def ensure_recording(model: str, prompts: str | Path, count: int, max_new_tokens: int,
                     feature_layers: list[int], threads: int = 1, dtype: str = "auto",
                     cache: Path | None = None, progress: bool = True) -> Recording:
    """The cached recording for these settings, made now if there is none."""
    # deferred: transformers load only when this runs
    from starhub.models.loading import resolve

    items = read_prompts(prompts)[:count]
    if not items:
        raise ValueError(f"{prompts} holds no prompts to record")
    key = recording_key(model, resolve(model), items, max_new_tokens, feature_layers, dtype)
    path = (cache or cache_root()) / f"{key}.npz"
    if path.exists():
        try:
            rec = Recording.load(path)
            if rec.meta.format == FORMAT and rec.meta.key == key:
                return rec
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or foreign file: record again over it
    rec = record(model, str(prompts), items, max_new_tokens, feature_layers, threads, dtype,
                 key, progress)
    rec.save(path)
    return rec


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def record(model_spec: str, prompts: str, items: list[tuple[object, str]],
           max_new_tokens: int, feature_layers: list[int], threads: int = 1,
           dtype: str = "auto", key: str = "", progress: bool = True) -> Recording:
    """Decode each prompt greedily with plain steps, keeping every position's features."""
    import torch

    # deferred: transformers load only when this runs
    from starhub.models.loading import load_model, set_threads, tokenizer_fingerprint
    from targets.verify import TargetModel

    started = time.perf_counter()
    previous = torch.get_num_threads()
    set_threads(threads)
    model, tokenizer = load_model(model_spec, dtype=dtype)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    prompts_ids, outputs, features, steps = [], [], [], []
    for n, (id_, text) in enumerate(items, 1):
        ids = encode_prompt(tokenizer, text)
        target = TargetModel(model, feature_layers=list(feature_layers))
        first, feats = target.prefill(ids)
        out, rows = [first], [feats]
        while len(out) < max_new_tokens and out[-1] not in eos:
            t0 = time.perf_counter()
            out.append(target.step())
            steps.append(time.perf_counter() - t0)
            rows.append(target.step_features)
        width = rows[0].shape[-1] if feature_layers else 0
        feats = (torch.cat(rows).float().numpy().astype(np.float16) if width
                 else np.zeros((0, 0), np.float16))
        prompts_ids.append(np.asarray(ids, np.int32))
        outputs.append(np.asarray(out, np.int32))
        features.append(feats)
        _say(progress, f"hub-load: recorded prompt {n}/{len(items)} ({id_}): {len(ids)} "
                       f"prompt + {len(out)} new tokens, {time.perf_counter() - started:.0f}s")
    verify_ms = _time_verify(model, prompts_ids[0], outputs[0], list(feature_layers))
    settled = sorted(steps[len(steps) // 4:]) or [0.0]
    cfg = model.config
    meta = RecordingMeta(
        key=key, model=model_spec, prompts=prompts, prompt_names=[str(i) for i, _ in items],
        max_new_tokens=max_new_tokens, feature_layers=list(feature_layers),
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, tokenizer_fp=tokenizer_fingerprint(tokenizer),
        step_ms=1e3 * settled[len(settled) // 2], verify_ms=verify_ms, threads=threads,
        seconds=time.perf_counter() - started)
    set_threads(previous)
    return Recording(meta, prompts_ids, outputs, features)


def _time_verify(model, prompt: np.ndarray, output: np.ndarray, layers: list[int],
                 nodes: int = VERIFY_NODES, reps: int = 6) -> float:
    """Milliseconds of one tree verification after a recorded context: a chain of
    recorded tokens (its cost depends on the node count, not on which are accepted)."""
    # deferred: transformers load only when this runs
    from targets.verify import TargetModel

    target = TargetModel(model, feature_layers=layers)
    target.prefill([*prompt.tolist(), *output[:-1].tolist()])
    tokens = np.resize(output, nodes).astype(np.int32)
    tree = DraftTree(tokens, np.arange(-1, nodes - 1, dtype=np.int32))
    times = []
    base = target.cached
    for _ in range(reps):
        t0 = time.perf_counter()
        target.verify(tree)
        times.append(time.perf_counter() - t0)
        target.compact()
        target.kv.crop(base)  # every pass after the same context, not a grown one
    settled = sorted(times[reps // 2:])
    return 1e3 * settled[len(settled) // 2]
