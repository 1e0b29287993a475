"""The benchmarks' shared harness: timing (:func:`bench_ms`, :func:`gpu_ms`, :func:`host_ms`,
:func:`wall_ms`, profiler busy time), where and with what a result was measured
(:func:`environment`), the JSON every script writes (:func:`write_json`), argument types,
copy bandwidth, BERT-large shapes, and stand-ins for the Triton kernels in host-time runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

# triton (the optional ``kernels`` extra) is imported where it is used, so that the scripts
# that only need busy_ms (bert_step.py's CPU check) run without it


class NoLaunch:
    """Stands in for a Triton kernel in host-time runs: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class NoKernel:
    """A compiled Triton kernel whose launch enqueues nothing (host-time runs)."""

    function = packed_metadata = None

    def run(self, *args) -> None:
        pass

    def launch_metadata(self, *args) -> None:
        return None


class NoTuning:
    """An autotuner that hands back :class:`NoKernel` with its first config."""

    def __init__(self, autotuner) -> None:
        self.arg_names, self.fn = autotuner.arg_names, autotuner.fn
        self.best_config = autotuner.configs[0]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: NoKernel()


@contextlib.contextmanager
def stubbed_products():
    """The block-sparse launchers serve CPU tensors with kernels that do nothing: the
    GPU's tuned launch path, host side only. The weight gradient is split in two token
    chunks (summed after the kernel), as on a GPU at BERT-base's token count."""
    from sparse_training.kernels.block_sparse import kernels as bsk
    from sparse_training.kernels.block_sparse import launch, ops
    from sparse_training.kernels.block_sparse.topology import KERNEL_DTYPES

    saved = {(module, name): getattr(module, name) for module, name in [
        (bsk, "_DENSE_SPARSE"), (bsk, "_SAMPLED_DENSE_DENSE"), (bsk, "_multiprocessors"),
        (bsk, "_major_capability"), (bsk, "_token_splits"), (launch, "current_stream"),
        (ops, "_use_kernels")]}
    for name in ("_DENSE_SPARSE", "_SAMPLED_DENSE_DENSE"):
        tuned = getattr(bsk, name)
        stand_in = launch.TunedKernel(NoTuning(tuned.kernel), tuned.grid)
        stand_in.fast = True
        setattr(bsk, name, stand_in)
    bsk._multiprocessors, bsk._major_capability = (lambda index: 132), (lambda index: 9)
    bsk._token_splits = lambda tokens, nnz, device: (-(-tokens // 2), 2)
    launch.current_stream = lambda device: 0
    ops._use_kernels = lambda t: t.dtype in KERNEL_DTYPES
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def linear_and_inputs(in_features: int, out_features: int, tokens: int,
                      dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A CUDA ``nn.Linear``, an input that requires grad and an output gradient."""
    dense = torch.nn.Linear(in_features, out_features, device="cuda", dtype=dtype)
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype, requires_grad=True)
    return dense, x, torch.randn(tokens, out_features, device="cuda", dtype=dtype)


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, CUDA events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def gpu_ms(fn) -> float:
    """Median GPU milliseconds of ``fn`` replayed as a CUDA graph (no host launch cost);
    ``fn`` runs once first, outside the graph, so autotuning happens before capture."""
    fn()
    torch.cuda.synchronize()
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


def host_ms(fn, calls: int = 20) -> float:
    """Host (Python + launch) milliseconds per call: wall time of ``calls`` back-to-back
    calls that only enqueue work (the device is synchronised before, not inside)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def wall_ms(fn, reps: int = 10) -> float:
    """Median wall-clock milliseconds of ``reps`` calls of ``fn`` after one untimed call
    (CPU work, or work too slow for :func:`bench_ms`)."""
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def device_activity(events) -> list:
    """The profiler events that are device work (kernels, copies, memsets): user
    annotations and ``Optimizer.*`` ranges, which span idle time too, left out."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.is_user_annotation and not e.name.startswith("Optimizer.")]


def busy_ms(events) -> float:
    """Union of the device activity intervals (:func:`device_activity`), in ms."""
    return sum(stop - start for start, stop in merged_spans(device_activity(events))) / 1e3


def communication_ms(events, steps: int) -> dict:
    """Per step of a profile of ``steps`` steps, in ms: GPU busy (union of the device
    activity), compute (the same without NCCL's kernels), NCCL kernel time, and the exposed
    communication, the time NCCL kernels run with no compute kernel beside them (busy -
    compute); ``collectives``: per collective kind (AllGather, ReduceScatter, ...) its
    kernels per step, their ms and the ms of them no compute kernel overlaps (whether
    FSDP's prefetch hides that kind)."""
    device = device_activity(events)
    nccl = [e for e in device if "nccl" in e.name.lower()]
    compute = [e for e in device if e not in nccl]
    busy, computing = busy_ms(device) / steps, merged_spans(compute)
    compute_ms = sum(stop - start for start, stop in computing) / 1e3 / steps
    kinds: dict[str, dict[str, float]] = {}
    for event in nccl:
        kind = collective_kind(event.name)
        row = kinds.setdefault(kind, {"count": 0, "ms": 0.0, "exposed_ms": 0.0})
        start, stop = event.time_range.start, event.time_range.end
        row["count"] += 1 / steps
        row["ms"] += (stop - start) / 1e3 / steps
        row["exposed_ms"] += (stop - start - overlap_us(computing, start, stop)) / 1e3 / steps
    return {"gpu_busy_ms": busy, "compute_busy_ms": compute_ms,
            "nccl_ms": sum(e.time_range.elapsed_us() for e in nccl) / 1e3 / steps,
            "exposed_nccl_ms": busy - compute_ms, "collectives": kinds}


def collective_kind(kernel: str) -> str:
    """The collective an NCCL kernel's name runs (``ncclDevKernel_AllGather_RING_LL(...)``
    -> ``AllGather``), or the name up to its first parenthesis where it names none."""
    for kind in ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "Reduce",
                 "SendRecv", "AllToAll"):
        if kind.lower() in kernel.lower():
            return kind
    return kernel.split("(")[0]


def merged_spans(events) -> list[tuple[float, float]]:
    """The union of the events' time ranges (us) as sorted disjoint intervals."""
    spans: list[tuple[float, float]] = []
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return spans


def overlap_us(spans: list[tuple[float, float]], start: float, stop: float) -> float:
    """How much of [start, stop] the disjoint sorted ``spans`` cover, in us."""
    return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in spans if a < stop and b > start)


# on the lent NCCL machines multicast (NVLink SHARP) must stay off: set where missing
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def print_row(row: dict | None) -> None:
    """A run's row on stdout as ``ROW {json}``, the line :func:`printed_rows` reads back
    (nothing for None: the ranks other than 0)."""
    if row is not None:
        print("ROW " + json.dumps(row), flush=True)


def printed_rows(stdout: str) -> list[dict]:
    """The rows :func:`print_row` printed in ``stdout``."""
    return [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def device_name(device: str | None = None) -> str:
    """The GPU's name for ``device`` "cuda" (None: when a CUDA GPU is visible), "cpu" for
    "cpu"; any other string is taken as the name already."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        return torch.cuda.get_device_name(device)
    return device


def environment(device: str | None = None) -> dict:
    """Where and with what a result was measured, stored with every result: the device
    (:func:`device_name`), the host CPU (host-bound steps depend on it), Python, torch and
    CUDA, and triton, lightning and transformers where installed."""
    env = {"device": device_name(device), "cpu": cpu_name(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    for key, package in (("triton", "triton"), ("lightning", "lightning"),
                         ("lightning", "pytorch_lightning"), ("transformers", "transformers")):
        if key not in env:
            with contextlib.suppress(ImportError):
                env[key] = __import__(package).__version__
    return env


def file_tag(name: str) -> str:
    """``name`` (a GPU's or CPU's) made fit for a file name."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def cpu_name() -> str:
    """The CPU's model name (Linux), and how many cores this process may use."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"


def bert_large_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of BERT-large (uncased, with pooler): 335M parameters."""
    h, i, layers = 1024, 4096, 24
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,)]
        shapes += [(i, h), (i,), (h, i), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def results_dir(out: str | os.PathLike | None = None) -> Path:
    """Where results go: ``out``, else ``$OUT``, else ``benchmarks/results/``."""
    return Path(out or os.environ.get("OUT") or Path(__file__).parent / "results")


def write_json(name: str, payload: dict, out: str | os.PathLike | None = None,
               device: str | None = None) -> Path:
    """Write ``payload`` as ``<out>/<name>`` (:func:`results_dir`), with the
    :func:`environment` of ``device`` first where the payload has none."""
    folder = results_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    if "environment" not in payload:
        payload = {"environment": environment(device), **payload}
    path = folder / name
    path.write_text(json.dumps(payload, indent=1))
    return path


def fraction_in(low: float, high: float, closed_high: bool = False):
    """An argparse type: a float in ``(low, high)`` (``(low, high]`` with ``closed_high``)."""
    def parse(text: str) -> float:
        value = float(text)
        if not (low < value < high or closed_high and value == high):
            raise argparse.ArgumentTypeError(
                f"must be a number in ({low:g}, {high:g}{']' if closed_high else ')'}, "
                f"got {text}")
        return value

    return parse


def at_least(low: int):
    """An argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
        return value

    return parse
