"""Mask regrowth: drop by magnitude, grow by a score, the same count back, inside the structure.

A regrowth rule is one frozen dataclass, :class:`Regrowth`, with one signature::

    regrowth.fraction(step) -> float    # the share of active blocks swapped at step

and its grow score (:mod:`sparse_training.pieces.scores`); every algorithm is one call of
:func:`drop_and_grow` with a different grow score (jaxpruner's split: "RigL is SET with a
different grow score"):

- RigL, ``Regrowth("rigl", GradientScore())``: grow where |dense gradient| is largest
  (Evci et al. 2020, "Rigging the Lottery").
- SET, ``Regrowth("set", RandomScore(seed))``: grow at random (Mocanu et al. 2018, "Sparse
  Evolutionary Training"); the random stream is seeded by (seed, step, tensor), so every
  process draws the same positions.

The share of active weights swapped at step t is the cosine decay of RigL,
f(t) = alpha/2 (1 + cos(pi t / T_end)), alpha = 0.3 by default, and no swaps from T_end on.

SR-STE (Zhou et al. 2021, "Learning N:M Fine-grained Structured Sparse Neural Networks From
Scratch") is not a drop/grow rule but a refinement of the gradient,
:class:`SparseRefinement`: the engine keeps dense weights, recomputes the N:M mask from them
every step, and adds the sparse-refined decay lambda (1 - mask) w to the straight-through
gradient.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from sparse_training.pieces.masks import (
    as_matrix,
    expand_blocks,
    from_matrix,
    pool_blocks,
    score_stack,
)
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.schedules import Step, check_step, to_steps
from sparse_training.pieces.scores import Score

DEFAULT_ALPHA = 0.3  # RigL's drop fraction (Evci et al. 2020, Table 1 setting)
DEFAULT_REGROW_END = 0.75  # RigL stops mask updates at 75% of training
DEFAULT_SR_STE_DECAY = 2e-4  # lambda_W of Zhou et al. 2021


def check_fraction(value: float, name: str) -> float:
    """``value`` as a float in (0, 1] (RigL's alpha); ValueError naming ``name`` else."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0.0 < value <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_decay(value: float, name: str) -> float:
    """``value`` as a finite float >= 0 (SR-STE's lambda); ValueError naming ``name`` else."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def cosine_fraction(step: int, end: int, alpha: float) -> float:
    """f(t) = alpha/2 (1 + cos(pi t / T_end)) for t < T_end, else 0."""
    return 0.0 if step >= end else alpha / 2 * (1 + math.cos(math.pi * step / end))


@dataclass(frozen=True)
class Regrowth:
    """Drop and grow until ``end``: the cosine-decayed share of the active blocks swapped,
    the smallest ``|w|`` out, the largest ``grow`` score in.

    Attributes:
        name: the setting that names it (``"rigl"``, ``"set"``), for messages.
        grow: the grow score.
        alpha: the share swapped at the first update.
        end: no swaps from this step (int) or fraction of training (float) on.
    """

    name: str
    grow: Score
    alpha: float = DEFAULT_ALPHA
    end: Step = DEFAULT_REGROW_END

    def resolve(self, total_steps: int | None) -> Regrowth:
        """This rule with ``end`` in steps of a run of ``total_steps``."""
        return replace(self, end=to_steps(self.end, total_steps, "regrow_end"))

    def fraction(self, step: int) -> float:
        """The share of active blocks swapped at ``step`` (``end`` resolved)."""
        return cosine_fraction(step, self.end, self.alpha)


@dataclass(frozen=True)
class SparseRefinement:
    """SR-STE's gradient: g <- g + ``decay`` (1 - mask) w, in place, for the dense weights
    the optimizer updates (Zhou et al. 2021)."""

    decay: float = DEFAULT_SR_STE_DECAY

    def __call__(self, grad: Tensor, dense_weight: Tensor, mask: Tensor) -> None:
        grad.add_(torch.where(mask, 0.0, dense_weight), alpha=self.decay)


@dataclass(frozen=True)
class RegrowthRule:
    """A regrowth setting as a piece: ``regrow=RigL(fraction=0.5, end=0.8)`` is
    ``regrow="rigl", regrow_fraction=0.5, regrow_end=0.8``.

    Attributes:
        fraction: alpha, the share of active blocks swapped at the first update.
        end: no swaps from this step (int) or fraction of training (float) on.

    Raises:
        ValueError: ``fraction`` outside (0, 1] or a bad ``end``, named as the piece's field
            (``RigL.fraction``).
    """

    name: ClassVar[str]
    fraction: float = DEFAULT_ALPHA
    end: Step = DEFAULT_REGROW_END

    def __post_init__(self) -> None:
        piece = type(self).__name__
        object.__setattr__(self, "fraction", check_fraction(self.fraction, f"{piece}.fraction"))
        object.__setattr__(self, "end", check_step(self.end, f"{piece}.end"))

    def settings(self) -> dict[str, Any]:
        """The flat settings this piece stands for."""
        return {"regrow": self.name, "regrow_fraction": self.fraction, "regrow_end": self.end}


@dataclass(frozen=True)
class RigL(RegrowthRule):
    """Drop the smallest |w|, grow the largest |gradient| (Evci et al. 2020)."""

    name: ClassVar[str] = "rigl"


@dataclass(frozen=True)
class SET(RegrowthRule):
    """Drop the smallest |w|, grow at random (Mocanu et al. 2018)."""

    name: ClassVar[str] = "set"


@dataclass(frozen=True)
class SRSTE:
    """SR-STE as a piece: ``regrow=SRSTE(decay=1e-4)`` is ``regrow="sr-ste",
    sr_ste_decay=1e-4`` (Zhou et al. 2021: N:M masks from |w| at every step, the pruned
    weights decayed by ``decay``).

    Raises:
        ValueError: ``decay`` not a finite number >= 0 (named ``SRSTE.decay``).
    """

    name: ClassVar[str] = "sr-ste"
    decay: float = DEFAULT_SR_STE_DECAY

    def __post_init__(self) -> None:
        object.__setattr__(self, "decay", check_decay(self.decay, "SRSTE.decay"))

    def settings(self) -> dict[str, Any]:
        """The flat settings this piece stands for."""
        return {"regrow": self.name, "sr_ste_decay": self.decay}


def drop_and_grow(masks: Sequence[Tensor], weights: Sequence[Tensor],
                  grow_scores: Sequence[Tensor], pattern: Pattern, fraction: float,
                  kept: Sequence[int] | None = None, input_dims: Sequence[int] | None = None,
                  drop_scores: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Swap ``fraction`` of each group's active blocks: drop the smallest |w| (or
    ``drop_scores``), grow the largest |grow score| among the rest; every group keeps
    exactly its count.

    The blocks are the pattern's blocks (whole blocks move together, overhanging ones
    included); the groups are its N:M groups, or the whole tensor for unstructured and
    block patterns. A block dropped and grown back in the same update stays active, so it
    keeps its value. Tensors of one shape and one count are ranked together (one stack and
    two top-k calls per shape).

    Args:
        masks, weights, grow_scores: one entry per tensor.
        kept: each ``mask.sum()`` if the caller has them (counting here is a device sync).
        input_dims: where each tensor stores its input dimension (default 1,
            :func:`~sparse_training.pieces.masks.as_matrix`).
        drop_scores: what drop ranks instead of ``|w|`` (a training score's ranks, signed,
            shaped like the weights; summed over each block), one per tensor.

    Returns:
        The new bool masks, shaped like the weights.
    """
    kept = list(kept) if kept is not None else [int(m.sum()) for m in masks]
    input_dims = input_dims or [1] * len(masks)
    rows, cols = pattern.block_rows, pattern.block_cols
    by_shape: dict[tuple, list[int]] = {}
    for i, (mask, dim) in enumerate(zip(masks, input_dims, strict=True)):
        by_shape.setdefault((mask.shape, mask.device, dim, _kept_blocks(mask, kept[i], pattern,
                                                                        dim)), []).append(i)
    new: list[Tensor] = [None] * len(masks)  # type: ignore[list-item]
    for (_, _, dim, count), indices in by_shape.items():
        magnitude = pool_blocks(score_stack(
            [weights[i] for i in indices],
            None if drop_scores is None else [drop_scores[i] for i in indices], dim), rows, cols)
        growth = pool_blocks(score_stack([grow_scores[i] for i in indices], input_dim=dim),
                             rows, cols)  # |g|
        matrices = torch.stack([as_matrix(masks[i], dim) for i in indices])
        active = pool_blocks(matrices.float(), rows, cols) > 0  # (B, blocks down, across)
        # groups: N:M groups of M blocks, or each tensor's blocks as one group
        size = pattern.m if pattern.is_nm else active[0].numel()
        active_g, magnitude_g, growth_g = (t.reshape(-1, size) for t in (active, magnitude,
                                                                           growth))
        per_group = count // (active_g.shape[0] // len(indices))
        swaps = int(fraction * per_group + 0.5)
        if swaps == 0:
            for i in indices:
                new[i] = masks[i].clone()
            continue
        drop_score = torch.where(active_g, magnitude_g, torch.inf)
        dropped = torch.zeros_like(active_g).scatter_(
            1, drop_score.topk(swaps, dim=1, largest=False, sorted=False).indices, True)
        still = active_g & ~dropped
        grow = torch.where(still, -torch.inf, growth_g)
        grown = torch.zeros_like(active_g).scatter_(
            1, grow.topk(swaps, dim=1, sorted=False).indices, True)
        new_blocks = expand_blocks((still | grown).reshape(active.shape), rows, cols,
                                   matrices.shape[-2:])
        for i, mask in zip(indices, new_blocks, strict=True):
            new[i] = from_matrix(mask, masks[i].shape, dim)
    return new


def _kept_blocks(mask: Tensor, kept: int, pattern: Pattern, input_dim: int) -> int:
    """Kept blocks of ``mask`` (``kept`` entries): ``kept / (R C)`` when the blocks tile the
    weight, else counted on the block grid (overhanging blocks hold fewer entries; one
    device sync, for such tensors only)."""
    rows, cols = as_matrix(mask, input_dim).shape
    if rows % pattern.block_rows == 0 and cols % pattern.block_cols == 0:
        return kept // (pattern.block_rows * pattern.block_cols)
    blocks = pool_blocks(as_matrix(mask, input_dim).float(), pattern.block_rows,
                         pattern.block_cols)
    return int((blocks > 0).sum())
