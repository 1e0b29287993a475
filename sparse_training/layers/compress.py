"""Train compressed from setup: selected ``nn.Linear`` (and HF ``Conv1D``) weights become
``BlockSparseLinear`` (blocks), ``SemiStructuredLinear`` (2:4) or ``SlimLinear`` (whole
heads and neurons removed, :mod:`sparse_training.layers.compress_units`); ``Conv1D`` takes
their input-first forms (:mod:`sparse_training.layers.conv1d`).

Where a block pattern's kept count is fixed from the first step (``schedule="oneshot"`` or
``"constant"`` at ``start=0``, a per-tensor distribution; RigL and SET move blocks inside
that count, :class:`~sparse_training.layers.storage.BlockSparseSlot`), a selected Linear
weight needs no dense copy at all: it is swapped for a :class:`BlockSparseLinear` before
the optimizers are built, so weights, gradients and optimizer state hold only the kept
blocks. The kept blocks are exactly those the masked-dense engine would keep at step 0
(the same mask function and seeded scores), so ``compress`` changes how a layer trains,
not which blocks it keeps. Everything else stays masked-dense (the engine), and
:func:`compress_selected` says, per tensor, which path it takes and why, in the swap
table of :func:`~sparse_training.layers.swap.sparsify` and in the plan it returns.

``compress="auto"`` compresses only where the compressed layer trains faster than
masked-dense on the device and compute dtype training uses: each distinct layer is timed
both ways there, at ``auto_tokens`` tokens per step, and the times are cached
(:mod:`sparse_training.layers.auto_paths`); heads and neurons shrink untimed (smaller
dense products); ``True`` compresses every eligible tensor. On
resume the same layers are swapped again, with fresh masks; loading the checkpoint's
dense weights then gives each layer its kept blocks (the blocks that hold a nonzero), and
the callback's state its exact mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparse_training.engine.names import replaced_name
from sparse_training.engine.plan import SparsityPlan, pattern_label
from sparse_training.engine.selection import TensorPlan
from sparse_training.engine.sharding import is_sharded
from sparse_training.engine.state import LayerForm, check_compressed
from sparse_training.engine.tensors import is_conv1d
from sparse_training.kernels.block_sparse import block_grid
from sparse_training.kernels.semi_structured.masks import features_problem
from sparse_training.layers.auto_paths import (
    CUDA_GRAPHS,
    EAGER,
    Measure,
    PathCache,
    PathKey,
    choose_paths,
    device_name,
    dtype_name,
    unmeasured_reason,
)
from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.layers.blocks import BLOCK_SIZES
from sparse_training.layers.compress_units import record_head_counts, shrinkable_units
from sparse_training.layers.conv1d import INPUT_FIRST, as_linear
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.layers.slim import SlimLinear, sync_head_counts
from sparse_training.layers.swap import (
    SwapRow,
    nothing_pruned,
    replace_module,
    swap_checker,
    swap_in,
)
from sparse_training.pieces.masks import kept_count, pattern_mask
from sparse_training.pieces.patterns import Pattern, parse_pattern
from sparse_training.pieces.scores import DenseWeight
from sparse_training.pieces.training_scores import TrainingScore

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

def pattern_problem(pattern: Pattern) -> str | None:
    """Why no compressed layer takes ``pattern``, or None: blocks of :data:`BLOCK_SIZES`
    (``BlockSparseLinear``) or 2:4 (``SemiStructuredLinear``, transposable or not)."""
    if problem := pattern.compression_problem:
        return problem
    block = (pattern.block_rows, pattern.block_cols)
    if not pattern.is_nm and not set(block) <= set(BLOCK_SIZES):
        return f"block {block[0]}x{block[1]}: the kernels take blocks of {BLOCK_SIZES}"
    return None


def _first_score(weight: torch.Tensor, index: int,
                 config: SparsityConfig) -> torch.Tensor | None:
    """The score the masked-dense engine ranks the ``index``-th selected tensor by at step 0
    (``ScheduledMasks.score``; a training score has observed nothing at step 0: None, the
    largest |w|, as its updater keeps)."""
    return None if isinstance(config.parsed_score, TrainingScore) else (
        config.parsed_score(DenseWeight(weight), 0, index))


def _first_mask(weight: torch.Tensor, plan: TensorPlan, index: int,
                config: SparsityConfig) -> torch.Tensor:
    """The mask the masked-dense engine would set at step 0: the pattern's mask of the
    tensor's :func:`_first_score`."""
    return pattern_mask(weight.detach(), plan.pattern, plan.sparsity,
                        _first_score(weight, index, config), plan.input_dim)


