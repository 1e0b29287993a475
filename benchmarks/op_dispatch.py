"""Host cost of the block-sparse custom ops' dispatch, per call: each product's launcher
called directly (what the eager autograd Function calls) against the same product through
``torch.ops.sparse_training.*`` (what a default-mode ``torch.compile`` graph calls, grad off
inside the compiled graph, and with grad on for a direct call).

    python3 benchmarks/op_dispatch.py                 # CPU: kernels stubbed (host path only)

The launchers run their GPU host path with kernels that launch nothing
(:func:`_common.stubbed_products`), so the columns hold Python and dispatch only. Columns:
microseconds per call, min over ``--repeats`` loops of ``--calls`` calls; "dispatch": the op
through the dispatcher with grad off minus the direct launcher; "custom_op": the same
implementations registered in this process with ``torch.library.custom_op`` (the package's
registration before it moved to the low-level API), grad off. JSON in ``$OUT`` (or
``benchmarks/results/``) as ``op_dispatch_cpu.json``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import at_least, stubbed_products, write_json

from sparse_training.kernels.block_sparse import kernels, ops
from sparse_training.layers.block_sparse import BlockSparseLinear


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``: the fastest of ``repeats`` loops of ``calls``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def custom_op_twins() -> tuple:
    """The package's three implementations registered again with ``torch.library.custom_op``
    (fake and autograd as the package registers them), as ``torch.ops`` overloads."""
    forward = torch.library.custom_op("op_dispatch::forward", ops._linear_impl, mutates_args=())
    forward.register_fake(ops._linear_fake)
    forward.register_autograd(ops._backward, setup_context=ops._setup_context)
    for name, impl, fake in (("input_grad", ops._input_grad_impl, ops._input_grad_fake),
                             ("weight_grad", ops._weight_grad_impl, ops._weight_grad_fake)):
        torch.library.custom_op(f"op_dispatch::{name}", impl, mutates_args=()).register_fake(
            fake)
    twins = torch.ops.op_dispatch
    return twins.forward.default, twins.input_grad.default, twins.weight_grad.default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=at_least(1), default=3000)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = BlockSparseLinear(128, 128, block=(16, 16), density=0.5, dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    grad_out = torch.randn(32, 128, dtype=torch.bfloat16)
    values, topology, features = layer.values.detach(), layer.topology, (128, 128)
    packed = topology.packed
    forward, input_grad, weight_grad = custom_op_twins()
    products = {
        "forward": (lambda: kernels.forward_product(x, values, topology, None),
                    lambda: torch.ops.sparse_training.block_sparse_linear(
                        x, values, None, *features, packed, True),
                    lambda: forward(x, values, None, *features, packed, True)),
        "input grad": (lambda: kernels.input_grad_product(grad_out, values, topology),
                       lambda: torch.ops.sparse_training.block_sparse_linear_input_grad(
                           grad_out, values, *features, packed, True),
                       lambda: input_grad(grad_out, values, *features, packed, True)),
        "weight grad": (lambda: kernels.weight_grad_product(grad_out, x, topology,
                                                            values.dtype),
                        lambda: torch.ops.sparse_training.block_sparse_linear_weight_grad(
                            grad_out, x, values, *features, packed, True),
                        lambda: weight_grad(grad_out, x, values, *features, packed, True)),
    }
    rows = []
    with stubbed_products():
        for name, (direct, dispatched, custom) in products.items():
            with torch.no_grad():
                row = {"product": name, "direct_us": per_call_us(direct, args.calls,
                                                                 args.repeats),
                       "op_no_grad_us": per_call_us(dispatched, args.calls, args.repeats),
                       "custom_op_no_grad_us": per_call_us(custom, args.calls, args.repeats)}
            values.requires_grad_(True)
            row["op_grad_us"] = per_call_us(dispatched, args.calls, args.repeats)
            values.requires_grad_(False)
            row["dispatch_us"] = row["op_no_grad_us"] - row["direct_us"]
            rows.append(row)
    print(f"{'product':<12} {'direct':>8} {'op, no grad':>12} {'op, grad':>9} {'dispatch':>9}"
          f" {'custom_op':>10}   (us per call)")
    for row in rows:
        print(f"{row['product']:<12} {row['direct_us']:8.1f} {row['op_no_grad_us']:12.1f} "
              f"{row['op_grad_us']:9.1f} {row['dispatch_us']:9.1f} "
              f"{row['custom_op_no_grad_us']:10.1f}")
    print("wrote", write_json("op_dispatch_cpu.json", {
        "threads": torch.get_num_threads(),
        "calls": args.calls, "repeats": args.repeats,
        "rows": rows}))


if __name__ == "__main__":
    main()
