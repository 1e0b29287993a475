"""Sparsity distributions: how a model-wide target is shared among tensors.

Every distribution is a small frozen dataclass with one signature::

    distribution(shapes, sparsity) -> list[float | None]

the per-tensor final sparsities of the tensors that follow the model-wide target (tensors
with overrides keep their own). None means no fixed value: :class:`Global` decides with one
magnitude threshold across the tensors at every update
(:func:`sparse_training.pieces.masks.global_masks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Uniform:
    """Every tensor at the model-wide sparsity."""

    name: ClassVar[str] = "uniform"

    def __call__(self, shapes: Sequence[Sequence[int]], sparsity: float) -> list[float | None]:
        return [sparsity] * len(shapes)


@dataclass(frozen=True)
class ERK:
    """Erdős–Rényi-Kernel: density_l = min(1, eps * sum(shape_l) / prod(shape_l)).

    eps is solved so that sum_l density_l * N_l = (1 - s) * sum_l N_l; tensors that would
    exceed density 1 are made dense and eps is solved again over the rest (Evci et al. 2020,
    "Rigging the Lottery", appendix; Mocanu et al. 2018 for the Erdős–Rényi form).
    """

    name: ClassVar[str] = "erk"

    def __call__(self, shapes: Sequence[Sequence[int]], sparsity: float) -> list[float | None]:
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


@dataclass(frozen=True)
class Global:
    """One magnitude threshold across the tensors at every update: no fixed per-tensor
    value (None each)."""

    name: ClassVar[str] = "global"

    def __call__(self, shapes: Sequence[Sequence[int]], sparsity: float) -> list[float | None]:
        return [None] * len(shapes)


Distribution = Uniform | ERK | Global
DISTRIBUTIONS: dict[str, Distribution] = {d.name: d for d in (Uniform(), ERK(), Global())}
