"""2:4 Linear on the sparse tensor cores (cuSPARSELt) against cuBLAS and torch's own path.

One run, bf16 (``cd benchmarks && PYTHONPATH=.. python3 semi_structured.py``), two tables:

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
   alternating timed blocks in one process; and whether ``torch.compile`` traces the layer
   (outputs compared).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from _common import bench_ms, busy_ms, environment, gpu_ms, write_json
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine
from sparse_training.kernels.semi_structured import PackedWeight
from sparse_training.kernels.semi_structured import paths as path_module
from sparse_training.kernels.semi_structured.cusparselt import sparse_mm
from sparse_training.patcher import replace_module
from sparse_training.semi_structured import SemiStructuredLinear

DTYPE = torch.bfloat16
SHAPES = {  # name: (in, out), token counts
    "bert-base up 768->3072": ((768, 3072), (4096, 16384)),
    "bert-base down 3072->768": ((3072, 768), (4096, 16384)),
    "bert-large up 1024->4096": ((1024, 4096), (4096, 16384)),
    "bert-large down 4096->1024": ((4096, 1024), (4096, 16384)),
    "llm up 4096->14336": ((4096, 14336), (4096, 16384, 32768)),
    "llm down 14336->4096": ((14336, 4096), (4096, 16384)),
    "llm up 8192->28672": ((8192, 28672), (4096, 16384)),
    "llm down 28672->8192": ((28672, 8192), (4096, 16384)),
}


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.float() - reference.float()).abs().max() / reference.float().abs().max())


def trainer_step(model: nn.Module, loss, engine: bool, deny: tuple[str, ...] = ()):
    """One training step of ``model`` (``loss()`` runs forward and backward) with fused
    AdamW: torch's (``engine`` False: a dense model, or 2:4 layers masking their own
    gradient), or the callback's path (``engine``: a :class:`SparsityEngine` attached, its
    optimizer hooks mask the 2:4 weights' gradients, the layers leave them alone: inside the
    fused masked step for float32 weights, one multi-tensor pass for bf16 ones; the
    dense Linears that ``deny`` does not name are masked 2:4 too)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if not engine:
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss()
            optimizer.step()
        return step
    sparse = SparsityEngine(model, SparsityConfig("2:4:2d", deny=list(deny)))
    sparse.start(None)
    sparse.attach(optimizer)  # fused for float32 weights; bf16 ones take the hook path

    def engine_step():
        sparse.on_step_start(0)
        optimizer.zero_grad(set_to_none=True)
        loss()
        sparse.before_optimizer_step(optimizer, 0, clipping=False)
        optimizer.step()
        sparse.on_step_end()
    return engine_step


def step_ms(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, mixed: bool = False,
            engine: bool = False) -> float:
    """Forward, backward (dX and dW) and a fused AdamW step (:func:`trainer_step`);
    ``mixed``: under bf16 autocast (the layer's weights float32, as Lightning's
    ``bf16-mixed`` keeps them)."""
    x = x.detach().requires_grad_()

    def loss():
        x.grad = None
        with torch.autocast("cuda", DTYPE, enabled=mixed):
            y = layer(x)
        y.backward(grad)
    return bench_ms(trainer_step(nn.Sequential(layer), loss, engine))


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
    return row


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


def bert_model(config, variant: str, dtype: torch.dtype) -> nn.Module:
    """BERT-large from ``config`` (seed 0) in ``dtype``; for ``2:4`` every encoder Linear a
    ``SemiStructuredLinear(transposable=True)`` with the automatic choice."""
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(config).to("cuda", dtype)
    if variant == "2:4":
        for name, module in list(model.encoder.named_modules()):
            if isinstance(module, nn.Linear):
                replace_module(model.encoder, name,
                               SemiStructuredLinear.from_dense(module, transposable=True))
    return model


def timed_blocks(steps: dict, block: int, rounds: int) -> dict[str, list[float]]:
    """Wall ms per step of each of ``steps`` (name: callable), alternating blocks of
    ``block`` steps for ``rounds`` rounds so that every variant sees the same clocks."""
    blocks = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(block):
                step()
            torch.cuda.synchronize()
            blocks[name].append((time.perf_counter() - start) / block * 1e3)
    return blocks


