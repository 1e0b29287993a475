"""The BERT-large fine-tuning step of ``semi_structured.py`` (its ``bert`` table), and the
training step both tables time.

A BERT-large encoder (24 layers, built from a config; embeddings and encoder, no attention
mask) at 16 x 384 tokens, fused AdamW, dense against every encoder Linear a
``SemiStructuredLinear(2:4:2d)``, with bf16 weights and with float32 weights under bf16
autocast. Eager: dense, the layers masking dW themselves and the layers under the engine
(its fused masked step, and its hook path) alternate timed blocks in one process. CUDA
graph: the whole step captured per variant, AdamW ``capturable`` (dense, layers with
``timing="cuda_graph"`` masking dW themselves, the same under the engine's fused masked
step, and forced sparse), timed one variant at a time. In both modes also the dense model
masked 2:4 by the engine (masked-dense, what ``compress="auto"`` trains at this size).
Each with its GPU busy time and its kernels (GPU ms and calls per step, all of them) from
``torch.profiler``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F
from _common import busy_ms, device_activity
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine
from sparse_training.kernels.semi_structured import cusparselt
from sparse_training.kernels.semi_structured import paths as path_module
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.layers.swap import replace_module

DTYPE = torch.bfloat16
VARIANTS = {  # per mode, besides dense (bert_rows)
    "eager": ("2:4", "2:4 engine", "2:4 engine hooks", "masked 2:4 engine"),
    "cuda_graph": ("2:4", "2:4 engine", "2:4 forced", "masked 2:4 engine"),
}
BERT_VARIANTS = tuple(dict.fromkeys(VARIANTS["eager"] + VARIANTS["cuda_graph"]))


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.float() - reference.float()).abs().max() / reference.float().abs().max())


def trainer_step(model: nn.Module, loss, engine: bool, deny: tuple[str, ...] = (),
                 fused: bool | str = "auto", capturable: bool = False):
    """One training step of ``model`` (``loss()`` runs forward and backward) with fused
    AdamW: torch's (``engine`` False: a dense model, or 2:4 layers masking their own
    gradient), or the callback's path (``engine``: a :class:`SparsityEngine` attached, its
    optimizer hooks mask the 2:4 weights, the layers leave their gradients alone: inside the
    fused masked step, or with ``fused=False`` the hook path's multi-tensor gradient and
    weight passes around torch's step; the dense Linears that ``deny`` does not name are
    masked 2:4 too). ``capturable``: AdamW's option for steps captured in a CUDA graph."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=capturable)
    if not engine:
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss()
            optimizer.step()
        return step
    sparse = SparsityEngine(model, SparsityConfig("2:4:2d", deny=list(deny), fused=fused))
    sparse.start(None)
    sparse.attach(optimizer)

    def engine_step():
        sparse.on_step_start(0)
        optimizer.zero_grad(set_to_none=True)
        loss()
        sparse.before_optimizer_step(optimizer, 0, clipping=False)
        optimizer.step()
        sparse.on_step_end()
    return engine_step


def layer_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, engine: bool = False,
               mixed: bool = False, fused: bool | str = "auto"):
    """:func:`trainer_step` of one layer: forward of ``x`` (a leaf that requires grad, so dX
    is computed), backward of ``grad``; ``mixed``: under bf16 autocast (the layer's weights
    float32, as Lightning's ``bf16-mixed`` keeps them)."""
    x = x.detach().requires_grad_()

    def loss():
        x.grad = None
        with torch.autocast("cuda", DTYPE, enabled=mixed):
            y = layer(x)
        y.backward(grad)
    return trainer_step(nn.Sequential(layer), loss, engine, fused=fused)


def bert_large_config():
    """BERT-large's shapes (24 layers, 1024 wide, 16 heads, 4096 MLP)."""
    from transformers import BertConfig

    return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096)


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
    it, so a host-bound step shows wall > busy); ``top``, if given, gets every kernel (ms and
    calls per step), the most GPU time first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(block):
            step()
        torch.cuda.synchronize()
    if top is not None:
        kernels: dict[str, list[float]] = {}
        for event in device_activity(prof.events()):
            total = kernels.setdefault(event.name, [0.0, 0])  # whole: templates differ
            total[0] += event.time_range.elapsed_us() / 1e3 / block
            total[1] += 1 / block
        top.update(sorted(kernels.items(), key=lambda item: -item[1][0]))
    return busy_ms(prof.events()) / block


