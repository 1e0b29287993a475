"""The packed copies a :class:`~sparse_training.layers.semi_structured.SemiStructuredLinear`
multiplies on the sparse tensor cores: :class:`PackedCopies`.

A copy of the weight (``W``, or ``W^T`` for the input gradient of a transposable mask) is
packed in a compute dtype at its first use, and kept only while a measured route uses it.
It is refreshed, values only, at the first call after any ``torch.optim`` optimizer stepped
(a global step post-hook counts the steps: torch's fused optimizers do not move a
parameter's version counter) or the weight was written in place; and at every call once the
layer ran under CUDA graph capture, since no Python sees the optimizer steps that replays
take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from sparse_training.kernels.semi_structured import PackedWeight, PathChoice, choose_paths

_OPTIMIZER_STEPS = [0]  # optimizer steps taken in this process, once counting starts
_COUNTING: list = []  # the global hook's handle, registered by the first layer


def _count_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    _OPTIMIZER_STEPS[0] += 1


def count_optimizer_steps() -> None:
    """Start counting the optimizer steps of this process (once; each layer asks)."""
    if not _COUNTING:
        _COUNTING.append(register_optimizer_step_post_hook(_count_step))


def weights_changed_marker(weight: Tensor) -> tuple[int, int]:
    """What changes when the weight may have: (optimizer steps, the weight's version)."""
    return _OPTIMIZER_STEPS[0], weight._version


@dataclass
class PackedCopies:
    """A layer's packed copies by (dtype, transposed): ``[PackedWeight, marker when last
    packed]``, and whether the layer ran under CUDA graph capture (module doc)."""

    copies: dict[tuple[torch.dtype, bool], list] = field(default_factory=dict)
    captured: bool = False

    def _copy(self, weight: Tensor, mask: Tensor, dtype: torch.dtype, transposed: bool) -> list:
        """The copy of W (``transposed``: W^T) in ``dtype``, packed at its first use."""
        copy = self.copies.get((dtype, transposed))
        if copy is None:
            copy = self.copies[(dtype, transposed)] = _pack(weight, mask, dtype, transposed)
        return copy

    @torch.compiler.disable
    @torch.no_grad()
    def measure(self, weight: Tensor, mask: Tensor, dtype: torch.dtype, tokens: int,
                timing: str, transposable: bool) -> PathChoice:
        """The route for ``tokens`` (:func:`~sparse_training.kernels.semi_structured.paths.
        choose_paths`); copies packed to time it are kept only where the choice uses them
        (a dense choice keeps none)."""
        made: dict[bool, list] = {}

        def pack(transposed: bool) -> PackedWeight:
            copy = self.copies.get((dtype, transposed))
            if copy is None:
                copy = made[transposed] = _pack(weight, mask, dtype, transposed)
            return copy[0]

        choice = choose_paths(weight, dtype, tokens, timing, pack, transposable)
        for transposed, used in ((False, choice.forward), (True, choice.input_grad)):
            if used and transposed in made:
                self.copies[(dtype, transposed)] = made[transposed]
        return choice

    @torch.compiler.disable
    @torch.no_grad()
    def refreshed(self, weight: Tensor, mask: Tensor, dtype: torch.dtype, route: PathChoice
                  ) -> tuple[PackedWeight | None, PackedWeight | None]:
        """The packed copies ``route`` uses (None for a cuBLAS product), repacked (values
        only) if the weights may have changed since they were last packed, and at every call
        once captured in a CUDA graph."""
        marker = weights_changed_marker(weight)
        if torch.cuda.is_current_stream_capturing():  # a sparse route runs on CUDA
            self.captured = True
        copies = []
        for transposed, used in ((False, route.forward), (True, route.input_grad)):
            copy = self._copy(weight, mask, dtype, transposed) if used else None
            if copy is not None and (self.captured or copy[1] != marker):
                copy[0].refresh(weight)
                copy[1] = marker
            copies.append(None if copy is None else copy[0])
        return copies[0], copies[1]


def _pack(weight: Tensor, mask: Tensor, dtype: torch.dtype, transposed: bool) -> list:
    marker = weights_changed_marker(weight)
    return [PackedWeight.pack(weight.detach(), mask, dtype, transposed), marker]
