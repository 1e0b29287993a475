"""What the engine sees of a sparse tensor: the :class:`Slot` protocol, and
:class:`CompressedLayer`, the base of layers that hold their own sparsity.

The engine and the updaters read and write sparse tensors only through slots.
:class:`~sparse_training.engine.slots.MaskedSlot` is the engine's own storage (a dense
parameter and a mask buffer beside it); a compressed layer (block-sparse, 2:4) lives above
the engine, in :mod:`sparse_training.layers`, and hands the engine its slot
(:meth:`CompressedLayer.slot`), so the engine never imports a layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.pieces.patterns import Pattern


class LayerForm(NamedTuple):
    """What a compressed layer's saved mask must be: the layer's pattern (``"block:RxC"``,
    ``"2:4"`` or ``"2:4:2d"``), the mask's shape (the block grid, or the dense weight's for
    2:4) and, for blocks, the exact kept count ``nnz``."""

    pattern: str
    shape: tuple[int, int]
    kept: int | None = None


class Slot(Protocol):
    """One sparse tensor as the engine and the updaters read and write it.

    :class:`~sparse_training.engine.slots.MaskedSlot` (a dense parameter and a mask buffer
    beside it), :class:`~sparse_training.layers.storage.BlockSparseSlot` (a layer's kept
    blocks) and :class:`~sparse_training.layers.storage.SemiStructuredSlot` (a 2:4 layer's
    weight) implement it.

    Attributes:
        name: the qualified name of the trained weight tensor.
        compressed: whether a layer holds the sparsity itself (scheduled updates leave it
            alone; a checkpoint keeps its mask among the compressed layers').
        sharded: whether the mask is this rank's shard of the whole tensor's (FSDP2).
        movable: whether regrowth has anything to swap.
        enforced: whether the optimizer step masks its weight and gradient (the hooks and
            the fused step read :attr:`module`'s buffer ``mask_key``).
        records_gradient: whether :attr:`dense_gradient` is recorded by the slot (a
            compressed layer has no dense gradient): each rank's own, loss-scaled, until
            the engine reduces it (:meth:`SlotSet.reduce_dense_gradients
            <sparse_training.engine.slot_set.SlotSet.reduce_dense_gradients>`).
        numel: entries of the dense weight.
        grid_pattern: the pattern regrowth applies to :meth:`full_mask`.
        input_dim: where the mask stores the input dimension.
        module, mask_key: the module whose buffer ``mask_key`` is the mask (for the
            optimizer hooks of an enforced slot).
    """

    name: str
    compressed: bool
    sharded: bool
    movable: bool
    enforced: bool
    records_gradient: bool
    numel: int
    grid_pattern: Pattern
    input_dim: int
    module: nn.Module
    mask_key: str

    # -- the tensor ---------------------------------------------------------------------------
    @property
    def param(self) -> nn.Parameter:
        """The parameter the optimizer updates."""

    @property
    def dense_shape(self) -> torch.Size:
        """The shape of the dense weight the mask stands for."""

    @property
    def device(self) -> torch.device:
        """Where the parameter lives."""

    def forward_weight(self) -> Tensor:
        """The dense weight the forward pass computes with (zeros where pruned)."""

    @property
    def dense_gradient(self) -> Tensor | None:
        """The gradient at every dense position, pruned ones included, or None."""

    @property
    def gradient_ready(self) -> bool:
        """Whether this step's gradient (and, recorded, dense gradient) exists."""

    # -- the mask -----------------------------------------------------------------------------
    @property
    def mask(self) -> Tensor:
        """The bool mask buffer (this rank's shard when sharded), True where kept."""

    def full_mask(self) -> Tensor:
        """The mask of the whole tensor (gathered when sharded: a collective)."""

    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer] = (),
                 reset_state: bool = True, gradient: Tensor | None = None,
                 carried: Sequence[Tensor] = ()) -> None:
        """Install the whole tensor's ``mask`` and write the weight under it; with
        ``reset_state``, the state of ``optimizers`` restarts (zero) wherever a position is
        not kept in both masks, and a moved block takes its block of ``gradient``;
        ``carried`` tensors (a training score's statistics, dim 0 the local tensor's rows)
        follow the mask as that state does."""

    def sparsity(self, kept: int) -> float:
        """The fraction of the dense weight's entries that are pruned, its mask keeping
        ``kept`` entries (:func:`~sparse_training.engine.slots.whole_counts`)."""

    # -- regrowth ---------------------------------------------------------------------------
    def drop_scores(self, scores: Tensor | None = None) -> Tensor:
        """What drop ranks, shaped like :meth:`full_mask`: the whole weight (drop ranks its
        ``|w|``), or the whole of ``scores``, given shaped like the local tensor the
        optimizer steps on (a training score's ranks), summed over each entry of the mask
        as ``|w|`` is."""

    def grow_scores(self, scores: Tensor) -> Tensor:
        """Dense-shaped ``scores`` as grow ranks them, shaped like :meth:`full_mask`."""

    # -- the optimizer ------------------------------------------------------------------------
    def attach(self, optimizer: Optimizer, dense_state: bool) -> None:
        """``optimizer`` trains this slot from now on (unless the updater keeps
        ``dense_state``, its state is zeroed where pruned)."""

    def detach(self) -> None:
        """No optimizer of the engine trains this slot any more."""