def _keeps_every_block(plan: TensorPlan) -> str | None:
    """Why a block-pattern tensor stays masked-dense because its target prunes no block
    (a compressed layer would hold every block, for nothing), or None."""
    pattern, target = plan.pattern, plan.sparsity
    if pattern.is_nm or not target or kept_count(plan.block_count, target) < plan.block_count:
        return None
    return nothing_pruned(plan.shape, (pattern.block_rows, pattern.block_cols),
                          f"sparsity {target:g}")


def compress_selected(model: nn.Module, plan: SparsityPlan,
                      device: torch.device | None = None,
                      compute_dtype: torch.dtype | None = None, *,
                      measure: Measure | None = None, cache: PathCache | None = None,
                      progress: Callable[[str], object] | None = None,
                      agree: Callable[[list], list] | None = None, mode: str = EAGER
                      ) -> tuple[list[SwapRow], SparsityPlan]:
    """Swap the selected Linear weights of ``plan`` that can train compressed, in place
    (module doc), each with the mask masked-dense training keeps at step 0.

    Args:
        plan: ``model``'s plan (:meth:`SparsityPlan.build`).
        device: where the layers will train, for ``compress="auto"`` (default: each
            weight's device now).
        compute_dtype: the dtype of their products (autocast's, or the weights'), for
            ``"auto"`` (default: each weight's dtype).
        measure, cache, progress, agree: how ``"auto"`` times the layers, where it keeps
            the times, says each measurement and makes ranks agree
            (:func:`~sparse_training.layers.auto_paths.choose_paths`).
        mode: how the model runs (:func:`~sparse_training.layers.auto_paths.compile_mode`):
            replaying CUDA graphs, ``"auto"`` times graph replays; compiled, it keeps 2:4
            layers masked-dense (their compiled forward is cuBLAS on the dense weight).

    Returns:
        One row per selected tensor's module (``compressed``, or why it trains
        masked-dense; under ``"auto"`` both with the measured times), and the plan of the
        model after the swap (the compressed rows follow their layers; ``path_reason``
        says why each took its path).

    Raises:
        ValueError: before anything is swapped: ``config.compress`` is True and nothing can
            be (or already is) compressed (the rows say why); a weight to compress on the
            meta device.
    """
    config = plan.config
    problem = config.fixed_count_problem()
    swap_problem = swap_checker(model)
    # (index, plan row, why it stays masked-dense | a PathKey to time | None, module)
    entries = []
    keys: dict[PathKey, torch.device] = {}  # "auto": each distinct layer, where to time it
    for index, (row, tensor) in enumerate(plan.masked):
        module, attr = tensor.owners[0]
        if problem is not None:
            reason = problem
        elif len(tensor.owners) > 1:
            reason = (f"{attr} tied to {', '.join(tensor.names[1:])}: compressing one name "
                      f"would untie them")
        elif not linear_like(module) or attr != "weight":
            reason = f"{type(module).__name__}.{attr} is not an nn.Linear or Conv1D weight"
        elif (swap := swap_problem(row.name.rpartition(".")[0], module)) is not None:
            reason = swap
        elif row.tie is not None:  # decided per group of units, below
            reason = None
        elif (unsupported := pattern_problem(row.pattern)) is not None:
            reason = unsupported
        elif row.pattern.is_nm and (shape := features_problem(*matrix_shape(row)[::-1])):
            reason = f"SemiStructuredLinear: {shape}"  # a 10-class head, say
        elif (kept_all := _keeps_every_block(row)) is not None:
            reason = kept_all
        elif config.compress == "auto":
            where, dtype = device or module.weight.device, compute_dtype or module.weight.dtype
            if (reason := unmeasured_reason(where, dtype, row.pattern.is_nm, mode)) is None:
                reason = _path_key(row, where, dtype, config.auto_tokens, mode == CUDA_GRAPHS)
                keys.setdefault(reason, where)
        else:
            reason = None
        entries.append((index, row, reason, module))
    timings = choose_paths(keys, measure=measure, cache=cache, progress=progress,
                           agree=agree) if keys else {}
    notes = {}  # tensor name -> the measured times of a compressed one
    for i, (index, row, key, module) in enumerate(entries):
        if not isinstance(key, PathKey):
            continue
        timing = timings[key]
        if isinstance(timing, str):  # why it could not be measured
            entries[i] = (index, row, timing, module)
        elif timing.compresses:
            entries[i], notes[row.name] = (index, row, None, module), timing.text(key)
        else:
            entries[i] = (index, row, timing.text(key), module)
    units = shrinkable_units(model, plan, entries, lambda w, i: _first_score(w, i, config))
    entries = [(i, row, units[row.name][0] if row.name in units else reason, module)
               for i, row, reason, module in entries]
    if meta := [row.name for _, row, reason, module in entries
                if reason is None and module.weight.is_meta]:
        raise ValueError(f"{meta} are on the meta device: compressing keeps the blocks their "
                         f"values choose; initialize the weights first (build the layers on "
                         f"their device, or to_empty and reset_parameters)")
    rows, reasons = [], {}  # reasons: tensor name -> why it stays masked-dense
    for index, row, reason, module in entries:
        module_name = row.name.rpartition(".")[0]
        if reason is not None:
            reasons[row.name] = reason
            rows.append(SwapRow(module_name, row.shape, pattern_label(row),
                                f"masked-dense: {reason}"))
            continue
        mask = units[row.name][1] if row.name in units else (
            _first_mask(module.weight, row, index, config))
        layer = _compressed_layer(module, row, mask.to(module.weight.device))
        decision = f"compressed: {notes[row.name]}" if row.name in notes else "compressed"
        rows.append(SwapRow(module_name, row.shape, pattern_label(row), decision,
                            layer.train(module.training)))
    if config.compress is True and len(reasons) == len(rows) and not any(
            p.compressed for p in plan.rows):
        lines = "\n".join(f"  {name}: {why}" for name, why in reasons.items()) or "\n".join(
            f"  {p.name}: not selected: {p.reason}" for p in plan.rows)  # why none was
        raise ValueError(f"compress=True but no selected tensor can train compressed; "
                         f"use compress='auto' or False. Per tensor:\n{lines}")
    record_head_counts(model, {row.tie.group for _, row, reason, _ in entries
                               if reason is None and row.tie and row.tie.kind == "head"})
    swap_in(model, rows)
    sync_head_counts(model)
    return rows, plan.with_rows([replace(p, path_reason=reasons.get(p.name) or notes.get(
        p.name, "")) for p in plan.rows])


