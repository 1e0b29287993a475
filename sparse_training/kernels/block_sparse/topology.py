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
The six index tensors are views of one int32 tensor, :attr:`BlockTopology.packed`, which is
what a compiled graph takes: one input per layer rather than six (each a guard, an input
and a saved output that ``torch.compile``'s runtime handles in Python at every call).
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor


def block_grid(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """Number of block rows and block columns covering the weight (tails included)."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def kept_positions(block_mask: Tensor) -> Tensor:
    """Each kept block's index in ``values`` (row-major order of the kept blocks), shaped
    like the mask; dropped blocks hold the index of the last kept block before them."""
    return (block_mask.flatten().cumsum(0) - 1).view(block_mask.shape)


INDEX_FIELDS = ("row_offsets", "row_indices", "col_indices", "t_offsets", "t_row_indices",
                 "t_block_ids")


def _check_weight_shape(out_features: int, in_features: int, block: tuple[int, int]) -> None:
    """Raises ValueError unless both features and the two block entries are >= 1."""
    if out_features < 1 or in_features < 1:
        raise ValueError(f"a block-sparse weight needs out_features and in_features >= 1, got "
                         f"({out_features}, {in_features})")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (R, C) with R, C >= 1, got {tuple(block)}")


def _split(packed: Tensor, rows: int, cols: int, nnz: int) -> tuple[Tensor, ...]:
    """The views of ``packed`` in :data:`INDEX_FIELDS` order."""
    return packed.split([rows + 1, nnz, nnz, cols + 1, nnz, nnz])


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

    def __post_init__(self) -> None:
        """Packs the index tensors into one int32 tensor, :attr:`packed` (in
        :data:`INDEX_FIELDS` order), and keeps contiguous views of it as the fields: the
        kernels read them so, at addresses fixed for the topology's life.

        Raises ValueError where the fields do not describe one block grid: sizes that
        are not positive, index tensors that are not 1-D integer tensors on one device, or
        of lengths other than ``grid + 1`` (offsets) and ``nnz`` (indices)."""
        _check_weight_shape(self.out_features, self.in_features, self.block)
        rows, cols = self.grid
        nnz, device = self.col_indices.numel(), self.col_indices.device
        lengths = {"row_offsets": rows + 1, "t_offsets": cols + 1}
        for name in INDEX_FIELDS:
            t, length = getattr(self, name), lengths.get(name, nnz)
            if (not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64)
                    or t.shape != (length,) or t.device != device):
                got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor)
                       else type(t).__name__)
                raise ValueError(
                    f"BlockTopology.{name} must be an int32 (or int64) tensor of shape "
                    f"({length},) on {device} for a ({self.out_features}, "
                    f"{self.in_features}) weight in {tuple(self.block)} blocks with {nnz} "
                    f"kept, got {got}: build topologies with BlockTopology.from_block_mask")
        # never an inference tensor, also when built under torch.inference_mode (a load or
        # device move there): the forward saves it for backward, which refuses those
        with torch.inference_mode(False):
            packed = torch.cat([getattr(self, name).to(torch.int32) for name in INDEX_FIELDS])
        object.__setattr__(self, "packed", packed)  # (frozen)
        for name, view in zip(INDEX_FIELDS, _split(packed, rows, cols, nnz), strict=True):
            object.__setattr__(self, name, view)
        key = id(packed)  # a new tensor, alive as long as this topology: no other holds it
        _LIVE[key] = weakref.ref(self, lambda ref: _LIVE.pop(key) if _LIVE.get(key) is ref
                                 else None)

    packed: Tensor = field(init=False, repr=False)
    """The index tensors in one int32 tensor, ``[2 + rows + cols + 4 nnz]``, in
    :data:`INDEX_FIELDS` order (the fields are its views)."""

    def __reduce__(self):
        """Copies, deep copies and unpickled topologies are built through ``__init__``:
        checked, contiguous and registered for :meth:`live` as any other."""
        return type(self), (self.out_features, self.in_features, self.block,
                            *(getattr(self, name) for name in INDEX_FIELDS))

    @classmethod
    def live(cls, packed: Tensor) -> BlockTopology | None:
        """The topology still alive whose :attr:`packed` is this very tensor, or None: a
        compiled graph hands the custom ops a layer's own packed indices at every call, and
        this finds the layer's topology (and the launches the kernels keep for it) without
        building one."""
        ref = _LIVE.get(id(packed))
        topology = None if ref is None else ref()
        return topology if topology is not None and topology.packed is packed else None

    @classmethod
    def from_packed(cls, out_features: int, in_features: int, block: tuple[int, int],
                    packed: Tensor, nnz: int) -> BlockTopology:
        """The topology of a :attr:`packed` index tensor with ``nnz`` kept blocks (built on
        its own copy of it).

        Raises:
            ValueError: ``nnz`` not a kept count of the block grid, or ``packed`` not a 1-D
                integer tensor of length ``2 + rows + cols + 4 nnz``.
        """
        _check_weight_shape(out_features, in_features, block)
        rows, cols = block_grid(out_features, in_features, block)
        if not isinstance(nnz, torch.SymInt) and (  # (symbolic under dynamic shapes)
                isinstance(nnz, bool) or not isinstance(nnz, numbers.Integral)
                or not 0 <= nnz <= rows * cols):
            raise ValueError(f"nnz must be an int in [0, {rows * cols}] (the kept blocks of a "
                             f"{rows}x{cols} block grid), got {nnz!r}")
        length = 2 + rows + cols + 4 * nnz
        if (not isinstance(packed, Tensor) or packed.shape != (length,)
                or packed.dtype not in (torch.int32, torch.int64)):
            got = (f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, Tensor)
                   else type(packed).__name__)
            raise ValueError(f"packed block indices must be a 1-D int32 (or int64) tensor of "
                             f"length 2 + {rows} + {cols} + 4 * {nnz} = {length} for a "
                             f"({out_features}, {in_features}) weight in {tuple(block)} "
                             f"blocks with {nnz} kept, got {got}: pass a BlockTopology's "
                             f".packed")
        return cls(out_features, in_features, tuple(block), *_split(packed, rows, cols, nnz))

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
        _check_weight_shape(out_features, in_features, block)
        grid = block_grid(out_features, in_features, block)
        if tuple(block_mask.shape) != grid:
            raise ValueError(f"block mask shape {tuple(block_mask.shape)} != block grid {grid} "
                             f"of a ({out_features}, {in_features}) weight in {block} blocks")
        block_mask = block_mask.bool()
        if nnz is None:
            nnz = int(block_mask.sum())
        elif not 0 <= nnz <= block_mask.numel():  # (a count that does not match the mask
            raise ValueError(                     # pads or cuts the indices: give it right)
                f"nnz {nnz} is not a kept count of a {grid[0]}x{grid[1]} block grid (0 to "
                f"{block_mask.numel()}); pass the mask's number of True entries")
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


_LIVE: dict[int, weakref.ref] = {}
"""Every topology alive, held weakly, by the id of its :attr:`~BlockTopology.packed`:
:meth:`BlockTopology.live`."""

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What the Triton kernels compute in (fp32 accumulation); float64 runs the references."""


def check_operands(topology: BlockTopology, *, values: Tensor | None = None,
                   x: Tensor | None = None, grad_out: Tensor | None = None,
                   bias: Tensor | None = None, kernel: bool = False) -> None:
    """Check the operands of one block-sparse product against ``topology``.

    ``values`` is ``[nnz, R, C]``, ``x`` is ``[..., in_features]``, ``grad_out`` is
    ``[..., out_features]`` (one row per row of ``x``), ``bias`` is ``[out_features]``: all
    of one floating dtype, on the device of the topology's index tensors. Strides are free.

    Args:
        kernel: the operands of a Triton launcher: ``x`` and ``grad_out`` are 2-D, the
            dtype one of :data:`KERNEL_DTYPES`.

    Raises:
        ValueError: naming the first operand that does not fit, its value and the fix.
    """
    device, first = topology.col_indices.device, None
    for name, t in (("input", x), ("grad_out", grad_out), ("values", values), ("bias", bias)):
        if t is None:
            continue
        _check_shape(name, t, topology, kernel)
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} dtype {t.dtype} is not a floating dtype: cast it with "
                             f".to(torch.float32) (or bfloat16, float16, float64)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the topology's index tensors on "
                             f"{device}: move both to one device (a BlockSparseLinear moves "
                             f"its values, bias and topology together with .to(device))")
        if first is None:
            first = name, t.dtype
        elif t.dtype != first[1]:
            raise ValueError(f"{name} dtype {t.dtype} != {first[0]} dtype {first[1]}: give "
                             f"the operands one dtype (cast with .to(...), or run under "
                             f"torch.autocast)")
        if kernel and t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype}: the Triton kernels run float32, float16 "
                             f"and bfloat16 (block_sparse_linear runs float64 through the "
                             f"pure-torch reference); cast it with .to(...)")
    if x is not None and grad_out is not None and x.shape[:-1] != grad_out.shape[:-1]:
        raise ValueError(f"grad_out shape {tuple(grad_out.shape)} does not match input shape "
                         f"{tuple(x.shape)}: one row of grad_out per row of the input")


