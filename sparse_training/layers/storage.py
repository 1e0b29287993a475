"""The compressed layers' storage as the engine sees it: their slots
(:class:`~sparse_training.engine.protocol.Slot`).

A compressed layer holds its own sparsity, so the engine never masks it; it reads and
writes the layer through its slot. :class:`BlockSparseSlot` is a block grid whose kept
blocks regrowth moves (their count never changes); :class:`SemiStructuredSlot` is a 2:4
weight with a fixed mask, which the optimizer hooks mask as they mask a masked-dense one
(``enforced``).

The dense gradient RigL grows by does not exist in a compressed layer: while
:attr:`~BlockSparseSlot.recording`, the layer's forward passes its output through
:class:`DenseGradientProbe`, whose backward gives a float32 probe of the dense weight's
shape (one element of storage: stride 0) the gradient ``dY^T X``, summed over
micro-batches by autograd (the update steps only: a dense-sized gradient and one dense
matmul per micro-batch there, nothing at other steps). It
ranks RigL's growth and is the first gradient of every grown block (RigL and SET). Being an
``autograd.Function`` without side effects (no hook), it compiles into the model's graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.engine.protocol import CompressedLayer, LayerForm
from sparse_training.engine.sharding import copy_whole, full, gather_rows, shard_rows
from sparse_training.engine.slots import state_tensors
from sparse_training.kernels.block_sparse import dense_to_values
from sparse_training.layers.blocks import gather_blocks
from sparse_training.pieces.patterns import Pattern, parse_pattern


class DenseGradientProbe(torch.autograd.Function):
    """``out`` (a copy: a view would refuse later in-place ops), whose backward gives
    ``probe`` the dense weight gradient ``dY^T X`` of ``out = layer(x)`` (RigL, Evci et al.
    2020). With a bfloat16 ``dY`` (bf16 autocast) the product runs in bfloat16, as autocast
    computes a masked-dense ``nn.Linear``'s weight gradient; float32 (no TF32 by default)
    would run at a fraction of the tensor cores' bf16 rate. Other dtypes (float16 is
    loss-scaled) run in float32, whose range holds any scaled sum."""

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, probe: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        ctx.probe_dtype = probe.dtype
        return out.clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, Tensor]:
        (x,) = ctx.saved_tensors
        dtype = torch.bfloat16 if grad_out.dtype == torch.bfloat16 else torch.float32
        gradient = (grad_out.reshape(-1, grad_out.shape[-1]).T.to(dtype)
                    @ x.reshape(-1, x.shape[-1]).to(dtype))
        return grad_out, None, gradient.to(ctx.probe_dtype)


def probed(out: Tensor, x: Tensor, probe: Tensor | None) -> Tensor:
    """``out``, through :class:`DenseGradientProbe` where a ``probe`` is set and ``out``
    takes part in a backward (a frozen layer's does not)."""
    if probe is None or not (torch.is_grad_enabled() and out.requires_grad):
        return out
    return DenseGradientProbe.apply(out, x.detach(), probe)


class CompressedSlot:
    """A compressed layer's trained weight, named ``name``.

    Args:
        name: the qualified name of the layer's trained weight tensor.
        layer: the compressed layer.
    """

    compressed = True
    # the mask is replicated on every rank (a sharded block layer's values split along the
    # kept blocks, gathered to move them; the engine refuses 2:4 layers with sharded weights)
    sharded = False
    input_dim = 1
    unit = "entries"  # what one entry of the mask keeps

    def __init__(self, name: str, layer: CompressedLayer) -> None:
        self.name, self.layer = name, layer

    @property
    def module(self) -> nn.Module:
        """The layer, which owns the ``mask_key`` buffer (the optimizer hooks' view)."""
        return self.layer

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.layer, self.layer.trained_weight)

    @property
    def mask(self) -> Tensor:
        raise NotImplementedError

    @property
    def dense_shape(self) -> torch.Size:
        return torch.Size((self.layer.out_features, self.layer.in_features))

    @property
    def device(self) -> torch.device:
        return self.param.device

    def full_mask(self) -> Tensor:
        """The layer's mask (replicated, whether or not a block layer's values are
        sharded; a 2:4 layer with sharded weights is refused)."""
        return self.mask

    @property
    def numel(self) -> int:
        """Entries of the dense weight."""
        return self.layer.out_features * self.layer.in_features

    def sparsity(self, kept: int) -> float:
        """The layer's own count (a block layer's overhanging blocks hold fewer entries)."""
        return self.layer.sparsity

    def held(self) -> Tensor:
        """What each mask entry holds, zero where it holds nothing (see the subclasses)."""
        raise NotImplementedError

    def attach(self, optimizer: Optimizer, dense_state: bool) -> None:
        """Nothing to do: the layer keeps its structure under any optimizer."""

    def detach(self) -> None:
        """Nothing to give back."""

    @torch.no_grad()
    def restore_problem(self, mask: Tensor) -> str | None:
        """Why a checkpoint's ``mask`` cannot be restored into this layer as loaded from the
        same checkpoint, or None: it would drop blocks (entries) holding nonzero weights,
        so the checkpoint's weights and masks disagree."""
        dropped = self.mask & ~mask
        if not dropped.any() or not (self.held()[dropped] != 0).any():
            return None
        return (f"the checkpoint's mask of {self.name!r} drops {int(dropped.sum())} "
                f"{self.unit} that hold nonzero weights in its state_dict: its weights and "
                f"masks disagree (corrupted)")


