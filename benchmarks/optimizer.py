"""Masked optimizer step on the GPU: fused kernels vs torch's fused step vs ASP.

Run on a CUDA machine:  python benchmarks/optimizer.py
Checks the kernels (fast math and correctly rounded variants) against the float64
reference first, sweeps the launch configs (``masked_step_configs``), then times, for AdamW and SGD (momentum 0.9) at 64Mi parameters (64 x 1024x1024) and
at BERT-large size (335M, real shapes), every parameter masked at 50%:

- ``fused_unmasked``: torch.optim.<Opt>(fused=True).step(), no mask (the target);
- ``masked_fused``: sparse_training.kernels.fused_masked_step, bool masks;
- ``masked_fused_packed``: the same with bit-packed masks;
- ``masked_exact``: the same kernel with correctly rounded div/sqrt (``FAST_MATH=False``);
- ``asp``: NVIDIA ASP: per-parameter grad.mul_(mask), fused step, p.mul_(mask);
- ``foreach_mul``: _foreach_mul_(grads, masks), foreach step, _foreach_mul_(params, masks);
- ``floor``: bytes the masked step must move / measured copy bandwidth.

Also the host time per call (Python + launch; cached plan vs plan rebuilt every call).
Prints one table and writes optimizer_step.json (GPU name, versions) to $OUT or
benchmarks/results/.

With ``--bf16`` the same table for bf16 weights, gradients and state (Lightning's
``bf16-true``), the kernels checked against torch's fused step instead (ASP's way: the
same float32 arithmetic rounded once); writes optimizer_step_bf16.json.

Without a GPU:  python benchmarks/optimizer.py --host-cpu
Host time per ``fused_masked_step`` call on this machine's CPU with the kernel launch
stubbed out (TRITON_INTERPRET=1, real shapes, tensors never touched): the Python side
alone, cached plan and plan rebuilt every call; writes host_step_cpu.json.
"""

from __future__ import annotations

import gc
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
    environment,
    host_ms,
    write_json,
)
from sparse_training.kernels import (  # noqa: E402
    _step_run,
    fused_masked_step,
    masked_step_reference,
    pack_mask,
)
from sparse_training.kernels import masked_step as ms  # noqa: E402

ADAMW = (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01})
SGD = (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-4})
# Tensors read + written per element by the masked step, beyond the mask.
STREAMS = {"AdamW": 4 + 3, "SGD": 3 + 2}


def check_correctness() -> dict:
    """Kernel vs float64 reference, bf16 grads, several steps, odd sizes, exact zeros."""
    result = {}
    for fast in (True, False):
        ms.FAST_MATH = fast
        for opt_cls, kw in (ADAMW, SGD, (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1})):
            result[f"{opt_cls.__name__}{'' if fast else ' exact'}"] = _check(opt_cls, kw)
    ms.FAST_MATH = True
    return result


def _check(opt_cls, kw) -> dict:
    torch.manual_seed(0)
    shapes = [(1000, 37), (4097,), (3, 5, 7), (65536 * 3 + 5,), (1024, 1024)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    for p in ps:
        if hasattr(p, "grad_dtype"):  # torch >= 2.10 checks grad dtypes on assignment
            p.grad_dtype = None
    ref = [torch.nn.Parameter(p.detach().double().clone()) for p in ps]
    opt, opt_ref = opt_cls(ps, **kw), opt_cls(ref, **kw)
    masks = {p: torch.rand(p.shape, device="cuda") > 0.5 for p in ps}
    masks_ref = {q: masks[p] for p, q in zip(ps, ref, strict=True)}
    for _ in range(4):
        for p, q in zip(ps, ref, strict=True):
            g = torch.randn(p.shape, device="cuda").bfloat16()
            p.grad, q.grad = g, g.double()
        fused_masked_step(opt, masks)
        masked_step_reference(opt_ref, masks_ref)
    err = max(((p.double() - q).norm() / q.norm()).item() for p, q in zip(ps, ref, strict=True))
    zeros = all(bool((p[~masks[p]] == 0).all()) for p in ps)
    finite = all(bool(p.isfinite().all()) for p in ps)
    out = {"rel_err_vs_fp64": err, "pruned_exact_zero": zeros}
    assert err < 1e-6 and zeros and finite, out
    return out


def check_against_torch_fused(dtype: torch.dtype) -> dict:
    """Half-precision weights, 4 steps, odd sizes: the kernel against torch's fused step the
    ASP way (gradients masked, ``fused=True`` step, weights masked) and both against a
    float64 run of the same steps. Both compute in float32 and round once, so kept weights
    should mostly agree bit for bit (fast math's approximate square root and division may
    flip a rounding), and both should be as far from float64 as rounding makes them."""
    result = {}
    for opt_cls, kw in (ADAMW, SGD):
        torch.manual_seed(0)
        shapes = [(1000, 37), (4097,), (65536 * 3 + 5,), (1024, 1024)]
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
        twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        exact = [torch.nn.Parameter(p.detach().double()) for p in ps]
        masks = [torch.rand(p.shape, device="cuda") > 0.5 for p in ps]
        opt, ref, ref64 = opt_cls(ps, **kw), opt_cls(twins, fused=True, **kw), opt_cls(exact, **kw)
        for _ in range(4):
            for p, q, e, k in zip(ps, twins, exact, masks, strict=True):
                g = torch.randn(p.shape, device="cuda", dtype=dtype)
                p.grad, q.grad, e.grad = g, g * k, g.double() * k
            fused_masked_step(opt, dict(zip(ps, masks, strict=True)))
            ref.step()
            ref64.step()
            with torch.no_grad():
                for q, e, k in zip(twins, exact, masks, strict=True):
                    q.mul_(k)
                    e.mul_(k)
        kept, twin_kept, exact_kept = (torch.cat([t.detach()[k].double() for t, k in
                                                  zip(ts, masks, strict=True)])
                                       for ts in (ps, twins, exact))
        ulps = (kept - twin_kept).abs() / (torch.finfo(dtype).eps * twin_kept.abs())

        def error(values, exact_kept=exact_kept):
            return float((values - exact_kept).norm() / exact_kept.norm())
        out = {"kept_bit_equal_to_torch_fused": float((kept == twin_kept).double().mean()),
               "max_diff_ulps": float(ulps[twin_kept != 0].max()),
               "rel_err_vs_fp64": error(kept), "torch_fused_rel_err_vs_fp64": error(twin_kept),
               "pruned_exact_zero": all(bool((p[~k] == 0).all())
                                        for p, k in zip(ps, masks, strict=True))}
        assert out["pruned_exact_zero"] and bool(kept.isfinite().all()), out
        result[opt_cls.__name__] = out
    return result


def make_model(shapes, dtype=torch.float32):
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02)
              for s in shapes]
    grads = [torch.randn_like(p) for p in params]
    masks = [torch.rand(p.shape, device="cuda") > 0.5 for p in params]
    return params, grads, masks