def _check_shape(name: str, t: Tensor, topology: BlockTopology, kernel: bool) -> None:
    """``values`` is ``(nnz, R, C)``, ``bias`` ``(out_features,)``; ``input`` and
    ``grad_out`` end in ``in_features`` / ``out_features`` (2-D for the kernels)."""
    if name == "values":
        want, label = (topology.nnz, *topology.block), "(nnz, R, C)"
    elif name == "bias":
        want, label = (topology.out_features,), "(out_features,)"
    else:
        want = (topology.in_features if name == "input" else topology.out_features,)
        label = f"(tokens, {want[0]})" if kernel else f"(..., {want[0]})"
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor of shape {label}, got {type(t).__name__}")
    if name in ("values", "bias"):
        if t.shape != want:
            raise ValueError(f"{name} shape {tuple(t.shape)} != {label} = {want} of the "
                             f"topology")
    elif (t.dim() != 2) if kernel else (t.dim() == 0):
        raise ValueError(f"{name} must have shape {label}, got {tuple(t.shape)}")
    elif t.shape[-1] != want[0]:
        role = "takes" if name == "input" else "gives"
        raise ValueError(f"{name} has {t.shape[-1]} features, the layer {role} {want[0]}")


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
    :meth:`BlockSparseLinear.from_dense` ranks blocks by (NaN where a block holds a NaN)."""
    rows, cols = block_grid(*weight.shape, block)
    padded = weight.new_zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:weight.shape[0], :weight.shape[1]] = weight.detach()
    return _block_view(padded, block).square().sum((-1, -2)).sqrt()


def top_blocks(scores: Tensor, nnz: int) -> Tensor:
    """Bool mask of the ``nnz`` highest-scoring blocks (exact count; ties by ``topk``).

    NaN scores rank below every other score (``-inf`` included), the engine's rule
    (:func:`sparse_training.pieces.masks.score_stack`): a block holding a NaN is kept only when
    fewer than ``nnz`` blocks have a number for a score.

    Raises:
        ValueError: ``nnz`` outside ``[0, scores.numel()]``.
    """
    if (isinstance(nnz, bool) or not isinstance(nnz, numbers.Integral)
            or not 0 <= nnz <= scores.numel()):
        raise ValueError(f"nnz must be an int in [0, {scores.numel()}] (the number of blocks "
                         f"of a {tuple(scores.shape)} block grid), got {nnz!r}")
    ranked = torch.nan_to_num(scores.flatten(), nan=float("-inf"))
    mask = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    mask[ranked.topk(nnz).indices] = True
    return mask.view(scores.shape)
