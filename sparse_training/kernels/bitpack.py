"""Bit-packed mask storage: one bit per weight instead of one byte."""

from __future__ import annotations

import torch

_BITS = 1 << torch.arange(8, dtype=torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask into uint8, eight elements per byte.

    Element ``i`` of the flattened mask is bit ``i % 8`` (least significant first) of
    byte ``i // 8``; the last byte's unused bits are zero.

    Args:
        mask: Bool tensor of any shape.

    Returns:
        1-D uint8 tensor of ``ceil(mask.numel() / 8)`` bytes on the mask's device.

    Raises:
        ValueError: If ``mask`` is not bool.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"pack_mask expects a bool tensor, got {mask.dtype}")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = _BITS.to(mask.device)
    return (flat.view(-1, 8).to(torch.uint8) * bits).sum(1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``pack_mask``.

    Args:
        packed: 1-D uint8 tensor from ``pack_mask``.
        shape: Shape of the original mask.

    Returns:
        Bool tensor of ``shape``.
    """
    numel = 1
    for s in shape:
        numel *= s
    bits = _BITS.to(packed.device)
    flat = (packed.view(-1, 1) & bits) != 0
    return flat.reshape(-1)[:numel].reshape(shape)
