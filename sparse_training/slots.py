"""Sparse-tensor slots: how the engine reads and writes one selected tensor.

A slot owns the sparse form of one weight tensor and is the only code that knows it.
:class:`MaskedSlot` is the masked-dense form: the parameter keeps its full shape and a
bool buffer ``<attribute>_mask`` beside it (on the module that stores the parameter; for
a parametrized weight, its ``ParametrizationList``) marks the kept entries. The buffer is
not persistent: the model's ``state_dict`` stays plain (weights with zeros at pruned
positions), so a sparse checkpoint loads into the plain model with a strict load; the
masks travel in the engine's own state (:mod:`sparse_training.state`).

Every slot answers the same questions: its parameter (what the optimizer updates), its
mask, the dense gradient regrowth ranks, and the optimizer-state tensors shaped like its
parameter.

:class:`CompressedSlot` is a layer that holds its own sparsity: a
:class:`~sparse_training.block_sparse.BlockSparseLinear` (only the kept blocks exist, their
count is fixed, its mask is the block grid's; regrowth moves its blocks,
:meth:`CompressedSlot.move`) or a :class:`~sparse_training.semi_structured.SemiStructuredLinear`
(a fixed 2:4 mask, never moved). The engine never masks either.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from sparse_training.block_sparse import BlockSparseLinear, gather_blocks
from sparse_training.kernels.block_sparse import dense_to_values
from sparse_training.patcher import check_not_in_training, densify
from sparse_training.selection import TensorPlan
from sparse_training.semi_structured import SemiStructuredLinear
from sparse_training.sharding import full, gather_like, is_sharded, local, shard_like, totals_like
from sparse_training.tensors import WeightTensor

MASK_SUFFIX = "_mask"


class MaskedSlot:
    """A selected tensor in masked-dense form.

    Args:
        plan: the tensor's row of the setup table.
        tensor: where the tensor lives (names, owners, stored parameter).
    """

    compressed = False

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
    def sharded(self) -> bool:
        """Whether the parameter is a DTensor (FSDP2): the mask buffer then holds the local
        shard of the full tensor's mask (:mod:`sparse_training.sharding`)."""
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
    def set_mask(self, mask: Tensor) -> Tensor:
        """Install ``mask``, the whole tensor's (this rank keeps its shard of it), and zero
        the pruned weights; returns the local positions whose optimizer state must restart
        (not kept in both the old and the new mask)."""
        if self.sharded:
            mask = shard_like(mask, self.param)
        restart = ~(mask & self.mask)
        self.mask.copy_(mask)
        self.local_param.masked_fill_(~self.mask, 0)
        return restart

    @property
    def movable(self) -> bool:
        """Whether regrowth has anything to swap (not a tensor kept dense)."""
        return self.plan.sparsity != 0.0

    @property
    def dense_shape(self) -> torch.Size:
        return self.param.shape

    @property
    def dense_gradient(self) -> Tensor | None:
        """The gradient at every position, pruned ones included (before masking), of the
        whole tensor (gathered from every rank when sharded)."""
        grad = self.param.grad
        return None if grad is None else full(grad)

    @property
    def local_grad(self) -> Tensor | None:
        """The gradient's local shard (the gradient itself when not sharded)."""
        grad = self.param.grad
        return None if grad is None else local(grad)

    def state_tensors(self, optimizer: Optimizer) -> list[Tensor]:
        """The optimizer's state tensors shaped like the parameter (moments, buffers), their
        local shards when sharded."""
        return [local(v) for v in _state_tensors(optimizer, self.param)]

    def forward_weight(self) -> Tensor:
        """The tensor the forward pass uses (a parametrization evaluated)."""
        return self.tensor.forward_weight()


