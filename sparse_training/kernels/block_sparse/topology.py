"""Where the kept blocks of a block-sparse weight are: :class:`BlockTopology`.

A weight ``W`` of shape ``(out_features, in_features)`` is cut into ``R x C`` blocks (the
last block row and column may hang over the edge: the layer pads them with zeros). The
kept blocks are stored as ``values[nnz, R, C]`` in row-major block order, and the
topology holds three int32 views of where they are, each one kernel's loop order
(stk's ``Matrix``, FlexAttention's ``BlockMask`` with kv and transposed q indices):

* BSR by block row (forward ``Y = X W^T``): ``row_offsets[i] : row_offsets[i + 1]`` are
  the kept blocks of block row ``i``, ``col_indices`` their block columns;
* COO (weight gradient, one program per kept block): ``row_indices``, ``col_indices``;
* BSR by block column (input gradient ``dX = dY W``): ``t_offsets``, ``t_row_indices``
  and ``t_block_ids`` (the position of each block in ``values``).

Everything is built on the device without a host synchronization: the kept count ``nnz``
is passed in (``torch.nonzero_static``), and it is fixed while a layer trains compressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def block_grid(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """Number of block rows and block columns covering the weight (tails included)."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def kept_positions(block_mask: Tensor) -> Tensor:
    """Each kept block's index in ``values`` (row-major order of the kept blocks), shaped
    like the mask; dropped blocks hold the index of the last kept block before them."""
    return (block_mask.flatten().cumsum(0) - 1).view(block_mask.shape)


def _offsets(counts: Tensor) -> Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


@dataclass(frozen=True, eq=False)
class BlockTopology:
    """The kept blocks of one ``(out_features, in_features)`` weight cut into ``block``."""

    out_features: int
    in_features: int
    block: tuple[int, int]
    row_offsets: Tensor
    row_indices: Tensor
    col_indices: Tensor
    t_offsets: Tensor
    t_row_indices: Tensor
    t_block_ids: Tensor

    @classmethod
    def from_block_mask(cls, block_mask: Tensor, out_features: int, in_features: int,
                        block: tuple[int, int], nnz: int | None = None) -> BlockTopology:
        """The topology of a bool ``(block_rows, block_cols)`` mask (True = kept block).

        Args:
            nnz: the mask's kept count. Given, nothing waits for the device; left out, it
                is read from the mask (one synchronization).

        Raises:
            ValueError: a mask whose shape is not the weight's block grid.
        """
        grid = block_grid(out_features, in_features, block)
        if tuple(block_mask.shape) != grid:
            raise ValueError(f"block mask shape {tuple(block_mask.shape)} != block grid {grid} "
                             f"of a ({out_features}, {in_features}) weight in {block} blocks")
        block_mask = block_mask.bool()
        if nnz is None:
            nnz = int(block_mask.sum())
        kept = torch.nonzero_static(block_mask, size=nnz).to(torch.int32)
        kept_t = torch.nonzero_static(block_mask.t(), size=nnz).to(torch.int32)
        positions = kept_positions(block_mask)
        return cls(
            out_features, in_features, tuple(block),
            row_offsets=_offsets(block_mask.sum(1)),
            row_indices=kept[:, 0].contiguous(), col_indices=kept[:, 1].contiguous(),
            t_offsets=_offsets(block_mask.sum(0)),
            t_row_indices=kept_t[:, 1].contiguous(),
            t_block_ids=positions[kept_t[:, 1].long(), kept_t[:, 0].long()].to(torch.int32),
        )

    @property
    def nnz(self) -> int:
        """Number of kept blocks."""
        return self.col_indices.numel()

    @property
    def grid(self) -> tuple[int, int]:
        return block_grid(self.out_features, self.in_features, self.block)

    @property
    def density(self) -> float:
        """Kept blocks / all blocks."""
        return self.nnz / (self.grid[0] * self.grid[1])

    def block_mask(self) -> Tensor:
        """The bool ``(block_rows, block_cols)`` mask of kept blocks."""
        mask = torch.zeros(self.grid, dtype=torch.bool, device=self.col_indices.device)
        mask[self.row_indices.long(), self.col_indices.long()] = True
        return mask


def _block_view(padded: Tensor, block: tuple[int, int]) -> Tensor:
    """``(rows*R, cols*C)`` -> ``(rows, cols, R, C)`` view of a padded matrix."""
    (r, c), (height, width) = block, padded.shape
    return padded.view(height // r, r, width // c, c).transpose(1, 2)


def values_to_dense(values: Tensor, topology: BlockTopology) -> Tensor:
    """The dense ``(out_features, in_features)`` weight: kept blocks, zeros elsewhere."""
    (rows, cols), (r, c) = topology.grid, topology.block
    padded = values.new_zeros(rows * r, cols * c)
    _block_view(padded, topology.block)[topology.row_indices.long(),
                                        topology.col_indices.long()] = values
    return padded[:topology.out_features, :topology.in_features]


def dense_to_values(weight: Tensor, topology: BlockTopology) -> Tensor:
    """The kept blocks of a dense weight as ``[nnz, R, C]`` (tails padded with zeros)."""
    (rows, cols), (r, c) = topology.grid, topology.block
    padded = weight.new_zeros(rows * r, cols * c)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return _block_view(padded, topology.block)[topology.row_indices.long(),
                                               topology.col_indices.long()].contiguous()


def block_norms(weight: Tensor, block: tuple[int, int]) -> Tensor:
    """L2 norm of each ``block`` of a weight, tails padded with zeros: the score that
    :meth:`BlockSparseLinear.from_dense` ranks blocks by."""
    rows, cols = block_grid(*weight.shape, block)
    padded = weight.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:weight.shape[0], :weight.shape[1]] = weight.detach()
    return _block_view(padded, block).square().sum((-1, -2)).sqrt()


def top_blocks(scores: Tensor, nnz: int) -> Tensor:
    """Bool mask of the ``nnz`` highest-scoring blocks (exact count; ties by ``topk``)."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[scores.flatten().topk(nnz).indices] = True
    return mask.view(scores.shape)
