"""Block geometry of :class:`~sparse_training.layers.block_sparse.BlockSparseLinear`:
argument checks, kept counts, the entries of overhanging blocks, block moves, and the
checkpoint forms: the compact form turned dense (:func:`dense_state_dict`), a dense one
turned compact for the layer to load (:func:`compact_from`).

The weight ``(out_features, in_features)`` is cut into ``R x C`` blocks; the last block row
and column may hang over the edge, their outside entries held as zeros.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from sparse_training.engine.tensors import is_conv1d
from sparse_training.kernels._shards import is_sharded
from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_grid,
    dense_to_values,
    values_to_dense,
)
from sparse_training.pieces.masks import kept_count

BLOCK_SIZES = (16, 32, 64, 128)


def check_block(block: Sequence[int]) -> tuple[int, int]:
    """``block`` as an ``(R, C)`` tuple of ints, each one of :data:`BLOCK_SIZES`.

    Raises:
        ValueError: anything else, naming it.
    """
    valid = ", ".join(map(str, BLOCK_SIZES))
    if (not isinstance(block, Sequence) or len(block) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool)
                       and b in BLOCK_SIZES for b in block)):
        raise ValueError(f"block must be (R, C) with entries each one of {valid}, got {block!r}")
    return int(block[0]), int(block[1])


def check_density(density: float) -> float:
    """``density`` as a float in (0, 1].

    Raises:
        ValueError: anything else, naming it.
    """
    if (not isinstance(density, numbers.Real) or isinstance(density, bool)
            or not 0 < density <= 1):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    return float(density)


def blocks_kept(grid: tuple[int, int], density: float, shape: tuple[int, int],
                block: tuple[int, int]) -> int:
    """``max(1, kept_count(blocks, 1 - density))`` of the ``grid``'s blocks.

    Raises:
        ValueError: ``density < 1`` keeps every block (a grid of few blocks): the layer
            would be dense, labelled sparse.
    """
    blocks = grid[0] * grid[1]
    nnz = max(1, kept_count(blocks, 1.0 - density))
    if nnz == blocks and density < 1:
        raise ValueError(
            f"density {density} keeps {nnz} of {blocks} blocks of {block[0]}x{block[1]} in "
            f"the {shape[0]}x{shape[1]} weight: nothing would be sparse; use smaller blocks or "
            f"a lower density")
    return nnz


def check_features(**features: int) -> None:
    for name, value in features.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def inside(topology: BlockTopology) -> Tensor:
    """Bool ``[nnz, R, C]``: which entries of each kept block lie inside the weight (not in
    the padded tail of an overhanging block)."""
    (r, c), device = topology.block, topology.row_indices.device
    rows = topology.row_indices[:, None] * r + torch.arange(r, device=device)
    cols = topology.col_indices[:, None] * c + torch.arange(c, device=device)
    return (rows < topology.out_features)[:, :, None] & (cols < topology.in_features)[:, None, :]


def block_extents(out_features: int, in_features: int, block: tuple[int, int],
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """Rows ``h_i = min(R, out - i R)`` of each block row and columns ``w_j = min(C, in - j C)``
    of each block column that lie inside the weight."""
    (r, c), (rows, cols) = block, block_grid(out_features, in_features, block)
    h = (out_features - r * torch.arange(rows, device=device)).clamp(max=r)
    w = (in_features - c * torch.arange(cols, device=device)).clamp(max=c)
    return h, w


def blocks_of_mask(mask: Tensor, block: tuple[int, int]) -> Tensor:
    """The block-grid mask of an element mask that is constant on every block.

    Raises:
        ValueError: naming the first block (row-major) that is partly kept.
    """
    (r, c), (out_features, in_features) = block, mask.shape
    rows, cols = block_grid(out_features, in_features, block)
    padded = mask.new_zeros(rows * r, cols * c, dtype=torch.int64)
    padded[:out_features, :in_features] = mask
    kept = padded.view(rows, r, cols, c).sum((1, 3))  # kept entries per block
    h, w = block_extents(out_features, in_features, block, mask.device)
    size = h[:, None] * w[None, :]
    mixed = ((kept > 0) & (kept < size)).nonzero()
    if len(mixed):
        i, j = mixed[0].tolist()
        raise ValueError(
            f"mask is not constant on block ({i}, {j}) (weight rows {i * r}:"
            f"{i * r + int(h[i])}, columns {j * c}:{j * c + int(w[j])}): {int(kept[i, j])} of "
            f"{int(size[i, j])} entries kept; an element mask must keep or drop whole "
            f"{r}x{c} blocks")
    return kept > 0


def check_block_mask(mask: Tensor, grid: tuple[int, int], name: str = "block_mask") -> None:
    """Raise a ValueError naming ``name`` unless ``mask`` is a bool tensor of shape ``grid``."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a bool tensor of the block grid's shape {grid}, "
                         f"got {what}")
    if tuple(mask.shape) != grid:
        raise ValueError(f"{name} shape {tuple(mask.shape)} != block grid {grid} "
                         f"(ceil(out_features / R), ceil(in_features / C))")