def gpu_busy_ms(step, block: int, top: dict | None = None) -> float:
    """GPU busy ms per step (kernels and copies from ``torch.profiler``; host time is not in
    it, so a host-bound step shows wall > busy); ``top``, if given, gets the 8 kernels that
    took the most GPU time (ms and calls per step)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(block):
            step()
        torch.cuda.synchronize()
    if top is not None:
        kernels: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                total = kernels.setdefault(event.name[:90], [0.0, 0])
                total[0] += event.time_range.elapsed_us() / 1e3 / block
                total[1] += 1 / block
        top.update(sorted(kernels.items(), key=lambda item: -item[1][0])[:8])
    return busy_ms(prof.events()) / block


def graphed(step, model: nn.Module) -> tuple:
    """``step`` (forward, backward, optimizer step) captured in one CUDA graph after 3
    warm-up steps on a side stream (torch's whole-network recipe); the replay, and the
    graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # also times the 2:4 paths, which cannot happen under capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for parameter in model.parameters():
        parameter.grad = None
    with torch.cuda.graph(graph):
        step(zero_grad=False)
    return graph.replay, graph


def bert_rows(modes: tuple[str, ...] = ("eager", "cuda_graph"),
              precisions: tuple[str, ...] = ("bf16", "bf16-mixed"), batch: int = 16,
              length: int = 384, block: int = 10, rounds: int = 4) -> dict:
    """Dense and 2:4 BERT-large steps in one process, alternating timed blocks of ``block``
    steps (``rounds`` each) so both see the same clocks, with the GPU busy time of each
    (the profiler, one more block); per precision: ``bf16`` weights, and ``bf16-mixed``
    (float32 weights under bf16 autocast, Lightning's ``bf16-mixed``). Eager: dense, 2:4
    layers masking their own gradient, 2:4 under the engine. CUDA graph (the whole step
    captured, AdamW ``capturable``): dense against 2:4 layers with ``timing="cuda_graph"``,
    and with both products forced sparse (what the choice avoided)."""
    from transformers import BertConfig

    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096)
    ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
    result = {"tokens": batch * length, "block_steps": block, "rounds": rounds}
    for precision in precisions:
        dtype = DTYPE if precision == "bf16" else torch.float32
        for mode in modes:
            variants = (("dense", "2:4", "2:4 engine") if mode == "eager"
                        else ("dense", "2:4", "2:4 forced"))
            try:
                result[f"{precision} {mode}"] = bert_row(config, ids, dtype, mode, variants,
                                                         block, rounds)
            except Exception as error:  # recorded, not hidden: the JSON says what failed
                result[f"{precision} {mode}"] = {"error": f"{type(error).__name__}: "
                                                          f"{str(error)[:600]}"}
                print(f"BERT-large {precision} {mode} failed: {error}", flush=True)
            torch.cuda.empty_cache()
    result["choices"] = [{"key": [str(k) for k in key], "forward": c.forward,
                          "input_grad": c.input_grad, "reason": c.reason, "times_ms": c.times_ms}
                         for key, c in path_module.cached_choices().items()
                         if key[4] == batch * length]
    return result


