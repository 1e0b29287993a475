"""Sparsity distributions: how a model-wide target is shared among layers.

Every distribution has one signature: ``f(shapes, sparsity) -> list of per-layer sparsities``
for the layers that follow the model-wide target (layers with overrides keep their own).
``"global"`` is the exception: one magnitude threshold decides at every update, so it has
no fixed per-layer values (:func:`sparse_training.masks.global_masks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DISTRIBUTIONS = ("uniform", "erk", "global")


def uniform(shapes: Sequence[Sequence[int]], sparsity: float) -> list[float]:
    """Every layer at the model-wide sparsity."""
    return [sparsity] * len(shapes)


def erk(shapes: Sequence[Sequence[int]], sparsity: float) -> list[float]:
    """Erdős–Rényi-Kernel: density_l = min(1, eps * sum(shape_l) / prod(shape_l)).

    eps is solved so that sum_l density_l * N_l = (1 - s) * sum_l N_l; layers that would
    exceed density 1 are made dense and eps is solved again over the rest (Evci et al. 2020,
    "Rigging the Lottery", appendix; Mocanu et al. 2018 for the Erdős–Rényi form).
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes, strict=True)]
    kept_total = (1.0 - sparsity) * sum(sizes)
    dense: set[int] = set()
    while True:
        budget = kept_total - sum(sizes[i] for i in dense)
        weighted = sum(raw[i] * sizes[i] for i in range(len(sizes)) if i not in dense)
        eps = budget / weighted if weighted else 0.0
        overflow = {i for i in range(len(sizes)) if i not in dense and eps * raw[i] > 1.0}
        if not overflow:
            break
        dense |= overflow
    return [0.0 if i in dense else 1.0 - eps * raw[i] for i in range(len(sizes))]


PER_LAYER = {"uniform": uniform, "erk": erk}