def nonzero_blocks(weight: Tensor, block: tuple[int, int]) -> Tensor:
    """Bool block grid: which ``block``s of a dense weight hold a nonzero (NaN counts)."""
    (r, c), (rows, cols) = block, block_grid(*weight.shape, block)
    nonzero = weight.new_zeros(rows * r, cols * c, dtype=torch.bool)
    nonzero[:weight.shape[0], :weight.shape[1]] = weight != 0
    return nonzero.view(rows, r, cols, c).any(3).any(1)


def gather_blocks(blocks: Tensor, sources: Tensor) -> Tensor:
    """``blocks[sources]`` along the first dimension, zeros where ``sources`` is -1: values
    or optimizer state ``[nnz, R, C]`` re-ordered for a new block mask
    (:meth:`BlockSparseLinear.block_sources`)."""
    return torch.where((sources >= 0)[:, None, None], blocks[sources.clamp(min=0)], 0)


def transfer(weight: nn.Parameter, new_weight: Tensor, weight_requires_grad: bool,
              bias: nn.Parameter | None, source_bias: nn.Parameter | None) -> None:
    """Copy a converted weight and the bias in, with their ``requires_grad``."""
    with torch.no_grad():
        weight.copy_(new_weight)
        if source_bias is not None:
            bias.copy_(source_bias)
    weight.requires_grad_(weight_requires_grad)
    if source_bias is not None:
        bias.requires_grad_(source_bias.requires_grad)