class BlockSparseSlot(CompressedSlot):
    """A :class:`~sparse_training.layers.block_sparse.BlockSparseLinear`: its mask is the
    block grid; drop and grow rank blocks by the sums of ``|w|`` and of ``|score|`` over
    each block's entries, as a masked block pattern does
    (:func:`~sparse_training.pieces.regrowth.drop_and_grow` on the block grid)."""

    movable = True  # regrowth moves its kept blocks
    enforced = False  # only the kept blocks exist: nothing to mask
    records_gradient = True  # RigL's dense gradient, recorded while due (module docstring)
    grid_pattern = parse_pattern("unstructured")  # one block is one entry of the grid
    mask_key = "block_mask"
    unit = "blocks"

    def __init__(self, name: str, layer: CompressedLayer) -> None:
        super().__init__(name, layer)
        self._gradient: Tensor | None = None
        self._probe: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        """The bool ``(block_rows, block_cols)`` grid, True where a block is kept."""
        return self.layer.block_mask

    @property
    def form(self) -> LayerForm:
        r, c = self.layer.block
        return LayerForm(f"block:{r}x{c}", tuple(self.mask.shape), self.layer.nnz)

    @property
    def recording(self) -> bool:
        return self.layer.dense_gradient_probe is not None

    @recording.setter
    def recording(self, on: bool) -> None:
        if on and not self.recording:
            if self._probe is None or self._probe.device != self.device:
                # a dense-shaped leaf on one element (stride 0): only its gradient is dense;
                # kept, so that a compiled graph (a CUDA graph) finds it at one address
                self._probe = torch.empty_strided(self.dense_shape, (0, 0),
                                                  device=self.device, requires_grad=True)
            self.layer.dense_gradient_probe = self._probe
        elif not on and self.recording:
            self._collect()
            self.layer.dense_gradient_probe = None

    def _collect(self) -> Tensor | None:
        """The gradient recorded so far: the probe's gradient moved into the slot's sum."""
        probe = self.layer.dense_gradient_probe
        if probe is not None and probe.grad is not None:
            self._gradient = (probe.grad if self._gradient is None
                              else self._gradient.add_(probe.grad))
            probe.grad = None
        return self._gradient

    @property
    def dense_gradient(self) -> Tensor | None:
        """``sum over micro-batches of dY^T X`` since :meth:`clear_gradient`, float32, or
        None if nothing was recorded (loss-scaled under AMP: a constant factor, which no
        ranking sees)."""
        return self._collect()

    @property
    def gradient_ready(self) -> bool:
        return self.param.grad is not None and self._collect() is not None

    def clear_gradient(self) -> None:
        self._gradient = None
        if self.layer.dense_gradient_probe is not None:
            self.layer.dense_gradient_probe.grad = None

    def grow_scores(self, scores: Tensor) -> Tensor:
        """Float32 ``(block_rows, block_cols)`` sums of ``|scores|`` (dense-shaped) over each
        block's entries inside the weight."""
        (r, c), (rows, cols) = self.layer.block, self.mask.shape
        out, inp = self.dense_shape
        padded = F.pad(scores.detach().abs().float(), (0, cols * c - inp, 0, rows * r - out))
        return padded.view(rows, r, cols, c).sum((1, 3))

    def magnitudes(self) -> Tensor:
        """Float32 ``(block_rows, block_cols)`` sums of ``|w|`` per block, zero where none."""
        return self._grid(full(self.param).detach().abs().float())

    held = magnitudes

    def drop_scores(self, scores: Tensor | None = None) -> Tensor:
        """The grid of ``|w|`` sums per block, or of the sums of ``scores`` (shaped like the
        local values: a training score's ranks; zero where no block is kept)."""
        if scores is None:
            return self.magnitudes()
        return self._grid(gather_rows(scores, self.param))

    def _grid(self, per_value: Tensor) -> Tensor:
        """The ``(block_rows, block_cols)`` grid of the sums of ``per_value`` (shaped like
        the whole values) over each kept block, zero where none."""
        topology = self.layer.topology
        grid = torch.zeros(self.mask.shape, dtype=per_value.dtype, device=self.mask.device)
        grid[topology.row_indices.long(), topology.col_indices.long()] = per_value.sum((1, 2))
        return grid

    def forward_weight(self) -> Tensor:
        """The dense weight, zeros at dropped blocks (differentiable in ``values``)."""
        return self.layer.weight

    def detach(self) -> None:
        """Stop recording; drop what was recorded."""
        self.recording = False
        self.clear_gradient()

    @torch.no_grad()
    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer] = (),
                 reset_state: bool = True, gradient: Tensor | None = None,
                 carried: Sequence[Tensor] = ()) -> None:
        """Keep the blocks of the grid ``mask`` (same count) where it differs from the
        layer's, between backward and the optimizer step: a block kept before keeps its
        values, gradient, optimizer state and ``carried`` tensors (shaped like the local
        values); a newly kept block starts with zero values, state and carried tensors and
        takes its block of the dense ``gradient`` (zero without one), as a grown
        masked-dense weight does."""
        if torch.equal(mask.to(self.mask.device), self.mask):
            return
        sources = self.layer.block_sources(mask)
        # sharded values (FSDP2): the whole of each tensor gathered, moved alike on every
        # rank, and each rank keeps its slice
        self.layer.set_block_mask(mask, gather_blocks(full(self.param), sources))
        grad = self.param.grad
        if grad is not None:
            moved = gather_blocks(full(grad), sources)
            if gradient is not None:
                grown = dense_to_values(gradient.to(grad.dtype), self.layer.topology)
                moved += torch.where((sources < 0)[:, None, None], grown, 0)
            copy_whole(grad, moved)
        for optimizer in optimizers:
            for state in state_tensors(optimizer, self.param):
                copy_whole(state, gather_blocks(full(state), sources))
        for value in carried:
            value.copy_(shard_rows(gather_blocks(gather_rows(value, self.param), sources),
                                   self.param))


