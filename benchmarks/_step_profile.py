"""Where a training step's time goes, and how much of it sparsity could remove.

- :func:`kernel_families`: device time per step by kernel family from a ``torch.profiler``
  trace (on a CPU-only run, the self CPU time of the aten ops, classified the same way);
- :func:`shrinkable_ms`: the time of the products and the optimizer step that sparse
  training shrinks, measured directly on the model's real Linear shapes (not from kernel
  names): forward ``X W^T (+b)``, ``dX = dY W`` and ``dW = dY^T X`` at the step's token
  count (bf16 on a GPU, fp32 on the CPU), plus AdamW on the fp32 weights;
- :func:`amdahl_limit`: the best speed-up a density can buy when nothing else changes;
- :func:`floor_limit`: the same with each product no faster than its bandwidth floor, the
  time to read and write its token matrices (X, Y, dY, dX), which no density shrinks.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from _common import busy_ms, device_activity
from torch import nn

# the first pattern that a kernel (or, on the CPU, aten op) name matches names its family
FAMILIES: tuple[tuple[str, re.Pattern], ...] = tuple((family, re.compile(pattern, re.I)) for
                                                      family, pattern in (
    # the project's Triton block-sparse kernels, cuSPARSELt (sm90_xmma_sparse_gemm_...);
    # on the CPU the layers' autograd Functions (forward and backward) and custom ops
    ("sparse products", r"_dense_sparse_kernel|_sampled_dense_dense_kernel|sparse_gemm|"
                        r"cusparselt|_cslt_sparse_mm|sparse_training::block_sparse|"
                        r"(BlockSparse|SemiStructured)LinearFunction"),
    # fused/foreach AdamW (multi_tensor_apply_kernel), the project's masked step kernels
    ("optimizer", r"adam|multi_tensor_apply|_foreach_|masked_step|_zero_pruned"),
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    # cuBLAS (nvjet_*, *xmma_gemm*, splitKreduce), cutlass, Inductor's Triton mm templates
    ("dense products", r"nvjet|gemm|gemv|cutlass|cublas|splitkreduce|triton_tem_|"
                       r"^aten::(mm|addmm|bmm|baddbmm)$"),
    ("memory copies", r"^memcpy|^memset|^aten::(copy_|fill_|zero_)$"),
))
OTHER = "elementwise/other"


def family_of(name: str) -> str:
    """The kernel family of a kernel or aten op name (:data:`FAMILIES`, else "other")."""
    return next((family for family, pattern in FAMILIES if pattern.search(name)), OTHER)


def _cpu_family(event) -> str:
    """The family of a CPU op: that of its outermost enclosing op with one (the ``aten::mm``
    inside a block-sparse custom op is a sparse product); ``Optimizer.*`` ranges do not
    count (under Lightning the whole step, closure included, runs inside one)."""
    chain = [event]
    while chain[-1].cpu_parent is not None:
        chain.append(chain[-1].cpu_parent)
    families = (family_of(e.name) for e in reversed(chain) if not e.name.startswith("Optimizer."))
    return next((f for f in families if f != OTHER), OTHER)


def kernel_families(events, steps: int, top: int = 5) -> dict:
    """Per step of a profile of ``steps`` steps, in ms: time by family (``family_ms``),
    ``busy_ms`` (GPU: the union of the device activity; CPU-only: the ops' summed self CPU
    time, each op in the family of its outermost classified caller) and the ``top`` largest
    "other" kernels or ops (``top_other``: name, ms) for refining :data:`FAMILIES`."""
    device = device_activity(events)
    if device:
        timed = [(e.name, family_of(e.name), e.time_range.elapsed_us()) for e in device]
        busy = busy_ms(device) / steps
    else:
        timed = [(e.name, _cpu_family(e), e.self_cpu_time_total) for e in events
                 if e.device_type == torch.autograd.DeviceType.CPU and not e.is_user_annotation]
        busy = sum(us for _, _, us in timed) / 1e3 / steps
    family_ms: dict[str, float] = {family: 0.0 for family, _ in FAMILIES} | {OTHER: 0.0}
    other: Counter[str] = Counter()
    for name, family, us in timed:
        family_ms[family] += us / 1e3 / steps
        if family == OTHER:
            other[name] += us / 1e3 / steps
    return {"family_ms": family_ms, "busy_ms": busy,
            "top_other": [[name[:160], ms] for name, ms in other.most_common(top)]}


def linear_shapes(model: nn.Module, deny: Sequence[str]) -> list[list[int]]:
    """``[in, out, has bias, count]`` of every ``nn.Linear`` and Hugging Face ``Conv1D``
    (GPT-2's input-first Linear: weight ``in x out``) whose qualified weight name no
    ``deny`` regex is found in (the callback's selection, the type rule and ``deny``)."""
    shapes: Counter[tuple[int, int, int]] = Counter()
    for name, module in model.named_modules():
        if any(re.search(d, f"{name}.weight") for d in deny):
            continue
        if isinstance(module, nn.Linear):
            shapes[module.in_features, module.out_features, module.bias is not None] += 1
        elif type(module).__name__ == "Conv1D":
            fan_in, fan_out = module.weight.shape
            shapes[fan_in, fan_out, module.bias is not None] += 1
    return [[*shape, count] for shape, count in shapes.items()]


def _median_ms(fn) -> float:
    """Median ms of ``fn`` (``torch.utils.benchmark``, which synchronizes CUDA)."""
    from torch.utils.benchmark import Timer

    fn()  # first call: cuBLAS heuristics, optimizer state
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.3).median * 1e3


def products_ms(shapes: Iterable[Sequence[int]], tokens: int, device: str,
                dtype: torch.dtype) -> list[float]:
    """ms of forward + dX + dW of the Linears of each entry of ``shapes``
    (:func:`linear_shapes`) at ``tokens`` tokens: timed once per shape, times its count."""
    per_shape = []
    for fan_in, fan_out, bias, count in shapes:
        with torch.device(device):
            w, x = torch.randn(fan_out, fan_in, dtype=dtype), torch.randn(tokens, fan_in,
                                                                          dtype=dtype)
            dy = torch.randn(tokens, fan_out, dtype=dtype)
            b = torch.randn(fan_out, dtype=dtype) if bias else None

        def products(w=w, x=x, dy=dy, b=b):
            nn.functional.linear(x, w, b)
            dy @ w
            dy.t() @ x

        per_shape.append(count * _median_ms(products))
    return per_shape


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device copy (read + write) of 1 GiB (64 MiB on the CPU)."""
    size = 2**30 if device == "cuda" else 2**26
    with torch.device(device):
        src, dst = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    seconds = _median_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * size / seconds


def token_bytes(shapes: Iterable[Sequence[int]], tokens: int, element_bytes: int) -> list[int]:
    """Bytes that forward, dX and dW of each entry of ``shapes`` move whatever the weight's
    density: X and Y (forward), dY and dX (dX), X and dY (dW), ``3 T (in + out)`` elements
    per Linear, times its count (the kept weights' bytes, which shrink, left out)."""
    return [count * 3 * tokens * (fan_in + fan_out) * element_bytes
            for fan_in, fan_out, _, count in shapes]


def optimizer_ms(shapes: Iterable[Sequence[int]], device: str) -> float:
    """ms of one ``AdamW(fused=True)`` step over fp32 weights and gradients of ``shapes``
    (every copy allocated: one launch over them all, as in training)."""
    with torch.device(device):
        weights = [nn.Parameter(torch.randn(fan_out, fan_in)) for fan_in, fan_out, _, count
                   in shapes for _ in range(count)]
        for w in weights:
            w.grad = torch.randn_like(w)
    step = torch.optim.AdamW(weights, lr=1e-5, fused=True).step
    return _median_ms(step)


def shrinkable_ms(shapes: Sequence[Sequence[int]], tokens: int) -> dict:
    """``products_ms`` (:func:`products_ms`, summed; bf16 on a GPU, fp32 on the CPU),
    ``optimizer_ms`` (:func:`optimizer_ms`) of ``shapes``, and per shape its products' ms
    (``products_by_shape_ms``) and bandwidth floor (``floor_by_shape_ms``:
    :func:`token_bytes` at the measured :func:`copy_bandwidth`, ``bandwidth_gbs``); memory
    the caller freed (its model and optimizer) is first given back to the device."""
    import gc

    gc.collect()
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.empty_cache()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    per_shape = products_ms(shapes, tokens, device, dtype)
    bandwidth = copy_bandwidth(device)
    floors = [b / bandwidth * 1e3 for b in token_bytes(shapes, tokens, dtype.itemsize)]
    return {"products_ms": sum(per_shape), "optimizer_ms": optimizer_ms(shapes, device),
            "products_by_shape_ms": per_shape, "floor_by_shape_ms": floors,
            "bandwidth_gbs": bandwidth / 1e9}


def amdahl_limit(dense_ms: float, shrinkable: float, density: float) -> float | None:
    """Speed-up over dense when the ``shrinkable`` ms scale with ``density`` and the rest of
    the ``dense_ms`` step does not: ``dense / (dense - (1 - density) * shrinkable)``; None
    when the shrunk step would take no time (``shrinkable``, measured alone, is off)."""
    rest = dense_ms - (1 - density) * shrinkable
    return dense_ms / rest if rest > 0 else None


def floor_limit(dense_ms: float, shrinkable: dict, density: float) -> float | None:
    """:func:`amdahl_limit` with each shape's products shrunk to ``max(density * P_s, F_s)``
    (``F_s`` its bandwidth floor, at most ``P_s``: what was measured is reachable) rather
    than ``density * P_s``, the optimizer with the density:
    ``dense / (dense - sum_s (P_s - max(d P_s, min(F_s, P_s))) - (1 - d) O)``; None without
    the per-shape figures (runs saved before they were measured) or when the rest is <= 0."""
    if "floor_by_shape_ms" not in shrinkable:
        return None
    pairs = zip(shrinkable["products_by_shape_ms"], shrinkable["floor_by_shape_ms"], strict=True)
    saved = sum(p - max(density * p, min(f, p)) for p, f in pairs)
    rest = dense_ms - saved - (1 - density) * shrinkable["optimizer_ms"]
    return dense_ms / rest if rest > 0 else None


def compile_census() -> dict:
    """What ``torch.compile`` built in this process: Dynamo's ``graphs`` and
    ``graph_breaks``, and per CUDA graph of ``mode="reduce-overhead"`` (CUDA-graph trees) its
    ``inputs``, how many are ``static`` (read in place: parameters, buffers, marked
    addresses) and the first ``copied`` ones, copied into the graph's buffers at every replay
    (host time a step pays), ``[placeholder name, ...]`` with their count ``n_copied``."""
    from torch._dynamo.utils import counters

    census = {"graphs": counters["stats"]["unique_graphs"],
              "graph_breaks": sum(counters["graph_break"].values()), "cuda_graphs": []}
    if not torch.cuda.is_available():
        return census
    from torch._inductor.cudagraph_trees import get_container

    manager = get_container(torch.cuda.current_device()).tree_manager
    nodes = [] if manager is None else [n for ns in manager.roots.values() for n in ns]
    while nodes:
        node = nodes.pop()
        nodes.extend(n for ns in node.children.values() for n in ns)
        placeholders = node.wrapped_function.placeholders
        copied = list(node.non_static_input_idx)
        census["cuda_graphs"].append({
            "inputs": len(placeholders), "static": len(node.static_input_idxs),
            "n_copied": len(copied), "copied": [placeholders[i].name for i in copied[:12]]})
    return census
