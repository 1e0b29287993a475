"""Mask computation on the GPU at BERT-large size: Triton kernels vs torch paths.

Run on a CUDA machine:  python benchmarks/mask_compute.py
Over the 2-D weights of BERT-large (the prunable ones; scores = |w|, fp32):

- N:M (2:4): ``nm_topk_masks`` (one launch for all weights; also its kernel alone
  and its host time per call), ``nm_topk_mask`` per
  tensor, torch ``topk`` + ``scatter_`` per tensor; floor = (4 B read + 1 B written)
  per weight / copy bandwidth.
- Global magnitude threshold (keep 10%): ``global_magnitude_threshold`` (radix
  select) vs ``torch.cat`` + ``kthvalue`` and ``torch.cat`` + ``topk``; floor = one
  read of all weights.
- Block scores (16x16 sums of |w|): torch reshape + sum per tensor vs the floor of
  reading every weight once.

Checks each kernel against its torch reference first. Prints one table and writes
mask_compute.json to $OUT or benchmarks/results/.

Without a GPU:  python benchmarks/mask_compute.py --host-cpu
Host time per ``nm_topk_masks`` call over the 146 BERT-large shapes on this machine's
CPU with the kernel launch stubbed out (TRITON_INTERPRET=1, tensors never touched):
cached plan, and plan rebuilt every call; writes mask_host_cpu.json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    NoLaunch,
    bench_ms,
    bert_large_shapes,
    copy_bandwidth_gbs,
    cpu_name,
    environment,
    host_ms,
    write_json,
)
from sparse_training.kernels import (  # noqa: E402
    global_magnitude_threshold,
    global_magnitude_threshold_reference,
    nm_topk_mask,
    nm_topk_mask_reference,
    nm_topk_masks,
)
from sparse_training.kernels import nm_mask as nmk  # noqa: E402


def torch_nm(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    groups = score.reshape(-1, m)
    idx = groups.topk(n, dim=1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(1, idx, True).view(score.shape)


def block_scores(w: torch.Tensor, b: int) -> torch.Tensor:
    r, c = w.shape
    return w.abs().view(r // b, b, c // b, b).sum(dim=(1, 3))


def once_ms(fn, reps: int = 3) -> float:
    """Median of a few event-timed runs, for baselines too slow for do_bench."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    env = environment()
    bw = copy_bandwidth_gbs()
    torch.manual_seed(0)
    weights = [torch.randn(s, device="cuda") * 0.02 for s in bert_large_shapes() if len(s) == 2]
    weights = [w for w in weights if w.shape[0] % 16 == 0]  # token-type (2 x 1024) excluded
    scores = [w.abs() for w in weights]
    numel = sum(w.numel() for w in weights)
    kept = numel // 10

    # Correctness first (fresh random data, exact equality with the references).
    odd = [torch.randn(37, 12, device="cuda"), torch.randint(0, 3, (64, 8), device="cuda").float()]
    checks = {
        "nm_equal": all(torch.equal(a, nm_topk_mask_reference(s, 2, 4)) for a, s in zip(nm_topk_masks(odd + scores[:3], 2, 4), odd + scores[:3], strict=True)),
        "nm_equal_4_8_bf16": all(torch.equal(a, nm_topk_mask_reference(s, 4, 8)) for a, s in zip(nm_topk_masks([x.bfloat16() for x in odd[1:] + scores[3:5]], 4, 8), [x.bfloat16() for x in odd[1:] + scores[3:5]], strict=True)),
        "nm_equal_1_3": all(torch.equal(a, nm_topk_mask_reference(s, 1, 3)) for a, s in zip(nm_topk_masks(odd[:1], 1, 3), odd[:1], strict=True)),
        "threshold_equal": bool(global_magnitude_threshold(weights[:5], 12345) == global_magnitude_threshold_reference(weights[:5], 12345)),
    }  # fmt: skip
    assert all(checks.values()), checks

    t = {}
    t["nm_kernel_multi"] = bench_ms(lambda: nm_topk_masks(scores, 2, 4))
    plan = nmk._nm_plan(scores, 4) or nmk._build_nm_plan(scores, 4)
    out = torch.empty(plan.total, dtype=torch.uint8, device="cuda")

    def nm_kernel_alone():
        nmk._nm_topk_kernel[(plan.grid,)](
            plan.table, plan.tensor_index, plan.chunk_index, out, 2, M=4, M_POW2=4, WORDS=True,
            SCORE_DTYPE=nmk._TORCH_TO_TL[torch.float32], ALIGNED=plan.aligned, CHUNK_G=nmk._CHUNK_G,
        )  # fmt: skip

    t["nm_kernel_alone"] = bench_ms(nm_kernel_alone)
    assert torch.equal(plan.views(out.view(torch.bool))[0], nm_topk_mask_reference(scores[0], 2, 4))
    host = {"nm_kernel_multi": host_ms(lambda: nm_topk_masks(scores, 2, 4), calls=200)}

    def rebuilt():
        nmk.clear_nm_plan_cache()
        nm_topk_masks(scores, 2, 4)

    host["nm_kernel_multi_plan_rebuilt"] = host_ms(rebuilt)
    # Repeated calls: masks of successive calls must stay independent (fresh buffer each).
    a, b = nm_topk_masks(scores[:2], 2, 4), nm_topk_masks(scores[:2], 2, 4)
    checks["nm_calls_independent"] = a[0].data_ptr() != b[0].data_ptr() and torch.equal(a[0], b[0])
    t["nm_kernel_per_tensor"] = bench_ms(lambda: [nm_topk_mask(s, 2, 4) for s in scores])
    t["nm_torch_topk"] = bench_ms(lambda: [torch_nm(s, 2, 4) for s in scores])
    t["nm_floor"] = numel * 5 / bw / 1e6
    t["threshold_kernel"] = bench_ms(lambda: global_magnitude_threshold(weights, kept))
    t["threshold_torch_kthvalue"] = once_ms(
        lambda: global_magnitude_threshold_reference(weights, kept)
    )
    t["threshold_torch_topk"] = once_ms(
        lambda: (
            torch.cat([w.reshape(-1).abs() for w in weights]).topk(kept, sorted=False).values.min()
        )
    )
    t["threshold_floor"] = numel * 4 / bw / 1e6
    t["block16_torch"] = bench_ms(lambda: [block_scores(w, 16) for w in weights])
    t["block16_floor"] = numel * 4 / bw / 1e6
    path = write_json(
        "mask_compute.json",
        {"environment": env, "copy_bandwidth_GBs": bw, "numel": numel, "tensors": len(weights), "checks": checks, "ms": t, "host_ms_per_call": host, "nm_best_config": str(nmk._nm_topk_kernel.best_config)},
    )  # fmt: skip
    print(
        f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}; copy bandwidth {bw:.0f} GB/s"
    )
    print(f"{len(weights)} BERT-large weight matrices, {numel / 1e6:.0f}M weights; checks {checks}")
    print("| computation | variant | ms | / floor |")
    print("|---|---|---|---|")
    for key, ms in t.items():
        op, _, variant = key.partition("_")
        floor = t[f"{op}_floor"]
        print(f"| {op} | {variant} | {ms:.3f} | {ms / floor:.2f}x |")
    print(f"host ms per call: {host}; N:M autotuned config: {nmk._nm_topk_kernel.best_config}")
    print(f"(JSON: {path})")


