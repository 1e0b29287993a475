"""The slots of one model and every change to their masks: what an updater works on.

:class:`SlotSet` holds the model's slots (:mod:`sparse_training.engine.slots`, and the
compressed layers' own), installs new masks (zeroing pruned weights and, where positions
restart, their optimizer state; checked across ranks), moves compressed layers' blocks,
and counts the sparsity after every change. :class:`~sparse_training.engine.SparsityEngine`
is a SlotSet with a lifecycle (selection, optimizer hooks, state); updaters
(:mod:`sparse_training.engine.updaters`) see the SlotSet only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from sparse_training.engine.distributed import check_across_ranks
from sparse_training.engine.slots import MaskedSlot, whole_counts
from sparse_training.kernels import zero_pruned_


class SlotSet:
    """The masked-dense ``slots`` and ``compressed`` layers' slots of one model.

    Args:
        streams: each tensor's random stream (its index in model order over masked and
            compressed tensors: a tensor draws the same scores either way).
        pooled_sparsity: the model-wide final sparsity, for tensors the global
            distribution pools (their plans give none).
        check_masks: compare mask checksums across ranks after every update.

    Attributes:
        loss_scale: the loss scale of the gradients at the optimizer step (an AMP
            GradScaler's; the Lightning callback sets it): recorded dense gradients are
            divided by it.
    """

    def __init__(self, slots: list[MaskedSlot], compressed: list[Any], streams: dict[str, int],
                 pooled_sparsity: float | None, check_masks: bool) -> None:
        self.slots, self.compressed, self.streams = slots, compressed, streams
        self.pooled_sparsity, self.check_masks = pooled_sparsity, check_masks
        self._attached: dict[Optimizer, Any] = {}  # the optimizers whose state follows
        self._stats: dict[str, float] = {}  # counted by recount at every mask change
        self.loss_scale: Callable[[], float] = lambda: 1.0

    @property
    def masked_final_sparsity(self) -> float:
        """The mean final target over the masked weights (schedules scale it)."""
        total = sum(s.plan.numel for s in self.slots)
        return sum(s.plan.numel * (self.pooled_sparsity if s.plan.sparsity is None
                                   else s.plan.sparsity) for s in self.slots) / max(total, 1)

    def overall(self, masked: float) -> float:
        """``masked`` (a sparsity of the masked weights) with the compressed layers' zeros:
        the fraction over every selected and compressed weight."""
        numel = sum(s.plan.numel for s in self.slots)
        total = numel + sum(s.numel for s in self.compressed)
        zeros = sum(self.tensor_sparsity[s.name] * s.numel for s in self.compressed)
        return (masked * numel + zeros) / total if total else 0.0

    def recount(self) -> None:
        """Count the masks after they change, where every rank is (one sync; an all-reduce
        for sharded tensors): a later read of :attr:`tensor_sparsity` communicates nothing,
        so one rank alone may read it."""
        kept, _ = whole_counts(self.slots)
        self._stats = {s.name: 1.0 - k / s.plan.numel
                       for s, k in zip(self.slots, kept, strict=True)}
        self._stats.update({s.name: s.layer.sparsity for s in self.compressed})

    @property
    def tensor_sparsity(self) -> dict[str, float]:
        """Fraction of zeros in each selected tensor's mask and each compressed layer's dense
        form, as counted at the last mask change."""
        return self._stats

    @property
    def sparsity(self) -> float:
        """Fraction of zeros over all selected and compressed weights."""
        numel = sum(s.plan.numel for s in self.slots)
        masked = sum(self.tensor_sparsity[s.name] * s.plan.numel for s in self.slots)
        return self.overall(masked / numel if numel else 0.0)

    @torch.no_grad()
    def set_masks(self, new_masks: dict[str, Tensor], step: int | None, broadcast: bool,
                  reset_state: bool = True, check: bool = True) -> None:
        """Install masks (keyed by tensor name; of the whole tensors, sharded ones too):
        zero the pruned weights and, with ``reset_state``, every optimizer-state tensor
        wherever a position is not kept in both the old and the new mask (pruned, or grown
        and so starting from zero).
        Under torch.distributed, rank 0's masks are broadcast (``broadcast``) and checksums
        compared (``check`` and :attr:`check_masks`; of the new whole masks of sharded
        tensors)."""
        for slot in self.slots:
            new = new_masks.get(slot.name)
            if new is None:
                continue
            restart = slot.set_mask(new)
            if reset_state:
                for optimizer in self._attached:
                    for value in slot.state_tensors(optimizer):
                        value.masked_fill_(restart, 0)
        self.recount()
        if check:
            check_across_ranks([s for s in self.slots if not s.sharded or s.name in new_masks],
                               step, broadcast, self.check_masks, new_masks)

    def move_blocks(self, new_masks: dict[str, Tensor], step: int,
                    gradients: dict[str, Tensor]) -> None:
        """Move compressed layers' blocks to ``new_masks`` (block grids keyed by tensor
        name, same counts): values, gradients and optimizer state follow kept blocks, new
        ones start at zero with their block of the dense ``gradients``
        (``BlockSparseSlot.move``); checksums compared across ranks."""
        moved = [s for s in self.compressed if s.name in new_masks]
        for slot in moved:
            slot.move(new_masks[slot.name], self._attached, gradients.get(slot.name))
        self.recount()
        check_across_ranks(moved, step, False, self.check_masks)

    def zero_pruned_gradients(self, slots: Iterable[MaskedSlot]) -> None:
        """Zero the gradients of pruned weights, one multi-tensor pass."""
        pairs = [(s.local_grad, s.mask) for s in slots if s.param.grad is not None]
        if pairs:
            zero_pruned_(*zip(*pairs, strict=True))

    def zero_pruned_weights(self, slots: Iterable[MaskedSlot]) -> None:
        """Zero the pruned weights, one multi-tensor pass."""
        slots = list(slots)
        with torch.no_grad():
            zero_pruned_([s.local_param for s in slots], [s.mask for s in slots])
