"""2:4 Linear on the sparse tensor cores (cuSPARSELt) against cuBLAS and torch's own path.

One run, bf16 (``cd benchmarks && PYTHONPATH=.. python3 semi_structured.py``), two tables
(``--layers-only`` or ``--bert-only`` for one of them):

1. ``layers``: per weight shape and token count, median ms (``do_bench``: host included,
   as eager training sees it) of
   - the forward: cuBLAS ``F.linear``; torch's ``to_sparse_semi_structured`` weight;
     cuSPARSELt with the searched plan (ours);
   - the input gradient dX: cuBLAS ``dY @ W``; cuSPARSELt on the packed transpose (ours,
     a ``2:4:2d`` mask);
   - the whole Linear step (forward, backward, ``AdamW(fused=True)``): ``nn.Linear`` vs
     ``SemiStructuredLinear(transposable=True)`` with its automatic choice, and forced
     sparse (both products on cuSPARSELt) to show what the choice avoided;
   - the repacking after a step: the values-only refresh vs ``_cslt_compress``;
   - the forward's GPU time under a CUDA graph (no host time), and the correctness of the
     sparse forward and dX against the dense masked product (max relative error).
2. ``bert``: a BERT-large encoder (24 layers, built from a config) fine-tuning step,
   16 x 384 tokens, fused AdamW, dense vs every encoder Linear a ``SemiStructuredLinear``
   (the automatic choice), with bf16 weights and under bf16 autocast with float32 weights,
   eager (alternating timed blocks) and as a whole step captured in a CUDA graph, with GPU
   busy time (``semi_structured_bert.py``).

With the layers table also whether ``torch.compile`` traces the layer (outputs compared).
``--predict JSON`` prints a run's measured engine steps against what its isolated timings
predict (no GPU needed).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from _common import bench_ms, device_name, environment, file_tag, gpu_ms, write_json
from semi_structured_bert import BERT_VARIANTS, DTYPE, bert_rows, layer_step, relative_error
from torch import nn

from sparse_training.kernels.semi_structured import PackedWeight
from sparse_training.kernels.semi_structured import paths as path_module
from sparse_training.kernels.semi_structured.cusparselt import sparse_mm
from sparse_training.layers.semi_structured import SemiStructuredLinear

SHAPES = {  # name: (in, out), token counts
    "bert-base up 768->3072": ((768, 3072), (4096, 16384)),
    "bert-base down 3072->768": ((3072, 768), (4096, 16384)),
    "bert-large up 1024->4096": ((1024, 4096), (4096, 16384)),
    "bert-large down 4096->1024": ((4096, 1024), (4096, 16384)),
    # 16.8M weights (compress="auto" never compresses 2:4: docs/semi_structured.md)
    "mid up 2048->8192": ((2048, 8192), (4096, 16384)),
    "mid down 8192->2048": ((8192, 2048), (4096, 16384)),
    "llm attention 4096->4096": ((4096, 4096), (4096, 16384)),
    "llm up 4096->14336": ((4096, 14336), (4096, 16384, 32768)),
    "llm down 14336->4096": ((14336, 4096), (4096, 16384)),
    "llm up 8192->28672": ((8192, 28672), (4096, 16384)),
    "llm down 28672->8192": ((28672, 8192), (4096, 16384)),
}


def step_ms(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, mixed: bool = False,
            engine: bool = False) -> float:
    """Forward, backward (dX and dW) and a fused AdamW step (:func:`layer_step`), do_bench
    ms; ``mixed``: under bf16 autocast."""
    return bench_ms(layer_step(layer, x, grad, engine, mixed))


def layer_row(name: str, in_f: int, out_f: int, tokens: int) -> dict:
    dense = nn.Linear(in_f, out_f, device="cuda", dtype=DTYPE)
    sparse = SemiStructuredLinear.from_dense(dense, transposable=True)
    weight, mask = sparse.weight.detach(), sparse.mask
    x = torch.randn(tokens, in_f, device="cuda", dtype=DTYPE)
    grad = torch.randn(tokens, out_f, device="cuda", dtype=DTYPE)
    packed = PackedWeight.pack(weight, mask, DTYPE)
    packed_t = PackedWeight.pack(weight, mask, DTYPE, transposed=True)
    fwd_alg, dx_alg = packed.algorithm(x), packed_t.algorithm(grad)
    row = {"layer": name, "tokens": tokens, "refresh_verified": packed.fast and packed_t.fast}
    row["fwd_dense"] = bench_ms(lambda: F.linear(x, weight))
    row["fwd_ours"] = bench_ms(lambda: sparse_mm(packed.packed, x, fwd_alg))
    row["fwd_dense_graph"] = gpu_ms(lambda: F.linear(x, weight))
    row["fwd_ours_graph"] = gpu_ms(lambda: sparse_mm(packed.packed, x, fwd_alg))
    try:
        torch_sparse = torch.sparse.to_sparse_semi_structured(weight)
        row["fwd_torch_semi"] = bench_ms(lambda: F.linear(x, torch_sparse))
    except (RuntimeError, ValueError) as error:  # shapes or backends it refuses
        row["fwd_torch_semi"], row["torch_semi_error"] = float("nan"), str(error)[:200]
    row["dx_dense"] = bench_ms(lambda: grad @ weight)
    row["dx_ours"] = bench_ms(lambda: sparse_mm(packed_t.packed, grad, dx_alg))
    row["refresh"] = bench_ms(lambda: (packed.refresh(weight), packed_t.refresh(weight)))
    row["cslt_compress"] = bench_ms(lambda: (torch._cslt_compress(weight),
                                             torch._cslt_compress(weight.t().contiguous())))
    reference = F.linear(x.float(), weight.float())
    row["fwd_error"] = relative_error(sparse_mm(packed.packed, x, fwd_alg), reference)
    row["dx_error"] = relative_error(sparse_mm(packed_t.packed, grad, dx_alg),
                                     grad.float() @ weight.float())
    row["step_dense"] = step_ms(dense, x, grad)
    row["step_ours"] = step_ms(sparse, x, grad)
    row["step_engine_ours"] = step_ms(copy.deepcopy(sparse), x, grad, engine=True)
    dense_fp32 = nn.Linear(in_f, out_f, device="cuda")
    row["step_mixed_dense"] = step_ms(dense_fp32, x, grad, mixed=True)
    sparse_fp32 = SemiStructuredLinear.from_dense(dense_fp32, transposable=True)
    del dense_fp32
    row["step_mixed_ours"] = step_ms(sparse_fp32, x, grad, mixed=True)
    row["step_mixed_engine_ours"] = step_ms(sparse_fp32, x, grad, mixed=True, engine=True)
    del sparse_fp32
    choice = sparse.paths(x)
    row["choice"] = {"forward": choice.forward, "input_grad": choice.input_grad,
                     "reason": choice.reason, "times_ms": choice.times_ms}
    forced = path_module.PathChoice(True, True, "forced", {})
    key = (x.device, DTYPE, tokens, sparse.timing)
    saved, sparse._routes[key] = sparse._routes[key], forced
    row["step_forced_sparse"] = step_ms(sparse, x, grad)
    # after many optimizer steps the packed copies must hold the new weights
    with torch.no_grad():
        row["layer_error_after_steps"] = relative_error(
            sparse(x), F.linear(x.float(), (sparse.weight * mask).float(), sparse.bias.float()))
    sparse._routes[key] = saved
    for op in ("fwd", "dx", "step", "step_mixed"):
        row[f"{op}_speedup"] = row[f"{op}_dense"] / row[f"{op}_ours"]
    # the engine's steps against the same dense steps
    row["step_engine_speedup"] = row["step_dense"] / row["step_engine_ours"]
    row["step_mixed_engine_speedup"] = row["step_mixed_dense"] / row["step_mixed_engine_ours"]
    row["fwd_graph_speedup"] = row["fwd_dense_graph"] / row["fwd_ours_graph"]
    row["fwd_vs_torch_semi"] = row["fwd_torch_semi"] / row["fwd_ours"]
    row["step_forced_speedup"] = row["step_dense"] / row["step_forced_sparse"]
    row["step_engine_predicted"] = predicted_step_ms(row)
    return row


def predicted_step_ms(row: dict) -> float:
    """The engine's bf16 step as the row's isolated timings predict it: the dense step, less
    what the products the choice sent to cuSPARSELt save, plus their repacking (the
    ``refresh`` column repacks both copies; with one product sparse, half of it: the
    copies of W and of W^T are counted alike)."""
    choice, ms = row["choice"], row["step_dense"]
    if choice["forward"]:
        ms -= row["fwd_dense"] - row["fwd_ours"]
    if choice["input_grad"]:
        ms -= row["dx_dense"] - row["dx_ours"]
    if choice["forward"] or choice["input_grad"]:
        ms += row["refresh"] if choice["forward"] and choice["input_grad"] else row["refresh"] / 2
    return ms


def print_predictions(path: str) -> None:
    """Measured against predicted engine steps (:func:`predicted_step_ms`) of a JSON's rows."""
    import json
    from pathlib import Path

    print("| layer | tokens | dense ms | predicted ms | measured ms | predicted x | measured x |")
    print("|---|---|---|---|---|---|---|")
    for row in json.loads(Path(path).read_text())["layers"]:
        predicted = predicted_step_ms(row)
        print(f"| {row['layer']} | {row['tokens']} | {row['step_dense']:.2f} | {predicted:.2f} | "
              f"{row['step_engine_ours']:.2f} | {row['step_dense'] / predicted:.2f}x | "
              f"{row['step_dense'] / row['step_engine_ours']:.2f}x |")


