"""Zero the pruned entries of many tensors in one launch: ``x[~mask] = 0`` for each pair.

The enforcement pass of the engine's hook path: pruned gradients before the optimizer
step, pruned weights after it. The kernel never reads ``x``: it reads the mask (1 byte per
element) and stores zeros where the mask is False, so a fp32 tensor at sparsity s moves
1 + 4 s bytes per element (3 B at 2:4, 4.6 B at 90%); torch's ``masked_fill_`` with an
inverted mask moves 1 + 1 + 1 + 4 + 4 s. One launch covers every tensor of a dtype, with a
launch plan (device tables) cached per set of addresses, so a step costs one dictionary
lookup and one launch on the host.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

import torch

from ._multi_tensor import address_table, chunk_table
from ._triton import tl, triton
from .reference import zero_pruned_reference

_CHUNK = 16384  # elements per program: 4 iterations of BLOCK
_BLOCK = 4096
_NUM_WARPS = 8
_MAX_PLANS = 16
_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                torch.float16: tl.float16, torch.float64: tl.float64}
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


@triton.jit
def _zero_pruned_kernel(table, tensor_index, chunk_index, DTYPE: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = table + tl.load(tensor_index + tl.program_id(0)) * 3
    x_ptr = tl.load(row).to(tl.pointer_type(DTYPE))
    k_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int8))
    numel = tl.load(row + 2)
    first = tl.load(chunk_index + tl.program_id(0)) * CHUNK
    zero = tl.zeros([BLOCK], dtype=DTYPE)
    for start in range(0, CHUNK, BLOCK):
        offs = first + start + tl.arange(0, BLOCK)
        inside = offs < numel
        keep = tl.load(k_ptr + offs, mask=inside, other=1)
        tl.store(x_ptr + offs, zero, mask=inside & (keep == 0))


_PLANS: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, tl.dtype]] = \
    OrderedDict()


def _plan_key(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> tuple:
    """Addresses, sizes and dtypes: what a plan's device table and launch depend on."""
    return (tuple(map(_DATA_PTR, tensors)), tuple(map(_DATA_PTR, masks)),
            tuple(map(torch.Tensor.numel, tensors)), tuple(map(_DTYPE, tensors)))


def _one_launch(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> bool:
    """Whether all pairs fit one launch: one float dtype, one CUDA device, everything
    contiguous, masks bool of the tensors' sizes. CPU tensors take the reference even under
    ``TRITON_INTERPRET=1``: the interpreter would make every training step of the CPU tests
    slow; the tests call :func:`launch_zero_pruned` directly."""
    first = tensors[0]
    return (first.dtype in _TORCH_TO_TL and first.is_cuda
            and all(map(operator.is_, map(_DTYPE, tensors), repeat(first.dtype)))
            and all(map(operator.eq, map(_DEVICE, tensors), repeat(first.device)))
            and all(map(operator.eq, map(_DEVICE, masks), repeat(first.device)))
            and all(map(operator.is_, map(_DTYPE, masks), repeat(torch.bool)))
            and list(map(torch.Tensor.numel, masks)) == list(map(torch.Tensor.numel, tensors))
            and all(map(torch.Tensor.is_contiguous, tensors))
            and all(map(torch.Tensor.is_contiguous, masks)))


def _launch(plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tl.dtype]) -> None:
    table, tensor_index, chunk_index, dtype = plan
    if tensor_index.numel():
        _zero_pruned_kernel[(tensor_index.numel(),)](
            table, tensor_index, chunk_index, DTYPE=dtype, CHUNK=_CHUNK, BLOCK=_BLOCK,
            num_warps=_NUM_WARPS)


def launch_zero_pruned(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> None:
    """One launch over contiguous tensors of one dtype and device with their bool masks.

    The launch plan (device tables) is cached by the tensors' and masks' addresses and
    sizes: values may change freely, any new address builds a new plan.
    """
    key = _plan_key(tensors, masks)
    plan = _PLANS.get(key)
    if plan is None:
        device = tensors[0].device
        plan = _PLANS[key] = (address_table(key[:3], device),
                              *chunk_table(key[2], _CHUNK, device), _TORCH_TO_TL[key[3][0]])
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _launch(plan)


def zero_pruned_(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> None:
    """In place, for every pair: ``tensor[~mask] = 0`` (NaN and inf included).

    Contiguous float tensors on CUDA go through one launch per dtype and device; the rest
    through :func:`zero_pruned_reference`. A list seen before costs five C-level maps, a
    dictionary lookup and the launch.

    Args:
        tensors: tensors to zero at pruned positions.
        masks: bool masks of the same shapes and devices, True where kept.
    """
    if not tensors:
        return
    if tensors[0].is_cuda:
        plan = _PLANS.get(_plan_key(tensors, masks))
        if plan is not None and all(map(torch.Tensor.is_contiguous, tensors)):
            _launch(plan)
            return
        if _one_launch(tensors, masks):
            launch_zero_pruned(tensors, masks)
            return
    groups: dict[tuple, tuple[list, list]] = {}
    for tensor, mask in zip(tensors, masks, strict=True):
        fits = _one_launch([tensor], [mask])
        group = groups.setdefault((fits, tensor.dtype, tensor.device) if fits else (), ([], []))
        group[0].append(tensor)
        group[1].append(mask)
    for key, (group_tensors, group_masks) in groups.items():
        if key:
            launch_zero_pruned(group_tensors, group_masks)
        else:
            zero_pruned_reference(group_tensors, group_masks)