def dense_state_dict(state_dict: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state_dict`` with each compressed layer's compact form (``<name>.values`` and
    ``<name>.block_mask``, what layers with sharded values save) replaced by the dense
    ``<name>.weight`` (zeros at the dropped blocks) that ``model``'s ``nn.Linear`` of that
    name takes, or its HF ``Conv1D`` (GPT-2): ``(in, out)``, the block grid's weight
    transposed; every other entry as it is. A consolidated FSDP2 checkpoint of compressed
    layers then loads into the plain model: ``model.load_state_dict(dense_state_dict(sd,
    model))``.

    Raises:
        ValueError: naming the key: a compact form whose name is not an ``nn.Linear`` or
            ``Conv1D`` of ``model``, a ``block_mask`` that is not the layer's block grid
            (of its ``(out, in)`` weight), or ``values`` not ``[kept blocks, R, C]``.
    """
    dense, modules = dict(state_dict), dict(model.named_modules())
    for key in [k for k in state_dict if k.endswith(".values")]:
        prefix = key[:-len("values")]
        if prefix + "block_mask" not in state_dict:
            continue  # not a compressed layer's
        values, mask = state_dict[key], state_dict[prefix + "block_mask"]
        layer = modules.get(prefix[:-1])
        conv = layer is not None and is_conv1d(layer)
        if not (isinstance(layer, nn.Linear) or conv):
            what = "no module" if layer is None else type(layer).__name__
            raise ValueError(f"{prefix}values and {prefix}block_mask are a compressed layer's, "
                             f"but {prefix[:-1]!r} in the model is {what}, not an nn.Linear "
                             f"or a Conv1D")
        shape = tuple(layer.weight.shape[::-1]) if conv else (layer.out_features,
                                                              layer.in_features)
        block = tuple(values.shape[1:])
        if values.dim() != 3 or not all(block):
            raise ValueError(f"{key} has shape {tuple(values.shape)}, not [blocks, R, C]")
        check_block_mask(mask, block_grid(*shape, block), prefix + "block_mask")
        if int(mask.sum()) != values.shape[0]:
            raise ValueError(f"{prefix}block_mask keeps {int(mask.sum())} blocks, {key} holds "
                             f"{values.shape[0]}")
        topology = BlockTopology.from_block_mask(mask, *shape, block, nnz=values.shape[0])
        del dense[key], dense[prefix + "block_mask"]
        weight = values_to_dense(values, topology)
        dense[prefix + "weight"] = (weight.T if conv else weight).clone(
            memory_format=torch.contiguous_format)
    return dense


def fill_blocks(nonzero: Tensor, preferred: Tensor | None, nnz: int) -> Tensor:
    """``nonzero`` with blocks added until it keeps ``nnz``: first the blocks of
    ``preferred`` (the layer's current mask), then the others in row-major order. The added
    blocks hold zeros, so the layer computes what the loaded weight does; a resume then
    sets the checkpoint's own mask (RigL grows blocks at zero), moving zeros only."""
    missing = nnz - int(nonzero.sum())
    if missing <= 0:
        return nonzero
    free = (~nonzero).flatten().to(torch.int8)
    rank = free if preferred is None else free * (1 + preferred.flatten().to(torch.int8))
    added = torch.argsort(rank, descending=True, stable=True)[:missing]
    return nonzero.flatten().index_fill(0, added, True).view_as(nonzero)


def compact_from(layer: nn.Module, state_dict: dict, prefix: str) -> None:
    """Check a ``BlockSparseLinear``'s entries of ``state_dict`` (keys ``prefix + name``) and
    turn a dense ``weight`` into the compact ``values`` and ``block_mask``, in place.

    The block mask of a dense weight is the layer's current ``block_mask`` where it is set
    (not unset, not on the meta device) and the weight is zero outside it, else the blocks
    that hold a nonzero if they are at most ``nnz`` (:func:`fill_blocks` adds zero blocks up
    to ``nnz``).

    Raises:
        ValueError: naming the key: a weight of another shape, with nonzeros in more than
            ``nnz`` blocks, beside compact keys, or dense for sharded values; a
            ``block_mask`` of another shape, dtype or count, or without ``values``;
            ``values`` of another shape.
    """
    weight = state_dict.get(prefix + "weight")
    values, mask = state_dict.get(prefix + "values"), state_dict.get(prefix + "block_mask")
    if weight is None:
        _check_compact(layer, values, mask, prefix)
        return
    if values is not None or mask is not None:
        raise ValueError(f"{prefix}weight and the compact {prefix}values/block_mask are both "
                         f"given; give one form")
    shape = (layer.out_features, layer.in_features)
    if not isinstance(weight, Tensor) or tuple(weight.shape) != shape:
        what = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"{prefix}weight has shape {what}, the layer's dense weight "
                         f"(out_features, in_features) = {shape}")
    if is_sharded(layer.values):
        raise ValueError(f"{prefix}weight is dense but the layer's values are sharded (FSDP2): "
                         f"sharded layers load the compact form they save")
    nonzero = nonzero_blocks(weight.detach(), layer.block)
    # no mask to keep: unset (to_empty of a meta layer), or on the meta device (a meta
    # layer loading with assign=True)
    unset = layer.mask_unset or layer.block_mask.is_meta
    mask = None if unset else layer.block_mask.to(nonzero.device)
    if mask is None or (nonzero & ~mask).any():
        if (kept := int(nonzero.sum())) > layer.nnz:
            (r, c) = layer.block
            where = ("the layer's block_mask unset (to_empty of a meta layer)"
                     if layer.mask_unset else "the layer's block_mask on the meta device"
                     if mask is None else "some outside the layer's block_mask")
            raise ValueError(
                f"{prefix}weight has nonzeros in {kept} of its {nonzero.numel()} {r}x{c} "
                f"blocks, {where}, and the layer keeps nnz = {layer.nnz}: load a weight "
                f"that is zero outside {layer.nnz} blocks (resuming a checkpoint saved with "
                f"other settings, pattern or sparsity, or by a dense run? resume with its "
                f"settings, or compress its weights in a new fit)")
        mask = fill_blocks(nonzero, mask, layer.nnz)
    topology = BlockTopology.from_block_mask(mask, *shape, layer.block, nnz=layer.nnz)
    del state_dict[prefix + "weight"]
    state_dict[prefix + "values"] = dense_to_values(weight.detach(), topology)
    state_dict[prefix + "block_mask"] = mask


def _check_compact(layer: nn.Module, values: Tensor | None, mask: Tensor | None,
                   prefix: str) -> None:
    """The compact form's checks (either key may be absent in a partial state_dict)."""
    if mask is not None:
        check_block_mask(mask, tuple(layer.block_mask.shape), prefix + "block_mask")
        if values is None:
            raise ValueError(f"{prefix}block_mask without {prefix}values: the compact form "
                             f"loads both (or give the dense {prefix}weight)")
        if int(mask.sum()) != layer.nnz:
            raise ValueError(f"{prefix}block_mask keeps {int(mask.sum())} blocks but values "
                             f"holds {layer.nnz}: the state_dict is inconsistent")
    expected = (layer.nnz, *layer.block)
    if values is not None and tuple(values.shape) != expected:
        what = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"{prefix}values has shape {what}, the layer's (nnz, R, C) = "
                         f"{expected}: a checkpoint of another layer")
