"""Sparse-tensor slots: how the engine reads and writes one selected tensor.

A slot owns the sparse form of one weight tensor and is the only code that knows it.
:class:`MaskedSlot` is the masked-dense form: the parameter keeps its full shape and a
bool buffer ``<attribute>_mask`` beside it (on the module that stores the parameter; for
a parametrized weight, its ``ParametrizationList``) marks the kept entries. The buffer is
not persistent: the model's ``state_dict`` stays plain (weights with zeros at pruned
positions), so a sparse checkpoint loads into the plain model with a strict load; the
masks travel in the engine's own state (:mod:`sparse_training.engine.state`).

Every slot answers the same questions: its parameter (what the optimizer updates), its
mask, the dense gradient regrowth ranks, and the optimizer-state tensors shaped like its
parameter.

A layer that holds its own sparsity (:class:`~sparse_training.engine.protocol.CompressedLayer`)
answers them through its own slot (:mod:`sparse_training.layers.storage`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.engine.protocol import Slot
from sparse_training.engine.selection import TensorPlan
from sparse_training.engine.sharding import (
    full,
    gather_like,
    is_sharded,
    local,
    shard_like,
    totals_like,
)
from sparse_training.engine.tensors import WeightTensor
from sparse_training.pieces.patterns import Pattern

MASK_SUFFIX = "_mask"


class MaskedSlot:
    """A selected tensor in masked-dense form (a :class:`~sparse_training.engine.protocol.Slot`).

    Args:
        plan: the tensor's row of the setup table.
        tensor: where the tensor lives (names, owners, stored parameter).
    """

    compressed = False
    enforced = True  # the optimizer hooks keep its pruned weights and gradients zero
    records_gradient = False  # its gradient is dense: the parameter's own

    def __init__(self, plan: TensorPlan, tensor: WeightTensor) -> None:
        self.plan, self.tensor = plan, tensor
        module, attr = tensor.store
        self._parameters, self._param_key = module._parameters, attr
        self._buffers, self.mask_key = module._buffers, attr + MASK_SUFFIX
        self.module = module

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def grid_pattern(self) -> Pattern:
        return self.plan.pattern

    @property
    def input_dim(self) -> int:
        return self.plan.input_dim

    @property
    def param(self) -> nn.Parameter:
        """The stored parameter: what the optimizer updates."""
        return self._parameters[self._param_key]

    @property
    def sharded(self) -> bool:
        """Whether the parameter is a DTensor (FSDP2): the mask buffer then holds the local
        shard of the full tensor's mask (:mod:`sparse_training.engine.sharding`)."""
        return is_sharded(self.param)

    @property
    def local_param(self) -> Tensor:
        """The parameter's local shard (the parameter itself when not sharded)."""
        return local(self.param)

    @property
    def mask(self) -> Tensor:
        """Bool mask of the local parameter's shape (:attr:`local_param`), True where kept."""
        return self._buffers[self.mask_key]

    def full_mask(self) -> Tensor:
        """The mask of the whole tensor (gathered from every rank when sharded)."""
        return gather_like(self.mask, self.param) if self.sharded else self.mask

    def full_param(self) -> Tensor:
        """The whole parameter (gathered from every rank when sharded)."""
        return full(self.param)

    @property
    def installed(self) -> bool:
        """Whether the mask buffer is on the module (``make_permanent`` removes it)."""
        return self.mask_key in self._buffers

    def existing_mask_problem(self) -> str | None:
        """Why the attribute the mask needs is taken, or None."""
        existing = self._buffers.get(self.mask_key)
        param = self.local_param
        if existing is not None and (existing.dtype != torch.bool
                                     or existing.shape != param.shape):
            return (f"{self.mask_key!r} ({existing.dtype}, {tuple(existing.shape)}) is not a "
                    f"bool mask of its {'local shard' if self.sharded else 'shape'} "
                    f"{tuple(param.shape)} (torch.nn.utils.prune?); remove it")
        if existing is None and hasattr(self.module, self.mask_key):
            return f"the attribute {self.mask_key!r} is taken; rename it"
        return None

    def install(self) -> None:
        """Register the mask buffer: kept as it is when a bool mask of the right shape is
        there (masks of an earlier fit), all True otherwise."""
        if self.mask_key not in self._buffers:
            mask = torch.ones_like(self.local_param, dtype=torch.bool)
            self.module.register_buffer(self.mask_key, mask, persistent=False)

    @torch.no_grad()
    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer] = (),
                 reset_state: bool = True, gradient: Tensor | None = None,
                 carried: Sequence[Tensor] = ()) -> None:
        """Install ``mask``, the whole tensor's (this rank keeps its shard of it), and zero
        the pruned weights; with ``reset_state``, the state of ``optimizers`` and the
        ``carried`` tensors restart (zero) wherever a position is not kept in both the old
        and the new mask (pruned, or grown and so starting from zero). A grown weight's
        gradient is its own: ``gradient`` is not needed."""
        if self.sharded:
            mask = shard_like(mask, self.param)
        restart = ~(mask & self.mask)
        self.mask.copy_(mask)
        self.local_param.masked_fill_(~self.mask, 0)
        if reset_state:
            for optimizer in optimizers:
                for value in self.state_tensors(optimizer):
                    value.masked_fill_(restart, 0)
            for value in carried:
                value.masked_fill_(restart, 0)

    def sparsity(self, kept: int) -> float:
        return 1.0 - kept / self.numel

    @property
    def movable(self) -> bool:
        """Whether regrowth has anything to swap (not a tensor kept dense)."""
        return self.plan.sparsity != 0.0

    @property
    def dense_shape(self) -> torch.Size:
        return self.param.shape

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def dense_gradient(self) -> Tensor | None:
        """The gradient at every position, pruned ones included (before masking), of the
        whole tensor (gathered from every rank when sharded)."""
        grad = self.param.grad
        return None if grad is None else full(grad)

    @property
    def gradient_ready(self) -> bool:
        return self.param.grad is not None

    def drop_scores(self, scores: Tensor | None = None) -> Tensor:
        """The whole weight (drop ranks its ``|w|``), or the whole of the local-shaped
        ``scores``."""
        if scores is None:
            return self.full_param()
        return gather_like(scores, self.param) if self.sharded else scores

    def grow_scores(self, scores: Tensor) -> Tensor:
        """``scores`` as they are: the mask is the weight's."""
        return scores

    @property
    def local_grad(self) -> Tensor | None:
        """The gradient's local shard (the gradient itself when not sharded)."""
        grad = self.param.grad
        return None if grad is None else local(grad)

    def state_tensors(self, optimizer: Optimizer) -> list[Tensor]:
        """The optimizer's state tensors shaped like the parameter (moments, buffers), their
        local shards when sharded."""
        return [local(v) for v in state_tensors(optimizer, self.param)]

    def forward_weight(self) -> Tensor:
        """The tensor the forward pass uses (a parametrization evaluated)."""
        return self.tensor.forward_weight()

    @torch.no_grad()
    def attach(self, optimizer: Optimizer, dense_state: bool) -> None:
        """Unless the updater keeps ``dense_state`` (SR-STE), zero the state of dense steps
        before, and the weights, where pruned."""
        if not dense_state:
            for value in self.state_tensors(optimizer):
                value.masked_fill_(~self.mask, 0)
            self.local_param.masked_fill_(~self.mask, 0)

    def detach(self) -> None:
        """Nothing to give back: the mask buffer stays on the model."""


def state_tensors(optimizer: Optimizer, param: Tensor) -> list[Tensor]:
    """The optimizer's state tensors of ``param`` shaped like it (moments, buffers)."""
    return [v for v in optimizer.state.get(param, {}).values()
            if isinstance(v, Tensor) and v.shape == param.shape]


def whole_counts(slots: Sequence[Slot], gradients: bool = False
                 ) -> tuple[list[int], int]:
    """Kept entries of each slot's whole mask (blocks, for a block-sparse layer) and, with
    ``gradients``, how many entries of all their gradients are not finite: one device sync,
    and one all-reduce per mesh dimension for all the sharded tensors together."""
    if not slots:
        return [], 0
    sums = [slot.mask.sum() for slot in slots]
    # a masked tensor's mask is sharded like its weight; a block grid is whole on every rank
    likes = [slot.param if slot.sharded else slot.mask for slot in slots]
    if gradients:
        sums += [local(slot.param.grad).isfinite().logical_not_().sum() for slot in slots]
        likes += [slot.param for slot in slots]
    counts = totals_like(sums, likes).tolist()
    return counts[:len(slots)], int(sum(counts[len(slots):]))
