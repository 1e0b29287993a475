"""Checks of a 2:4 layer's mask and of weights against it (plain torch, any device)."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from sparse_training.kernels.semi_structured.cusparselt import row_chunks


def features_problem(in_features: object, out_features: object) -> str | None:
    """Why a 2:4 layer cannot have these features, or None: each must be a positive multiple
    of 4 (the groups run along the inputs, and along the outputs for ``2:4:2d``)."""
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        if (not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 4
                or size % 4):
            return f"{name} must be a positive multiple of 4 (2:4 groups), got {size!r}"
    return None


def check_mask(mask: Tensor, shape: tuple[int, int], transposable: bool, owner: str) -> None:
    """Raise ``ValueError`` unless ``mask`` is a bool 2:4 mask of ``shape`` (and of its
    transpose where ``transposable``), naming ``owner`` and the first bad group."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        what = (f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor)
                else type(mask).__name__)
        raise ValueError(f"{owner}: mask must be a bool tensor of the weight's shape {shape}, "
                         f"got {what}")
    if mask.is_meta:  # no values to check (a layer built on the meta device)
        return
    views = [("row", mask)] + ([("column", mask.T)] if transposable else [])
    for direction, view in views:
        kept = view.reshape(view.shape[0], -1, 4).sum(-1, dtype=torch.uint8)
        bad = (kept != 2).nonzero()
        if len(bad):
            i, group = bad[0].tolist()
            raise ValueError(f"{owner}: mask is not 2:4 along each {direction}: {direction} "
                             f"{i}, entries {4 * group}:{4 * group + 4} keep "
                             f"{int(kept[i, group])} (2 of every 4 must be kept; "
                             f"pattern_mask(weight, {'2:4:2d' if transposable else '2:4'!r}) "
                             "makes one)")


def zero_outside(weight: Tensor, mask: Tensor) -> bool:
    """Whether ``weight`` is zero (not NaN) wherever ``mask`` is False, by row chunks."""
    for rows in row_chunks(*weight.shape):
        if torch.where(mask[rows].to(weight.device), 0, weight[rows]).any():
            return False
    return True