def layer_rows(only: list[str]) -> list[dict]:
    print(f"{'layer':28s} {'tok':>6s} {'fwd':>6s} {'fwd g':>6s} {'dX':>6s} {'step':>6s} "
          f"{'mixed':>6s} {'eng':>6s} {'eng mx':>6s} {'forced':>6s} {'vs t.semi':>9s} {'refresh':>8s} {'compress':>8s} {'err':>8s} "
          f"choice")
    rows = []
    for name, ((in_f, out_f), token_counts) in SHAPES.items():
        if only and not any(part in name for part in only):
            continue
        for tokens in token_counts:
            r = layer_row(name, in_f, out_f, tokens)
            rows.append(r)
            print(f"{name:28s} {tokens:6d} {r['fwd_speedup']:5.2f}x {r['fwd_graph_speedup']:5.2f}x "
                  f"{r['dx_speedup']:5.2f}x {r['step_speedup']:5.2f}x {r['step_mixed_speedup']:5.2f}x "
                  f"{r['step_engine_speedup']:5.2f}x {r['step_mixed_engine_speedup']:5.2f}x "
                  f"{r['step_forced_speedup']:5.2f}x {r['fwd_vs_torch_semi']:8.2f}x "
                  f"{r['refresh']:8.3f} {r['cslt_compress']:8.3f} "
                  f"{max(r['fwd_error'], r['dx_error']):8.1e} {r['choice']['reason']}",
                  flush=True)
            torch.cuda.empty_cache()
    return rows


