"""Sparse or dense, measured: each 2:4 product runs where it was timed faster.

cuSPARSELt beats cuBLAS at large shapes only (on an H100 its host time per call is about
0.8 ms in torch 2.11, and its default plan is slower than dense), so each shape is timed
once, both ways, on the GPU it runs on: the forward, the input gradient (where the mask is
transposable) and the refresh of the packed copies after an optimizer step. A product goes
sparse where it is faster, and only if what the sparse products save per step is more than
the refresh costs. ``timing="eager"`` times the wall time of back-to-back calls, so
host-bound calls count as an eager training step sees them; ``timing="cuda_graph"`` times
replays of a CUDA graph of the calls, the GPU time alone, as a step captured in a CUDA graph
sees it. Decisions are cached per (GPU, dtype, shape, token count, transposable, timing)
for the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_training.kernels.semi_structured.cusparselt import PackedWeight, envelope_problem

CALLS = 10  # timed calls per candidate, after 2 warm-up calls
MARGIN = 0.05  # sparse only if it saves more than this share of the dense products' time
TIMINGS = ("eager", "cuda_graph")  # what a training step pays per call: host and GPU, or GPU


@dataclass(frozen=True)
class PathChoice:
    """Which products of one shape run on cuSPARSELt, why, and the times (ms) behind it."""

    forward: bool
    input_grad: bool
    reason: str
    times_ms: dict[str, float]


_CHOICES: dict[tuple, PathChoice] = {}


def wall_ms(fn: Callable[[], object], calls: int = CALLS) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (host and device)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def graph_ms(fn: Callable[[], object], calls: int = CALLS) -> float:
    """GPU milliseconds per call: one replay of a CUDA graph of ``calls`` calls (no host
    time), after 2 eager warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def check_timing(timing: str) -> None:
    """Raise ``ValueError`` unless ``timing`` is one of :data:`TIMINGS`."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")


def choose_paths(weight: torch.Tensor, dtype: torch.dtype, tokens: int, timing: str,
                 pack: Callable[[bool], PackedWeight], transposable: bool) -> PathChoice:
    """The measured choice for ``tokens`` rows of input to ``weight`` computed in ``dtype``
    (cached); ``timing``: ``"eager"`` or ``"cuda_graph"`` (module doc). ``pack(transposed)``
    gives the packed weight (``transposed``: its transpose) to time; it is called only when
    no choice is cached, and for the transpose only where ``transposable``.

    Raises:
        ValueError: an unknown ``timing``.
        RuntimeError: a shape or token count outside cuSPARSELt's envelope
            (:func:`~sparse_training.kernels.semi_structured.cusparselt.envelope_problem`:
            callers check it first), or called while a CUDA graph is being captured (timing
            needs the GPU to itself: run one step before capturing).
    """
    check_timing(timing)
    out_features, in_features = weight.shape
    if problem := envelope_problem(out_features, in_features, tokens):
        raise RuntimeError(f"not timing cuSPARSELt for a {out_features}x{in_features} weight: "
                           f"{problem}")
    key = (torch.cuda.get_device_name(weight.device), dtype, out_features, in_features, tokens,
           transposable, timing)
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the first call of a 2:4 layer ({out_features}x{in_features}) with {tokens} "
                "tokens times cuSPARSELt against cuBLAS, which cannot happen inside CUDA graph "
                "capture: run one training step (the usual warm-up) before capturing")
        timer = wall_ms if timing == "eager" else graph_ms
        _CHOICES[key] = _measure(weight.detach(), pack(False),
                                 pack(True) if transposable else None, tokens, timer)
    return _CHOICES[key]


def cached_choices() -> dict[tuple, PathChoice]:
    """Every decision made in this process, keyed by (GPU, dtype, out, in, tokens,
    transposable, timing)."""
    return dict(_CHOICES)


def _measure(weight: torch.Tensor, packed: PackedWeight, packed_t: PackedWeight | None,
             tokens: int, timer: Callable[[Callable[[], object]], float]) -> PathChoice:
    """Times the products on random inputs: cuBLAS on ``weight`` cast to the packed dtype
    (the cast autocast makes; none for weights already in it), the refreshes from
    ``weight`` itself, as a training step reads it."""
    dtype = packed.packed.dtype
    dense = weight.to(dtype)
    x = torch.randn(tokens, weight.shape[1], device=weight.device, dtype=dtype)
    grad = torch.randn(tokens, weight.shape[0], device=weight.device, dtype=dtype)
    times = {"dense_forward": timer(lambda: F.linear(x, dense)),
             "sparse_forward": timer(lambda: packed.matmul(x)),
             "refresh": timer(lambda: packed.refresh(weight))}
    if packed_t is not None:
        times.update(dense_input_grad=timer(lambda: grad @ dense),
                     sparse_input_grad=timer(lambda: packed_t.matmul(grad)),
                     refresh_transposed=timer(lambda: packed_t.refresh(weight)))
    return decide(times)


def decide(times: dict[str, float]) -> PathChoice:
    """The choice from measured milliseconds: ``dense_forward``, ``sparse_forward``,
    ``refresh`` and, for a transposable mask, ``dense_input_grad``, ``sparse_input_grad``,
    ``refresh_transposed``. A product goes sparse where it is faster, and only if the
    products' savings per step, net of the refreshes they need, exceed :data:`MARGIN` of
    the dense products' time (smaller savings are within the timing's noise; a BERT-large
    step with such ties sparse was no faster than with them dense: docs/performance.md)."""
    forward = times["sparse_forward"] < times["dense_forward"]
    saved = times["dense_forward"] - times["sparse_forward"] if forward else 0.0
    refresh = times["refresh"] if forward else 0.0
    input_grad = "sparse_input_grad" in times and (
        times["sparse_input_grad"] < times["dense_input_grad"])
    if input_grad:
        saved += times["dense_input_grad"] - times["sparse_input_grad"]
        refresh += times["refresh_transposed"]
    if not (forward or input_grad):
        return PathChoice(False, False, "dense: cuBLAS was faster for every product", times)
    if saved <= refresh:
        return PathChoice(False, False, f"dense: the sparse products save {saved:.3f} ms but "
                          f"repacking after each step costs {refresh:.3f} ms", times)
    dense = times["dense_forward"] + times.get("dense_input_grad", 0.0)
    if saved - refresh <= MARGIN * dense:
        return PathChoice(False, False, f"dense: the sparse products save {saved - refresh:.3f}"
                          f" ms net of repacking, within {MARGIN:.0%} of cuBLAS's {dense:.3f} ms",
                          times)
    parts = [name for name, on in (("forward", forward), ("dX", input_grad)) if on]
    return PathChoice(forward, input_grad, f"sparse {' and '.join(parts)}: saves "
                      f"{saved - refresh:.3f} ms per step net of repacking", times)