class SemiStructuredSlot(CompressedSlot):
    """A 2:4 :class:`~sparse_training.layers.semi_structured.SemiStructuredLinear`: a dense
    weight under a fixed mask, never moved."""

    movable = False  # a fixed mask
    enforced = True  # a dense weight with zeros: the hooks mask it as a MaskedSlot
    records_gradient = False
    mask_key = "mask"  # the layer's dense mask buffer, which the optimizer hooks read

    @property
    def mask(self) -> Tensor:
        """The bool mask of the weight's shape."""
        return self.layer.mask

    @property
    def form(self) -> LayerForm:
        return LayerForm(self.layer.pattern, tuple(self.dense_shape))

    @property
    def grid_pattern(self) -> Pattern:
        return parse_pattern(self.layer.pattern)

    @property
    def dense_gradient(self) -> Tensor | None:
        """The weight's gradient: the weight is dense."""
        return self.param.grad

    @property
    def gradient_ready(self) -> bool:
        return self.param.grad is not None

    def forward_weight(self) -> Tensor:
        """The weight under its mask."""
        return self.layer.weight * self.mask

    def drop_scores(self, scores: Tensor | None = None) -> Tensor:
        return self.param.detach() if scores is None else scores

    def grow_scores(self, scores: Tensor) -> Tensor:
        return scores

    def held(self) -> Tensor:
        """The weight itself."""
        return self.param.detach()

    @torch.no_grad()
    def set_mask(self, mask: Tensor, optimizers: Iterable[Optimizer] = (),
                 reset_state: bool = True, gradient: Tensor | None = None,
                 carried: Sequence[Tensor] = ()) -> None:
        """Keep the 2:4 ``mask``: the layer zeroes its pruned weights
        (``SemiStructuredLinear.set_mask``), and, with ``reset_state``, their optimizer
        state and the ``carried`` tensors restart wherever a position is not kept in both
        masks."""
        if torch.equal(mask, self.mask):
            return
        restart = ~(mask & self.mask)
        self.layer.set_mask(mask)
        if reset_state:
            states = [s for o in optimizers for s in state_tensors(o, self.param)]
            for state in [*states, *carried]:
                state.masked_fill_(restart, 0)

    @torch.no_grad()
    def attach(self, optimizer: Optimizer, dense_state: bool) -> None:
        """The optimizer step masks the gradient from now on: the layer need not; unless
        the updater keeps ``dense_state``, the state is zeroed where pruned (Adagrad's
        starts at ``initial_accumulator_value``)."""
        self.layer.masks_gradient = False
        if not dense_state:
            for state in state_tensors(optimizer, self.param):
                state.masked_fill_(~self.mask, 0)

    def detach(self) -> None:
        """The layer masks its own gradient again."""
        self.layer.masks_gradient = True
