"""Pure mask functions: a weight (and an optional score) in, a bool mask out.

Every function here has the signature ``f(weight, ..., score=None) -> BoolTensor`` with the
mask shaped like ``weight``; True means kept. The score defaults to ``|weight|`` (magnitude
pruning) and is summed over each block. Ties are broken by ``torch.topk``, so every mask
keeps exactly the promised count, whatever the values. NaN scores rank lowest.

Weights are read through their 2-D view ``(rows, in_features)`` (:func:`as_matrix`), input
(reduction) dimension last: a Linear weight as it is, a Conv weight ``(out, in, *kernel)``
in NVIDIA ASP's ``(r, s, k, c)`` order, ``(prod(kernel) * out, in)``, so N:M groups run along
input channels as in ASP. A weight stored input-first (HF ``Conv1D``'s ``(in, out)``,
``nn.ConvTranspose*d``'s ``(in, out, *kernel)``) is read with ``input_dim=0``
(:func:`sparse_training.engine.tensors.input_dim_of`).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sparse_training.pieces.patterns import Pattern, parse_pattern

NM_KERNEL_MAX_M = 32  # the Triton N:M kernel holds one group in registers


def check_input_dim(input_dim: int) -> int:
    """``input_dim`` if it is 0 or 1 (the stored position of a weight's input dimension).

    Raises:
        ValueError: anything else, naming it.
    """
    if isinstance(input_dim, bool) or not isinstance(input_dim, numbers.Integral) or (
            input_dim not in (0, 1)):
        raise ValueError(f"input_dim must be 0 (weights stored (in, out, ...)) or 1 "
                         f"((out, in, ...)), got {input_dim!r}")
    return int(input_dim)


def as_matrix(tensor: Tensor, input_dim: int = 1) -> Tensor:
    """The 2-D view ``(rows, in_features)`` of a weight, input dimension last.

    ``input_dim`` is where the weight stores its input (reduction) dimension: 1 for
    ``(out, in, *kernel)`` weights (Linear, Conv, RNN, embeddings), 0 for ``(in, out,
    *kernel)`` ones (HF ``Conv1D``, ``ConvTranspose``). The view is ``(*kernel, out, in)``
    flattened to ``(prod(kernel) * out, in)``: NVIDIA ASP's ``(r, s, k, c)`` order, so
    consecutive rows are consecutive output channels at one kernel tap and a transposable
    MxM tile is N:M along output channels too. A 1-D tensor is one row.
    """
    if tensor.dim() == 1:
        return tensor.unsqueeze(0)
    input_dim = check_input_dim(input_dim)
    moved = tensor.permute(*range(2, tensor.dim()), 1 - input_dim, input_dim)
    return moved.reshape(-1, tensor.shape[input_dim])


def view_shape_problem(pattern: Pattern, weight: Tensor, input_dim: int = 1) -> str | None:
    """Why ``weight`` cannot take ``pattern`` in its 2-D view (:func:`as_matrix`), or None.

    A kernel's view stacks its taps; an N:M block of several rows, or a transposable tile
    (M rows), must stay inside one tap: the output channels a multiple of its rows
    (``Conv2d(8, 6, 2)`` cannot take ``2:4:2d``, although its 24 view rows could).
    """
    problem = pattern.shape_error(*as_matrix(weight, input_dim).shape)
    tile_rows = math.lcm(pattern.block_rows, pattern.m if pattern.transposable else 1)
    if pattern.is_nm and weight.dim() > 2 and (
            outputs := weight.shape[1 - input_dim]) % tile_rows:
        tap = (f"{outputs} output channels are not a multiple of the {tile_rows} rows of a "
               f"tile, which must stay inside one kernel tap")
        problem = tap if problem is None else f"{problem}; {tap}"
    return problem


def from_matrix(matrix: Tensor, shape: torch.Size, input_dim: int = 1) -> Tensor:
    """Inverse of :func:`as_matrix` for a weight of ``shape``."""
    if len(shape) <= 1:
        return matrix.reshape(shape)
    input_dim = check_input_dim(input_dim)
    dims = len(shape)
    stored = (shape[1 - input_dim], shape[input_dim])  # (out, in)
    lead = (dims - 2, dims - 1) if input_dim == 1 else (dims - 1, dims - 2)
    return matrix.reshape(*shape[2:], *stored).permute(*lead, *range(dims - 2))


def kept_count(total: int, sparsity: float) -> int:
    """Number of elements kept at ``sparsity``: total - round(sparsity * total)."""
    return total - int(sparsity * total + 0.5)


def block_grid(rows: int, cols: int, pattern: Pattern) -> tuple[int, int]:
    """Block rows and block columns covering a ``(rows, cols)`` view, overhanging blocks
    included: ``(ceil(rows / R), ceil(cols / C))``."""
    return -(-rows // pattern.block_rows), -(-cols // pattern.block_cols)


def score_stack(weights: Sequence[Tensor], scores: Sequence[Tensor] | None = None,
                input_dim: int = 1) -> Tensor:
    """The scores of same-shape weights as one float32 (float64 for float64 weights or
    scores) ``(B, rows, in_features)`` stack of their 2-D views (:func:`as_matrix` with
    ``input_dim``): ``|w|``, or the given scores; NaN ranks lowest.

    Raises:
        ValueError: a score whose shape is not its weight's.
    """
    if scores is not None:
        for w, score in zip(weights, scores, strict=True):
            if score.shape != w.shape:
                raise ValueError(f"score shape {tuple(score.shape)} != weight shape "
                                 f"{tuple(w.shape)}")
    stack = torch.stack([as_matrix(t.detach(), input_dim)
                         for t in (weights if scores is None else scores)])
    stack = stack.to(torch.promote_types(stack.dtype, torch.float32))
    return torch.nan_to_num(stack.abs() if scores is None else stack, nan=float("-inf"))


def pool_blocks(scores: Tensor, rows: int, cols: int) -> Tensor:
    """Sum of scores over each ``rows x cols`` block of the last two dims, the last block
    row and column clipped to the entries inside: (..., R, C) -> (..., ceil(R/rows),
    ceil(C/cols))."""
    if rows == cols == 1:
        return scores
    *lead, r, c = scores.shape
    grid_rows, grid_cols = -(-r // rows), -(-c // cols)
    if (grid_rows * rows, grid_cols * cols) != (r, c):  # overhanging blocks: pad with zeros
        scores = F.pad(scores, (0, grid_cols * cols - c, 0, grid_rows * rows - r))
    return nan_lowest(scores.reshape(*lead, grid_rows, rows, grid_cols, cols).sum(dim=(-3, -1)))


def nan_lowest(sums: Tensor) -> Tensor:
    """``sums`` with NaN as -inf: a sum over a NaN score (-inf in :func:`score_stack`) and
    an overflow to +inf is NaN, which ``torch.topk`` would rank highest; NaN ranks lowest."""
    return sums.masked_fill(sums.isnan(), float("-inf")) if sums.is_floating_point() else sums


def expand_blocks(block_mask: Tensor, rows: int, cols: int, size: Sequence[int]) -> Tensor:
    """Inverse of :func:`pool_blocks` for masks: each block's value over its entries,
    clipped to the matrix ``size`` ``(R, C)``."""
    if rows == cols == 1:
        return block_mask
    expanded = block_mask.repeat_interleave(rows, -2).repeat_interleave(cols, -1)
    return expanded[..., : size[0], : size[1]]


def topk_mask(scores: Tensor, kept: int) -> Tensor:
    """Keep exactly the ``kept`` largest entries of ``scores`` (any shape)."""
    return topk_rows(scores.reshape(1, -1), kept).view(scores.shape)


def topk_rows(scores: Tensor, kept: int) -> Tensor:
    """Keep exactly the ``kept`` largest entries of every row of a 2-D ``scores``."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if kept > 0:
        mask.scatter_(1, scores.topk(kept, dim=1, sorted=False).indices, True)
    return mask


def nm_groups_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the ``n`` largest of every ``m`` consecutive entries along the last dim.

    Top-k within groups: time linear in the number of entries, any M. On CUDA with
    M <= 32, one Triton kernel (:func:`sparse_training.kernels.nm_topk_mask`: 12x faster
    than ``torch.topk`` + ``scatter_`` over BERT-large's weights on an H200,
    docs/performance.md).
    """
    if scores.is_cuda and m <= NM_KERNEL_MAX_M:
        from sparse_training.kernels import nm_topk_mask

        return nm_topk_mask(scores.contiguous(), n, m)
    *lead, cols = scores.shape
    groups = scores.reshape(*lead, cols // m, m)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, groups.topk(n, dim=-1, sorted=False).indices, True)
    return mask.view(scores.shape)


@cache
def _regular_tiles(n: int, m: int) -> tuple[tuple[int, ...], ...]:
    """All m x m 0/1 tiles with exactly n ones in every row and column, flattened."""
    row_choices = [tuple(1 if j in kept else 0 for j in range(m))
                   for kept in itertools.combinations(range(m), n)]
    tiles: list[tuple[int, ...]] = []

    def extend(prefix: list[tuple[int, ...]], col_counts: list[int]) -> None:
        if len(prefix) == m:
            tiles.append(tuple(itertools.chain.from_iterable(prefix)))
            return
        rows_left = m - len(prefix)
        for row in row_choices:
            counts = [c + r for c, r in zip(col_counts, row, strict=True)]
            # a column can still reach n only if it has no more than n and enough rows remain
            if all(n - rows_left + 1 <= c <= n for c in counts):
                extend([*prefix, row], counts)

    extend([], [0] * m)
    return tuple(tiles)


def transposable_groups_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Best N-regular mask of every MxM tile: N kept per row and per column of the tile.

    Exact: the score of every admissible tile pattern is one matrix product, then argmax
    (Hubara et al. 2021, "Accelerated Sparse Neural Training", transposable N:M masks).
    """
    *lead, rows, cols = scores.shape
    tiles = scores.reshape(-1, rows // m, m, cols // m, m).permute(0, 1, 3, 2, 4)
    tiles = tiles.reshape(-1, m * m)
    candidates = torch.tensor(_regular_tiles(n, m), dtype=tiles.dtype, device=tiles.device)
    finite = torch.where(torch.isfinite(tiles), tiles, torch.finfo(tiles.dtype).min / (m * m))
    best = (finite @ candidates.T).argmax(dim=1)  # (tiles,)
    mask = candidates[best].bool().reshape(-1, rows // m, cols // m, m, m)
    return mask.permute(0, 1, 3, 2, 4).reshape(scores.shape)


def _check_weights(weights: Sequence[Tensor], scores: Sequence[Tensor | None] | None) -> None:
    """Raises ValueError unless ``weights`` is a non-empty list of real, non-empty tensors of
    at least one dimension, with one score (or None) per weight where ``scores`` is given."""
    if isinstance(weights, Tensor) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(f"weights must be a non-empty list of weight tensors, got "
                         f"{type(weights).__name__}")
    for w in weights:
        if not isinstance(w, Tensor) or w.dim() == 0 or w.numel() == 0 or w.is_complex():
            shown = (f"{w.dtype} tensor of shape {tuple(w.shape)}" if isinstance(w, Tensor)
                     else type(w).__name__)
            raise ValueError(f"a mask needs a real weight tensor of at least one dimension "
                             f"and one entry, got a {shown}")
        if w.layout != torch.strided:
            raise ValueError(f"a mask needs a dense (strided) weight tensor, got a {w.layout} "
                             f"one of shape {tuple(w.shape)}; pass weight.to_dense()")
    if scores is not None and len(scores) != len(weights):
        raise ValueError(f"scores must hold one entry per weight ({len(weights)}), got "
                         f"{len(scores)}")
    for score in scores or ():
        if score is not None and (not isinstance(score, Tensor) or score.is_complex()
                                  or score.layout != torch.strided):
            shown = (f"{score.dtype} tensor ({score.layout})" if isinstance(score, Tensor)
                     else type(score).__name__)
            raise ValueError(f"score must be a real tensor shaped like the weight, got a "
                             f"{shown}")


def _check_not_unit(pattern: Pattern) -> None:
    """Raises ValueError for a unit pattern (heads, neurons): its units span several
    tensors, which a mask of single tensors cannot see."""
    if pattern.is_unit:
        raise ValueError(f"pattern {pattern.spec!r} prunes whole {pattern.unit}s, which span "
                         f"several tensors (their member rows and columns); a mask function of "
                         f"single tensors cannot make it: give it to SparsityEngine or "
                         f"SparsityCallback, or give a block pattern ('block:RxC')")


def pattern_mask(
    weight: Tensor, pattern: str | Pattern, sparsity: float | None = None,
    score: Tensor | None = None, input_dim: int = 1,
) -> Tensor:
    """Mask of ``weight`` with ``pattern`` at ``sparsity`` (fraction of zeros).

    For N:M patterns ``sparsity`` picks the stage of a gradual ramp,
    N' = round(M (1 - sparsity)) clamped to [N, M]; None means the pattern's own N.
    For other patterns it is required: of the ``B = ceil(rows/R) ceil(cols/C)`` blocks
    (overhanging ones included, each kept or pruned whole), ``round(sparsity * B)`` are
    pruned, the smallest sums of the score over their entries inside the weight.

    Args:
        weight: a Linear or Conv weight, any float dtype, any device.
        pattern: a pattern string or :class:`Pattern`.
        sparsity: target fraction of zeros in [0, 1).
        score: importance per weight (larger is kept), default ``|weight|``.
        input_dim: where ``weight`` stores its input dimension (:func:`as_matrix`).

    Raises:
        ValueError: if the weight's 2-D view cannot take the pattern, sparsity is
            missing or outside [0, 1), the pattern is a unit pattern (``"head"``,
            ``"neuron"``: its units span several tensors), or the weight or score is no
            real, dense tensor.

    Example:
        >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5]])
        >>> pattern_mask(w, "2:4")
        tensor([[False,  True,  True, False]])
    """
    # checked here, not in pattern_masks, which the engine calls at every mask update
    scores = None if score is None else [score]
    _check_weights([weight], scores)
    return pattern_masks([weight], pattern, sparsity, scores, [input_dim])[0]


def pattern_masks(
    weights: Sequence[Tensor], pattern: str | Pattern, sparsity: float | None = None,
    scores: Sequence[Tensor] | None = None, input_dims: Sequence[int] | None = None,
) -> list[Tensor]:
    """:func:`pattern_mask` of each weight (``input_dims``: each one's, default 1),
    same-shape weights ranked together: one stack and one top-k call per shape instead of
    one per tensor (72 BERT-base weights, 3 shapes)."""
    pattern = parse_pattern(pattern)
    _check_not_unit(pattern)
    if sparsity is not None:
        check_sparsity(sparsity)
    elif not pattern.is_nm:
        raise ValueError(f"pattern {pattern.spec!r} needs a sparsity")
    input_dims = _input_dims(weights, input_dims)
    by_shape: dict[tuple, list[int]] = {}
    for i, (w, input_dim) in enumerate(zip(weights, input_dims, strict=True)):
        if (problem := view_shape_problem(pattern, w, input_dim)) is not None:
            raise ValueError(f"weight of shape {tuple(w.shape)} cannot take pattern "
                             f"{pattern.spec!r}: {problem}")
        by_shape.setdefault((w.shape, w.device, input_dim), []).append(i)
    masks: list[Tensor] = [None] * len(weights)  # type: ignore[list-item]
    rows, cols = pattern.block_rows, pattern.block_cols
    for (shape, _, input_dim), indices in by_shape.items():
        stack = score_stack([weights[i] for i in indices],
                            None if scores is None else [scores[i] for i in indices], input_dim)
        blocks = pool_blocks(stack, rows, cols)  # (B, ceil(R/rows), ceil(C/cols))
        if pattern.is_nm:
            n = pattern.n if sparsity is None else pattern.kept_per_group(sparsity)
            select = transposable_groups_mask if pattern.transposable else nm_groups_mask
            block_mask = select(blocks, n, pattern.m)
        else:
            per_tensor = blocks[0].numel()
            block_mask = topk_rows(blocks.reshape(len(indices), per_tensor),
                                   kept_count(per_tensor, sparsity)).view(blocks.shape)
        expanded = expand_blocks(block_mask, rows, cols, stack.shape[-2:])
        for i, mask in zip(indices, expanded, strict=True):
            masks[i] = from_matrix(mask, shape, input_dim)
    return masks


def global_masks(
    weights: Sequence[Tensor], pattern: str | Pattern, sparsity: float,
    scores: Sequence[Tensor | None] | None = None, input_dims: Sequence[int] | None = None,
) -> list[Tensor]:
    """One magnitude threshold across all ``weights``: the globally largest blocks are kept.

    Exactly ``total - round(sparsity * total)`` blocks survive over all layers together
    (Han et al. 2015 prune by one global threshold); each layer's share follows its scores.
    Blocks may overhang a weight's edge, as in :func:`pattern_mask`.

    Raises:
        ValueError: for N:M patterns (their count is fixed per group, not global) and unit
            patterns (``"head"``, ``"neuron"``: their units span several tensors).
    """
    pattern = parse_pattern(pattern)
    _check_not_unit(pattern)
    if pattern.is_nm:
        raise ValueError(f"the global distribution needs an unstructured or block pattern, "
                         f"got {pattern.spec!r}")
    _check_weights(weights, scores)
    scores = scores or [None] * len(weights)
    input_dims = _input_dims(weights, input_dims)
    pooled, matrices = [], []
    for w, s, input_dim in zip(weights, scores, input_dims, strict=True):
        matrix = score_stack([w], None if s is None else [s], input_dim)[0]
        matrices.append(matrix.shape)
        pooled.append(pool_blocks(matrix, pattern.block_rows, pattern.block_cols))
    flat = torch.cat([p.reshape(-1) for p in pooled])
    kept = topk_mask(flat, kept_count(flat.numel(), check_sparsity(sparsity)))
    masks = []
    for w, p, size, input_dim, block_mask in zip(
            weights, pooled, matrices, input_dims, kept.split([p.numel() for p in pooled]),
            strict=True):
        mask = expand_blocks(block_mask.view(p.shape), pattern.block_rows, pattern.block_cols,
                             size)
        masks.append(from_matrix(mask, w.shape, input_dim))
    return masks


def _input_dims(weights: Sequence[Tensor], input_dims: Sequence[int] | None) -> list[int]:
    """Each weight's input dimension (default 1), checked.

    Raises:
        ValueError: not one 0 or 1 per weight.
    """
    if input_dims is None:
        return [1] * len(weights)
    if len(input_dims) != len(weights):
        raise ValueError(f"input_dims must give one entry per weight ({len(weights)}), got "
                         f"{len(input_dims)}")
    return [check_input_dim(d) for d in input_dims]


def _sparsity_hint(value: Any) -> str:
    """What a bad sparsity most likely meant: a percentage (90, "90%") names its fraction,
    a number in a string (a quoted YAML value) the number."""
    if isinstance(value, str):
        text = value.strip().removesuffix("%")
        try:
            number = float(text)
        except ValueError:
            return ""
        return _sparsity_hint(number) if value.strip().endswith("%") else (
            f" (a string; give the number {number:g})" if 0 <= number < 1 else "")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return ""
    if value == 1:
        return " (1 would prune every weight)"
    return f" (a percentage? give the fraction pruned, {value / 100:g})" if 1 < value < 100 else ""


def check_sparsity(sparsity: float, name: str = "sparsity") -> float:
    """Return ``sparsity`` as a float if it is a real number (numpy scalars included) in
    [0, 1), else raise ValueError (naming what it most likely meant: :func:`_sparsity_hint`)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or not (
            0.0 <= sparsity < 1.0):
        raise ValueError(f"{name} must be a number in [0, 1), got {sparsity!r}"
                         f"{_sparsity_hint(sparsity)}")
    return float(sparsity)
