"""Train compressed from setup: selected ``nn.Linear`` weights become ``BlockSparseLinear``.

Where a block pattern's kept count is fixed from the first step (``schedule="oneshot"`` or
``"constant"`` at ``start=0``, a per-tensor distribution; RigL and SET move blocks inside
that count, :class:`~sparse_training.slots.CompressedSlot`), a selected Linear
weight needs no dense copy at all: it is swapped for a :class:`BlockSparseLinear` before
the optimizers are built, so weights, gradients and optimizer state hold only the kept
blocks. The kept blocks are exactly those the masked-dense engine would keep at step 0
(the same mask function and seeded scores), so ``compress`` changes how a layer trains,
not which blocks it keeps. Everything else stays masked-dense (the engine), and
:func:`compress_selected` says, per tensor, which path it takes and why.

``compress="auto"`` compresses only where the compressed layers beat a masked dense matmul
(:func:`slower_reason`: blocks from 16M weights, 2:4 from 32M); ``True`` compresses every
eligible tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from sparse_training.block_sparse import BLOCK_SIZES, BlockSparseLinear
from sparse_training.kernels.semi_structured import cusparselt_problem, shape_problem
from sparse_training.masks import pattern_mask
from sparse_training.patcher import COMPRESSED_LAYERS, replace_module, swap_checker
from sparse_training.patterns import Pattern
from sparse_training.regrowth import random_scores
from sparse_training.selection import TensorPlan, plan_model
from sparse_training.semi_structured import SemiStructuredLinear

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

COMPRESS = ("auto", True, False)
# measured on an H100 (docs/performance.md): LLM-sized weights train faster compressed, with
# blocks up to density 0.5 at 128x128 and 0.25 at 64x64 from 16M weights; at BERT-large
# sizes (4M weights) the block kernels' launches cost more than they save. 2:4: the layer
# picked cuSPARSELt for 4096x14336 (59M) and larger from 16k tokens, and cuBLAS for every
# shape of 16.8M weights or fewer (2048x8192, 4096x4096, BERT's) in eager steps, where
# cuSPARSELt's host time per call costs more than its products save (under a CUDA graph
# its forward saves more than the repacking costs there); 16.8M-59M is not measured
AUTO_MIN_WEIGHTS = 16 * 2**20
AUTO_MIN_WEIGHTS_2_4 = 32 * 2**20
AUTO_MAX_DENSITY = {128: 0.5, 64: 0.25}


@dataclass(frozen=True)
class CompressionRow:
    """One selected tensor's training path: ``compressed`` or ``masked-dense``, and why."""

    name: str
    shape: tuple[int, ...]
    path: str
    reason: str


def pattern_problem(pattern: Pattern) -> str | None:
    """Why no compressed layer takes ``pattern``, or None: blocks of :data:`BLOCK_SIZES`
    (``BlockSparseLinear``) or 2:4 (``SemiStructuredLinear``, transposable or not)."""
    if problem := _kind_problem(pattern):
        return problem
    block = (pattern.block_rows, pattern.block_cols)
    if not pattern.is_nm and not set(block) <= set(BLOCK_SIZES):
        return f"block {block[0]}x{block[1]}: the kernels take blocks of {BLOCK_SIZES}"
    return None


def _kind_problem(pattern: Pattern) -> str | None:
    """Why no compressed layer takes patterns of this kind (block sizes aside), or None."""
    if pattern.is_nm and not pattern.is_2_4:
        return (f"pattern {pattern.spec!r}: of the N:M patterns only '2:4' and '2:4:2d' "
                f"compress (the sparse tensor cores)")
    if not pattern.is_nm and pattern.block_rows * pattern.block_cols == 1:
        return f"pattern {pattern.spec!r} is neither a block pattern nor 2:4"
    return None


def fixed_count_problem(config: SparsityConfig) -> str | None:
    """Why ``config`` does not fix the kept count from the first step, or None (the block
    sizes are checked per tensor, by :func:`pattern_problem`)."""
    pattern = config.parsed_pattern
    if problem := _kind_problem(pattern):
        return problem
    if pattern.is_nm and config.regrow is not None:
        return (f"regrow={config.regrow!r} moves 2:4 entries; the 2:4 layer keeps a fixed "
                f"mask, so it trains masked-dense")
    if config.schedule not in ("oneshot", "constant") or config.start != 0:
        return (f"schedule={config.schedule!r} from start={config.start!r} reaches its "
                f"sparsity after the first step; it trains masked-dense (docs/block_sparse.md)")
    if config.distribution == "global":
        return "distribution='global' sets per-tensor counts at the update, not at setup"
    return None