def _path_key(row: TensorPlan, device: torch.device, dtype: torch.dtype,
              tokens: int, graphed: bool) -> PathKey:
    """The measurement ``row``'s layer stands for: its shape, pattern, kept share (the
    blocks its target keeps; half for 2:4), compute dtype, device, tokens and whether it
    replays as a CUDA graph."""
    density = 0.5 if row.pattern.is_nm else kept_count(
        row.block_count, row.sparsity) / row.block_count
    return PathKey(matrix_shape(row), row.pattern.spec, round(density, 3),
                   dtype_name(dtype), device_name(device), tokens, graphed)


def follow_checkpoint(model: nn.Module, plan: SparsityPlan, saved: Any,
                      swapped: list[tuple[str, nn.Module]]) -> SparsityPlan:
    """Make the layers this fit swapped (``swapped``: name and the Linear it replaced) the
    ones a checkpoint trained compressed (``saved``: its state's ``"compressed"`` masks),
    in place, before the optimizers are built: a layer the checkpoint trained masked-dense
    goes back to its Linear with the loaded weights, a selected Linear it trained
    compressed is swapped with the checkpoint's mask. ``compress="auto"`` decided for
    this device; the checkpoint's decision wins, so the resumed run is the saved one.

    Returns:
        ``plan`` with the checkpoint's paths (``swapped`` is updated to match).

    Raises:
        ValueError: a saved layer that is not a selected Linear of this plan, or whose mask
            does not fit it (pattern, shape, count); before anything changes.
    """
    if not isinstance(saved, dict):
        return plan
    mine = {f"{name}.{model.get_submodule(name).trained_weight}": name for name, _ in swapped}
    rows = {p.name: (p, t) for p, t in plan.masked}
    forms, why = {}, {}
    held = {p.name for p in plan.rows if p.compressed}  # compressed before this fit
    for key in saved:
        if key in mine or key in held:
            continue
        row, tensor = rows.get(replaced_name(key), (None, None))
        module = None if tensor is None else tensor.owners[0][0]
        unsupported = None if row is None or row.tie else pattern_problem(row.pattern)
        if row is None or not linear_like(module) or unsupported:
            skipped = next((p.reason for p in plan.rows if p.name == replaced_name(key)), None)
            why[key] = (("no such layer" if skipped is None else f"not selected: {skipped}")
                        if row is None else
                        unsupported or f"{row.kind} is not an nn.Linear or Conv1D")
        else:
            forms[key] = _layer_form(row)
    if why:
        raise ValueError("cannot resume: the checkpoint's compressed layers " + "; ".join(
            f"{k} ({v})" for k, v in why.items()) + " cannot be compressed in this model "
            "with these settings")
    masks = check_compressed({k: saved[k] for k in forms}, forms, every=False)
    for key, name in mine.items():
        if key not in saved:  # masked-dense in the checkpoint
            replace_module(model, name, model.get_submodule(name).to_dense())
    compressed = {key.rpartition(".")[0] for key in saved}
    swapped[:] = [(name, linear) for name, linear in swapped if name in compressed]
    for key, mask in masks.items():
        row, tensor = rows[replaced_name(key)]
        name, linear = key.rpartition(".")[0], tensor.owners[0][0]
        layer = _compressed_layer(linear, row, mask.to(linear.weight.device),
                                  weight_shaped=False)
        if row.tie is not None and row.tie.kind == "head":
            record_head_counts(model, {row.tie.group})
        replace_module(model, name, layer.train(linear.training))
        swapped.append((name, linear))
    sync_head_counts(model)
    undone = {replaced_name(key) for key in mine if key not in saved}
    return plan.with_rows([replace(p, path_reason="") if replaced_name(p.name) in {
        replaced_name(k) for k in saved} else replace(
        p, path_reason="the checkpoint trained it masked-dense") if p.name in undone else p
        for p in plan.rows])


