"""Shared fixtures: a tiny random-weight Llama with the embedded model's tokenizer.

Servers and clients started without keys use the user's local keystore; the tests' is a
folder of their own (``STARHUB_KEYS``, inherited by every process they start)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from starhub.models.loading import resolve

torch.set_num_threads(1)


def _pin_worker() -> None:
    """Under ``pytest -n N`` each worker, and every process its tests start, keeps to its
    own share of this process's CPUs: a test then sees a smaller machine, never a neighbour
    that takes the cores its processes were sized for."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(
        os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker.startswith("gw") and 1 < count <= len(cpus):
        os.sched_setaffinity(0, cpus[int(worker[2:])::count])


_pin_worker()

KEYSTORE = tempfile.mkdtemp(prefix="starhub-test-keys-")
os.environ["STARHUB_KEYS"] = KEYSTORE
atexit.register(shutil.rmtree, KEYSTORE, ignore_errors=True)


def tiny_config(vocab_size: int = 49152, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve("default")


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer random Llama on disk, loadable with ``--model <dir>`` by subprocesses."""
    torch.manual_seed(1234)
    model = LlamaForCausalLM(tiny_config()).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from starhub.models.loading import load_model

    return load_model(str(tiny_dir))


class HubThread:
    """A real Hub on an ephemeral loopback port, run in a background event loop."""

    def __init__(self, drafter, bind: str = "tcp://127.0.0.1:0", **config):
        import asyncio

        from starhub.hub.server import Hub, HubConfig

        self.loop = asyncio.new_event_loop()
        self.hub = Hub.__new__(Hub)
        self._started = threading.Event()
        self._config = HubConfig(bind=bind, **config)
        self._drafter = drafter
        self.task = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._started.wait(10)
        self.address = self.hub.bound

    def _run(self) -> None:
        import asyncio

        from starhub.hub.server import Hub

        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.hub = Hub(self._drafter, self._config)
            self.task = asyncio.create_task(self.hub.serve())
            await self.hub.ready.wait()
            self._started.set()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

        self.loop.run_until_complete(main())

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self) -> None:
        if self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


@pytest.fixture
def ngram_hub():
    from starhub.drafters.ngram import NgramDrafter

    hub = HubThread(NgramDrafter(), max_message_bytes=1 << 16, ttl_s=30.0)
    yield hub
    hub.stop()
