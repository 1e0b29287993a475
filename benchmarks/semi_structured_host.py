"""Where the 2:4 steps lose time that the GPU does not spend (issue 10's open rows).

One run (``cd benchmarks && PYTHONPATH=.. python3 semi_structured_host.py``, ``--tables``
to pick), bf16, these tables:

1. ``layers``: a single BERT-large Linear (1024 -> 4096 and 4096 -> 1024, 4096 tokens) as
   ``nn.Linear`` with torch's fused AdamW, and as ``SemiStructuredLinear(2:4:2d)`` under the
   engine (its fused masked step) and under the engine's hook path. Per variant: wall ms
   per step (back to back, synchronised at the ends), GPU busy ms per step
   (``torch.profiler``), the CUDA runtime calls that can block the host, and the host
   functions with the most own time (``cProfile``).
2. ``adamw``: torch's ``AdamW(fused=True).step()`` alone on the parameters and gradients of
   the BERT-large encoder, dense and with every Linear a ``SemiStructuredLinear`` (run 9:
   3.13 against 2.16 ms of GPU time per step, same 21 launches), with the gradients'
   layout.
3. ``adamw_values``: the same step on random BERT-large-shaped tensors, with and without
   zeros in the gradients and in the weights, to find what differs.
4. ``llm_kernels``: the 8192 <-> 28672 Linear steps at 16k tokens, dense and under the engine
   (run 10: 2.2-2.9 ms slower than its isolated products predict), every GPU kernel's ms
   and calls per step, and the forward alone for comparison.
5. ``harness``: the engine's 8192 -> 28672 step timed by do_bench, then by the wall clock,
   on a layer made by ``from_dense`` and on a deep copy of a trained one (run 12 against
   run 11's 2 ms).
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    bench_ms,
    bert_large_shapes,
    busy_ms,
    environment,
    linear_and_inputs,
    write_json,
)
from semi_structured_bert import DTYPE, bert_large_config, bert_model, gpu_busy_ms, layer_step
from torch import nn

from sparse_training.kernels.semi_structured.paths import wall_ms
from sparse_training.layers.semi_structured import SemiStructuredLinear

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
            "cudaEventSynchronize")


def profiled_step(step, steps: int = 50) -> dict:
    """Wall and GPU busy ms per step, the blocking runtime calls per step (torch.profiler),
    and the host functions with the most own time (cProfile, ms per step)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    wall = wall_ms(step, steps)  # 2 warm-up steps (the first times the 2:4 paths), then timed
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    calls: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name in BLOCKING:
            calls[e.name] = calls.get(e.name, 0) + 1 / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, _)
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    return {"wall_ms": wall, "gpu_busy_ms": busy_ms(events) / steps,
            "blocking_calls_per_step": calls,
            "top_host": [(f"{key[0].split('/')[-1]}:{key[1]}({key[2]})"[:80],
                          value[2] * 1e3 / steps, value[1] / steps) for key, value in top]}


def layer_rows(tokens: int = 4096) -> dict:
    rows = {}
    for name, (in_f, out_f) in {"up 1024->4096": (1024, 4096),
                                "down 4096->1024": (4096, 1024)}.items():
        torch.manual_seed(0)
        dense, x, grad = linear_and_inputs(in_f, out_f, tokens, DTYPE)
        variants = {"dense": (dense, False, "auto"),
                    "2:4 engine": (SemiStructuredLinear.from_dense(dense, True), True, "auto"),
                    "2:4 engine hooks": (SemiStructuredLinear.from_dense(dense, True), True,
                                         False)}
        row = {}
        for variant, (layer, engine, fused) in variants.items():
            row[variant] = profiled_step(layer_step(layer, x, grad, engine, fused=fused))
            r = row[variant]
            print(f"{name:16s} {variant:17s} wall {r['wall_ms']:.3f}  gpu {r['gpu_busy_ms']:.3f}"
                  f" ms  blocking {r['blocking_calls_per_step']}", flush=True)
            for key, ms, count in r["top_host"][:8]:
                print(f"    {key:60s} {ms:.3f} ms x{count:.0f}", flush=True)
        rows[name] = row
    return rows


def adamw_rows() -> dict:
    """torch's fused AdamW step alone on the dense and the 2:4 BERT-large encoder."""
    config = bert_large_config()
    ids = torch.randint(0, config.vocab_size, (16, 384), device="cuda")
    rows = {}
    for variant in ("dense", "2:4"):
        model = bert_model(config, variant, DTYPE)
        out = model.encoder(model.embeddings(input_ids=ids)).last_hidden_state
        out.float().square().mean().backward()
        params = [p for p in model.parameters() if p.grad is not None]
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        optimizer.step()  # state created
        grads = [p.grad for p in params]
        rows[variant] = {
            "step_ms": bench_ms(optimizer.step),
            "tensors": len(params),
            "numel": sum(p.numel() for p in params),
            "grads_not_contiguous": sum(not g.is_contiguous() for g in grads),
            "grad_dtypes": sorted({str(g.dtype) for g in grads}),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "addresses_not_256_aligned": sum(t.data_ptr() % 256 != 0
                                             for p in params for t in (p, p.grad)),
            "weights_with_other_strides": sum(p.stride() != p.grad.stride() for p in params),
        }
        print(f"fused AdamW alone, {variant}: {rows[variant]}", flush=True)
        del model, optimizer, params, grads, out
        torch.cuda.empty_cache()
    return rows


