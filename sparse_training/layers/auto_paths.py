"""``compress="auto"``: each distinct layer timed both ways on the device it trains on.

A selected Linear weight that could train compressed is described by a :class:`PathKey`
(weight shape, pattern, kept density, compute dtype, device name, tokens per step). For
each distinct key :func:`measure_step` times one training step of that layer both ways,
back to back in this process: masked-dense (``nn.Linear`` forward, backward to the input
and the weight under autocast, then ``AdamW`` on its fp32 weight) and compressed (the
``BlockSparseLinear`` or ``SemiStructuredLinear`` of a random weight with the same
pattern and density, the same step). After warm-up calls (Triton's autotuning, the 2:4
layer's own path choice) it takes the median of repetitions that fill a budget of
:data:`BUDGET_MS`. A model compiled to replay CUDA graphs (``mode="reduce-overhead"``,
:func:`compile_mode`) has no host time between its kernels, so its keys are timed the same
way: each step captured once in a CUDA graph and its replays timed, the GPU's time alone.
Compiled without CUDA graphs the eager step stands for it; compiled in any mode a 2:4 layer
is cuBLAS on its dense weight, so it is not timed (:func:`unmeasured_reason`). The layer
compresses where

    compressed_ms <= (1 - MARGIN) * masked_dense_ms

Times are kept in a JSON file (:class:`PathCache`), keyed by device name, torch and Triton
versions and the key, so a later fit decides without measuring. Off CUDA, or in a compute
dtype the kernels do not take, nothing is measured (:func:`unmeasured_reason`).

A measure is any ``(key, device) -> Timing``; :func:`measure_step` is the real one, tests
give fakes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.pieces.patterns import parse_pattern

EAGER, COMPILED, CUDA_GRAPHS = "eager", "compiled", "cuda graphs"  # compile_mode's answers
MARGIN = 0.03  # compressed must save this share of the masked-dense step to be chosen
BUDGET_MS = 20.0  # timed milliseconds per key, both candidates together
MIN_REPEATS, MAX_REPEATS, WARMUP = 3, 50, 2
MEASURED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CACHE_FILE = "auto_paths.json"
CACHE_VERSION = 1
logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # cache files whose write failed: said once per process


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16``, ``fp32``, ``fp64``, or torch's name of another dtype."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float64: "fp64"}


@dataclass(frozen=True)
class PathKey:
    """What one measurement stands for: layers with equal keys train alike."""

    shape: tuple[int, int]  # (out_features, in_features)
    pattern: str  # spec: "block:128x128", "2:4", "2:4:2d"
    density: float  # kept share, rounded to 3 places
    dtype: str  # compute dtype, dtype_name's
    device: str  # device_name's
    tokens: int  # rows of the input per step
    graphed: bool = False  # timed as CUDA-graph replays (the model replays CUDA graphs)

    def cache_key(self, versions: str) -> str:
        """``versions|device|OUTxIN|pattern|density|dtype|tokens``, ``|cuda graph`` added
        for a graphed key: the cache's entry."""
        return "|".join((versions, self.device, "x".join(map(str, self.shape)), self.pattern,
                         f"{self.density:g}", self.dtype, str(self.tokens),
                         *(["cuda graph"] if self.graphed else [])))


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one training step of a layer on each path."""

    masked_dense_ms: float
    compressed_ms: float

    @property
    def compresses(self) -> bool:
        """compressed_ms <= (1 - MARGIN) * masked_dense_ms."""
        return self.compressed_ms <= (1 - MARGIN) * self.masked_dense_ms

    def text(self, key: PathKey) -> str:
        """The times measured for ``key``, the chosen path's first."""
        first, second = ("compressed", "masked-dense") if self.compresses else (
            "masked-dense", "compressed")
        times = {"compressed": self.compressed_ms, "masked-dense": self.masked_dense_ms}
        return (f"auto: {first} measured {times[first]:.3f} ms, {second} {times[second]:.3f} "
                f"ms per step at {key.tokens} tokens"
                + (" as CUDA-graph replays" if key.graphed else ""))


Measure = Callable[[PathKey, torch.device], Timing]


def unmeasured_reason(device: torch.device, compute_dtype: torch.dtype, nm: bool = False,
                      mode: str = EAGER) -> str | None:
    """Why ``"auto"`` keeps a layer masked-dense without measuring on ``device`` with
    products in ``compute_dtype`` (an N:M pattern's with ``nm``, the model running as
    :func:`compile_mode` says), or None: measure it."""
    if device.type != "cuda":
        return f"auto: on {device.type} the compressed layer multiplies a dense copy"
    if compute_dtype not in MEASURED_DTYPES:
        return (f"auto: {dtype_name(compute_dtype)} compute; the compressed kernels take "
                f"bf16, fp16 and fp32")
    if nm and mode != EAGER:
        return ("auto: compiled, a 2:4 layer multiplies its dense weight (cuBLAS), as "
                "masked-dense does")
    return None