def host_cpu(calls: int = 200, repeats: int = 7) -> None:
    """Host time per ``nm_topk_masks`` call on the CPU, launch stubbed (see the docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernel path (stubbed)
    nmk._nm_topk_kernel = NoLaunch()
    shapes = [s for s in bert_large_shapes() if len(s) == 2 and s[0] % 16 == 0]
    scores = [torch.empty(s) for s in shapes]

    def best_us(fn, n=calls):
        fn()
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - start) / n * 1e6)
        return best

    def rebuilt():
        nmk.clear_nm_plan_cache()
        nm_topk_masks(scores, 2, 4)

    plan = nmk._nm_plan(scores, 4) or nmk._build_nm_plan(scores, 4)
    out = torch.empty(plan.total, dtype=torch.bool)
    row = {
        "tensors": len(scores),
        "cached_us": best_us(lambda: nm_topk_masks(scores, 2, 4)),
        "plan_rebuilt_us": best_us(rebuilt, max(5, calls // 20)),
        "validate_us": best_us(lambda: plan.matches(scores, 4)),
        "views_us": best_us(lambda: plan.views(out)),
        "empty_us": best_us(lambda: torch.empty(plan.total, dtype=torch.uint8)),
    }
    cpu = cpu_name()
    path = write_json("mask_host_cpu.json", row, device="cpu")
    print(f"nm_topk_masks over {len(scores)} BERT-large shapes, launch stubbed ({cpu}):")
    for key, value in row.items():
        print(f"  {key}: {value:.1f}" if key != "tensors" else f"  {key}: {value}")
    print(f"(best of {repeats} x {calls} calls; JSON: {path})")


if __name__ == "__main__":
    if unknown := [a for a in sys.argv[1:] if a != "--host-cpu"]:
        sys.exit(f"mask_compute: unknown arguments {unknown}; the only one is --host-cpu "
                 f"(no argument: the GPU table)")
    if "--host-cpu" in sys.argv:
        host_cpu()
    else:
        main()