def adamw_value_rows() -> dict:
    """torch's fused AdamW step alone on BERT-large-shaped random bf16 tensors, with half of
    the gradients' entries zero or not, and half of the weights' entries zero or not: does
    its time depend on the values?"""
    rows = {}
    for zero_grads in (False, True):
        for zero_weights in (False, True):
            torch.manual_seed(0)
            params = [nn.Parameter(torch.randn(s, device="cuda", dtype=DTYPE) * 0.02)
                      for s in bert_large_shapes()]
            for p in params:
                keep = torch.rand(p.shape, device="cuda") < 0.5
                p.grad = torch.randn_like(p) * 1e-3 * (keep if zero_grads else 1)
                if zero_weights:
                    p.data.mul_(keep)
            optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
            optimizer.step()
            name = f"grads {'half zero' if zero_grads else 'dense'}, " \
                   f"weights {'half zero' if zero_weights else 'dense'}"
            rows[name] = bench_ms(optimizer.step)
            print(f"fused AdamW alone, random tensors, {name}: {rows[name]:.3f} ms", flush=True)
            del params, optimizer
            torch.cuda.empty_cache()
    return rows


def llm_kernels(shapes: tuple = ((8192, 28672), (28672, 8192)), tokens: int = 16384) -> dict:
    """Every GPU kernel of the dense and the engine's 2:4 Linear steps (ms and calls per
    step), with each step's wall time and the forward alone, per (in, out) shape."""
    return {f"{in_f}x{out_f}": llm_kernel_rows(in_f, out_f, tokens) for in_f, out_f in shapes}


def llm_kernel_rows(in_f: int, out_f: int, tokens: int) -> dict:
    torch.manual_seed(0)
    dense, x, grad = linear_and_inputs(in_f, out_f, tokens, DTYPE)
    sparse = SemiStructuredLinear.from_dense(dense, True)
    rows = {}
    for variant, (layer, engine) in {"dense": (dense, False),
                                     "2:4 engine": (sparse, True)}.items():
        step = layer_step(layer, x, grad, engine)
        for _ in range(3):  # the first steps time the 2:4 paths
            step()
        kernels: dict = {}
        with torch.no_grad():
            forward = bench_ms(lambda layer=layer: layer(x))
        rows[variant] = {"wall_ms": wall_ms(step, 10),
                         "gpu_busy_ms": gpu_busy_ms(step, 5, kernels),
                         "forward_ms": forward, "kernels": kernels}
        print(f"{in_f}x{out_f} {variant}: wall {rows[variant]['wall_ms']:.2f} ms, gpu "
              f"{rows[variant]['gpu_busy_ms']:.2f} ms, forward alone {forward:.2f} ms", flush=True)
        for name, (ms, calls) in list(kernels.items())[:12]:
            print(f"    {name[:70]:70s} {ms:.3f} ms x{calls:.0f}", flush=True)
    rows["choice"] = str(sparse.paths(x))
    return rows


def harness_rows(in_f: int = 8192, out_f: int = 28672, tokens: int = 16384) -> dict:
    """The engine's 2:4 step of one layer timed both ways the tables time it (run 12's
    do_bench layer table read 2 ms more than run 11's back-to-back wall clock): first
    do_bench (``bench_ms``, an L2 flush before each call), then ``wall_ms`` on the same
    layer (after do_bench's steps, with a new engine), for a layer made by ``from_dense``
    and for a deep copy of a layer that trained first (as the layer table's engine column
    does), with the dense step as the control."""
    import copy

    from semi_structured import step_ms

    torch.manual_seed(0)
    dense, x, grad = linear_and_inputs(in_f, out_f, tokens, DTYPE)
    fresh = SemiStructuredLinear.from_dense(dense, True)
    trained = SemiStructuredLinear.from_dense(dense, True)
    step_ms(trained, x, grad)  # the layer masking dW itself, as the table's "step" column
    layers = {"dense": (dense, False), "2:4 engine, fresh layer": (fresh, True),
              "2:4 engine, deep copy": (copy.deepcopy(trained), True)}
    rows = {}
    for variant, (layer, engine) in layers.items():
        rows[variant] = {"do_bench_ms": step_ms(layer, x, grad, engine=engine)}
        step = layer_step(layer, x, grad, engine)
        for _ in range(3):
            step()
        rows[variant]["wall_ms"] = wall_ms(step, 10)
        print(f"{variant}: do_bench {rows[variant]['do_bench_ms']:.2f} ms, back-to-back wall "
              f"{rows[variant]['wall_ms']:.2f} ms", flush=True)
    return rows


TABLES = {"layers": layer_rows, "adamw": adamw_rows, "adamw_values": adamw_value_rows,
          "llm_kernels": llm_kernels, "harness": harness_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES),
                        help="tables to run (default: all)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = parser.parse_args()
    result = {"environment": environment()}
    result.update({name: TABLES[name]() for name in args.tables})
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    print("JSON:", write_json(f"semi_structured_host_{gpu}{args.tag}.json", result))


if __name__ == "__main__":
    main()