def graphed(step) -> tuple:
    """``step`` (zero_grad to None, forward, backward, optimizer step) captured in one CUDA
    graph after 3 warm-up steps on a side stream (torch's whole-network recipe: the
    gradients are allocated inside the graph); the replay, and the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # also times the 2:4 paths, which cannot happen under capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, graph


def bert_rows(modes: tuple[str, ...] = ("eager", "cuda_graph"),
              precisions: tuple[str, ...] = ("bf16", "bf16-mixed"),
              chosen: tuple[str, ...] = BERT_VARIANTS, batch: int = 16, length: int = 384,
              block: int = 10, rounds: int = 4) -> dict:
    """Dense and 2:4 BERT-large steps in one process, ``rounds`` timed blocks of ``block``
    steps each, with the GPU busy time of each (the profiler, one more block); per
    precision: ``bf16`` weights, and ``bf16-mixed`` (float32 weights under bf16 autocast,
    Lightning's ``bf16-mixed``). Eager, the variants' blocks alternating so that all see the
    same clocks: dense, 2:4 layers masking their own gradient, 2:4 under the engine (fused
    step, and hook path). CUDA graph (the whole step captured, AdamW ``capturable``), one
    variant at a time (:func:`bert_row`): dense against 2:4 layers with
    ``timing="cuda_graph"`` (masking dW themselves, and under the engine's fused masked
    step), and with both products forced sparse (what the choice avoided). In both modes
    "masked 2:4 engine": the dense model's encoder Linears masked 2:4 by the engine
    (masked-dense, its fused masked step), what ``compress="auto"`` trains at this size.
    ``chosen``: the variants to time besides dense."""
    config = bert_large_config()
    ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
    result = {"tokens": batch * length, "block_steps": block, "rounds": rounds}
    for precision in precisions:
        dtype = DTYPE if precision == "bf16" else torch.float32
        for mode in modes:
            variants = ("dense", *(v for v in VARIANTS[mode] if v in chosen))
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
    steps, checks, layers_of, models = {}, {}, {}, {}
    for variant in variants:
        model = bert_model(config, variant.split()[0], dtype)
        layers = [m for m in model.modules() if isinstance(m, SemiStructuredLinear)]
        for layer in layers:
            layer.timing = mode
            if variant.endswith("forced"):  # both products sparse, whatever the timing says
                # (BERT-base's 768 features are under the layer's envelope: probe below it)
                cusparselt.SPARSE_MIN_FEATURES = cusparselt.SPARSE_MIN_TOKENS = 16
                key = (ids.device, DTYPE, ids.numel(), mode)
                layer._routes[key] = path_module.PathChoice(True, True, "forced", {})

        def loss(model=model):  # embeddings and encoder: no padding, no attention mask
            # (BertModel builds a dense mask under graph capture, which sends SDPA to its
            # float32 math path: 2 fp32 GEMMs per layer, 2.5x the step)
            with torch.autocast("cuda", DTYPE, enabled=mixed, cache_enabled=False):
                out = model.encoder(model.embeddings(input_ids=ids)).last_hidden_state
            out.float().square().mean().backward()
        step = trainer_step(model, loss, engine="engine" in variant, deny=("pooler",),
                            fused=False if variant.endswith("hooks") else "auto",
                            capturable=mode == "cuda_graph")
        if mode == "eager":
            for _ in range(3):  # the first steps time the 2:4 paths
                step()
            steps[variant], layers_of[variant], models[variant] = step, layers, model
        else:
            replay, graph = graphed(step)
            row["blocks_ms"].update(timed_blocks({variant: replay}, block, rounds))
            row["gpu_busy_ms"][variant] = gpu_busy_ms(replay, block,
                                                      row["top_kernels"].setdefault(variant, {}))
            checks[variant] = (layer_checks(layers, mixed, ids.numel()) if layers
                               else masked_checks(model))
            del model, layers, replay, graph, step, loss
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if mode == "eager":
        row["blocks_ms"] = timed_blocks(steps, block, rounds)
        row["gpu_busy_ms"] = {variant: gpu_busy_ms(step, block,
                                                   row["top_kernels"].setdefault(variant, {}))
                              for variant, step in steps.items()}
        checks = {variant: layer_checks(layers, mixed, ids.numel()) if layers
                  else masked_checks(models[variant])
                  for variant, layers in layers_of.items()}
    row.update({variant: statistics.median(ms) for variant, ms in row["blocks_ms"].items()})
    row["checks"] = checks
    for variant in variants[1:]:
        row[f"{variant} speedup"] = row["dense"] / row[variant]
        busy = row["gpu_busy_ms"][variant]  # 0 only if the profiler saw no kernels
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


def layer_checks(layers: list[SemiStructuredLinear], mixed: bool, tokens: int) -> dict:
    """After the timed steps: pruned weights still zero in every layer, and the first
    layer's output at the timed token count (so its timed route: the packed copies, if
    sparse) against the dense masked product."""
    layer = layers[0]
    x = torch.randn(tokens, layer.in_features, device="cuda", dtype=DTYPE)
    with torch.no_grad(), torch.autocast("cuda", DTYPE, enabled=mixed):
        error = relative_error(layer(x), F.linear(x.float(), (layer.weight * layer.mask).float(),
                                                  layer.bias.float()))
    return {"pruned_weights_zero": all(not m.weight[~m.mask].any() for m in layers),
            "layer_error": error}


def masked_checks(model: nn.Module) -> dict:
    """After the timed steps: whether every encoder Linear weight keeps at most 2 of every
    4 consecutive inputs (the engine's 2:4 masks hold; the dense variant reads False)."""
    weights = [m.weight for m in model.encoder.modules() if isinstance(m, nn.Linear)]
    return {"weights_2_4": all(bool(((w.reshape(-1, 4) != 0).sum(-1) <= 2).all())
                               for w in weights)}
