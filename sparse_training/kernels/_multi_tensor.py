"""Tables that let one kernel launch walk many tensors (multi-tensor apply).

A launch processes a list of tensors. Each program handles one fixed-size chunk of
one tensor: ``chunk_table`` maps program id to (tensor index, chunk index within that
tensor), and ``address_table`` holds the tensors' data addresses, which the kernel
loads and casts to typed pointers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

# Tables uploaded under CUDA graph capture and their pinned host sources: every replay of
# the graph copies one into the other, so both live as long as the process (a few KB per
# table; a launcher that drops its table would leave the graph a freed address).
_CAPTURED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied to ``device`` asynchronously. Under CUDA graph capture the copy is
    recorded in the graph from a pinned host buffer (a pageable copy cannot be captured):
    the table holds its values from the graph's first replay on."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return host.to(device, non_blocking=True)
    pinned = host.pin_memory()
    table = pinned.to(device, non_blocking=True)
    _CAPTURED.append((table, pinned))
    return table


def _chunk_table(
    numels: tuple[int, ...], chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = torch.tensor(numels, dtype=torch.int64)
    per_tensor = (sizes + chunk - 1) // chunk
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor
    chunk_index = torch.arange(tensor_index.numel()) - first[tensor_index]
    return _upload(tensor_index, device), _upload(chunk_index, device)


def chunk_table(
    numels: Sequence[int], chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Program-to-chunk map for a multi-tensor launch (cached by sizes).

    Args:
        numels: Element count of each tensor of the launch (zero allowed).
        chunk: Elements per program.
        device: Device the kernel runs on.

    Returns:
        ``(tensor_index, chunk_index)``, two int64 tensors of one entry per program;
        the grid is their length. Cached by sizes, except under CUDA graph capture (a
        table made there holds its values only once the graph has been replayed).
    """
    key = (tuple(int(n) for n in numels), int(chunk), torch.device(device))
    if key[2].type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _chunk_table(*key)  # filled by the graph's replays: not for eager calls
    return _chunk_table_cached(*key)


_chunk_table_cached = lru_cache(maxsize=64)(_chunk_table)


def address_table(columns: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Upload per-tensor integers (addresses, counts) as an int64 ``[T, K]`` table.

    Args:
        columns: ``K`` sequences of ``T`` integers each (e.g. ``data_ptr()`` values).
        device: Device the kernel runs on.

    Returns:
        A contiguous int64 tensor on ``device`` with row ``t`` holding tensor ``t``'s
        values in column order. The copy is asynchronous; the host buffer is
        pageable, so the driver stages it before the call returns (pinned and kept
        under CUDA graph capture, where the copy becomes part of the graph).
    """
    return _upload(torch.tensor(list(zip(*columns, strict=True)), dtype=torch.int64), device)


def all_aligned(addresses: Sequence[int], nbytes: int = 16) -> bool:
    """Whether every address is a multiple of ``nbytes`` (enables 16-byte vector access)."""
    return all(a % nbytes == 0 for a in addresses)
