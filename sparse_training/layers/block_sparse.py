"""A Linear layer that stores and trains only its kept weight blocks: :class:`BlockSparseLinear`.

The weight ``W`` of shape ``(out_features, in_features)`` is cut into ``R x C`` blocks (the
last block row and column may hang over the edge). Only the kept blocks exist, as the
parameter ``values[nnz, R, C]`` in row-major block order, so gradients and optimizer state
are compressed too. The persistent bool buffer ``block_mask[block_rows, block_cols]`` says
which blocks are kept. Entries of ``values`` that hang over the weight's edge are zeros, and
stay zeros: the forward never reads them and their gradient is zero.

The state_dict is ``nn.Linear``'s: the dense ``weight`` (zeros at dropped blocks) and
``bias``, so a checkpoint loads strictly into the model with plain Linear layers. Loading
takes that dense form or the compact one (``values``, ``block_mask``, ``bias``), which
layers whose ``values`` are sharded (FSDP2 DTensors) save.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.sharding import copy_whole, full
from sparse_training.kernels._shards import is_sharded
from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_grid,
    block_norms,
    block_sparse_linear,
    dense_to_values,
    top_blocks,
    values_to_dense,
)
from sparse_training.kernels.block_sparse.topology import kept_positions
from sparse_training.layers.blocks import (
    block_extents,
    blocks_kept,
    blocks_of_mask,
    check_block,
    check_block_mask,
    check_density,
    check_features,
    compact_from,
    gather_blocks,
    inside,
    transfer,
)
from sparse_training.layers.storage import BlockSparseSlot, probed


class BlockSparseLinear(CompressedLayer):
    """``y = x W^T + b`` with ``W`` stored as its kept ``R x C`` blocks (module docstring).

    Args:
        block: ``(R, C)``, each one of 16, 32, 64, 128.
        density: fraction of blocks kept, in (0, 1]: ``nnz = max(1, kept_count(n_blocks,
            1 - density))`` blocks chosen at random. Ignored when ``block_mask`` is given.
        block_mask: bool ``(block_rows, block_cols)`` mask of the kept blocks (at least one).

    ``values`` and ``bias`` are initialized like :class:`torch.nn.Linear`'s, uniform in
    ``±1/sqrt(in_features)``.
    """

    trained_weight = "values"  # the parameter holding the weight
    mask_buffer = "block_mask"

    def __init__(self, in_features: int, out_features: int,
                 block: tuple[int, int] = (64, 64), density: float = 0.1, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 *, block_mask: Tensor | None = None) -> None:
        check_features(in_features=in_features, out_features=out_features)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype (the layer trains its "
                             f"values), got {dtype!r}")
        block = check_block(block)
        grid = block_grid(out_features, in_features, block)
        if block_mask is None:
            nnz = blocks_kept(grid, check_density(density), (out_features, in_features), block)
            block_mask = top_blocks(torch.rand(grid, device=device), nnz)
        else:
            check_block_mask(block_mask, grid)
            nnz = int(block_mask.sum())
            if nnz == 0:
                raise ValueError(f"block_mask {tuple(block_mask.shape)} keeps no block; "
                                 f"keep at least one")
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.values = nn.Parameter(torch.empty(nnz, *block, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        self.register_buffer("block_mask", block_mask.to(device=self.values.device,
                                                          copy=True))
        self._topology: BlockTopology | None = None
        # RigL's dense gradient is recorded into it while set (BlockSparseSlot.recording)
        self.dense_gradient_probe: Tensor | None = None
        self.register_load_state_dict_post_hook(_after_load)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(in_features)`` like ``nn.Linear``; padded tails zero. A
        layer whose block mask is unset (built on the meta device, then ``to_empty()``)
        first draws its ``nnz`` kept blocks at random, as the constructor does."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            if self.mask_unset:
                self.block_mask.copy_(top_blocks(torch.rand(self.block_mask.shape,
                                                            device=self.block_mask.device),
                                                 self.nnz))
                self.mask_unset = False
                _rebuild_topology(self)
            self.values.uniform_(-bound, bound).mul_(inside(self.topology))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @property
    def topology(self) -> BlockTopology:
        """The kept blocks' index tensors, built from ``block_mask`` (with ``nnz`` from
        ``values``, so no host synchronization) and cached until the mask changes through
        :meth:`set_block_mask`, ``load_state_dict`` or a device move."""
        if self._topology is None:
            self._topology = self._build_topology()
        return self._topology

    @torch.compiler.disable
    def _build_topology(self) -> BlockTopology:
        """Built eagerly, also when the first call is traced by ``torch.compile``: index
        tensors a compiled graph made and the layer kept would live in the CUDA-graph
        memory pool (``mode="reduce-overhead"``) and be overwritten by the next replay.

        Raises:
            RuntimeError: the block mask is unset (:meth:`CompressedLayer.check_mask_set`).
        """
        self.check_mask_set()
        return BlockTopology.from_block_mask(self.block_mask, self.out_features,
                                             self.in_features, self.block,
                                             nnz=self.values.shape[0])

    @property
    def nnz(self) -> int:
        """Number of kept blocks."""
        return self.values.shape[0]

    @property
    def density(self) -> float:
        """Kept blocks / all blocks, ``nnz / (block_rows * block_cols)``."""
        rows, cols = self.block_mask.shape
        return self.nnz / (rows * cols)

    @property
    def sparsity(self) -> float:
        """Fraction of the dense weight's ``out_features * in_features`` entries that are
        zero by structure (tails excluded; reads the mask once from the device)::

            sparsity = 1 - sum over kept blocks (i, j) of h_i * w_j / (out * in)

        with ``h_i = min(R, out - i R)`` and ``w_j = min(C, in - j C)`` the block's rows and
        columns inside the weight."""
        h, w = block_extents(self.out_features, self.in_features, self.block,
                              self.block_mask.device)
        covered = int((h[:, None] * w[None, :])[self.block_mask].sum())
        return 1.0 - covered / (self.out_features * self.in_features)

    @property
    def weight(self) -> Tensor:
        """The dense ``(out_features, in_features)`` weight, differentiable in ``values``.

        For code that reads ``.weight`` itself, such as ``nn.TransformerEncoderLayer``'s
        inference fast path; it materializes the dense matrix at every access.
        """
        return values_to_dense(self.values, self.topology)

    def slot(self, name: str) -> BlockSparseSlot:
        """The engine's view of ``values``: a block grid whose kept blocks regrowth moves."""
        return BlockSparseSlot(name, self)

    def forward(self, x: Tensor) -> Tensor:
        out = block_sparse_linear(x, self.values, self.topology, self.bias)
        return probed(out, x, self.dense_gradient_probe)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> BlockSparseLinear:
        super()._apply(fn, recurse)
        _rebuild_topology(self)  # a device move replaces block_mask
        return self

    def block_sources(self, mask: Tensor) -> Tensor:
        """For each block ``mask`` keeps (row-major order), its position in ``values`` now,
        or -1 where it is not kept now (every block, while the mask is unset): int64
        ``[nnz]``, what :func:`gather_blocks` takes.

        Raises:
            ValueError: a mask of another shape or dtype.
        """
        check_block_mask(mask, tuple(self.block_mask.shape))
        rows, cols = mask.to(self.block_mask.device).nonzero(as_tuple=True)
        if self.mask_unset:
            return torch.full_like(rows, -1)
        return torch.where(self.block_mask[rows, cols],
                           kept_positions(self.block_mask)[rows, cols], -1)

    @torch.no_grad()
    def set_block_mask(self, mask: Tensor, values: Tensor | None = None) -> None:
        """Keep the blocks of ``mask`` from now on (same count: ``values`` keeps its shape).

        With ``values`` None, a block kept in both the old and the new mask keeps its
        values and a newly kept block starts at zeros; otherwise ``values[nnz, R, C]`` (in
        row-major block order of ``mask``) are copied in. Padded tails are zeroed either
        way. The ``values`` parameter is updated in place, so an optimizer keeps it; its
        state is not touched (move it with :meth:`block_sources` and :func:`gather_blocks`,
        as :class:`~sparse_training.layers.storage.BlockSparseSlot` does). The topology's
        index tensors are rewritten in place (a compiled graph keeps reading them). Reads
        the mask's count from the device once.

        Raises:
            ValueError: a mask of another shape, dtype or kept count, or values of another
                shape.
        """
        check_block_mask(mask, tuple(self.block_mask.shape))
        mask = mask.to(self.block_mask.device)
        kept = int(mask.sum())
        if kept != self.nnz:
            raise ValueError(f"mask keeps {kept} blocks, the layer has nnz = {self.nnz}; "
                             f"set_block_mask keeps the count (build a new layer to change it)")
        if values is None:
            values = gather_blocks(full(self.values), self.block_sources(mask))
        elif not isinstance(values, Tensor):
            raise ValueError(f"values must be a tensor [nnz, R, C] = "
                             f"{tuple(self.values.shape)}, got {type(values).__name__}")
        elif tuple(values.shape) != tuple(self.values.shape):
            raise ValueError(f"values shape {tuple(values.shape)} != (nnz, R, C) = "
                             f"{tuple(self.values.shape)}")
        topology = BlockTopology.from_block_mask(mask, self.out_features, self.in_features,
                                                 self.block, nnz=self.nnz)
        copy_whole(self.values, values.to(dtype=self.values.dtype, device=mask.device)
                   * inside(topology))
        self.block_mask.copy_(mask)
        self.mask_unset = False
        packed = None if self._topology is None else self._topology.packed
        if (packed is not None and packed.device == mask.device
                and packed.shape == topology.packed.shape):
            # the index tensors keep their addresses, which a CUDA graph captured under
            # torch.compile(mode="reduce-overhead") reads (an autograd graph that saved them
            # and runs its backward after this raises autograd's in-place error)
            packed.copy_(topology.packed)
        else:
            self._topology = topology

    @classmethod
    def from_dense(cls, linear: nn.Linear, block: tuple[int, int] = (64, 64),
                   density: float | None = None, mask: Tensor | None = None,
                   ) -> BlockSparseLinear:
        """The blocks of ``linear``'s weight that ``density`` or ``mask`` keeps (exactly one).

        Args:
            density: keep ``max(1, kept_count(n_blocks, 1 - density))`` blocks of largest
                L2 norm (:func:`block_norms`; ties by ``topk``).
            mask: bool, either of the weight's shape (constant on every block) or of the
                block grid's shape.

        Kept blocks and the bias are copied; device, dtype and ``requires_grad`` follow
        ``linear``'s. A ``linear`` on the meta device (no values to rank) gives a meta layer
        of the ``nnz`` that ``density`` keeps; ``to_empty()`` and ``reset_parameters()`` then
        draw its blocks at random and initialize them.

        Raises:
            ValueError: both or neither of ``density`` and ``mask``, an invalid block or
                density, a mask of another shape, not constant on a block, or keeping none;
                a ``mask`` for a meta ``linear`` (its values would not survive
                ``to_empty()``).
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_dense takes an nn.Linear, got {type(linear).__name__}")
        if (density is None) == (mask is None):
            raise ValueError(f"give exactly one of density and mask, got density={density!r} "
                             f"and mask={'None' if mask is None else 'a tensor'}")
        block = check_block(block)
        weight = linear.weight.detach()
        grid = block_grid(*weight.shape, block)
        if weight.is_meta:  # no values to rank: reset_parameters after to_empty draws them
            if mask is not None:
                raise ValueError("from_dense of an nn.Linear on the meta device takes density, "
                                 "not mask: to_empty() would leave none of it; give density, "
                                 "or build the Linear's weights first")
            block_mask = None
        elif density is not None:
            nnz = blocks_kept(grid, check_density(density), tuple(weight.shape), block)
            block_mask = top_blocks(block_norms(weight, block), nnz)
        elif isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == weight.shape:
            block_mask = blocks_of_mask(mask.to(weight.device), block)
        elif isinstance(mask, Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == grid:
            block_mask = mask
        else:
            what = (f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor)
                    else type(mask).__name__)
            raise ValueError(f"mask must be a bool tensor of the weight's shape "
                             f"{tuple(weight.shape)} or of the block grid's shape {grid}, "
                             f"got {what}")
        layer = cls(linear.in_features, linear.out_features, block,
                    1.0 if density is None else density, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, block_mask=block_mask)
        transfer(layer.values, dense_to_values(weight, layer.topology),
                  linear.weight.requires_grad, layer.bias, linear.bias)
        return layer

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` with the dense weight (zeros at dropped blocks) and the bias, on
        the same device and dtype, ``requires_grad`` preserved."""
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features,
                                    bias=self.bias is not None, device=self.values.device,
                                    dtype=self.values.dtype)
        transfer(linear.weight, values_to_dense(self.values, self.topology),
                  self.values.requires_grad, linear.bias, self.bias)
        return linear

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The dense form ``weight`` (zeros at dropped blocks, no padded tails) and ``bias``,
        as ``nn.Linear`` saves them; sharded ``values`` (FSDP2) save the compact form."""
        if is_sharded(self.values):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        weight = values_to_dense(self.values if keep_vars else self.values.detach(),
                                 self.topology)
        if weight.untyped_storage().nbytes() > weight.numel() * weight.element_size():
            weight = weight.clone()  # a view of the padded grid: save only the weight
        destination[prefix + "weight"] = weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], *args: Any) -> None:
        """Load the dense form or the compact one, each checked in full before anything is
        copied (:func:`~sparse_training.layers.blocks.compact_from`)."""
        given = any(prefix + k in state_dict for k in ("weight", "values", "block_mask"))
        compact_from(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, *args)
        if prefix + "block_mask" in state_dict:  # (a dense weight was made compact above)
            self.mask_unset = False
        if not given and not is_sharded(self.values):  # the key this layer saves
            missing_keys[:] = [k for k in missing_keys
                               if k not in (prefix + "values", prefix + "block_mask")]
            missing_keys.append(prefix + "weight")

    def extra_repr(self) -> str:
        r, c = self.block
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={r}x{c}, density={self.density:.4f}, nnz={self.nnz}, "
                f"bias={self.bias is not None}")

def _after_load(module: BlockSparseLinear, incompatible_keys) -> None:
    """After ``load_state_dict`` (checked in full before): the topology is rebuilt."""
    _rebuild_topology(module)


def _rebuild_topology(module: BlockSparseLinear) -> None:
    """Build the topology now (not at the next forward) wherever the block mask has real
    storage and values: a forward that ``torch.compile`` traces then finds it cached, where
    building it would break the graph (:meth:`BlockSparseLinear._build_topology` runs
    eagerly) and leave the compiled model in pieces for good. Elsewhere (meta tensors, an
    unset mask, inside a trace) it is dropped, to be built at its next use."""
    real = (module.block_mask.device.type != "meta" and not module.mask_unset
            and not torch.compiler.is_compiling())
    module._topology = module._build_topology() if real else None
