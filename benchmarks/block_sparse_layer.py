"""Whole block-sparse layers on the GPU: Linear forward + backward, a BERT-large MLP block
training step, and the memory of weights + gradients + AdamW state.

Three tables, one run, bf16 (``python3 benchmarks/block_sparse_layer.py``):

1. ``layer``: one Linear, forward + backward (input and weight gradients), median time of
   ``nn.Linear`` (cuBLAS), ``BlockSparseLinear`` and torch's BSR path (its forward, input-
   gradient and ``sampled_addmm`` ops summed: torch has no BSR weight gradient in autograd).
   Times include the host (``do_bench``, no CUDA graph), as a training step sees them.
2. ``mlp``: LayerNorm -> Linear 1024->4096 -> GELU -> Linear 4096->1024, 16 x 512 tokens,
   forward + backward + ``AdamW(fused=True)`` step, dense vs both Linears block-sparse.
3. ``memory``: ``torch.cuda.memory_allocated`` of weights + gradients + AdamW state after a
   step (the input excluded), and the step's peak (``max_memory_allocated``), dense vs
   90% block-sparse.
"""

from __future__ import annotations

import torch
from _common import bench_ms, device_name, environment, file_tag, linear_and_inputs, write_json
from block_sparse_ops import torch_bsr_ms
from torch import nn

from sparse_training import BlockSparseLinear

DTYPE = torch.bfloat16
LAYER_SHAPES = {"bert-large up 1024->4096": (1024, 4096), "bert-large down 4096->1024": (4096, 1024),
                "llm up 4096->14336": (4096, 14336), "llm down 14336->4096": (14336, 4096)}


def fwd_bwd_ms(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)
    return bench_ms(step)


def layer_rows(tokens: int = 8192) -> list[dict]:
    rows = []
    print(f"\n{'layer':28s} {'blk':>4s} {'dens':>5s} {'dense ms':>9s} {'ours':>7s} "
          f"{'torch bsr':>9s} {'speed-up':>8s} {'vs bsr':>7s}")
    for name, (in_f, out_f) in LAYER_SHAPES.items():
        dense, x, grad = linear_and_inputs(in_f, out_f, tokens, DTYPE)
        dense_ms = fwd_bwd_ms(dense, x, grad)
        for block in (128, 64):
            for density in (0.1, 0.25, 0.5):
                sparse = BlockSparseLinear.from_dense(dense, block=(block, block),
                                                      density=density)
                ours = fwd_bwd_ms(sparse, x, grad)
                mask = sparse.to_dense().weight != 0
                bsr = torch_bsr_ms(x.detach(), grad, dense.weight.detach(), mask, (block, block))
                bsr_ms = sum(bsr.get(op, float("nan")) for op in ("fwd", "dx", "dw"))
                rows.append({"layer": name, "tokens": tokens, "block": block,
                             "density": sparse.density, "dense_ms": dense_ms, "ours_ms": ours,
                             "torch_bsr_ms": bsr_ms, "torch_bsr": bsr,
                             "speedup": dense_ms / ours, "vs_torch_bsr": bsr_ms / ours})
                print(f"{name:28s} {block:4d} {sparse.density:5.2f} {dense_ms:9.3f} "
                      f"{ours:7.3f} {bsr_ms:9.3f} {dense_ms / ours:7.2f}x {bsr_ms / ours:6.2f}x",
                      flush=True)
    return rows


def mlp(block: tuple[int, int] | None, density: float) -> nn.Sequential:
    model = nn.Sequential(nn.LayerNorm(1024), nn.Linear(1024, 4096), nn.GELU(),
                          nn.Linear(4096, 1024)).to("cuda", DTYPE)
    if block is not None:
        for i in (1, 3):
            model[i] = BlockSparseLinear.from_dense(model[i], block=block, density=density)
    return model


def mlp_rows(tokens: int = 16 * 512) -> list[dict]:
    x = torch.randn(tokens, 1024, device="cuda", dtype=DTYPE, requires_grad=True)
    grad = torch.randn(tokens, 1024, device="cuda", dtype=DTYPE)
    rows = []
    print(f"\n{'MLP block (fwd+bwd+AdamW)':28s} {'ms':>7s} {'speed-up':>8s}")
    for block, density in [(None, 1.0), ((128, 128), 0.1), ((64, 64), 0.1), ((128, 128), 0.5)]:
        model = mlp(block, density)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            model(x).backward(grad)
            optimizer.step()
        ms = bench_ms(step)
        label = "dense" if block is None else f"block {block[0]} density {density}"
        rows.append({"model": label, "tokens": tokens, "ms": ms})
        rows[-1]["speedup"] = rows[0]["ms"] / ms
        print(f"{label:28s} {ms:7.3f} {rows[-1]['speedup']:7.2f}x", flush=True)
    return rows


def memory_rows() -> list[dict]:
    rows = []
    print(f"\n{'memory (weights+grads+AdamW)':34s} {'dense MiB':>9s} {'90% MiB':>8s} "
          f"{'ratio':>6s} {'peak ratio':>10s}")
    for name, (in_f, out_f) in list(LAYER_SHAPES.items())[::2]:
        sizes = {}
        for kind in ("warm-up", "dense", "sparse"):  # warm-up: autotuning's buffers
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            x = torch.randn(64, in_f, device="cuda", dtype=DTYPE)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            layer = (nn.Linear(in_f, out_f, device="cuda", dtype=DTYPE) if kind == "dense" else
                     BlockSparseLinear(in_f, out_f, block=(128, 128), density=0.1,
                                       device="cuda", dtype=DTYPE))
            optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-4, fused=True)
            layer(x).sum().backward()
            optimizer.step()
            torch.cuda.synchronize()
            sizes[kind] = (torch.cuda.memory_allocated() - base,
                           torch.cuda.max_memory_allocated() - base)
            del layer, optimizer
        ratio = sizes["sparse"][0] / sizes["dense"][0]
        peak_ratio = sizes["sparse"][1] / sizes["dense"][1]
        rows.append({"layer": name, "dense_bytes": sizes["dense"][0],
                     "sparse_bytes": sizes["sparse"][0], "dense_peak": sizes["dense"][1],
                     "sparse_peak": sizes["sparse"][1], "ratio": ratio,
                     "peak_ratio": peak_ratio})
        print(f"{name:34s} {sizes['dense'][0] / 2**20:9.1f} {sizes['sparse'][0] / 2**20:8.1f} "
              f"{ratio:6.1%} {peak_ratio:10.1%}", flush=True)
    return rows


def main() -> None:
    """The three tables; the JSON is rewritten after each, so a run cut short keeps them."""
    name = f"block_sparse_layer_{file_tag(device_name())}.json"
    result = {"environment": environment()}
    for table, rows in (("memory", memory_rows), ("mlp", mlp_rows), ("layer", layer_rows)):
        result[table] = rows()
        write_json(name, result)


if __name__ == "__main__":
    main()
