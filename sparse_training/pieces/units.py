"""Units that span several tensors: whole attention heads and FFN neurons.

A head of a transformer block is the rows of the query, key and value projections that
compute it and the columns of the output projection that read it; an FFN neuron is a row
of the up (and gate) projection and the matching column of the down projection. Pruning a
unit zeroes its share of every member tensor, so the block computes as if the unit were
gone (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"; Lagunas et al. 2021,
"Block Pruning For Faster Transformers").

Each member tensor reads its share as a block pattern of its 2-D view (``(rows,
in_features)``, :func:`~sparse_training.pieces.masks.as_matrix`): a :class:`UnitTie` says
along which axis the blocks run, how wide one is, and which unit each block belongs to (a
fused QKV projection holds three blocks per head). :func:`unit_masks` ranks the units of
each group by the sum of their members' scores over every entry they hold, keeps the
largest ``total - round(sparsity * total)`` and expands the choice back to every member:
the members of one group always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparse_training.pieces.masks import (
    check_sparsity,
    from_matrix,
    kept_count,
    nan_lowest,
    score_stack,
)
from sparse_training.pieces.patterns import Pattern, parse_pattern

ROWS, COLUMNS = 0, 1


@dataclass(frozen=True)
class UnitTie:
    """One tensor's share of a group of units.

    Attributes:
        group: the qualified name of the module whose units these are (an attention or
            FFN block); every tensor tied to it ranks the same units.
        kind: ``"head"`` or ``"neuron"``.
        units: the units of the group.
        axis: :data:`ROWS` when a unit is a band of rows of the tensor's 2-D view (query,
            key, value, up and gate projections), :data:`COLUMNS` when it is a band of
            columns (output and down projections).
        size: the rows (or columns) of one band.
        of_block: the unit of each band, in order along the axis.
    """

    group: str
    kind: str
    units: int
    axis: int
    size: int
    of_block: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.axis not in (ROWS, COLUMNS) or self.size < 1 or not self.of_block or any(
                not 0 <= u < self.units for u in self.of_block):
            raise ValueError(f"not a unit tie: {self!r}")

    def block_pattern(self, view: Sequence[int]) -> Pattern:
        """The block pattern of this share in a 2-D view of shape ``view``: bands of
        ``size`` rows across every column, or of every row across ``size`` columns."""
        rows, cols = view
        return parse_pattern(f"block:{self.size}x{cols}" if self.axis == ROWS
                             else f"block:{rows}x{self.size}")

    def fits(self, view: Sequence[int]) -> bool:
        """Whether the bands tile a 2-D view of shape ``view`` exactly."""
        return view[self.axis] == self.size * len(self.of_block)

    def kept_blocks(self, sparsity: float) -> int:
        """Bands kept when ``sparsity`` of the units are pruned."""
        return kept_count(self.units, sparsity) * len(self.of_block) // self.units


def unit_scores(score: Tensor, tie: UnitTie) -> Tensor:
    """The sum of a member's 2-D ``score`` (rows, in_features) over each unit's bands:
    shape ``(units,)``."""
    bands = score.reshape(len(tie.of_block), tie.size, -1) if tie.axis == ROWS else (
        score.reshape(score.shape[0], len(tie.of_block), tie.size).transpose(0, 1))
    per_band = bands.sum((1, 2))
    index = torch.tensor(tie.of_block, device=score.device)
    return torch.zeros(tie.units, dtype=score.dtype, device=score.device).index_add_(
        0, index, per_band)


def expand_units(kept: Tensor, tie: UnitTie, view: Sequence[int]) -> Tensor:
    """A member's 2-D mask of shape ``view`` from the group's kept units ``(units,)``."""
    band = kept[torch.tensor(tie.of_block, device=kept.device)]
    per_index = band.repeat_interleave(tie.size)
    return (per_index[:, None] if tie.axis == ROWS else per_index[None, :]).expand(
        *view).clone()


def unit_masks(weights: Sequence[Tensor], ties: Sequence[UnitTie], sparsity: float,
               scores: Sequence[Tensor] | None = None,
               input_dims: Sequence[int] | None = None) -> list[Tensor]:
    """Masks of tensors tied by units: in every group, the units with the largest summed
    score (default ``|w|``) over all their members' entries are kept, exactly
    ``units - round(sparsity * units)`` of them, and every member keeps its bands of
    those units.

    Args:
        weights: the member tensors (any groups, any order).
        ties: each weight's :class:`UnitTie`.
        sparsity: the fraction of each group's units pruned, in [0, 1).
        scores: importance per entry (larger is kept), shaped like the weights.
        input_dims: where each weight stores its input dimension (default 1).

    Raises:
        ValueError: a tie whose bands do not tile its tensor, ties of one group that
            disagree on its units, or a bad sparsity.

    Example:
        >>> q = torch.tensor([[1.0, 1.0], [0.1, 0.1]])   # 2 heads of 1 row
        >>> o = torch.tensor([[0.1, 3.0], [0.1, 3.0]])   # their 2 columns
        >>> tie_q = UnitTie("attn", "head", 2, ROWS, 1, (0, 1))
        >>> tie_o = UnitTie("attn", "head", 2, COLUMNS, 1, (0, 1))
        >>> [m.tolist() for m in unit_masks([q, o], [tie_q, tie_o], 0.5)]
        [[[False, False], [True, True]], [[False, True], [False, True]]]
    """
    check_sparsity(sparsity)
    input_dims = list(input_dims) if input_dims is not None else [1] * len(weights)
    if not len(weights) == len(ties) == len(input_dims) or (
            scores is not None and len(scores) != len(weights)):
        raise ValueError(f"unit_masks takes one tie, input dim (and score) per weight; got "
                         f"{len(weights)} weights, {len(ties)} ties, {len(input_dims)} input "
                         f"dims" + ("" if scores is None else f", {len(scores)} scores"))
    totals: dict[str, Tensor] = {}
    views = []
    for i, (weight, tie, dim) in enumerate(zip(weights, ties, input_dims, strict=True)):
        stack = score_stack([weight], None if scores is None else [scores[i]], dim)[0]
        views.append(stack.shape)
        if not tie.fits(stack.shape):
            raise ValueError(f"a {tie.kind} tie of {len(tie.of_block)} bands of {tie.size} "
                             f"does not tile a tensor whose 2-D view is {tuple(stack.shape)}")
        per_unit = unit_scores(stack, tie)  # NaN scores: -inf, the unit ranks lowest
        total = totals.setdefault(tie.group, torch.zeros_like(per_unit))
        if total.shape != per_unit.shape:
            raise ValueError(f"the ties of group {tie.group!r} disagree on its units: "
                             f"{total.numel()} and {per_unit.numel()}")
        totals[tie.group] = total + per_unit.to(total.device)
    kept = {group: torch.zeros(len(t), dtype=torch.bool, device=t.device).scatter_(
        0, nan_lowest(t).topk(kept_count(len(t), sparsity), sorted=False).indices, True)
        for group, t in totals.items()}  # -inf (a NaN) + inf (an overflow): NaN, lowest
    return [from_matrix(expand_units(kept[tie.group].to(w.device), tie, view), w.shape, dim)
            for w, tie, view, dim in zip(weights, ties, views, input_dims, strict=True)]
