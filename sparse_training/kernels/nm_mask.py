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
        for bg, w in ((256, 4), (512, 4), (1024, 8), (2048, 8))
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
    j = tl.arange(0, M_POW2)
    # before[i, k]: position k precedes position i within a group (wins a tie).
    before = j[None, :] < j[:, None]
    first = tl.load(chunk_index + tl.program_id(0)) * CHUNK_G
    for start in range(0, CHUNK_G, BLOCK_G):
        g = first + start + tl.arange(0, BLOCK_G)
        offs = g[:, None] * M + j[None, :]
        valid = (g[:, None] < groups) & (j[None, :] < M)
        s = tl.load(s_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        si = s[:, :, None]
        sk = s[:, None, :]
        beats = (sk > si) | ((sk == si) & before[None, :, :])
        keep = (tl.sum(beats.to(tl.int32), axis=2) < N).to(tl.int32)
        if WORDS:
            # Four mask bytes per 32-bit store: byte k of a word is element 4w + k.
            quads = tl.reshape(keep, [BLOCK_G, M // 4, 4])
            shift = 8 * tl.arange(0, 4)[None, None, :]
            word = tl.sum(quads << shift, axis=2)
            w_offs = g[:, None] * (M // 4) + tl.arange(0, M // 4)[None, :]
            w_ptr = (out_ptr + out_base).to(tl.pointer_type(tl.int32), bitcast=True)
            tl.store(w_ptr + w_offs, word, mask=g[:, None] < groups)
        else:
            tl.store(out_ptr + out_base + offs, keep.to(tl.uint8), mask=valid)


def _launch_nm_topk(
    scores: list[torch.Tensor], n: int, m: int, chunk_groups: int
) -> list[torch.Tensor]:
    device = scores[0].device
    numels = [s.numel() for s in scores]
    offsets = [0]
    for size in numels:  # 16-byte aligned slots, so the kernel can store 16 bytes at once
        offsets.append(offsets[-1] + (size + 15) // 16 * 16)
    out = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    addresses = [s.data_ptr() for s in scores]
    table = address_table([addresses, offsets[:-1], [k // m for k in numels]], device)
    tensor_index, chunk_index = chunk_table([k // m for k in numels], chunk_groups, device)
    m_pow2 = triton.next_power_of_2(m)
    _nm_topk_kernel[(tensor_index.numel(),)](
        table, tensor_index, chunk_index, out, n,
        M=m, M_POW2=m_pow2, WORDS=m == m_pow2 and m % 4 == 0, SCORE_DTYPE=_TORCH_TO_TL[scores[0].dtype],
        ALIGNED=all_aligned(addresses) and (m * scores[0].element_size()) % 16 == 0,
        CHUNK_G=chunk_groups,
    )  # fmt: skip
    flat = out.view(torch.bool)
    return [flat[o : o + s.numel()].view(s.shape) for o, s in zip(offsets, scores, strict=False)]


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
    return _launch_nm_topk([s.contiguous() for s in scores], n, m, chunk_groups=4096)


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
