"""What a :class:`~sparse_training.block_sparse.BlockSparseLinear` checkpoint may hold, checked.

A layer saves ``nn.Linear``'s form, the dense ``weight`` (zeros at dropped blocks) and
``bias``; a layer with sharded ``values`` (FSDP2) saves the compact form, ``values``,
``block_mask`` and ``bias``. Loading takes either (:func:`compact_from`), checked in full
before anything is copied; :func:`dense_state_dict` turns the compact form into the dense one
for a model with plain ``nn.Linear`` layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparse_training.kernels._shards import is_sharded
from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_grid,
    dense_to_values,
    values_to_dense,
)

if TYPE_CHECKING:
    from sparse_training.block_sparse import BlockSparseLinear


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


def compact_from(layer: BlockSparseLinear, state_dict: dict, prefix: str) -> None:
    """Check ``layer``'s entries of ``state_dict`` (keys ``prefix + name``) and turn a dense
    ``weight`` into the compact ``values`` and ``block_mask``, in place.

    The block mask of a dense weight is the layer's current ``block_mask`` where the weight
    is zero outside it, else the blocks that hold a nonzero if they are exactly ``nnz``.

    Raises:
        ValueError: naming the key: a weight of another shape, with nonzeros in other than
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
    mask = layer.block_mask.to(nonzero.device)
    if (nonzero & ~mask).any():
        if int(nonzero.sum()) != layer.nnz:
            (r, c), kept = layer.block, int(nonzero.sum())
            raise ValueError(
                f"{prefix}weight has nonzeros in {kept} of its {nonzero.numel()} {r}x{c} "
                f"blocks, some outside the layer's block_mask, and the layer keeps nnz = "
                f"{layer.nnz}: load a weight that is zero outside {layer.nnz} blocks, or set "
                f"the mask first (set_block_mask)")
        mask = nonzero
    topology = BlockTopology.from_block_mask(mask, *shape, layer.block, nnz=layer.nnz)
    del state_dict[prefix + "weight"]
    state_dict[prefix + "values"] = dense_to_values(weight.detach(), topology)
    state_dict[prefix + "block_mask"] = mask


def _check_compact(layer: BlockSparseLinear, values: Tensor | None, mask: Tensor | None,
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


def dense_state_dict(state_dict: Mapping[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state_dict`` with each compressed layer's compact form (``<name>.values`` and
    ``<name>.block_mask``, what layers with sharded values save) replaced by the dense
    ``<name>.weight`` (zeros at the dropped blocks) that ``model``'s ``nn.Linear`` of that
    name takes; every other entry as it is. A consolidated FSDP2 checkpoint of compressed
    layers then loads into the plain model: ``model.load_state_dict(dense_state_dict(sd,
    model))``.

    Raises:
        ValueError: naming the key: a compact form whose name is not an ``nn.Linear`` of
            ``model``, a ``block_mask`` that is not the Linear's block grid, or ``values``
            not ``[kept blocks, R, C]``.
    """
    dense, modules = dict(state_dict), dict(model.named_modules())
    for key in [k for k in state_dict if k.endswith(".values")]:
        prefix = key[:-len("values")]
        if prefix + "block_mask" not in state_dict:
            continue  # not a compressed layer's
        values, mask = state_dict[key], state_dict[prefix + "block_mask"]
        layer = modules.get(prefix[:-1])
        if not isinstance(layer, nn.Linear):
            what = "no module" if layer is None else type(layer).__name__
            raise ValueError(f"{prefix}values and {prefix}block_mask are a compressed layer's, "
                             f"but {prefix[:-1]!r} in the model is {what}, not an nn.Linear")
        shape, block = (layer.out_features, layer.in_features), tuple(values.shape[1:])
        if values.dim() != 3 or not all(block):
            raise ValueError(f"{key} has shape {tuple(values.shape)}, not [blocks, R, C]")
        check_block_mask(mask, block_grid(*shape, block), prefix + "block_mask")
        if int(mask.sum()) != values.shape[0]:
            raise ValueError(f"{prefix}block_mask keeps {int(mask.sum())} blocks, {key} holds "
                             f"{values.shape[0]}")
        topology = BlockTopology.from_block_mask(mask, *shape, block, nnz=values.shape[0])
        del dense[key], dense[prefix + "block_mask"]
        dense[prefix + "weight"] = values_to_dense(values, topology).clone()
    return dense