def _layer_form(row: TensorPlan) -> LayerForm:
    """What the saved mask of ``row``'s compressed layer must be."""
    if row.pattern.is_nm:
        return LayerForm(row.pattern.spec, matrix_shape(row))
    block = (row.pattern.block_rows, row.pattern.block_cols)
    grid = block_grid(*matrix_shape(row), block)
    kept = (kept_count(grid[0] * grid[1], row.sparsity) if row.tie is None
            else row.tie.kept_blocks(row.sparsity))
    return LayerForm(f"block:{block[0]}x{block[1]}", grid, kept)


def undo_swaps(model: nn.Module, swapped: list[tuple[str, nn.Module]]) -> None:
    """Undo swaps of :func:`compress_selected` (``swapped``: each swapped module's name
    and the Linear it replaced): the original Linears, on the device and in the dtype the
    compressed layers have now (a fit that stops at its start leaves the model as it was).
    Sharded layers (FSDP2) stay compressed."""
    for name, original in swapped:
        layer = model.get_submodule(name)
        weight = getattr(layer, layer.trained_weight)
        if is_sharded(weight):
            continue  # fully_shard owns the layer now
        replace_module(model, name, original.to(device=weight.device, dtype=weight.dtype))
    sync_head_counts(model)


def matrix_shape(row: TensorPlan) -> tuple[int, int]:
    """``(out, in)`` of a Linear or ``Conv1D`` row (``Conv1D`` stores ``(in, out)``)."""
    return tuple(row.shape) if row.input_dim == 1 else tuple(row.shape[::-1])


