"""The slots of one model and every change to their masks: what an updater works on.

:class:`SlotSet` holds the model's slots in one list (the :class:`~sparse_training.engine.
protocol.Slot` protocol: masked-dense tensors and compressed layers alike), installs new
masks through them (each writes its weight and optimizer state under its mask; checked
across ranks), makes their recorded dense gradients comparable (averaged over ranks and
unscaled, here only), and counts the sparsity after every change.
:class:`~sparse_training.engine.SparsityEngine` is a SlotSet with a lifecycle (selection,
optimizer hooks, state); updaters
(:mod:`sparse_training.engine.updaters`) see the SlotSet only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from sparse_training.engine.distributed import average_across_ranks, check_across_ranks
from sparse_training.engine.protocol import Slot
from sparse_training.engine.sharding import local
from sparse_training.engine.slots import MaskedSlot, whole_counts
from sparse_training.kernels import zero_pruned_


class SlotSet:
    """The slots of one model, masked-dense and compressed, in model order.

    Args:
        slots: every slot (:class:`~sparse_training.engine.protocol.Slot`).
        streams: each tensor's random stream (its index in model order over masked and
            compressed tensors: a tensor draws the same scores either way).
        pooled_sparsity: the model-wide final sparsity, for tensors the global
            distribution pools (their plans give none).
        check_masks: compare mask checksums across ranks after every update.

    Attributes:
        loss_scale: the loss scale of the gradients at the optimizer step (an AMP
            GradScaler's; the Lightning callback sets it): recorded dense gradients are
            divided by it (:meth:`reduce_dense_gradients`).
        mask_changes: how many times the masks were counted after a change (:meth:`recount`);
            a reader compares it with the value it last saw to learn whether masks changed.
    """

    def __init__(self, slots: list[Slot], streams: dict[str, int],
                 pooled_sparsity: float | None, check_masks: bool) -> None:
        self.slots, self.streams = slots, streams
        self.pooled_sparsity, self.check_masks = pooled_sparsity, check_masks
        self.weights = sum(s.numel for s in slots)
        """How many weights the slots hold: every selected and compressed weight (a
        compressed layer's dense form), fixed for the set's life."""
        self._attached: dict[Optimizer, Any] = {}  # the optimizers whose state follows
        self._stats: dict[str, float] = {}  # counted by recount at every mask change
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.mask_changes = 0

    @property
    def masked(self) -> list[MaskedSlot]:
        """The masked-dense slots: the selected tensors, whose masks the schedule sets."""
        return [s for s in self.slots if not s.compressed]

    @property
    def compressed(self) -> list[Slot]:
        """The compressed layers' slots, which hold their own sparsity."""
        return [s for s in self.slots if s.compressed]

    @property
    def masked_final_sparsity(self) -> float:
        """The mean final target over the masked weights (schedules scale it)."""
        masked = self.masked
        total = sum(s.numel for s in masked)
        return sum(s.numel * self.final(s) for s in masked) / max(total, 1)

    def final(self, slot: MaskedSlot) -> float:
        """``slot``'s final target (the global distribution's: the pool's)."""
        return self.pooled_sparsity if slot.plan.sparsity is None else slot.plan.sparsity

    def overall(self, masked: float) -> float:
        """``masked`` (a sparsity of the masked weights) with the compressed layers' zeros:
        the fraction over every selected and compressed weight."""
        numel = sum(s.numel for s in self.masked)
        zeros = sum(self.tensor_sparsity[s.name] * s.numel for s in self.compressed)
        return (masked * numel + zeros) / self.weights if self.weights else 0.0

    def recount(self) -> None:
        """Count the masks after they change, where every rank is (one sync; an all-reduce
        for sharded tensors): a later read of :attr:`tensor_sparsity` communicates nothing,
        so one rank alone may read it."""
        kept, _ = whole_counts(self.slots)
        self._stats = {s.name: s.sparsity(k) for s, k in zip(self.slots, kept, strict=True)}
        self.mask_changes += 1

    @property
    def tensor_sparsity(self) -> dict[str, float]:
        """Share of each selected tensor's entries its mask prunes, and of each compressed
        layer's dense form its structure drops, as counted at the last mask change (a kept
        weight that happens to be zero counts as kept)."""
        return self._stats

    @property
    def sparsity(self) -> float:
        """Share of pruned weights over all selected and compressed weights."""
        masked = self.masked
        numel = sum(s.numel for s in masked)
        zeros = sum(self.tensor_sparsity[s.name] * s.numel for s in masked)
        return self.overall(zeros / numel if numel else 0.0)

    @torch.no_grad()
    def set_masks(self, new_masks: dict[str, Tensor], step: int | None, broadcast: bool,
                  reset_state: bool = True, check: bool = True,
                  gradients: dict[str, Tensor] | None = None,
                  carried: dict[str, list[Tensor]] | None = None) -> None:
        """Install masks (keyed by tensor name; of the whole tensors, sharded ones too; a
        block layer's block grid) through each slot (:meth:`Slot.set_mask
        <sparse_training.engine.protocol.Slot.set_mask>`): the weights follow, and, with
        ``reset_state``, the optimizer state restarts wherever a position is not kept in
        both the old and the new mask; a moved block takes its block of ``gradients``, and
        the ``carried`` tensors of a slot (a training score's statistics) follow its mask.
        Under torch.distributed, rank 0's masks are broadcast (``broadcast``) and checksums
        compared (``check`` and :attr:`check_masks`) of the new masks and of every
        unsharded masked-dense one."""
        gradients, carried = gradients or {}, carried or {}
        for slot in self.slots:
            if (new := new_masks.get(slot.name)) is not None:
                slot.set_mask(new, self._attached, reset_state, gradients.get(slot.name),
                              carried.get(slot.name, ()))
        self.recount()
        if check:
            check_across_ranks([s for s in self.slots if s.name in new_masks
                                or not (s.sharded or s.compressed)],
                               step, broadcast, self.check_masks, new_masks)

    @torch.no_grad()
    def reduce_dense_gradients(self, slots: Iterable[Slot]) -> None:
        """The dense gradients ``slots`` recorded (compressed layers: each rank's own
        micro-batches, loss-scaled under AMP), averaged over the ranks as DDP averages
        gradients and divided by the loss scale, in place: the one place where recorded
        gradients become comparable to masked-dense ones (those DDP and the AMP unscaling
        before ``on_before_optimizer_step`` have served)."""
        recorded = [s.dense_gradient for s in slots if s.records_gradient]
        recorded = [g for g in recorded if g is not None]
        average_across_ranks(recorded)
        scale = self.loss_scale()
        for gradient in recorded:
            gradient.div_(scale)

    def zero_pruned_weights(self, slots: Iterable[Slot]) -> None:
        """Zero the pruned weights of the enforced ``slots``, one multi-tensor pass."""
        slots = [s for s in slots if s.enforced]
        with torch.no_grad():
            zero_pruned_([local(s.param) for s in slots], [s.mask for s in slots])