def compile_check() -> dict:
    layer = SemiStructuredLinear(4096, 14336, device="cuda", dtype=DTYPE, transposable=True)
    x = torch.randn(8192, 4096, device="cuda", dtype=DTYPE, requires_grad=True)
    eager = layer(x)
    eager.sum().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    try:
        compiled = torch.compile(layer)(x)
        compiled.sum().backward()
        return {"ok": True, "output_error": relative_error(compiled, eager),
                "input_grad_error": relative_error(x.grad, eager_grad)}
    except Exception as error:  # recorded, not hidden: the JSON says what failed
        return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:400]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[],
                        help="layer names containing any of these (default: all)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--bert-only", action="store_true",
                      help="only the BERT-large step (no per-layer table)")
    only.add_argument("--layers-only", action="store_true",
                      help="only the per-layer table (no BERT-large step)")
    parser.add_argument("--bert-modes", nargs="+", default=["eager", "cuda_graph"],
                        choices=["eager", "cuda_graph"], help="BERT-large steps to time")
    parser.add_argument("--bert-precisions", nargs="+", default=["bf16", "bf16-mixed"],
                        choices=["bf16", "bf16-mixed"], help="BERT-large weights' precisions")
    parser.add_argument("--bert-variants", nargs="+", default=list(BERT_VARIANTS),
                        choices=BERT_VARIANTS, help="BERT-large variants timed besides dense")
    parser.add_argument("--predict", metavar="JSON",
                        help="print a run's measured against predicted engine steps (no GPU)")
    args = parser.parse_args()
    if args.predict:
        print_predictions(args.predict)
        return
    result = {"environment": environment(),
              "cusparselt_version": torch.backends.cusparselt.version()}
    if not args.bert_only:
        result.update(layers=layer_rows(args.only), compile=compile_check())
        print("torch.compile:", result["compile"], flush=True)
    if not args.layers_only:
        result["bert"] = bert_rows(tuple(args.bert_modes), tuple(args.bert_precisions),
                                   tuple(args.bert_variants))
    write_json(f"semi_structured_{file_tag(device_name())}{args.tag}.json",
               result)


if __name__ == "__main__":
    main()
