"""Sharded tensors (FSDP2's DTensors) as the kernels see them: their local shards."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed: nothing is ever sharded
    DTensor = None  # type: ignore[assignment,misc]


def is_sharded(tensor: Tensor | None) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter, gradient or state of FSDP2)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise): writes to it are
    writes to the DTensor's storage."""
    if not is_sharded(tensor):
        return tensor
    if not torch.is_grad_enabled():  # the optimizer step's hot path: no context to enter
        return tensor.to_local()
    with torch.no_grad():  # the local tensor itself, not an autograd view of it
        return tensor.to_local()