def time_variants(shapes, opt_cls, kw, dtype=torch.float32) -> dict:
    params, grads, masks = make_model(shapes, dtype)
    mask_of = dict(zip(params, masks, strict=True))
    packed_of = {p: pack_mask(k) for p, k in mask_of.items()}
    fmasks = [k.to(dtype) for k in masks]

    def set_grads():
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    set_grads()
    fused = opt_cls(params, fused=True, **kw)
    mine = opt_cls(params, **kw)
    foreach = opt_cls(params, foreach=True, **kw)

    def asp():
        with torch.no_grad():
            for p, k in zip(params, masks, strict=True):
                p.grad.mul_(k)
            fused.step()
            for p, k in zip(params, masks, strict=True):
                p.mul_(k)

    def foreach_mul():
        with torch.no_grad():
            torch._foreach_mul_(grads, fmasks)
            foreach.step()
            torch._foreach_mul_(params, fmasks)

    def masked(mask_map):
        def run():
            set_grads()
            fused_masked_step(mine, mask_map)

        return run

    times = {"fused_unmasked": bench_ms(fused.step)}
    sweep = {}
    for cfg in ms.masked_step_configs():
        ms.DEFAULT_CONFIG = cfg
        name = (
            f"{cfg.block}/{cfg.num_warps}w/{cfg.chunk}/pps{cfg.programs_per_sm}/st{cfg.num_stages}"
        )
        sweep[name] = bench_ms(masked(mask_of))
    best = min(sweep, key=sweep.get)
    best_cfg = ms.masked_step_configs()[list(sweep).index(best)]
    ms.DEFAULT_CONFIG = best_cfg
    times["masked_fused"] = bench_ms(masked(mask_of))
    packed_sweep = {}
    for cfg in (best_cfg, ms.StepConfig(512, 4, 16384), ms.StepConfig(1024, 4, 16384)):
        ms.DEFAULT_CONFIG = cfg
        packed_sweep[f"{cfg.block}/{cfg.num_warps}w/{cfg.chunk}/pps{cfg.programs_per_sm}"] = (
            bench_ms(masked(packed_of))
        )
    times["masked_fused_packed"] = min(packed_sweep.values())
    ms.DEFAULT_CONFIG = best_cfg
    ms.FAST_MATH = False
    times["masked_exact"] = bench_ms(masked(mask_of))
    ms.FAST_MATH = True
    set_grads()
    times["asp"] = bench_ms(asp)
    times["foreach_mul"] = bench_ms(foreach_mul)

    def uncached():
        _step_run.clear_plan_cache()
        masked(mask_of)()

    host = {
        "masked_fused": host_ms(masked(mask_of)),
        "masked_fused_plan_rebuilt": host_ms(uncached),
        "set_grads_alone": host_ms(set_grads),
        "fused_unmasked": host_ms(fused.step),
    }
    numel = sum(p.numel() for p in params)
    return {
        "numel": numel,
        "tensors": len(shapes),
        "ms": times,
        "host_ms_per_call": host,
        "config_sweep_ms": sweep,
        "packed_sweep_ms": packed_sweep,
        "best_config": best,
    }


