"""Sharded parameters (FSDP2's DTensors): masks of the full tensor, kept on the local shard.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``, Lightning's ``ModelParallelStrategy``)
a parameter is a ``DTensor``: each rank holds one shard of it (FSDP2 splits dim 0, rows),
and its gradient and optimizer state are DTensors sharded alike. For such a parameter the
engine keeps:

- **the mask buffer: the local shard of the full tensor's mask**, shaped like
  ``param.to_local()`` (a plain bool tensor beside the parameter). Everything per step
  works on local shards and sends nothing: zeroing pruned gradients (after FSDP's
  reduce-scatter) and weights, and optimizer state at mask updates.
- **mask updates computed from the full tensors**, gathered (``DTensor.full_tensor()``) at
  the update steps only. Every rank gathers the same values and computes the same full
  mask, so the masks are those of one process: N:M groups, blocks and the global top-k
  never see a shard boundary. Each rank then keeps its shard of it
  (:func:`shard_like`, a slice: no traffic), and the full masks' checksums are compared
  across ranks (:mod:`sparse_training.engine.distributed`).

The cost is paid at mask updates only, never per step:

- per update, one all-gather of every updated tensor's weights (RigL also of its gradient
  and its mask, 1 byte per weight), and the memory of those whole tensors on every rank
  (for the global distribution, all pooled tensors at once: the whole masked model);
- counting kept weights (the sparsity figures after a mask change, regrowth's counts): one
  all-reduce per mesh dimension for all sharded tensors together (:func:`totals_like`);
- a checkpoint gathers every mask (1 byte per weight) and saves it bit-packed, whole, in
  the callback's state; the weights and optimizer state stay sharded.

These are collectives: every rank must make the same calls (Lightning calls the hooks, the
logging and ``state_dict`` on every rank). The whole-tensor gather is the simple correct
design; at 7B scale a distributed threshold search (docs/distributed.md) would replace it.
The fused Triton step updates the local shards (``kernels._step_plan``). Compressed
block-sparse layers train sharded along their kept blocks (``values`` dim 0); when RigL or
SET moves blocks, every rank gathers the layer's values, gradient and optimizer state,
moves the blocks of the replicated block grid alike, and keeps its slice
(:func:`copy_whole`). Not supported yet, and refused with a reason: SR-STE, 2:4 layers with
sharded weights, and FSDP1 (:data:`FSDP1_PROBLEM`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from sparse_training.kernels._shards import is_sharded, local

try:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed: nothing is ever sharded
    DTensor = distribute_tensor = FullyShardedDataParallel = None  # type: ignore[assignment,misc]
try:  # FSDP2's module class: torch.distributed.fsdp from torch 2.6, _composable before
    from torch.distributed.fsdp import FSDPModule
except ImportError:
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None  # type: ignore[assignment,misc]

FSDP1_PROBLEM = (
    "FSDP1 (FullyShardedDataParallel; Lightning's FSDPStrategy) flattens parameters into "
    "1-D shards of other shapes, which masks cannot follow; shard with FSDP2 instead: "
    "torch.distributed.fsdp.fully_shard, in Lightning ModelParallelStrategy with "
    "fully_shard in the LightningModule's configure_model")


@torch.no_grad()
def full(tensor: Tensor) -> Tensor:
    """The whole tensor of a DTensor, gathered (a collective); the tensor itself otherwise."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of ``whole`` (shaped like the DTensor ``like``), laid out as
    ``like``'s local shard: a slice of ``whole``, nothing sent."""
    shard = distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
    return shard.to_local().contiguous()


@torch.no_grad()
def copy_whole(target: Tensor, whole: Tensor) -> None:
    """Write ``whole`` (a plain tensor of ``target``'s global shape) into ``target``: into
    its local shard, this rank's slice of ``whole`` (nothing sent), when ``target`` is a
    DTensor."""
    if is_sharded(target):
        local(target).copy_(shard_like(whole, target))
    else:
        target.copy_(whole)


def as_dtensor(shard: Tensor, like: Tensor) -> Tensor:
    """``shard`` (this rank's part of a tensor shaped like the DTensor ``like``) as a
    DTensor laid out as ``like``."""
    return DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride())


@torch.no_grad()
def gather_like(shard: Tensor, like: Tensor) -> Tensor:
    """The whole tensor from every rank's ``shard`` laid out as the DTensor ``like`` (an
    all-gather; bool travels as uint8)."""
    is_bool = shard.dtype == torch.bool
    whole = as_dtensor(shard.to(torch.uint8) if is_bool else shard, like).full_tensor()
    return whole.bool() if is_bool else whole


@torch.no_grad()
def totals_like(shard_sums: Sequence[Tensor], likes: Sequence[Tensor]) -> Tensor:
    """Sums over whole tensors from each rank's sums over its shards of ``likes`` (0-dim
    tensors of one dtype; an unsharded ``like``'s sum is already whole), stacked: one
    all-reduce per sharded mesh dimension for every tensor sharded alike, together."""
    totals = torch.stack(list(shard_sums))
    alike: dict[tuple, list[int]] = {}
    for i, like in enumerate(likes):
        if is_sharded(like):
            alike.setdefault((like.device_mesh, tuple(like.placements)), []).append(i)
    for (mesh, placements), indices in alike.items():
        index = torch.tensor(indices, device=totals.device)
        part = totals[index]
        for dim, placement in enumerate(placements):
            if placement.is_shard():  # replicas along the other dims hold the same shards
                dist.all_reduce(part, group=mesh.get_group(dim))
        totals[index] = part
    return totals


@torch.no_grad()
def gather_rows(shard: Tensor, like: Tensor) -> Tensor:
    """The whole of a tensor kept per rank with the rows (dim 0) of the DTensor ``like``'s
    local shard, any trailing shape (an all-gather): ``shard`` itself where ``like`` is not
    sharded."""
    if not is_sharded(like):
        return shard
    whole = (like.shape[0], *shard.shape[1:])
    return DTensor.from_local(shard.contiguous(), like.device_mesh, like.placements,
                              shape=whole, stride=_contiguous_strides(whole)).full_tensor()


def shard_rows(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's rows of ``whole`` (dim 0 split as the DTensor ``like``'s), nothing sent:
    ``whole`` itself where ``like`` is not sharded."""
    if not is_sharded(like):
        return whole
    shard = distribute_tensor(whole.to(local(like).device), like.device_mesh, like.placements,
                              src_data_rank=None)
    return shard.to_local().contiguous()


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
