"""N:M mask computation: keep the n largest scores of every m consecutive ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._multi_tensor import address_table, all_aligned, chunk_table
from ._triton import kernels_run_on, tl, triton
from .reference import nm_topk_mask_reference

_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def nm_topk_configs() -> list[triton.Config]:
    """Autotuning candidates (groups per iteration, warps) for ``_nm_topk_kernel``."""
    return [
        triton.Config({"BLOCK_G": bg}, num_warps=w)
        for bg, w in ((256, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8))
    ]


def _interpreter_prune(configs, named_args, **kwargs):
    # Under TRITON_INTERPRET=1 timing candidates is meaningless and slow: keep one.
    return configs[:1] if kernels_run_on(torch.device("cpu")) else configs


@triton.autotune(
    configs=nm_topk_configs(),
    key=["M_POW2", "SCORE_DTYPE", "ALIGNED", "WORDS"],
    prune_configs_by={"early_config_prune": _interpreter_prune},
)
@triton.jit
def _nm_topk_kernel(
    table, tensor_index, chunk_index, out_ptr, N,
    M: tl.constexpr, M_POW2: tl.constexpr, SCORE_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    WORDS: tl.constexpr,
    CHUNK_G: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    row = table + tl.load(tensor_index + tl.program_id(0)) * 3
    s_ptr = tl.load(row).to(tl.pointer_type(SCORE_DTYPE))
    if ALIGNED:
        s_ptr = tl.multiple_of(s_ptr, 16)
    out_base = tl.multiple_of(tl.load(row + 1), 16)
    groups = tl.load(row + 2)
    j = tl.arange(0, M_POW2)[None, :]
    first = tl.load(chunk_index + tl.program_id(0)) * CHUNK_G
    for start in range(0, CHUNK_G, BLOCK_G):
        g = first + start + tl.arange(0, BLOCK_G)
        offs = g[:, None] * M + j
        valid = (g[:, None] < groups) & (j < M)
        # One 16-byte load per group of 4 fp32 scores; a thread holds whole groups, so
        # the ranking below stays in registers (no 3-D broadcast, no layout conversion
        # through shared memory as the pairwise [G, M, M] form needed).
        s = tl.load(s_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        beaten = tl.zeros([BLOCK_G, M_POW2], dtype=tl.int32)
        for k in tl.static_range(M_POW2):
            sk = tl.max(tl.where(j == k, s, float("-inf")), axis=1)[:, None]
            # Column k beats element j if larger, or equal and earlier (ties: lower index).
            beaten += ((sk > s) | ((sk == s) & (k < j))).to(tl.int32)
        keep = (beaten < N).to(tl.int32)
        if WORDS:
            # Four mask bytes per 32-bit store: byte b of word w is element 4w + b.
            for w in tl.static_range(M // 4):
                in_word = (j >= 4 * w) & (j < 4 * w + 4)
                word = tl.sum(tl.where(in_word, keep << (8 * (j - 4 * w)), 0), axis=1)
                w_ptr = (out_ptr + out_base).to(tl.pointer_type(tl.int32), bitcast=True)
                tl.store(w_ptr + g * (M // 4) + w, word, mask=g < groups)
        else:
            tl.store(out_ptr + out_base + offs, keep.to(tl.uint8), mask=valid)


_NM_TABLES: dict[tuple, tuple] = {}


def _nm_plan(scores: list[torch.Tensor], m: int) -> tuple:
    """Device tables and output layout of a launch, cached by addresses and shapes."""
    key = (scores[0].device, m, tuple((s.data_ptr(), tuple(s.shape)) for s in scores))
    plan = _NM_TABLES.get(key)
    if plan is None:
        device = scores[0].device
        numels = [s.numel() for s in scores]
        # 16-byte aligned slots, so the kernel's word stores stay aligned.
        slots = [(size + 15) // 16 * 16 for size in numels]
        offsets = [0]
        for slot in slots:
            offsets.append(offsets[-1] + slot)
        addresses = [s.data_ptr() for s in scores]
        groups = [k // m for k in numels]
        table = address_table([addresses, offsets[:-1], groups], device)
        tensor_index, chunk_index = chunk_table(groups, _CHUNK_G, device)
        aligned = all_aligned(addresses) and (m * scores[0].element_size()) % 16 == 0
        shapes = [tuple(s.shape) for s in scores]
        padded = [slot != size for slot, size in zip(slots, numels, strict=True)]
        plan = (
            table,
            tensor_index,
            chunk_index,
            offsets[-1],
            slots,
            shapes,
            padded,
            numels,
            aligned,
        )
        if len(_NM_TABLES) >= 16:
            _NM_TABLES.pop(next(iter(_NM_TABLES)))
        _NM_TABLES[key] = plan
    return plan


_CHUNK_G = 4096


def _launch_nm_topk(scores: list[torch.Tensor], n: int, m: int) -> list[torch.Tensor]:
    table, tensor_index, chunk_index, total, slots, shapes, padded, numels, aligned = _nm_plan(
        scores, m
    )
    out = torch.empty(total, dtype=torch.bool, device=scores[0].device)
    m_pow2 = triton.next_power_of_2(m)
    _nm_topk_kernel[(tensor_index.numel(),)](
        table, tensor_index, chunk_index, out.view(torch.uint8), n,
        M=m, M_POW2=m_pow2, WORDS=m == m_pow2 and m % 4 == 0,
        SCORE_DTYPE=_TORCH_TO_TL[scores[0].dtype], ALIGNED=aligned, CHUNK_G=_CHUNK_G,
    )  # fmt: skip
    parts = torch.split(out, slots)
    if not any(padded):
        return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]
    return [
        (part[:size] if pad else part).view(shape)
        for part, shape, pad, size in zip(parts, shapes, padded, numels, strict=True)
    ]


def nm_topk_masks(scores: Sequence[torch.Tensor], n: int, m: int) -> list[torch.Tensor]:
    """N:M masks for many tensors in one kernel launch.

    In every group of ``m`` consecutive elements along the last dim, keeps exactly the
    ``n`` with the largest score; ties go to the lower index. One launch covers all
    tensors (per score dtype), and the masks are views of one bool buffer.

    Args:
        scores: Tensors (any rank >= 1) whose last dim is a multiple of ``m``, on one
            device; float32, bfloat16 or float16.
        n: Kept per group, ``0 <= n <= m``.
        m: Group size, ``1 <= m <= 32`` for the kernel.

    Returns:
        Bool masks, one per score tensor, of the same shapes.

    Raises:
        ValueError: If a last dim is not a multiple of ``m`` or ``n``/``m`` are out of range.
    """
    scores = list(scores)
    for s in scores:
        if s.dim() == 0 or s.shape[-1] % m != 0 or not 0 <= n <= m:
            raise ValueError(
                f"need last dim % m == 0 and 0 <= n <= m (shape {tuple(s.shape)}, {n}:{m})"
            )
    if not scores:
        return []
    usable = (
        kernels_run_on(scores[0].device)
        and m <= 32
        and all(s.dtype == scores[0].dtype and s.dtype in _TORCH_TO_TL for s in scores)
    )
    if not usable:
        return [nm_topk_mask_reference(s, n, m) for s in scores]
    return _launch_nm_topk([s.contiguous() for s in scores], n, m)


def nm_topk_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M mask of one tensor (see ``nm_topk_masks``).

    Args:
        score: Tensor whose last dim is a multiple of ``m``.
        n: Kept per group.
        m: Group size.

    Returns:
        Bool mask of ``score``'s shape.

    Raises:
        ValueError: As ``nm_topk_masks``.
    """
    return nm_topk_masks([score], n, m)[0]