def slower_reason(shape: tuple[int, int], pattern: Pattern, density: float,
                  device: torch.device) -> str | None:
    """Why ``compress="auto"`` keeps this tensor masked-dense, or None to compress it.

    Small weights stay masked-dense: on an H100 the compressed layers lose there (blocks
    under :data:`AUTO_MIN_WEIGHTS`, 16M entries: the kernels' launches; 2:4 under
    :data:`AUTO_MIN_WEIGHTS_2_4`, 32M: in eager steps cuSPARSELt's host time per call
    costs more than its faster products save). Above it, 2:4
    compresses wherever cuSPARSELt runs (the layer then times each token count and keeps
    cuBLAS where it is faster); blocks run on CUDA only (elsewhere the layer computes with
    a dense copy), at density <= 0.5 with 128x128 blocks and <= 0.25 with 64x64 blocks.
    """
    if pattern.is_nm and (problem := shape_problem(shape[0], shape[1])):
        return f"auto: {problem}"
    minimum = AUTO_MIN_WEIGHTS_2_4 if pattern.is_nm else AUTO_MIN_WEIGHTS
    if shape[0] * shape[1] < minimum:
        why = ("cuSPARSELt's host time per eager call outweighs its faster products"
               if pattern.is_nm else "launch costs make the compressed layer slower")
        return f"auto: {shape[0]}x{shape[1]} is under {minimum:,} weights, where {why}"
    if pattern.is_nm:
        problem = cusparselt_problem(device)
        return None if problem is None else f"auto: {problem}"
    block = (pattern.block_rows, pattern.block_cols)
    if device.type != "cuda":
        return f"auto: on {device.type} the compressed layer multiplies a dense copy"
    max_density = AUTO_MAX_DENSITY.get(min(block))
    if max_density is None or density > max_density:
        return (f"auto: block {block[0]}x{block[1]} at density {density:.2f} is slower than "
                f"dense (compressed wins at <= 0.5 with 128x128, <= 0.25 with 64x64)")
    return None


def _first_mask(weight: torch.Tensor, plan: TensorPlan, index: int,
                config: SparsityConfig) -> torch.Tensor:
    """The mask the masked-dense engine would set at step 0: the pattern's mask of |w|, or
    of the random scores of the ``index``-th selected tensor (``ScheduledMasks.score``)."""
    score = None if config.score == "magnitude" else random_scores(
        weight.shape, config.seed, 0, index, weight.device)
    return pattern_mask(weight.detach(), plan.pattern, plan.sparsity, score)


def compress_selected(model: nn.Module, config: SparsityConfig) -> list[CompressionRow]:
    """Swap the selected Linear weights that can train compressed, in place (module doc).

    Returns:
        One row per selected tensor: the path it takes and why.

    Raises:
        ValueError: ``config.compress`` is True and nothing can be (or already is)
            compressed (the rows say why), raised before anything is swapped.
    """
    problem = fixed_count_problem(config)
    tensors, plans = plan_model(model, config)
    swap_problem = swap_checker(model)
    rows, swaps = [], []
    selected = [(p, t) for p, t in zip(plans, tensors, strict=True) if p.selected]
    for index, (plan, tensor) in enumerate(selected):
        module, attr = tensor.owners[0]
        module_name = plan.name.rpartition(".")[0]
        if problem is not None:
            reason = problem
        elif not isinstance(module, nn.Linear) or attr != "weight" or len(tensor.owners) > 1:
            reason = f"{type(module).__name__}.{attr} is not an nn.Linear weight"
        elif (swap := swap_problem(module_name, module)) is not None:
            reason = swap
        elif (unsupported := pattern_problem(plan.pattern)) is not None:
            reason = unsupported
        elif config.compress == "auto" and (slow := slower_reason(
                tuple(plan.shape), plan.pattern, 1 - plan.sparsity, module.weight.device)):
            reason = slow
        else:
            layer, what = _compressed_layer(module, plan.pattern,
                                            _first_mask(module.weight, plan, index, config))
            layer.train(module.training)
            swaps.append((module_name, layer))
            rows.append(CompressionRow(plan.name, plan.shape, "compressed", what))
            continue
        rows.append(CompressionRow(plan.name, plan.shape, "masked-dense", reason))
    if config.compress is True and not swaps and not any(
            isinstance(m, COMPRESSED_LAYERS) for m in model.modules()):
        lines = "\n".join(f"  {r.name}: {r.reason}" for r in rows) or "  (no tensor selected)"
        raise ValueError(f"compress=True but no selected tensor can train compressed; "
                         f"use compress='auto' or False. Per tensor:\n{lines}")
    for name, layer in swaps:
        replace_module(model, name, layer)
    return rows


def _compressed_layer(linear: nn.Linear, pattern: Pattern, mask: torch.Tensor
                      ) -> tuple[nn.Module, str]:
    """The compressed form of ``linear`` under ``mask`` and its line in the table."""
    if pattern.is_nm:
        layer = SemiStructuredLinear.from_dense(linear, pattern.transposable, mask)
        return layer, (f"SemiStructuredLinear {layer.pattern} (cuSPARSELt where measured "
                       f"faster)")
    layer = BlockSparseLinear.from_dense(linear, (pattern.block_rows, pattern.block_cols),
                                         mask=mask)
    return layer, f"BlockSparseLinear, {layer.nnz} blocks"


def format_rows(rows: list[CompressionRow]) -> str:
    """The compression table: one line per selected tensor."""
    width = max((len(r.name) for r in rows), default=6)
    return "\n".join([f"{'tensor'.ljust(width)}  {'path':12s}  reason"]
                     + [f"{r.name.ljust(width)}  {r.path:12s}  {r.reason}" for r in rows])