class CompressedLayer(nn.Module):
    """A layer that holds its own sparsity (only the kept weights, or a fixed 2:4 mask).

    Subclasses name the parameter holding their weight (:attr:`trained_weight`) and the
    buffer holding their mask (:attr:`mask_buffer`), hand the engine their :meth:`slot`,
    and turn back into ``nn.Linear`` (:meth:`to_dense`).

    A layer built on the meta device has a mask of no values; ``to_empty()`` gives it
    storage of uninitialized memory, so the layer marks its mask unset (:attr:`mask_unset`)
    until ``reset_parameters``, ``load_state_dict`` or setting a mask writes one, and
    refuses to run until then (:meth:`check_mask_set`).
    """

    trained_weight: str = "weight"
    mask_buffer: str = "mask"
    mask_unset = False  # the mask buffer holds uninitialized memory (to_empty of a meta layer)

    def _apply(self, fn, recurse: bool = True) -> CompressedLayer:
        was_meta = getattr(self, self.mask_buffer).is_meta
        super()._apply(fn, recurse)
        if was_meta and not getattr(self, self.mask_buffer).is_meta:  # to_empty(): no values
            self.mask_unset = True
        return self

    def mask_problem(self) -> str | None:
        """Why the layer's mask holds no values to train with, or None: on the meta device,
        or unset after ``to_empty()``."""
        if getattr(self, self.mask_buffer).is_meta:
            return (f"its {self.mask_buffer} is on the meta device: to_empty() and "
                    f"reset_parameters() (or load_state_dict) first")
        if self.mask_unset:
            return (f"its {self.mask_buffer} is uninitialized memory (built on the meta device, "
                    f"then to_empty()): call reset_parameters() or load_state_dict() first, "
                    f"which set it")
        return None

    def check_mask_set(self) -> None:
        """Raise RuntimeError, naming the layer, while :attr:`mask_unset`."""
        if self.mask_unset:
            raise RuntimeError(f"{type(self).__name__}({self.extra_repr()}): "
                               f"{self.mask_problem()}")

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

    def __prepare_scriptable__(self) -> nn.Module:
        """Refuse ``torch.jit.script`` (which calls this on every submodule) with what works
        instead: its own errors name a line of Python, not the layer.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(f"torch.jit.script cannot compile {type(self).__name__}: its "
                           f"forward is Python that TorchScript does not take (kernel "
                           f"launches, path choices); use torch.compile, or script the dense "
                           f"model (sparse_training.densify(model), or layer.to_dense())")