def linear_like(module: nn.Module) -> bool:
    """Whether a compressed layer can stand for ``module``: an ``nn.Linear`` or HF's
    ``Conv1D`` (:mod:`sparse_training.layers.conv1d`)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _compressed_layer(module: nn.Module, row: TensorPlan, mask: torch.Tensor,
                      weight_shaped: bool = True) -> nn.Module:
    """The compressed form of ``module`` (a Linear or a ``Conv1D``) under ``mask``: shaped
    like its weight (``weight_shaped``: a ``Conv1D``'s is ``(in, out)``) or the layer's own
    mask (a saved one: a block grid or a 2:4 mask of ``(out, in)``); a unit-tied row's is
    its band grid."""
    pattern, conv = row.pattern, is_conv1d(module)
    linear = as_linear(module) if conv else module
    if conv and weight_shaped and row.tie is None:
        mask = mask.T
    if row.tie is not None:
        kind, args = SlimLinear, (row.tie.axis, row.tie.size, mask.flatten())
    elif pattern.is_nm:
        kind, args = SemiStructuredLinear, (pattern.transposable, mask)
    else:
        kind, args = BlockSparseLinear, ((pattern.block_rows, pattern.block_cols), None, mask)
    return (INPUT_FIRST[kind] if conv else kind).from_dense(linear, *args)


def held_apart(model: nn.Module, plan: SparsityPlan, swapped: set[str]) -> str | None:
    """Which compressed layers of ``plan`` that ``model`` held before this fit's swaps
    (not in ``swapped``: an earlier fit's, or ``sparsify``'s) keep another pattern than
    the plan gives them (its overrides included), or another count of blocks than its
    target keeps (where the target is the tensor's own: not under ERK or global, which
    weigh the whole model); None if every one follows the plan."""
    apart = []
    settings = {id(t.param): p for p, t in zip(plan.rows, plan.tensors, strict=True)}
    for name, layer in plan.held_layers(model):
        if name in swapped:
            continue
        row = settings[id(getattr(layer, layer.trained_weight))]
        pattern, target = row.pattern, row.sparsity
        if isinstance(layer, BlockSparseLinear):
            blocks, (r, c) = layer.block_mask.numel(), layer.block
            own = f"block:{r}x{c}, {layer.nnz} of {blocks} blocks kept"
            differs = pattern.is_nm or (pattern.block_rows, pattern.block_cols) != (r, c) or (
                target is not None and layer.nnz != kept_count(blocks, target))
        else:
            own, held = layer.pattern, parse_pattern(layer.pattern)
            differs = (held.n, held.m, held.transposable) != (pattern.n, pattern.m,
                                                               pattern.transposable)
        if differs:
            wanted = pattern.spec + ("" if target is None else f" at sparsity {target:g}")
            apart.append(f"{name or '(root)'} ({own}; these settings: {wanted})")
    if not apart:
        return None
    shown = ", ".join(apart[:3]) + (f" and {len(apart) - 3} more" if len(apart) > 3 else "")
    held_them = "layer was" if len(apart) == 1 else "layers were"
    return (f"{len(apart)} {held_them} compressed before this fit and keep their own blocks, "
            f"not what these settings give them: {shown}. To prune them anew under these "
            f"settings, densify(model) before the fit")
