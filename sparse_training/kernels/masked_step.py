"""Fused masked optimizer step (AdamW, Adam, SGD) in one multi-tensor Triton kernel.

One pass per element reads param, grad, optimizer state and mask and writes param and
state: the gradient is masked, the moments / momentum buffer are written as exact
zeros at pruned positions and so is the weight. A whole param group is one launch
(one per parameter dtype, gradient dtype and mask format present).

Parameters may be float32, bfloat16 or float16; their optimizer state has their dtype
(torch creates it with ``zeros_like``). The arithmetic runs in float32 and each tensor
is rounded once when stored, as in torch's ``fused=True`` optimizers (its default
``foreach`` path rounds after every operation instead).
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

from ._masked_step_kernel import ADAM, SGD
from ._masked_step_kernel import masked_step_kernel as _masked_step_kernel
from ._multi_tensor import address_table, all_aligned, chunk_table
from ._step_plan import StepBatch, device_unsupported_reason, options_unsupported_reason
from ._step_run import run_masked_step
from ._step_single_tensor import apply_batch
from ._triton import kernels_run_on, tl

_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Columns of the per-tensor address table.
_P, _G, _A, _B, _K, _NUMEL, _S0, _S1 = range(8)
_COLUMNS = 8


@dataclass(frozen=True)
class StepConfig:
    """Launch configuration of the masked step.

    Attributes:
        block: Elements per loop iteration of a program (``block / (32 * num_warps)``
            contiguous elements per thread: 8 gives two 16-byte loads per fp32 stream).
        num_warps: Warps per program.
        chunk: Elements per work item of the multi-tensor table (a multiple of ``block``).
        programs_per_sm: 0 launches one program per chunk (the hardware scheduler
            balances); ``k > 0`` launches a persistent grid of ``k`` programs per
            multiprocessor that stride over the chunk list.
        num_stages: Passed to Triton (software pipelining depth; elementwise loops
            without dots are hardly affected).
    """

    block: int
    num_warps: int
    chunk: int
    programs_per_sm: int = 0
    num_stages: int = 1


def masked_step_configs() -> list[StepConfig]:
    """Candidate launch configurations, swept by ``benchmarks/optimizer.py``.

    The step updates its inputs in place, so Triton's run-time autotuner (which
    launches every candidate on the live tensors) cannot pick among them; the
    benchmark sweeps them on live tensors of a throwaway optimizer and
    ``DEFAULT_CONFIG`` records the winner (see ``docs/performance.md``).
    """
    # 4 elements per thread (block = 128 * num_warps) keeps the int8 mask load, the
    # fp32 loads and the fp32 stores in one register layout; at 8 per thread the mask
    # load wants 8-wide and the fp32 stores 4-wide, and Triton converts three tensors
    # through shared memory (with barriers) every iteration (seen in the TTGIR).
    configs = [
        StepConfig(128 * warps, warps, chunk)
        for warps in (2, 4, 8, 16)
        for chunk in (8192, 16384, 65536)
    ]
    configs += [StepConfig(512, 4, 16384, pps) for pps in (4, 8, 16)]
    configs += [StepConfig(1024, 8, 16384, pps) for pps in (2, 4, 8)]
    configs += [StepConfig(512, 4, 16384, 0, 3)]
    configs += [StepConfig(1024, 4, 16384), StepConfig(4096, 16, 65536)]  # 8 per thread
    return configs


# Read at every launch; ``benchmarks/optimizer.py`` sets it while sweeping candidates.
DEFAULT_CONFIG = StepConfig(block=2048, num_warps=16, chunk=8192)

# Fast math (one approximate sqrt and one approximate division per element, the
# gradient scale and bias corrections as reciprocals computed once per program):
# kept weights agree with the float64 reference to a few fp32 ulps. False selects
# correctly rounded div/sqrt as torch uses them (bit-exact-leaning, slower);
# ``benchmarks/optimizer.py`` times both.
FAST_MATH = True


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _bias_corrections(t: float, hp: dict, fast: bool) -> tuple[float, float]:
    # lr / (1 - beta1^t) and sqrt(1 - beta2^t) (its reciprocal with fast math) in
    # float64 like torch's foreach path.
    bc2 = math.sqrt(1 - hp["beta2"] ** t)
    return hp["lr"] / (1 - hp["beta1"] ** t), (1.0 / bc2 if fast else bc2)


def _kernel_ready(batch: StepBatch, i: int) -> bool:
    param = batch.params[i]
    state = [s[i] for s in (batch.exp_avgs, batch.exp_avg_sqs, batch.momentum_buffers) if s]
    if not all(t.is_contiguous() for t in [param, batch.grads[i], batch.masks[i], *state]):
        return False
    if batch.grads[i].dtype not in _TORCH_TO_TL or param.dtype not in _TORCH_TO_TL:
        return False
    if any(t.dtype != param.dtype for t in state):  # e.g. float32 state loaded by hand
        return False
    return (
        not batch.steps
        or batch.steps[i].device.type == "cpu"
        or batch.steps[i].dtype == torch.float32
    )


def _split(batch: StepBatch, keep: list[int]) -> StepBatch:
    lists = ("keys", "params", "grads", "masks", "exp_avgs", "exp_avg_sqs", "steps",
             "momentum_buffers")
    part = StepBatch(batch.algo, batch.hparams, batch.sgd_first)
    for name in lists:
        src = getattr(batch, name)
        setattr(part, name, [src[i] for i in keep] if src else [])
    return part


@lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # interpreter: a small persistent grid still exercises the striding
    return torch.cuda.get_device_properties(device).multi_processor_count


_DATA_PTR = torch.Tensor.data_ptr
_TABLES_PER_BATCH = 4


@dataclass
class _Launch:
    """What one batch's launches share across steps (kept in ``StepBatch.launch``).

    Built from a batch on its first launch. A cached plan (``_step_run``) guarantees
    that params, state, masks and the kernel-ready split stay valid; per call only the
    gradients (their addresses: a device table per address set, a few kept), the step
    values (bias corrections) and the launch config are read again.
    """

    kernel_idx: list[int] | None  # batch indices the kernel takes (None: all)
    ref_idx: list[int]  # the rest: pure-torch reference
    device: torch.device
    param_dtype: torch.dtype  # one per batch (the plan groups by it)
    static_columns: list[list[int]]  # p, a, b, k addresses of the kernel's tensors
    numels: list[int]
    static_aligned: bool
    step_ptrs: list[int] | None  # device step counters (fused/capturable placement)
    tables: OrderedDict
    chunk_tables: dict


def _steps_on_device(steps: list[torch.Tensor]) -> bool:
    """Whether the kernel reads Adam's step counters itself (device tensors, as torch places
    them for fused/capturable optimizers) instead of host bias corrections."""
    return bool(steps) and steps[0].device.type != "cpu"


def _prepare(batch: StepBatch) -> _Launch:
    ready = [_kernel_ready(batch, i) for i in range(len(batch.params))]
    kernel_idx = None if all(ready) else [i for i, r in enumerate(ready) if r]
    ref_idx = [i for i, r in enumerate(ready) if not r]
    sub = batch if kernel_idx is None else _split(batch, kernel_idx)
    params = sub.params
    state_a = sub.exp_avgs or sub.momentum_buffers or params
    state_b = sub.exp_avg_sqs or params
    static = [list(map(_DATA_PTR, ts)) for ts in (params, state_a, state_b, sub.masks)]
    step_on_device = _steps_on_device(sub.steps)
    return _Launch(
        kernel_idx=kernel_idx,
        ref_idx=ref_idx,
        device=params[0].device if params else torch.device("cpu"),
        param_dtype=params[0].dtype if params else torch.float32,
        static_columns=static,
        numels=[p.numel() for p in params],
        static_aligned=all_aligned([a for col in static for a in col]),
        step_ptrs=list(map(_DATA_PTR, sub.steps)) if step_on_device else None,
        tables=OrderedDict(),
        chunk_tables={},
    )


def _step_values(batch: StepBatch, kernel_idx: list[int] | None) -> list[float]:
    if batch.step_buffer is not None:
        values = batch.step_buffer.tolist()
    else:
        values = torch.stack(batch.steps).tolist()
    return values if kernel_idx is None else [values[i] for i in kernel_idx]


def launch_masked_step(
    batch: StepBatch,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    config: StepConfig | None = None,
) -> None:
    """Update one ``StepBatch`` with a single kernel launch.

    Tensors the kernel cannot take (non-contiguous, unusual dtypes) go through the
    pure-torch reference instead. The batch keeps what its next launch can reuse
    (``batch.launch``); a batch of a cached plan only re-reads its gradients.

    Args:
        batch: Tensors of one param group, state created and steps advanced.
        grad_scale: Optional float32 tensor the gradients are divided by.
        found_inf: Optional float32 tensor; nonzero makes the kernel write nothing.
        config: Launch configuration; ``DEFAULT_CONFIG`` when None.

    Raises:
        ValueError: If ``config.chunk`` is not a multiple of ``config.block``.
    """
    config = config or DEFAULT_CONFIG
    if config.chunk % config.block:
        raise ValueError(f"chunk {config.chunk} is not a multiple of block {config.block}")
    prep = batch.launch
    if prep is None:
        prep = batch.launch = _prepare(batch)
    kernel_idx = prep.kernel_idx
    if prep.ref_idx:
        apply_batch(_split(batch, prep.ref_idx), grad_scale, found_inf)
        if not kernel_idx:
            return
    grads = batch.grads if kernel_idx is None else [batch.grads[i] for i in kernel_idx]
    fast = FAST_MATH
    hp = batch.hparams
    device = prep.device
    numels = prep.numels
    adam = batch.algo == "adam"
    step_on_device = prep.step_ptrs is not None
    bc_per_tensor = False
    step_size_all, bc2_all = hp["lr"], 1.0
    col6 = col7 = numels
    grad_ptrs = list(map(_DATA_PTR, grads))
    key: tuple = tuple(grad_ptrs)
    if adam and step_on_device:
        col6 = prep.step_ptrs
    elif adam:
        values = _step_values(batch, kernel_idx)
        first = values[0]
        if values.count(first) == len(values):  # the usual case: one pair of scalars
            step_size_all, bc2_all = _bias_corrections(first, hp, fast)
        else:
            distinct = {t: _bias_corrections(t, hp, fast) for t in set(values)}
            bc_per_tensor = True
            col6 = [_f32_bits(distinct[t][0]) for t in values]
            col7 = [_f32_bits(distinct[t][1]) for t in values]
            key = (key, tuple(col6), tuple(col7))
    entry = prep.tables.get(key)
    if entry is None:  # under CUDA graph capture: the gradients the graph allocated
        p_col, a_col, b_col, k_col = prep.static_columns
        table = address_table([p_col, grad_ptrs, a_col, b_col, k_col, numels, col6, col7], device)
        entry = prep.tables[key] = (table, prep.static_aligned and all_aligned(grad_ptrs))
        if len(prep.tables) > _TABLES_PER_BATCH:
            prep.tables.popitem(last=False)
    table, aligned = entry
    chunks = prep.chunk_tables.get(config.chunk)
    if chunks is None:
        chunks = prep.chunk_tables[config.chunk] = chunk_table(numels, config.chunk, device)
    tensor_index, chunk_index = chunks
    n_chunks = tensor_index.numel()
    grid = n_chunks
    if config.programs_per_sm:
        grid = max(1, min(n_chunks, config.programs_per_sm * _sm_count(device)))
    beta1, beta2 = (hp["beta1"], hp["beta2"]) if adam else (0.5, 0.5)
    momentum = hp.get("momentum", 0.0)
    _masked_step_kernel[(grid,)](
        table, tensor_index, chunk_index, n_chunks,
        grad_scale if grad_scale is not None else table,
        found_inf if found_inf is not None else table,
        -1.0 if hp["maximize"] else 1.0,
        hp["lr"], step_size_all, bc2_all, 1 - hp["lr"] * hp["weight_decay"], hp["weight_decay"],
        1 - beta1, beta2, 1 - beta2, math.log2(beta1), math.log2(beta2),
        hp.get("eps", 0.0), momentum, 1 - hp.get("dampening", 0.0),
        PARAM_DTYPE=_TORCH_TO_TL[prep.param_dtype],
        GRAD_DTYPE=_TORCH_TO_TL[grads[0].dtype],
        ALGO=ADAM if adam else SGD,
        DECOUPLED=hp.get("decoupled", False),
        HAS_MOMENTUM=momentum != 0,
        NESTEROV=hp.get("nesterov", False),
        SGD_FIRST=batch.sgd_first,
        MASK_PACKED=batch.masks[0].dtype == torch.uint8,
        STEP_ON_DEVICE=step_on_device,
        BC_PER_TENSOR=bc_per_tensor,
        HAS_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None,
        ALIGNED=aligned,
        FAST=fast,
        COLUMNS=_COLUMNS, CHUNK=config.chunk, BLOCK=config.block,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _apply(
    batch: StepBatch, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    if kernels_run_on(batch.params[0].device):
        launch_masked_step(batch, grad_scale, found_inf)
    else:
        apply_batch(batch, grad_scale, found_inf)


def fused_masked_step(
    optimizer: torch.optim.Optimizer,
    masks: Mapping[torch.Tensor, torch.Tensor],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Masked optimizer step for every masked parameter, in fused Triton kernels.

    For each parameter of ``optimizer.param_groups`` that has a gradient and an entry
    in ``masks``, performs the optimizer's update with the gradient masked, and writes
    the weight and its optimizer state as exact zeros where the mask is False
    (see ``_step_single_tensor.adam_update`` / ``sgd_update`` for the formulas; AdamW's
    decoupled decay follows Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019). Hyperparameters are read from the param
    groups at every call, so LR schedulers work. State lives in ``optimizer.state[p]``
    with torch's own layout (``step`` as a tensor placed as torch places it,
    ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), so ``state_dict()`` and a later
    plain ``optimizer.step()`` continue seamlessly.

    Convention: the handled parameters get ``p.grad = None`` afterwards (also on a
    skipped step), so that calling ``optimizer.step()`` right after, e.g. from a
    ``register_step_pre_hook``, updates only the unmasked parameters.

    ``grad_scale``/``found_inf`` behave like torch's fused optimizers: gradients are
    divided by ``grad_scale``; a nonzero ``found_inf`` writes nothing and does not
    advance ``step``. Callers that unscale first (Lightning's AMP, ``GradScaler``
    with a non-fused optimizer) pass neither.

    Parameters on devices the kernels cannot run on (CPU without
    ``TRITON_INTERPRET=1``) are updated in pure torch (``_step_single_tensor``).

    With ``capturable=True`` the step can be captured in a CUDA graph, as torch's: run
    it once before capturing (the usual warm-up, which plans the step; planning under
    capture raises); hyperparameters are then the ones read at capture (a float ``lr``; a
    tensor ``lr`` is refused), and the graph stays valid while the parameters, masks and
    state objects do.

    Args:
        optimizer: A ``torch.optim.AdamW``, ``Adam`` or ``SGD`` (exact classes).
        masks: Parameter tensor (the object itself) -> bool mask of its shape, or a
            bit-packed uint8 mask from ``pack_mask``; for an FSDP2 DTensor parameter, the
            mask of its local shard (the kernel updates the local shards).
        grad_scale: Optional float32 scalar tensor the gradients are divided by.
        found_inf: Optional float32 scalar tensor; nonzero skips the step.

    Raises:
        ValueError: If the optimizer class or an option (amsgrad, differentiable, a
            tensor lr with capturable) is unsupported, or a mask is malformed.
    """
    run_masked_step(optimizer, masks, grad_scale, found_inf, _apply, cache=True)


def fused_unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``fused_masked_step`` cannot run ``optimizer`` in kernels, or None if it can.

    None requires an exact ``torch.optim.AdamW``, ``Adam`` or ``SGD`` (no subclass),
    no ``amsgrad``/``differentiable`` (nor a tensor ``lr`` with ``capturable``), float32,
    bfloat16 or float16 parameters on CUDA (or CPU under ``TRITON_INTERPRET=1``) and
    Triton installed.

    Args:
        optimizer: The user's optimizer.

    Returns:
        A human-readable reason, or None.
    """
    return options_unsupported_reason(optimizer) or device_unsupported_reason(optimizer)
