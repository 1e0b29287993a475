"""Sparse-tensor slots: how the engine reads and writes one selected tensor.

A slot owns the sparse form of one weight tensor and is the only code that knows it.
:class:`MaskedSlot` is the masked-dense form: the parameter keeps its full shape and a
bool buffer ``<attribute>_mask`` beside it (on the module that stores the parameter; for
a parametrized weight, its ``ParametrizationList``) marks the kept entries. The buffer is
not persistent: the model's ``state_dict`` stays plain (weights with zeros at pruned
positions), so a sparse checkpoint loads into the plain model with a strict load; the
masks travel in the engine's own state (:mod:`sparse_training.state`).

Every slot answers the same questions: its parameter (what the optimizer updates), its
mask, the tensor the forward pass uses, and the optimizer-state tensors shaped like it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.patcher import densify
from sparse_training.selection import TensorPlan
from sparse_training.tensors import WeightTensor

MASK_SUFFIX = "_mask"


class MaskedSlot:
    """A selected tensor in masked-dense form.

    Args:
        plan: the tensor's row of the setup table.
        tensor: where the tensor lives (names, owners, stored parameter).
    """

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
    def param(self) -> nn.Parameter:
        """The stored parameter: what the optimizer updates."""
        return self._parameters[self._param_key]

    @property
    def mask(self) -> Tensor:
        """Bool mask of the parameter's shape, True where kept."""
        return self._buffers[self.mask_key]

    @property
    def installed(self) -> bool:
        """Whether the mask buffer is on the module (``make_permanent`` removes it)."""
        return self.mask_key in self._buffers

    def existing_mask_problem(self) -> str | None:
        """Why the attribute the mask needs is taken, or None."""
        existing = self._buffers.get(self.mask_key)
        param = self.param
        if existing is not None and (existing.dtype != torch.bool
                                     or existing.shape != param.shape):
            return (f"{self.mask_key!r} ({existing.dtype}, {tuple(existing.shape)}) is not a "
                    f"bool mask of its shape {tuple(param.shape)} (torch.nn.utils.prune?); "
                    f"remove it")
        if existing is None and hasattr(self.module, self.mask_key):
            return f"the attribute {self.mask_key!r} is taken; rename it"
        return None

    def install(self) -> None:
        """Register the mask buffer: kept as it is when a bool mask of the right shape is
        there (masks of an earlier fit), all True otherwise."""
        if self.mask_key not in self._buffers:
            mask = torch.ones_like(self.param, dtype=torch.bool)
            self.module.register_buffer(self.mask_key, mask, persistent=False)

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> Tensor:
        """Install ``mask`` and zero the pruned weights; returns the positions whose
        optimizer state must restart (not kept in both the old and the new mask)."""
        restart = ~(mask & self.mask)
        self.mask.copy_(mask)
        self.param.masked_fill_(~self.mask, 0)
        return restart

    def state_tensors(self, optimizer: Optimizer) -> list[Tensor]:
        """The optimizer's state tensors shaped like the parameter (moments, buffers)."""
        param = self.param
        return [v for v in optimizer.state.get(param, {}).values()
                if isinstance(v, Tensor) and v.shape == param.shape]

    def forward_weight(self) -> Tensor:
        """The tensor the forward pass uses (a parametrization evaluated)."""
        return self.tensor.forward_weight()


def make_permanent(model: nn.Module) -> nn.Module:
    """Remove the mask buffers and swap compressed layers back to ``nn.Linear``
    (:func:`~sparse_training.patcher.densify`), for inference or hand-off (a later fit
    starts from fresh masks). Returns ``model``.

    A mask in force has zero weights at every pruned position (the engine keeps them so);
    its buffer goes, the zeros stay. A mask that is not in force, left by an earlier fit on
    a tensor trained dense since, goes without touching the weights.
    """
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                param = module._parameters.get(name.removesuffix(MASK_SUFFIX))
                if (name.endswith(MASK_SUFFIX) and param is not None and buffer is not None
                        and buffer.dtype == torch.bool and buffer.shape == param.shape):
                    del module._buffers[name]
    densify(model)
    return model
