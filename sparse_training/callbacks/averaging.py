"""Weight averaging in a sparse fit: Lightning's ``WeightAveraging`` (``EMAWeightAveraging``)
and ``StochasticWeightAveraging`` keep an averaged copy of the model, made at their setup,
and put it into the model: for validation, at the end of training, in checkpoints. Left
alone, the copy averages in the dense weights of before each pruning (the fit ends dense
while its summary reports the masks' sparsity), and the masks, registered on the model
after the copy was made, shift the buffers ``WeightAveraging`` pairs with the copy's by
position. :class:`AveragedMasks` keeps every copy sparse with the model's masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import StochasticWeightAveraging, WeightAveraging
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn

if TYPE_CHECKING:
    from sparse_training.engine import SparsityEngine
    from sparse_training.engine.plan import SparsityPlan


def averaged_copies(trainer: pl.Trainer) -> list[tuple[str, nn.Module, AveragedModel | None]]:
    """``(callback's class name, averaged copy, its AveragedModel)`` of each weight-averaging
    callback of ``trainer`` that made its copy (at its setup); ``WeightAveraging``'s
    AveragedModel pairs the copy's buffers with the model's by position (None:
    ``StochasticWeightAveraging``'s copy, which pairs parameters only)."""
    copies = []
    for callback in trainer.callbacks:
        average = getattr(callback, "_average_model", None)  # made at the callbacks' setup
        if isinstance(callback, WeightAveraging) and isinstance(average, AveragedModel):
            copies.append((type(callback).__name__, average.module, average))
        elif isinstance(callback, StochasticWeightAveraging) and isinstance(average, nn.Module):
            copies.append((type(callback).__name__, average, None))
    return copies


def averaging_problem(copies: list[tuple[str, nn.Module, AveragedModel | None]], model: nn.Module,
                      plan: SparsityPlan) -> str | None:
    """Why the averaged ``copies`` cannot keep ``plan``'s masks, or None: compressed layers
    (their blocks move; an average of their values means nothing), or a selected tensor the
    copy lacks or holds in another shape."""
    if not copies:
        return None
    if any(row.compressed for row in plan.rows):
        return (f"compress={plan.config.compress!r} trains compressed layers, whose blocks "
                f"move, beside {copies[0][0]}, whose averaged copy of the model cannot follow "
                f"them: use compress=False (masked-dense) with weight averaging, or remove "
                f"the averaging callback")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for callback, copy, _ in copies:
        held = dict(copy.named_parameters(remove_duplicate=False))
        for row, tensor in plan.masked:
            name = names[id(tensor.param)]
            if name not in held or held[name].shape != tensor.param.shape:
                return (f"the averaged copy of {callback} has no tensor {name!r} of shape "
                        f"{tuple(tensor.param.shape)} ({row.name!r} is selected): it was made "
                        f"from another model; build the layers before the callbacks' setup "
                        f"(in __init__ or configure_model)")
    return None


class AveragedMasks:
    """The engine's masks in the averaged copies of its model (:func:`averaged_copies`).

    At every mask change (:meth:`sync`, after the hooks that change masks, before any
    average is taken at the batch's end) each copy's weights are zeroed where the masks
    prune; the model's pruned weights stay zero, so the average of both stays zero and the
    copy put into the model is sparse with the same masks. A copy whose AveragedModel pairs
    buffers by position gets a mask buffer beside each masked weight, so that every buffer
    of the copy meets its own, and its averaging function copies bool tensors (the masks)
    instead of averaging them (torch's default, SWA's, cannot subtract bools).
    """

    def __init__(self, engine: SparsityEngine, model: nn.Module,
                 copies: list[tuple[str, nn.Module, AveragedModel | None]]) -> None:
        paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.engine, self.changes = engine, -1
        # (copy, path of the module storing the weight, its attribute, slot, buffer too)
        self.tensors = [(copy, paths[id(slot.tensor.store[0])], slot.tensor.store[1], slot,
                         average is not None) for _, copy, average in copies
                        for slot in engine.masked]
        for copy, path, attr, slot, paired in self.tensors:
            if paired:
                module = copy.get_submodule(path)
                module.register_buffer(slot.mask_key, slot.mask.to(
                    module._parameters[attr].device, copy=True), persistent=False)
        for _, _, average in copies:
            if average is not None:
                _copy_masks(average)
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Where the masks changed since the last call, zero the copies' weights where they
        prune and put the masks in the copies' buffers."""
        if self.engine.mask_changes == self.changes:
            return
        self.changes = self.engine.mask_changes
        for copy, path, attr, slot, paired in self.tensors:
            module = copy.get_submodule(path)  # looked up: a copy moved by .to() has new ones
            weight = module._parameters[attr]
            mask = slot.mask.to(weight.device)
            weight.masked_fill_(~mask, 0)
            if paired:
                module._buffers[slot.mask_key].copy_(mask)


def _copy_masks(average: AveragedModel) -> None:
    """Have ``average`` copy the model's bool tensors (masks) instead of averaging them,
    whatever averages the rest: its ``multi_avg_fn`` or ``avg_fn``, or where it has
    neither torch's SWA average, tensor by tensor (as torch does on the CPU; its
    multi-tensor form cannot average integer buffers)."""
    if average.multi_avg_fn is not None:
        average.multi_avg_fn = functools.partial(_copied_masks, average.multi_avg_fn)
    else:
        average.avg_fn = functools.partial(_copied_mask, average.avg_fn or get_swa_avg_fn())


def _copied_masks(average_fn: Callable[..., None], averaged: list[Tensor],
                  current: list[Tensor], count: Tensor | int) -> None:
    """``average_fn`` of a group of tensors (one dtype), or the copy of bool ones."""
    if averaged[0].dtype != torch.bool:
        average_fn(averaged, current, count)
        return
    for mine, theirs in zip(averaged, current, strict=True):
        mine.copy_(theirs)


def _copied_mask(average_fn: Callable[..., Tensor], averaged: Tensor, current: Tensor,
                 count: Tensor | int) -> Tensor:
    """``average_fn`` of one tensor, or ``current`` for a bool one."""
    return current if averaged.dtype == torch.bool else average_fn(averaged, current, count)
