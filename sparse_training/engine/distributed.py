"""Masks across torch.distributed ranks: the same on every rank, checked, never re-sent.

Masks agree by construction (magnitudes of identical weights, RigL's gradients after
DDP's all-reduce, random draws from (seed, step)). When they are created, rank 0's are
broadcast once; after every update, one all-reduce of a checksum per tensor compares them
(``check_masks``), and a difference raises, naming the tensors. Compressed layers, whose
masks each rank made at the swap, take rank 0's at a fit's start where they differ.

A tensor sharded by FSDP2 (:mod:`sparse_training.engine.sharding`) is compared by its whole mask:
each rank computes it from the gathered tensor and keeps its shard, so the whole masks
must agree; its weights are not broadcast (each rank holds its own shard of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from sparse_training.engine.protocol import Slot
from sparse_training.engine.sharding import FSDP1_PROBLEM, FullyShardedDataParallel, is_sharded


def mask_checksum(mask: Tensor) -> Tensor:
    """Sum over kept positions of a mixing hash of the position (int64, wrapping; the
    xor-shift-multiply rounds of splitmix64): equal masks give equal sums, and different
    masks collide only by chance."""
    flat = mask.reshape(-1)
    keys = (torch.arange(flat.numel(), device=flat.device) + 1) * 0x1E3779B97F4A7C15
    keys = (keys ^ (keys >> 30)) * 0x3F58476D1CE4E5B9
    keys = keys ^ (keys >> 27)
    return torch.where(flat, keys, 0).sum()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def average_across_ranks(tensors: Sequence[Tensor]) -> None:
    """In place, under torch.distributed: each tensor averaged over the ranks, as DDP
    averages gradients (a compressed layer's recorded dense gradient, which DDP does not
    see)."""
    if _distributed():
        for tensor in tensors:
            dist.all_reduce(tensor)
            tensor.div_(dist.get_world_size())


@torch.no_grad()
def check_across_ranks(slots: Sequence[Slot], step: int | None,
                       broadcast: bool, check: bool,
                       whole_masks: Mapping[str, Tensor] | None = None) -> None:
    """Under torch.distributed: rank 0's masks and weights installed everywhere
    (``broadcast``, once, when the masks are created), then (``check``) one checksum
    all-reduce. A sharded slot is compared by its whole mask: ``whole_masks[name]`` if
    given (just computed), else gathered.

    Raises:
        RuntimeError: a rank's masks differ, naming the tensors.
    """
    if not slots or not _distributed():
        return
    whole_masks = whole_masks or {}

    def whole(slot: Slot) -> Tensor:
        if not slot.sharded:
            return slot.mask
        return whole_masks[slot.name] if slot.name in whole_masks else slot.full_mask()

    if broadcast:  # rank 0's masks and weights, so that no rank keeps what another pruned
        received = {}
        for slot in slots:
            as_bytes = whole(slot).to(torch.uint8)
            dist.broadcast(as_bytes, src=0)
            if not slot.sharded:  # a sharded weight has no replica to agree with
                dist.broadcast(slot.param.data, src=0)
            received[slot.name] = as_bytes.bool()
            slot.set_mask(received[slot.name])
        whole_masks = received
    if check and (differ := _differing(slots, whole)):
        raise RuntimeError(f"masks differ across ranks at step {step} in tensors "
                           f"{[s.name for s in differ]}; every rank must see the same "
                           f"weights, gradients and seed")


def _differing(slots: Sequence[Slot], whole: Callable[[Slot], Tensor]) -> list[Slot]:
    """The slots whose ``whole`` mask differs on some rank: one all-reduce of checksums
    (the same list on every rank)."""
    sums = torch.stack([mask_checksum(whole(slot)) for slot in slots])
    extremes = torch.cat([sums, -sums])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    high, low = extremes[: len(sums)], -extremes[len(sums):]
    return [s for s, h, lo in zip(slots, high, low, strict=True) if h != lo]


@torch.no_grad()
def agree_compressed(slots: Sequence[Slot]) -> None:
    """Under torch.distributed: rank 0's layout of every replicated compressed layer whose
    mask differs on some rank (one checksum all-reduce), at a fit's start.

    Each rank compresses its layers from its own weights; DDP then sends rank 0's
    parameters, but the masks (buffers) only with ``broadcast_buffers``: ranks that
    initialized their weights differently would train other blocks (2:4 masks, heads)
    under the same values. Such a layer takes rank 0's mask (its values move), then rank
    0's parameters. Layers whose weights FSDP2 shards are left out (no replica).
    """
    slots = [s for s in slots if s.compressed and not is_sharded(s.param)]
    if not slots or not _distributed():
        return
    for slot in _differing(slots, lambda s: s.mask):
        mask = slot.mask.to(torch.uint8)
        dist.broadcast(mask, src=0)
        slot.set_mask(mask.bool())
        for param in slot.layer.parameters():
            dist.broadcast(param.data, src=0)


def keep_masks_out_of_buffer_broadcast(wrapper: nn.Module,
                                       slots: Sequence[Slot]) -> None:
    """Add the names of the mask buffers of ``slots`` (masked tensors' masks, compressed
    layers' 2:4 masks and block masks) to the ignore list of ``wrapper`` if it is a
    ``DistributedDataParallel`` (names, so a ``.to()`` that replaces the buffers keeps them
    there).

    With ``broadcast_buffers`` (DDP's default) DDP sends rank 0's buffers before every
    forward, and it lists the module's buffers anew each time, so masks registered after
    the wrap would travel too: one byte per masked weight per step (85 MB at BERT-base), on
    any model that had a buffer at the wrap (BERT's position ids, BatchNorm's statistics).
    Masks agree on every rank by construction and are compared by checksum after every
    update (:func:`check_across_ranks`), so they need not travel.

    Where the masks are all the buffers there are (a model whose only buffers are its
    compressed layers' masks), the broadcast is turned off: DDP, having seen buffers at
    the wrap, would otherwise send the empty list that is left, which torch rejects
    ("INTERNAL ASSERT FAILED ... !tensors.empty()").
    """
    if isinstance(wrapper, DistributedDataParallel):
        masks = {id(slot.mask) for slot in slots}
        buffers = dict(wrapper.module.named_buffers())
        ignored = wrapper.parameters_to_ignore  # re-read at every buffer broadcast
        ignored.update(name for name, buffer in buffers.items() if id(buffer) in masks)
        if wrapper.broadcast_buffers and ignored.issuperset(buffers):
            wrapper.broadcast_buffers = False


def sharding_problem(model: nn.Module, slots: Sequence[Slot],
                     dense_weights: bool) -> str | None:
    """Why the engine cannot serve this model's sharding, or None: FSDP1 modules, 2:4
    layers with sharded weights, SR-STE on sharded tensors."""
    if FullyShardedDataParallel is not None and any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return f"the model holds FullyShardedDataParallel modules: {FSDP1_PROBLEM}"
    sharded_compressed = [s for s in slots if s.compressed and is_sharded(s.param)]
    # the hooks mask a 2:4 layer's dense weight with its whole mask; a block or slim layer
    # keeps only its kept blocks (bands), nothing to mask
    if two_four := [s.name for s in sharded_compressed if s.enforced]:
        return (f"2:4 layers {two_four} have sharded (FSDP2) weights, which their whole "
                f"dense mask cannot follow yet; use pattern='2:4' on nn.Linear under FSDP")
    if dense_weights and (sharded := [s.name for s in slots
                                      if s.sharded and not s.compressed]):
        return (f"tensors {sharded} are sharded (FSDP2): SR-STE keeps dense weights beside "
                f"them, which sharded training does not support yet")
    return None