def device_name(device: torch.device) -> str:
    """The GPU's name (``NVIDIA H100 80GB HBM3``), or the device type."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def versions() -> str:
    """``torch X|triton Y`` (``triton -`` where it does not import): a cache entry's
    software."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    return f"torch {torch.__version__}|triton {triton_version}"


def compile_mode(module: nn.Module) -> str:
    """How ``module``'s layers run: :data:`CUDA_GRAPHS` where a submodule (or the module) is
    compiled with Inductor's ``triton.cudagraphs`` (``mode="reduce-overhead"``), else
    :data:`COMPILED` where one is compiled at all, else :data:`EAGER`. It reads the compiler
    config of an ``OptimizedModule`` (``torch.compile(module)``), of ``module.compile()``,
    and of the ``torch.compile``-d LightningModule Lightning unwrapped (its
    ``_compiler_ctx``); a backend with no config (``"aot_eager"``, ``"cudagraphs"``) counts
    as compiled."""
    mode = EAGER
    for sub in module.modules():
        for config in _compiler_configs(sub):
            if isinstance(config, Mapping) and config.get("triton.cudagraphs"):
                return CUDA_GRAPHS
            mode = COMPILED
    return mode


def _compiler_configs(module: nn.Module) -> Iterator[object]:
    """The compiler config (None for a backend without one) of each compiled form of
    ``module``."""
    for compiled in (module, getattr(module, "_compiled_call_impl", None)):
        if callable(config := getattr(compiled, "get_compiler_config", None)):
            yield config()
    context = getattr(module, "_compiler_ctx", None)
    if isinstance(context, Mapping) and "dynamo_ctx" in context:
        yield getattr(context["dynamo_ctx"], "compiler_config", None)


def time_steps(steps: Mapping[str, Callable[[], object]], device: torch.device,
               budget_ms: float = BUDGET_MS) -> dict[str, float]:
    """Median milliseconds per call of each of ``steps``, after :data:`WARMUP` calls each:
    repetitions alternate between them until ``budget_ms`` is spent (at least
    :data:`MIN_REPEATS`, at most :data:`MAX_REPEATS`); CUDA events on CUDA, the wall clock
    elsewhere."""
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(MAX_REPEATS):
        for name, step in steps.items():
            times[name].append(_elapsed_ms(step, device))
        if repeat + 1 >= MIN_REPEATS and sum(map(sum, times.values())) >= budget_ms:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def _elapsed_ms(step: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def measure_step(key: PathKey, device: torch.device, budget_ms: float = BUDGET_MS) -> Timing:
    """Time one training step of ``key``'s layer both ways on ``device`` (module doc); the
    random draws leave the global generators as they were.

    Raises:
        RuntimeError: what the kernels raise (out of memory, no GPU, ...).
    """
    dtype = next(d for d in _DTYPE_NAMES if _DTYPE_NAMES[d] == key.dtype)
    pattern = parse_pattern(key.pattern)
    cuda = device.type == "cuda"
    out_features, in_features = key.shape
    with torch.random.fork_rng(devices=[device] if cuda else []), (
            torch.cuda.device(device) if cuda else contextlib.nullcontext()):
        torch.manual_seed(0)
        dense = nn.Linear(in_features, out_features, bias=False, device=device)
        if pattern.is_nm:
            compressed = SemiStructuredLinear.from_dense(dense, pattern.transposable)
        else:
            block = (pattern.block_rows, pattern.block_cols)
            compressed = BlockSparseLinear.from_dense(dense, block, density=key.density)
        x = torch.randn(key.tokens, in_features, device=device, dtype=dtype,
                        requires_grad=True)
        grad = torch.randn(key.tokens, out_features, device=device, dtype=dtype)
        steps = {name: _train_step(layer, x, grad, dtype, key.graphed) for name, layer in
                 (("masked-dense", dense), ("compressed", compressed))}
        if key.graphed:
            steps = {name: _replayed(step, device) for name, step in steps.items()}
        times = time_steps(steps, device, budget_ms)
    return Timing(times["masked-dense"], times["compressed"])


def _train_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor,
                dtype: torch.dtype, capturable: bool = False) -> Callable[[], None]:
    """One step of ``layer``: forward under autocast to ``dtype`` (no cast cache, which a
    CUDA graph cannot hold), backward to ``x`` and the parameters, AdamW (fused on CUDA;
    ``capturable`` for a CUDA graph)."""
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-6, fused=x.is_cuda or None,
                                  capturable=capturable)
    autocast = dtype != torch.float32

    def step() -> None:
        x.grad = None
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype, enabled=autocast,
                            cache_enabled=False):
            out = layer(x)
        out.backward(grad)
        optimizer.step()

    return step