class CompressedSlot:
    """A compressed layer: a :class:`~sparse_training.block_sparse.BlockSparseLinear`, whose
    kept blocks move and whose count never changes, or a 2:4
    :class:`~sparse_training.semi_structured.SemiStructuredLinear` (fixed mask;
    :attr:`masked_dense`).

    Drop and grow rank blocks by the sums of ``|w|`` and of ``|score|`` over each block's
    entries, as a masked block pattern does (:func:`~sparse_training.regrowth.drop_and_grow`
    on the block grid). The dense gradient RigL grows by does not exist in a compressed
    layer: while :attr:`recording`, a forward hook adds ``dY^T X`` of each micro-batch to a
    float32 buffer of the dense weight's shape (the update steps only: a dense-sized
    buffer and one dense matmul per micro-batch there, nothing at other steps). It ranks
    RigL's growth and is the first gradient of every grown block (RigL and SET).

    Args:
        name: the qualified name of the layer's trained weight tensor.
        layer: the compressed layer (the block methods need a ``BlockSparseLinear``).
    """

    compressed = True
    # the block grid is replicated on every rank (a sharded layer's values split along the
    # kept blocks; the engine refuses moving them, and 2:4 layers with sharded weights)
    sharded = False
    mask_key = "mask"  # a 2:4 layer's dense mask buffer, which the optimizer hooks read

    def __init__(self, name: str, layer: BlockSparseLinear | SemiStructuredLinear) -> None:
        self.name, self.layer = name, layer
        self.movable = isinstance(layer, BlockSparseLinear)  # regrowth moves its blocks
        self._gradient: Tensor | None = None
        self._hook: RemovableHandle | None = None

    @property
    def masked_dense(self) -> bool:
        """A 2:4 layer: a dense weight with zeros, which the optimizer hooks mask as they mask
        MaskedSlots (its gradient too, so the layer need not)."""
        return not self.movable

    @property
    def module(self) -> nn.Module:
        """The layer, which owns the ``mask_key`` buffer (the optimizer hooks' view)."""
        return self.layer

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.layer, self.layer.trained_weight)

    @property
    def mask(self) -> Tensor:
        """The layer's mask buffer: the bool ``(block_rows, block_cols)`` grid, True where a
        block is kept, or a 2:4 layer's bool mask of the weight's shape."""
        return self.layer.block_mask if self.movable else self.layer.mask

    @property
    def dense_shape(self) -> torch.Size:
        return torch.Size((self.layer.out_features, self.layer.in_features))

    def full_mask(self) -> Tensor:
        """The layer's mask (replicated, whether or not a block layer's values are
        sharded; a 2:4 layer with sharded weights is refused)."""
        return self.mask

    @property
    def numel(self) -> int:
        """Entries of the dense weight."""
        return self.layer.out_features * self.layer.in_features

    @property
    def recording(self) -> bool:
        return self._hook is not None

    @recording.setter
    def recording(self, on: bool) -> None:
        if on and self._hook is None:
            self._hook = self.layer.register_forward_hook(self._record)
        elif not on and self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def dense_gradient(self) -> Tensor | None:
        """``sum over micro-batches of dY^T X`` since :meth:`clear_gradient`, float32, or
        None if nothing was recorded (loss-scaled under AMP: a constant factor, which no
        ranking sees)."""
        return self._gradient

    def clear_gradient(self) -> None:
        self._gradient = None

    def _record(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if output.requires_grad:
            output.register_hook(functools.partial(self._accumulate, inputs[0].detach()))

    def _accumulate(self, x: Tensor, grad_out: Tensor) -> None:
        gradient = grad_out.reshape(-1, grad_out.shape[-1]).T.float() @ x.reshape(
            -1, x.shape[-1]).float()
        self._gradient = gradient if self._gradient is None else self._gradient.add_(gradient)

    def block_scores(self, scores: Tensor) -> Tensor:
        """Float32 ``(block_rows, block_cols)`` sums of ``|scores|`` (dense-shaped) over each
        block's entries inside the weight."""
        (r, c), (rows, cols) = self.layer.block, self.mask.shape
        out, inp = self.dense_shape
        padded = F.pad(scores.detach().abs().float(), (0, cols * c - inp, 0, rows * r - out))
        return padded.view(rows, r, cols, c).sum((1, 3))

    def magnitudes(self) -> Tensor:
        """Float32 ``(block_rows, block_cols)`` sums of ``|w|`` per block, zero where none."""
        topology = self.layer.topology
        grid = torch.zeros(self.mask.shape, device=self.mask.device)
        grid[topology.row_indices.long(), topology.col_indices.long()] = (
            self.param.detach().abs().float().sum((1, 2)))
        return grid

    @torch.no_grad()
    def restore_problem(self, mask: Tensor) -> str | None:
        """Why a checkpoint's ``mask`` cannot be restored into this layer as loaded from the
        same checkpoint, or None: it would drop blocks (entries) holding nonzero weights,
        so the checkpoint's weights and masks disagree."""
        dropped = self.mask & ~mask
        if not dropped.any():
            return None
        held = self.magnitudes() if self.movable else self.param.detach()
        if not (held[dropped] != 0).any():
            return None
        what = "blocks" if self.movable else "entries"
        return (f"the checkpoint's mask of {self.name!r} drops {int(dropped.sum())} {what} "
                f"that hold nonzero weights in its state_dict: its weights and masks "
                f"disagree (corrupted)")

    @torch.no_grad()
    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer]) -> None:
        """Keep ``mask`` (a block grid of the same count, or a 2:4 mask) where it differs
        from the layer's: blocks move (:meth:`move`: values and optimizer state follow,
        new blocks start at zero); a 2:4 layer zeroes its pruned weights and their
        optimizer state (``SemiStructuredLinear.set_mask``)."""
        if torch.equal(mask, self.mask):
            return
        if self.movable:
            self.move(mask, optimizers)
            return
        restart = ~(mask & self.mask)
        self.layer.set_mask(mask)
        for optimizer in optimizers:
            for state in _state_tensors(optimizer, self.param):
                state.masked_fill_(restart, 0)

    @torch.no_grad()
    def move(self, mask: Tensor, optimizers: Iterable[Optimizer],
             gradient: Tensor | None = None) -> None:
        """Keep the blocks of ``mask`` (same count) between backward and the optimizer
        step: a block kept before keeps its values, gradient and optimizer state; a newly
        kept block starts with zero values and state and takes its block of the dense
        ``gradient`` (zero without one), as a grown masked-dense weight does."""
        sources = self.layer.block_sources(mask)
        self.layer.set_block_mask(mask, gather_blocks(self.param, sources))
        grad = self.param.grad
        if grad is not None:
            moved = gather_blocks(grad, sources)
            if gradient is not None:
                grown = dense_to_values(gradient.to(grad.dtype), self.layer.topology)
                moved += torch.where((sources < 0)[:, None, None], grown, 0)
            grad.copy_(moved)
        for optimizer in optimizers:
            for state in _state_tensors(optimizer, self.param):
                state.copy_(gather_blocks(state, sources))


