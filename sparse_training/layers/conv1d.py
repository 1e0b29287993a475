"""Hugging Face's ``Conv1D`` (GPT-2, GPT, CTRL) trained compressed.

``Conv1D(nf, nx)`` is a Linear whose weight is stored input-first, ``(nx, nf) = (in, out)``,
computing ``y = x W + b``. Its compressed forms are the Linear ones applied to ``W^T``
(:func:`as_linear`), with the state dict, loading and :meth:`to_dense` in ``Conv1D``'s own
layout (:class:`InputFirst`): a checkpoint holds ``weight`` of shape ``(in, out)``, zeros
where pruned, and loads strictly into the plain model; ``densify`` gives ``Conv1D`` back.
The class is recognized by name (the core imports no model library).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.layers.blocks import transfer
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.layers.slim import SlimLinear


def as_linear(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what ``conv`` (a ``Conv1D``) computes: weight ``W^T``
    (a copy), the same bias, device, dtype and ``requires_grad``."""
    weight = conv.weight
    linear = nn.utils.skip_init(nn.Linear, weight.shape[0], weight.shape[1],
                                bias=conv.bias is not None, device=weight.device,
                                dtype=weight.dtype)
    transfer(linear.weight, weight.T, weight.requires_grad, linear.bias, conv.bias)
    return linear


class InputFirst:
    """A compressed Linear layer that saves, loads and densifies as a ``Conv1D``: its
    ``weight`` key holds ``W^T``, shape ``(in, out)``."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if (weight := destination.get(prefix + "weight")) is not None and weight.dim() == 2:
            destination[prefix + "weight"] = weight.T if keep_vars else weight.T.contiguous()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        # load_state_dict hands each module a copy of the mapping: the key is replaced there
        if (weight := state_dict.get(prefix + "weight")) is not None and weight.dim() == 2:
            state_dict[prefix + "weight"] = weight.T
        super()._load_from_state_dict(state_dict, prefix, *args)

    def to_dense(self) -> nn.Module:
        """The ``Conv1D`` computing the same function (zeros where pruned)."""
        from transformers.pytorch_utils import Conv1D  # a Conv1D layer was swapped: installed

        linear = super().to_dense()
        conv = Conv1D(linear.out_features, linear.in_features)
        conv.to(device=linear.weight.device, dtype=linear.weight.dtype)
        transfer(conv.weight, linear.weight.T, linear.weight.requires_grad, conv.bias,
                 linear.bias)
        return conv


class BlockSparseConv1D(InputFirst, BlockSparseLinear):
    """:class:`BlockSparseLinear` of a ``Conv1D`` (module doc)."""


class SemiStructuredConv1D(InputFirst, SemiStructuredLinear):
    """:class:`SemiStructuredLinear` of a ``Conv1D`` (module doc)."""


class SlimConv1D(InputFirst, SlimLinear):
    """:class:`SlimLinear` of a ``Conv1D`` (module doc)."""


INPUT_FIRST: dict[type[nn.Module], type[nn.Module]] = {
    BlockSparseLinear: BlockSparseConv1D, SemiStructuredLinear: SemiStructuredConv1D,
    SlimLinear: SlimConv1D}  # each compressed Linear's Conv1D form
