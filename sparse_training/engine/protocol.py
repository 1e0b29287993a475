"""What the engine sees of a sparse tensor: the :class:`Slot` protocol, and
:class:`CompressedLayer`, the base of layers that hold their own sparsity.

The engine and the updaters read and write sparse tensors only through slots.
:class:`~sparse_training.engine.slots.MaskedSlot` is the engine's own storage (a dense
parameter and a mask buffer beside it); a compressed layer (block-sparse, 2:4) lives above
the engine, in :mod:`sparse_training.layers`, and hands the engine its slot
(:meth:`CompressedLayer.slot`), so the engine never imports a layer.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn


class LayerForm(NamedTuple):
    """What a compressed layer's saved mask must be: the layer's pattern (``"block:RxC"``,
    ``"2:4"`` or ``"2:4:2d"``), the mask's shape (the block grid, or the dense weight's for
    2:4) and, for blocks, the exact kept count ``nnz``."""

    pattern: str
    shape: tuple[int, int]
    kept: int | None = None


class Slot(Protocol):
    """One sparse tensor as the engine reads and writes it.

    Attributes:
        name: the qualified name of the trained weight tensor.
        compressed: whether a layer holds the sparsity itself (its slot moves blocks).
        sharded: whether the parameter is a DTensor (FSDP2) whose mask is sharded alike.
        movable: whether regrowth has anything to swap.
    """

    name: str
    compressed: bool
    sharded: bool
    movable: bool

    @property
    def param(self) -> nn.Parameter:
        """The parameter the optimizer updates."""

    @property
    def mask(self) -> Tensor:
        """The bool mask buffer (this rank's shard when sharded), True where kept."""

    @property
    def dense_shape(self) -> torch.Size:
        """The shape of the dense weight the mask stands for."""

    @property
    def dense_gradient(self) -> Tensor | None:
        """The gradient at every dense position, pruned ones included, or None."""

    def full_mask(self) -> Tensor:
        """The mask of the whole tensor (gathered when sharded)."""

    def set_mask(self, mask: Tensor, *args: object) -> object:
        """Install the whole tensor's ``mask``."""


class CompressedLayer(nn.Module):
    """A layer that holds its own sparsity (only the kept weights, or a fixed 2:4 mask).

    Subclasses name the parameter holding their weight (:attr:`trained_weight`), hand the
    engine their :meth:`slot`, and turn back into ``nn.Linear`` (:meth:`to_dense`).
    """

    trained_weight: str = "weight"

    def slot(self, name: str) -> Slot:
        """The engine's view of this layer's weight, named ``name``."""
        raise NotImplementedError

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` computing the same function."""
        raise NotImplementedError

    @property
    def sparsity(self) -> float:
        """Fraction of the dense weight's entries that are zero by structure."""
        raise NotImplementedError