def _state_tensors(optimizer: Optimizer, param: Tensor) -> list[Tensor]:
    return [v for v in optimizer.state.get(param, {}).values()
            if isinstance(v, Tensor) and v.shape == param.shape]


def make_permanent(model: nn.Module) -> nn.Module:
    """Remove the mask buffers and swap compressed layers back to ``nn.Linear``
    (:func:`~sparse_training.patcher.densify`), for inference or hand-off (a later fit
    starts from fresh masks). Returns ``model``.

    A mask in force has zero weights at every pruned position (the engine keeps them so);
    its buffer goes, the zeros stay. A mask that is not in force, left by an earlier fit on
    a tensor trained dense since, goes without touching the weights.

    Raises:
        RuntimeError: an engine attached to an optimizer trains ``model`` (mid-fit): call
            it after the fit (the callback detaches then) or after ``engine.detach()``.
    """
    check_not_in_training(model, "make_permanent")
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                param = module._parameters.get(name.removesuffix(MASK_SUFFIX))
                if (name.endswith(MASK_SUFFIX) and param is not None and buffer is not None
                        and buffer.dtype == torch.bool and buffer.shape == local(param).shape):
                    del module._buffers[name]
    densify(model)
    return model


def whole_counts(slots: Sequence[MaskedSlot | CompressedSlot], gradients: bool = False
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
