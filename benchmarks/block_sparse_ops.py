"""Block-sparse Linear ops on the GPU: forward, input gradient, weight gradient.

One table: for each weight shape (BERT-base, BERT-large, an LLM MLP), token count, block
size and density, the median time of cuBLAS dense, torch's BSR path (``to_sparse_bsr`` +
``F.linear``; its Triton ``sampled_addmm`` for the weight gradient) and this project's
kernels, in bf16. Efficiency = TFLOP/s on kept blocks / cuBLAS dense TFLOP/s on the same
shape (= dense time x density / time); times are
CUDA-graph replays (GPU time, no host launch cost; L2 not flushed), host costs are in
the layer benchmark. The floor is the kept work at the measured dense
8192^3 TFLOP/s or its bytes at the measured copy bandwidth, whichever is longer.

    python3 benchmarks/block_sparse_ops.py [--shapes 'llm up'] [--blocks 128 64]
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    bench_ms,
    copy_bandwidth_gbs,
    device_name,
    environment,
    file_tag,
    gpu_ms,
    write_json,
)
from torch.sparse._triton_ops import sampled_addmm

from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_grid,
    forward_reference,
    input_grad_reference,
    top_blocks,
    weight_grad_reference,
)
from sparse_training.kernels.block_sparse import kernels as bsk

SHAPES = {  # name: (in_features, out_features)
    "bert-base qkv/out 768x768": (768, 768),
    "bert-base up 768->3072": (768, 3072),
    "bert-base down 3072->768": (3072, 768),
    "bert-large up 1024->4096": (1024, 4096),
    "bert-large down 4096->1024": (4096, 1024),
    "llm up 4096->14336": (4096, 14336),
    "llm down 14336->4096": (14336, 4096),
}


def dense_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ a) / 1e9


def torch_bsr_ms(x, g, weight, mask, block) -> dict:
    """torch's own BSR path; a failure is recorded, not hidden."""
    times = {}
    try:
        w_bsr = (weight * mask).to_sparse_bsr(block)
        times["fwd"] = gpu_ms(lambda: torch.nn.functional.linear(x, w_bsr))
        wt_bsr = (weight * mask).t().contiguous().to_sparse_bsr(block[::-1])
        times["dx"] = gpu_ms(lambda: torch.nn.functional.linear(g, wt_bsr))
        out = w_bsr.clone()  # torch.sparse.sampled_addmm refuses BSR; its Triton kernel:
        times["dw"] = gpu_ms(lambda: sampled_addmm(w_bsr, g.t(), x, beta=0.0, out=out))
    except Exception as err:  # noqa: BLE001 - an unsupported case is a table entry
        times["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return times


def relative_errors(x, g, values, topology) -> dict:
    """max |ours - float64 reference| / max |reference| of each op."""
    d = torch.float64
    pairs = {"fwd": (bsk.launch_forward(x, values, topology, None),
                     forward_reference(x.to(d), values.to(d), topology, None)),
             "dx": (bsk.launch_input_grad(g, values, topology),
                    input_grad_reference(g.to(d), values.to(d), topology)),
             "dw": (bsk.launch_weight_grad(g, x, topology, values.dtype),
                    weight_grad_reference(g.to(d), x.to(d), topology))}
    return {op: float((ours.to(d) - ref).abs().max() / ref.abs().max())
            for op, (ours, ref) in pairs.items()}


def row(name, in_f, out_f, tokens, block, density, peak_tflops, bandwidth_gbs,
        use_tma) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
    grid = block_grid(out_f, in_f, block)
    nnz = max(1, round(density * grid[0] * grid[1]))
    block_mask = top_blocks(torch.rand(grid, device="cuda", generator=gen), nnz)
    topology = BlockTopology.from_block_mask(block_mask, out_f, in_f, block, nnz)
    values = torch.randn(nnz, *block, device="cuda", dtype=torch.bfloat16, generator=gen)
    kept = nnz / (grid[0] * grid[1])
    errors = relative_errors(x, g, values, topology)
    dense = {"fwd": gpu_ms(lambda: x @ weight.t()), "dx": gpu_ms(lambda: g @ weight),
             "dw": gpu_ms(lambda: g.t() @ x)}
    ours = {"fwd": gpu_ms(lambda: bsk.launch_forward(x, values, topology, None, use_tma)),
            "dx": gpu_ms(lambda: bsk.launch_input_grad(g, values, topology, use_tma)),
            "dw": gpu_ms(lambda: bsk.launch_weight_grad(g, x, topology, values.dtype,
                                                         use_tma))}
    mask = block_mask.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    mask = mask[:out_f, :in_f]
    theirs = torch_bsr_ms(x, g, weight, mask, block)
    flops = 2 * tokens * in_f * out_f * kept
    element = 2
    bytes_moved = {"fwd": element * (tokens * in_f + tokens * out_f + nnz * block[0] * block[1]),
                   "dx": element * (tokens * out_f + tokens * in_f + nnz * block[0] * block[1]),
                   "dw": element * (tokens * (in_f + out_f) + nnz * block[0] * block[1])}
    result = {"shape": name, "in": in_f, "out": out_f, "tokens": tokens, "block": block,
              "density": kept, "nnz": nnz, "dense_ms": dense, "ours_ms": ours,
              "torch_bsr_ms": theirs, "relative_error": errors}
    for op in ("fwd", "dx", "dw"):
        floor = max(flops / peak_tflops / 1e9, bytes_moved[op] / bandwidth_gbs / 1e6)
        result[f"{op}_floor_ms"] = floor
        result[f"{op}_efficiency"] = dense[op] * kept / ours[op]
        result[f"{op}_vs_floor"] = ours[op] / floor
        if op in theirs:
            result[f"{op}_torch_bsr_efficiency"] = dense[op] * kept / theirs[op]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help="row names of SHAPES (prefix match)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 64, 32])
    parser.add_argument("--tma", choices=["auto", "on", "off"], default="auto",
                        help="tensor descriptors in the kernels (auto: on Hopper)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    args = parser.parse_args()
    peak, bandwidth = dense_peak_tflops(), copy_bandwidth_gbs()
    shapes = {name: shape for name, shape in SHAPES.items()
              if any(name.startswith(prefix) for prefix in args.shapes)}
    blocks = [(b, b) for b in args.blocks]
    print(f"dense bf16 peak {peak:.0f} TFLOP/s, copy {bandwidth:.0f} GB/s")
    print(f"{'shape':28s} {'tok':>6s} {'blk':>4s} {'dens':>5s} | "
          + " | ".join(f"{op:>3s} dense  ours  bsr  eff  bsr-eff x-floor"
                       for op in ("fwd", "dx", "dw")))
    rows = []
    for name, (in_f, out_f) in shapes.items():
        for tokens in args.tokens:
            for block in blocks:
                for density in (0.1, 0.25, 0.5):
                    r = row(name, in_f, out_f, tokens, block, density, peak, bandwidth,
                            {"auto": None, "on": True, "off": False}[args.tma])
                    rows.append(r)
                    cells = []
                    for op in ("fwd", "dx", "dw"):
                        bsr = r["torch_bsr_ms"].get(op, float("nan"))
                        cells.append(f"{r['dense_ms'][op]:8.3f} {r['ours_ms'][op]:6.3f} "
                                     f"{bsr:6.3f} {r[op + '_efficiency']:4.0%} "
                                     f"{r.get(op + '_torch_bsr_efficiency', float('nan')):5.0%}"
                                     f" {r[op + '_vs_floor']:5.2f}")
                    print(f"{name:28s} {tokens:6d} {block[0]:4d} {density:5.2f} | "
                          + " | ".join(cells) + f" err {max(r['relative_error'].values()):.1e}",
                          flush=True)
                    write_json(f"block_sparse_ops_{file_tag(device_name())}"
                               f"_tma_{args.tma}.json", {"environment": environment(), "dense_peak_tflops": peak,
                                "copy_gbs": bandwidth, "rows": rows})

    for kernel in (bsk._dense_sparse_kernel, bsk._sampled_dense_dense_kernel):
        print({key[:3]: str(config) for key, config in kernel.cache.items()})


if __name__ == "__main__":
    main()