def _replayed(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """The replay of ``step`` captured in a CUDA graph, after :data:`WARMUP` calls on a side
    stream (the capture recipe of ``torch.cuda.graphs``): the step without its host time.

    Raises:
        RuntimeError: what capturing raises (the caller says the layer was not measured).
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def cache_path() -> Path:
    """``$SPARSE_TRAINING_CACHE/auto_paths.json``, default
    ``~/.cache/sparse_training/auto_paths.json``."""
    root = os.environ.get("SPARSE_TRAINING_CACHE") or Path.home() / ".cache" / "sparse_training"
    return Path(root) / CACHE_FILE


class PathCache:
    """Measured :class:`Timing` s in a JSON file: ``{"version": 1, "timings": {cache key:
    {"masked_dense_ms": .., "compressed_ms": ..}}}``. A file that cannot be read or parsed
    is ignored with a warning (and replaced at the next write); one that cannot be written
    warns once per process, and the times stay in memory."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else cache_path()
        self.versions = versions()
        self._timings: dict[str, dict[str, float]] = self._read()

    def _read(self, quietly: bool = False) -> dict[str, dict[str, float]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not (
                    isinstance(data.get("timings"), dict)):
                raise ValueError(f"not a version {CACHE_VERSION} cache of timings")
            return data["timings"]
        except (OSError, ValueError) as error:
            if not quietly:
                warnings.warn(f"compress='auto': ignoring the unreadable cache {self.path} "
                              f"({error}); measuring again", stacklevel=3)
            return {}

    def get(self, key: PathKey) -> Timing | None:
        entry = self._timings.get(key.cache_key(self.versions))
        try:
            return Timing(float(entry["masked_dense_ms"]), float(entry["compressed_ms"]))
        except (TypeError, KeyError, ValueError):
            return None

    def put(self, key: PathKey, timing: Timing) -> None:
        """Keep ``timing`` and write the file (a temporary file, then ``os.replace``), with
        the entries other processes wrote since it was read."""
        self._timings = {**self._read(quietly=True), **self._timings,
                         key.cache_key(self.versions): asdict(timing)}
        text = json.dumps({"version": CACHE_VERSION, "timings": self._timings}, indent=1,
                          sort_keys=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=CACHE_FILE)
            try:
                with os.fdopen(handle, "w") as file:
                    file.write(text)
                os.replace(temporary, self.path)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
        except OSError as error:
            if str(self.path) not in _WARNED:
                _WARNED.add(str(self.path))
                warnings.warn(f"compress='auto': cannot write the timing cache {self.path} "
                              f"({error}); the next fit measures again (set "
                              f"SPARSE_TRAINING_CACHE to a writable folder)", stacklevel=3)


def choose_paths(keys: Mapping[PathKey, torch.device], *,
                 measure: Measure | None = None, cache: PathCache | None = None,
                 progress: Callable[[str], object] | None = None,
                 agree: Callable[[list], list] | None = None) -> dict[PathKey, Timing | str]:
    """Each key's timing, from ``cache`` or measured (and cached), or why it could not be
    measured (``"auto: could not measure ..."``).

    Args:
        keys: the distinct keys, each with the device to measure it on.
        measure: times a key on a device (default :func:`measure_step`).
        cache: default ``PathCache()`` (:func:`cache_path`).
        progress: says each measurement (default: this module's logger, INFO).
        agree: makes the ranks of a distributed run decide alike: takes this rank's list of
            results (in ``keys``' order) and returns the one every rank uses (rank 0's).
    """
    measure = measure or measure_step
    cache = cache if cache is not None else PathCache()
    say = progress or logger.info
    found: list[Timing | str] = []
    for number, (key, device) in enumerate(keys.items(), 1):
        timing = cache.get(key)
        if timing is None:
            say(f"compress='auto': measuring {number}/{len(keys)}: {key.shape[0]}x"
                f"{key.shape[1]} {key.pattern} density {key.density:g}, {key.dtype} at "
                f"{key.tokens} tokens on {key.device}")
            try:
                timing = measure(key, device)
            except Exception as error:  # noqa: BLE001 - any failure: masked-dense, said
                found.append(f"auto: could not measure on {device} "
                             f"({type(error).__name__}: {error})")
                continue
            cache.put(key, timing)
        found.append(timing)
    if agree is not None:
        found = agree(found)
    return dict(zip(keys, found, strict=True))