def main(dtype: torch.dtype = torch.float32) -> None:
    env = environment()
    bw = copy_bandwidth_gbs()
    half = dtype != torch.float32
    correctness = check_against_torch_fused(dtype) if half else check_correctness()
    sizes = {"64Mi": [(1024, 1024)] * 64, "BERT-large": bert_large_shapes()}
    size_of = torch.finfo(dtype).bits // 8
    runs = {}
    for (opt_cls, kw), name in ((ADAMW, "AdamW"), (SGD, "SGD")):
        for size, shapes in sizes.items():
            r = time_variants(shapes, opt_cls, kw, dtype)
            r["floor_ms"] = r["numel"] * (STREAMS[name] * size_of + 1) / bw / 1e6
            r["floor_packed_ms"] = r["numel"] * (STREAMS[name] * size_of + 0.125) / bw / 1e6
            runs[f"{name} {size}"] = r
            gc.collect()
            torch.cuda.empty_cache()
    path = write_json(
        "optimizer_step_bf16.json" if half else "optimizer_step.json",
        {"environment": env, "param_dtype": str(dtype), "copy_bandwidth_GBs": bw,
         "correctness": correctness, "runs": runs},
    )
    print(
        f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}; copy bandwidth {bw:.0f} GB/s"
        f"; {dtype} weights"
    )
    print(f"correctness: {correctness}")
    head = "| case | params | fused unmasked | masked fused | packed | exact-math | ASP | foreach+mul | floor (bool) | masked/unmasked | ASP/masked | masked/floor | host ms (cached / rebuilt) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for case, r in runs.items():
        t, h = r["ms"], r["host_ms_per_call"]
        print(
            f"| {case} | {r['numel'] / 1e6:.0f}M | {t['fused_unmasked']:.3f} | {t['masked_fused']:.3f} | "
            f"{t['masked_fused_packed']:.3f} | {t['masked_exact']:.3f} | {t['asp']:.3f} | {t['foreach_mul']:.3f} | "
            f"{r['floor_ms']:.3f} | {t['masked_fused'] / t['fused_unmasked']:.3f}x | "
            f"{t['asp'] / t['masked_fused']:.2f}x | {t['masked_fused'] / r['floor_ms']:.3f}x | "
            f"{h['masked_fused']:.3f} / {h['masked_fused_plan_rebuilt']:.3f} |"
        )
    print(f"(ms, medians of triton.testing.do_bench; JSON: {path})")
    for case, r in runs.items():
        print(
            case,
            "best",
            r["best_config"],
            "sweep:",
            {k: round(v, 3) for k, v in r["config_sweep_ms"].items()},
        )
        print(
            case,
            "host ms:",
            {k: round(v, 3) for k, v in r["host_ms_per_call"].items()},
            "packed:",
            {k: round(v, 3) for k, v in r["packed_sweep_ms"].items()},
        )


def host_cpu(calls: int = 100, repeats: int = 5) -> None:
    """Host time per call on the CPU, launch stubbed (see the module docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernel path (stubbed)
    ms._masked_step_kernel = NoLaunch()
    sizes = {"64Mi": [(1024, 1024)] * 64, "BERT-large": bert_large_shapes()}
    rows = {}
    for (opt_cls, kw), name in ((ADAMW, "AdamW"), (SGD, "SGD")):
        for size, shapes in sizes.items():
            params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
            grads = [torch.empty(s) for s in shapes]
            masks = [torch.empty(s, dtype=torch.bool) for s in shapes]
            opt = opt_cls(params, **kw)

            def set_grads(params=params, grads=grads):
                for p, g in zip(params, grads, strict=True):
                    p.grad = g

            def step(opt=opt, params=params, masks=masks, set_grads=set_grads):
                set_grads()  # the engine builds this dict every step too
                fused_masked_step(opt, dict(zip(params, masks, strict=True)))

            def rebuilt(step=step):
                _step_run.clear_plan_cache()
                step()

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

            grads_us = best_us(set_grads)
            rows[f"{name} {size}"] = {
                "tensors": len(shapes),
                "set_grads_us": grads_us,
                "cached_us": best_us(step) - grads_us,
                "plan_rebuilt_us": best_us(rebuilt, max(5, calls // 20)) - grads_us,
            }
            del opt, params, grads, masks
            gc.collect()
    path = write_json("host_step_cpu.json", {"runs": rows}, device="cpu")
    print("| case | tensors | host us/call, cached plan | plan rebuilt each call |")
    print("|---|---|---|---|")
    for case, r in rows.items():
        print(f"| {case} | {r['tensors']} | {r['cached_us']:.0f} | {r['plan_rebuilt_us']:.0f} |")
    print(f"(best of {repeats} x {calls} calls, set_grads subtracted; JSON: {path})")


if __name__ == "__main__":
    if "--host-cpu" in sys.argv:
        host_cpu()
    else:
        main(torch.bfloat16 if "--bf16" in sys.argv else torch.float32)
