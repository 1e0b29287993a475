"""Global magnitude threshold over many tensors by radix select (no sort).

The float32 bit pattern of ``|w|`` orders like its value, so the ``kept``-th largest
``|w|`` is found digit by digit: three histogram passes over bits 30-21, 20-10 and
9-0, each counting only the weights whose higher bits match the digits chosen so
far. Between passes, the digit and the remaining rank are picked on the device
(a suffix sum over the histogram), so there is no host synchronisation. The first
pass counts every weight (``tl.histogram`` in shared memory); the later passes count
only the few weights that match the prefix, with masked global atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._multi_tensor import address_table, all_aligned, chunk_table
from ._triton import kernels_run_on, tl, triton
from .reference import global_magnitude_threshold_reference

# (shift, width) of the three digits of a non-negative float32 bit pattern.
_DIGITS = ((21, 10), (10, 11), (0, 10))
_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _radix_histogram_kernel(
    table, tensor_index, chunk_index, hist_ptr, prefix_ptr,
    SHIFT: tl.constexpr, PREFIX_SHIFT: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BINS: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = table + tl.load(tensor_index + tl.program_id(0)) * 2
    x_ptr = tl.load(row).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
    numel = tl.load(row + 1)
    first = tl.load(chunk_index + tl.program_id(0)) * CHUNK
    prefix = 0
    if HAS_PREFIX:
        prefix = tl.load(prefix_ptr).to(tl.int32)
    bins = tl.arange(0, BINS)
    acc = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offs = first + start + tl.arange(0, BLOCK)
        valid = offs < numel
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        bits = tl.abs(x).to(tl.int32, bitcast=True)
        digit = (bits >> SHIFT) & (BINS - 1)
        if HAS_PREFIX:
            valid = valid & ((bits >> PREFIX_SHIFT) == prefix)
            tl.atomic_add(hist_ptr + digit, tl.full([BLOCK], 1, tl.int64), mask=valid)
        else:
            # Tail lanes were counted in bin 0; take them out again.
            excluded = tl.sum((~valid).to(tl.int32), axis=0)
            acc += tl.histogram(tl.where(valid, digit, 0), BINS) - tl.where(bins == 0, excluded, 0)
    if not HAS_PREFIX:
        tl.atomic_add(hist_ptr + bins, acc.to(tl.int64))


def _launch_radix_select(
    tensors: list[torch.Tensor], kept: int, chunk: int, block: int
) -> torch.Tensor:
    device = tensors[0].device
    addresses = [t.data_ptr() for t in tensors]
    numels = [t.numel() for t in tensors]
    table = address_table([addresses, numels], device)
    tensor_index, chunk_index = chunk_table(numels, chunk, device)
    remaining = torch.tensor(kept, dtype=torch.int64, device=device)
    prefix = torch.zeros((), dtype=torch.int64, device=device)
    prefix_shift = 31
    for shift, width in _DIGITS:
        hist = torch.zeros(1 << width, dtype=torch.int64, device=device)
        _radix_histogram_kernel[(tensor_index.numel(),)](
            table, tensor_index, chunk_index, hist, prefix,
            SHIFT=shift, PREFIX_SHIFT=prefix_shift, HAS_PREFIX=prefix_shift < 31,
            BINS=1 << width, DTYPE=_TORCH_TO_TL[tensors[0].dtype],
            ALIGNED=all_aligned(addresses), CHUNK=chunk, BLOCK=block,
            num_warps=8,
        )  # fmt: skip
        at_or_above = hist.flip(0).cumsum(0).flip(0)  # count with digit >= b
        digit = (at_or_above >= remaining).sum() - 1
        remaining = remaining - (at_or_above[digit] - hist[digit])
        prefix = (prefix << width) | digit
        prefix_shift = shift
    return prefix.to(torch.int32).view(torch.float32)


def global_magnitude_threshold(tensors: Sequence[torch.Tensor], kept: int) -> torch.Tensor:
    """The ``kept``-th largest ``|w|`` over all tensors, by radix select.

    Reads every weight three times and never sorts or concatenates them; the result
    stays on the device (no synchronisation). Keeping ``|w| >= threshold`` keeps
    ``kept`` weights when there are no ties at the threshold. NaNs count as larger
    than every number.

    Args:
        tensors: Weight tensors on one device (float32, bfloat16 or float16; any
            shapes).
        kept: Number of weights to keep, ``1 <= kept <= total``.

    Returns:
        0-d float32 tensor on the tensors' device.

    Raises:
        ValueError: If ``kept`` is out of range.
    """
    tensors = [t.detach() for t in tensors]
    total = sum(t.numel() for t in tensors)
    if not 1 <= kept <= total:
        raise ValueError(f"kept={kept} out of range for {total} weights")
    usable = kernels_run_on(tensors[0].device) and all(
        t.dtype == tensors[0].dtype and t.dtype in _TORCH_TO_TL for t in tensors
    )
    if not usable:
        return global_magnitude_threshold_reference(tensors, kept)
    return _launch_radix_select([t.contiguous() for t in tensors], kept, chunk=65536, block=4096)
