"""Mask regrowth: drop by magnitude, grow by a score, the same count back, inside the structure.

Every regrowth algorithm is one call of :func:`drop_and_grow` with a different grow score
(jaxpruner's split: "RigL is SET with a different grow score"):

- ``rigl``: grow where |dense gradient| is largest (Evci et al. 2020, "Rigging the Lottery").
- ``set``: grow at random (Mocanu et al. 2018, "Sparse Evolutionary Training"); the random
  stream is seeded by (seed, step, layer), so every process draws the same positions.

The share of active weights swapped at step t is the cosine decay of RigL,
f(t) = alpha/2 (1 + cos(pi t / T_end)), alpha = 0.3 by default, and no swaps from T_end on.

SR-STE (Zhou et al. 2021, "Learning N:M Fine-grained Structured Sparse Neural Networks From
Scratch") is not a drop/grow rule: the engine keeps dense weights, recomputes the N:M mask
from them every step, and adds the sparse-refined decay lambda (1 - mask) w to the
straight-through gradient (:func:`sr_ste_gradient`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparse_training.masks import as_matrix, expand_blocks, from_matrix, pool_blocks
from sparse_training.patterns import Pattern

REGROW = ("rigl", "set", "sr-ste")
DEFAULT_ALPHA = 0.3  # RigL's drop fraction (Evci et al. 2020, Table 1 setting)
DEFAULT_REGROW_END = 0.75  # RigL stops mask updates at 75% of training
DEFAULT_SR_STE_DECAY = 2e-4  # lambda_W of Zhou et al. 2021


def cosine_fraction(step: int, end: int, alpha: float) -> float:
    """f(t) = alpha/2 (1 + cos(pi t / T_end)) for t < T_end, else 0."""
    return 0.0 if step >= end else alpha / 2 * (1 + math.cos(math.pi * step / end))


def random_scores(shape: torch.Size, seed: int, step: int, layer: int,
                  device: torch.device) -> Tensor:
    """Uniform scores from a stream fixed by (seed, step, layer): equal on every rank."""
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * 1_000_003 + step) * 1_000_033 + layer) % 2**63)
    return torch.rand(shape, generator=generator, device=device)


def _groups(block_mask: Tensor, pattern: Pattern) -> Tensor:
    """(groups, group size) view: N:M groups of M blocks, or the whole layer as one group."""
    return block_mask.reshape(-1, pattern.m) if pattern.is_nm else block_mask.reshape(1, -1)


def drop_and_grow(mask: Tensor, weight: Tensor, grow_score: Tensor, pattern: Pattern,
                  fraction: float, kept: int | None = None) -> Tensor:
    """Swap ``fraction`` of each group's active blocks: drop the smallest |w|, grow the
    largest ``grow_score`` among the rest; every group keeps exactly its count.

    The blocks are the pattern's blocks (whole blocks move together); the groups are its N:M
    groups, or the whole layer for unstructured and block patterns. A block dropped and
    grown back in the same update stays active, so it keeps its value.

    Args:
        kept: ``mask.sum()`` if the caller has it (counting it here is a device sync).

    Returns:
        The new bool mask, shaped like ``weight``.
    """
    rows, cols = pattern.block_rows, pattern.block_cols
    magnitude = pool_blocks(torch.nan_to_num(as_matrix(weight.detach()).float().abs(),
                                             nan=float("-inf")), rows, cols)  # NaN: drop first
    growth = pool_blocks(torch.nan_to_num(as_matrix(grow_score).float().abs(),
                                          nan=float("-inf")), rows, cols)
    active = pool_blocks(as_matrix(mask).float(), rows, cols) > 0
    active_g, magnitude_g, growth_g = (_groups(t, pattern) for t in (active, magnitude, growth))
    kept = int(mask.sum()) if kept is None else kept
    per_group = kept // (rows * cols * active_g.shape[0])  # every group holds the same count
    swaps = int(fraction * per_group + 0.5)
    if swaps == 0:
        return mask.clone()
    drop_score = torch.where(active_g, magnitude_g, torch.inf)
    dropped = torch.zeros_like(active_g).scatter_(
        1, drop_score.topk(swaps, dim=1, largest=False).indices, True)
    kept = active_g & ~dropped
    grow = torch.where(kept, -torch.inf, growth_g)
    grown = torch.zeros_like(active_g).scatter_(1, grow.topk(swaps, dim=1).indices, True)
    new_blocks = (kept | grown).reshape(active.shape)
    return from_matrix(expand_blocks(new_blocks, rows, cols), mask.shape)


def sr_ste_gradient(grad: Tensor, dense_weight: Tensor, mask: Tensor, decay: float) -> None:
    """In place: g <- g + lambda (1 - mask) w, the sparse-refined straight-through gradient."""
    grad.add_(torch.where(mask, 0.0, dense_weight), alpha=decay)