def bert_row(config, ids: torch.Tensor, dtype: torch.dtype, mode: str, variants: tuple,
             block: int, rounds: int) -> dict:
    """Eager: the variants' steps in alternating blocks. CUDA graph: each variant built,
    captured and timed in turn, then freed (graph replays have no host noise to pair
    against; two whole-step graphs alive together segfaulted on replay on the H100)."""
    mixed = dtype != DTYPE
    row: dict = {"blocks_ms": {}, "gpu_busy_ms": {}, "top_kernels": {}}
    steps, checks, layers_of = {}, {}, {}
    for variant in variants:
        model = bert_model(config, variant.split()[0], dtype)
        layers = [m for m in model.modules() if isinstance(m, SemiStructuredLinear)]
        for layer in layers:
            layer.timing = mode
            if variant.endswith("forced"):  # both products sparse, whatever the timing says
                key = (ids.device, DTYPE, ids.numel(), mode)
                layer._routes[key] = path_module.PathChoice(True, True, "forced", {})

        def loss(model=model):  # embeddings and encoder: no padding, no attention mask
            # (BertModel builds a dense mask under graph capture, which sends SDPA to its
            # float32 math path: 2 fp32 GEMMs per layer, 2.6x the step)
            with torch.autocast("cuda", DTYPE, enabled=mixed, cache_enabled=False):
                out = model.encoder(model.embeddings(input_ids=ids)).last_hidden_state
            out.float().square().mean().backward()
        if mode == "eager":
            step = trainer_step(model, loss, engine=variant.endswith("engine"), deny=("pooler",))
            for _ in range(3):  # the first steps time the 2:4 paths
                step()
            steps[variant], layers_of[variant] = step, layers
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True,
                                          capturable=True)

            def whole_step(zero_grad=True, loss=loss, optimizer=optimizer):
                if zero_grad:
                    optimizer.zero_grad(set_to_none=True)
                loss()
                optimizer.step()
            replay, graph = graphed(whole_step, model)
            row["blocks_ms"].update(timed_blocks({variant: replay}, block, rounds))
            row["gpu_busy_ms"][variant] = gpu_busy_ms(replay, block,
                                                      row["top_kernels"].setdefault(variant, {}))
            if layers:
                checks[variant] = layer_checks(layers, mixed)
            del model, layers, optimizer, replay, graph, whole_step, loss
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if mode == "eager":
        row["blocks_ms"] = timed_blocks(steps, block, rounds)
        row["gpu_busy_ms"] = {variant: gpu_busy_ms(step, block,
                                                   row["top_kernels"].setdefault(variant, {}))
                              for variant, step in steps.items()}
        checks = {variant: layer_checks(layers, mixed)
                  for variant, layers in layers_of.items() if layers}
    row.update({variant: statistics.median(ms) for variant, ms in row["blocks_ms"].items()})
    row["checks"] = checks
    for variant in variants[1:]:
        row[f"{variant} speedup"] = row["dense"] / row[variant]
        busy = row["gpu_busy_ms"][variant]  # 0 if the profiler saw no kernels (graphs)
        row[f"{variant} gpu speedup"] = row["gpu_busy_ms"]["dense"] / busy if busy else math.nan
    print(f"BERT-large step {dtype} {mode:10s} " + "  ".join(
        f"{v} {row[v]:7.2f} ms (gpu {row['gpu_busy_ms'][v]:6.2f})" for v in variants)
        + "  " + "  ".join(f"{k} {v:.3f}x" for k, v in row.items() if k.endswith("speedup"))
        + f"  checks {checks}", flush=True)
    for variant, kernels in row["top_kernels"].items():
        print(f"  top kernels {variant}: " + "; ".join(
            f"{name[:60]} {ms:.2f} ms x{calls:.0f}" for name, (ms, calls) in
            list(kernels.items())[:5]), flush=True)
    return row


def layer_checks(layers: list[SemiStructuredLinear], mixed: bool) -> dict:
    """After the timed steps: pruned weights still zero in every layer, and the first
    layer's output (its packed copies, if sparse) against the dense masked product."""
    layer = layers[0]
    x = torch.randn(2048, layer.in_features, device="cuda", dtype=DTYPE)
    with torch.no_grad(), torch.autocast("cuda", DTYPE, enabled=mixed):
        error = relative_error(layer(x), F.linear(x.float(), (layer.weight * layer.mask).float(),
                                                  layer.bias.float()))
    return {"pruned_weights_zero": all(not m.weight[~m.mask].any() for m in layers),
            "layer_error": error}


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
    parser.add_argument("--bert-only", action="store_true",
                        help="only the BERT-large step (no per-layer table)")
    parser.add_argument("--bert-modes", nargs="+", default=["eager", "cuda_graph"],
                        choices=["eager", "cuda_graph"], help="BERT-large steps to time")
    parser.add_argument("--bert-precisions", nargs="+", default=["bf16", "bf16-mixed"],
                        choices=["bf16", "bf16-mixed"], help="BERT-large weights' precisions")
    args = parser.parse_args()
    result = {"environment": environment(),
              "cusparselt_version": torch.backends.cusparselt.version()}
    if not args.bert_only:
        result.update(layers=layer_rows(args.only), compile=compile_check())
        print("torch.compile:", result["compile"], flush=True)
    result["bert"] = bert_rows(tuple(args.bert_modes), tuple(args.bert_precisions))
    write_json(f"semi_structured_{torch.cuda.get_device_name().replace(' ', '_')}{args.tag}.json",
               result)


if __name__ == "__main__":
    main()
