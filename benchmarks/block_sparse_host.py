"""Host cost of the block-sparse Linear: Triton's launch path vs the cached tuned kernels.

For BERT-large up 1024->4096 and down 4096->1024 at 8192 tokens, blocks 128 and 64 at
density 0.1, bf16, forward + backward (input, weight and bias gradients) of ``nn.Linear``
and ``BlockSparseLinear`` with both launch paths of the kernels:

* ``plain``: ``kernel[grid](...)`` at every call (autotuner, heuristics, JIT binding);
* ``tuned``: :class:`~sparse_training.kernels.block_sparse.launch.TunedKernel`'s direct
  launch of the compiled kernel the autotuner picked.

Columns: host ms per step (``host_ms``: back-to-back calls that only enqueue, median of
7), GPU ms (``gpu_ms``: CUDA-graph replay) and ``do_bench`` ms (host included, as a
training step sees it). Then host microseconds per launcher call, a check that both paths
give bit-identical outputs and gradients, and a cProfile of the tuned step (backward on
the calling thread).

    cd benchmarks && PYTHONPATH=.. python3 block_sparse_host.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics

import torch
from _common import bench_ms, environment, gpu_ms, host_ms, linear_and_inputs, write_json
from torch import nn

from sparse_training import BlockSparseLinear
from sparse_training.kernels.block_sparse import kernels as bsk
from sparse_training.kernels.block_sparse import launch

DTYPE = torch.bfloat16
SHAPES = {"bert-large up 1024->4096": (1024, 4096), "bert-large down 4096->1024": (4096, 1024)}


def set_path(path: str) -> None:
    """Choose the launch path of both kernels."""
    for kernel in (bsk._DENSE_SPARSE, bsk._SAMPLED_DENSE_DENSE):
        kernel.fast = path == "tuned"


def step_of(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)
    return step


def timings(step) -> dict:
    try:
        graph_ms = gpu_ms(step)
    except RuntimeError as err:  # a capture failure is a table entry, not the end of the run
        graph_ms = float("nan")
        print(f"  gpu_ms failed: {str(err).splitlines()[0][:120]}")
    return {"host_ms": statistics.median(host_ms(step) for _ in range(7)),
            "gpu_ms": graph_ms, "bench_ms": bench_ms(step)}


def results(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    step_of(layer, x, grad)()
    out = layer(x)
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


def launcher_us(x, grad, layer: BlockSparseLinear) -> dict:
    """Host microseconds of one call of each launcher."""
    values, topology, bias = layer.values.detach(), layer.topology, layer.bias.detach()
    calls = {"fwd": lambda: bsk.launch_forward(x, values, topology, bias),
             "dx": lambda: bsk.launch_input_grad(grad, values, topology),
             "dw": lambda: bsk.launch_weight_grad(grad, x, topology, values.dtype)}
    return {op: 1e3 * statistics.median(host_ms(call) for _ in range(7))
            for op, call in calls.items()}


def profile(step, path: str) -> str:
    """cProfile of 200 steps, backward on this thread; the top functions by own time."""
    set_path(path)
    with torch.autograd.set_multithreading_enabled(False):
        step()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            step()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def main(tokens: int = 8192) -> None:
    rows, profiles = [], {}
    print(f"Triton launch hooks (enter, exit): {launch._hooks()}")
    print(f"{'layer':28s} {'blk':>4s} {'path':>6s} {'host ms':>8s} {'gpu ms':>7s} "
          f"{'bench ms':>8s} {'vs dense':>8s}  launcher us (fwd dx dw)")
    for name, (in_f, out_f) in SHAPES.items():
        dense, x, grad = linear_and_inputs(in_f, out_f, tokens, DTYPE)
        base = timings(step_of(dense, x, grad))
        rows.append({"layer": name, "block": None, "path": "dense", **base})
        print(f"{name:28s} {'':>4s} {'dense':>6s} {base['host_ms']:8.3f} {base['gpu_ms']:7.3f} "
              f"{base['bench_ms']:8.3f}", flush=True)
        for block in (128, 64):
            sparse = BlockSparseLinear.from_dense(dense, block=(block, block), density=0.1)
            step = step_of(sparse, x, grad)
            outputs = {}
            for path in ("plain", "tuned"):
                set_path(path)
                outputs[path] = results(sparse, x, grad)  # the first call tunes
                row = {"layer": name, "block": block, "density": sparse.density, "path": path,
                       **timings(step), "launcher_us": launcher_us(x.detach(), grad, sparse)}
                row["bench_vs_dense"] = base["bench_ms"] / row["bench_ms"]
                rows.append(row)
                us = " ".join(f"{v:5.1f}" for v in row["launcher_us"].values())
                print(f"{name:28s} {block:4d} {path:>6s} {row['host_ms']:8.3f} "
                      f"{row['gpu_ms']:7.3f} {row['bench_ms']:8.3f} "
                      f"{row['bench_vs_dense']:7.2f}x  {us}", flush=True)
            same = all(torch.equal(a, b) for a, b in zip(*outputs.values(), strict=True))
            cached = [len(k._launches) for k in (bsk._DENSE_SPARSE, bsk._SAMPLED_DENSE_DENSE)]
            rows[-1].update(bit_identical_to_plain=same, cached_launches=cached)
            print(f"  tuned == plain (outputs and gradients, bit for bit): {same}; "
                  f"cached direct launches (dsd, sdd): {cached}")
            if name.endswith("1024->4096"):
                for path in ("plain", "tuned"):
                    profiles[f"{block} {path}"] = profile(step, path)
    set_path("tuned")
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    path = write_json(f"block_sparse_host_{gpu}.json",
                      {"environment": environment(), "tokens": tokens, "rows": rows})
    with open(os.path.join(os.path.dirname(path), f"block_sparse_host_profile_{gpu}.txt"),
              "w") as f:
        for label, text in profiles.items():
            f.write(f"=== {label}\n{text}\n")
    print("\n" + "\n".join(profiles["128 tuned"].splitlines()[:30]))


if __name__ == "__main__":
    main()
