"""N:M mask computation: keep the n largest scores of every m consecutive ones."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

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


TILE_BUDGET = 16384  # BLOCK_G x M_POW2 scores per iteration: more crashed Triton 3.6 at M = 32


def _prune_configs(configs, named_args, **kwargs):
    """Tiles of at most TILE_BUDGET scores (a thread holds whole groups, so larger tiles at
    M = 32 exhaust registers); under TRITON_INTERPRET=1 one candidate (timing is moot)."""
    m_pow2 = kwargs.get("M_POW2", named_args.get("M_POW2", 1))
    fitting = [c for c in configs if c.kwargs["BLOCK_G"] * m_pow2 <= TILE_BUDGET]
    return fitting[:1] if kernels_run_on(torch.device("cpu")) else fitting


@triton.autotune(
    configs=nm_topk_configs(),
    key=["M_POW2", "SCORE_DTYPE", "ALIGNED", "WORDS"],
    prune_configs_by={"early_config_prune": _prune_configs},
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


_CHUNK_G = 4096
_MAX_PLANS = 16
_DTYPE = operator.attrgetter("dtype")


class _NmPlan:
    """Everything about a launch that depends only on the score tensors' metadata.

    Valid for a score list while the tensors have the same addresses, shapes and dtype
    and are contiguous (``matches``); the values may change freely. The output buffer is
    *not* part of the plan: every call allocates a fresh one, so masks returned by one
    call are never overwritten by a later call. The table holds each tensor's output
    offset (not address), so it stays valid for any buffer.

    The output layout groups tensors of one shape into consecutive slots, so a group's
    masks come out of one ``as_strided(...).unbind(0)`` (one C++ call for, e.g., the 96
    1024x1024 matrices of BERT-large) instead of one Python ``view`` per tensor, and an
    ``itemgetter`` puts them back in the caller's order.
    """

    __slots__ = (
        "device", "m", "dtype", "ptrs", "sizes", "table", "tensor_index", "chunk_index",
        "grid", "total", "aligned", "groups", "reorder", "count",
    )  # fmt: skip

    def __init__(self, scores: list[torch.Tensor], m: int) -> None:
        self.device = scores[0].device
        self.m = m
        self.dtype = scores[0].dtype
        self.ptrs = list(map(torch.Tensor.data_ptr, scores))
        self.sizes = list(map(torch.Tensor.size, scores))
        self.count = len(scores)
        by_shape: dict[torch.Size, list[int]] = {}
        for i, size in enumerate(self.sizes):
            by_shape.setdefault(size, []).append(i)
        offsets = [0] * len(scores)
        position = [0] * len(scores)  # index of tensor i in the flat list of group views
        self.groups = []
        total = flat = 0
        for size, members in by_shape.items():
            numel = size.numel()
            slot = (numel + 15) // 16 * 16  # 16-byte aligned slots: word stores stay aligned
            strides = [1] * len(size)
            for d in range(len(size) - 2, -1, -1):
                strides[d] = strides[d + 1] * size[d + 1]
            self.groups.append(((len(members), *size), (slot, *strides), total))
            for i in members:
                offsets[i] = total
                position[i] = flat
                total += slot
                flat += 1
        self.total = total
        self.reorder = operator.itemgetter(*position)
        numels = [size.numel() for size in self.sizes]
        groups = [k // m for k in numels]
        self.table = address_table([self.ptrs, offsets, groups], self.device)
        self.tensor_index, self.chunk_index = chunk_table(groups, _CHUNK_G, self.device)
        self.grid = self.tensor_index.numel()
        self.aligned = all_aligned(self.ptrs) and (m * scores[0].element_size()) % 16 == 0

    def matches(self, scores: list[torch.Tensor], m: int) -> bool:
        """Whether this plan is valid for ``scores`` (cheap: a few C-level maps)."""
        return (
            self.m == m
            and self.count == len(scores)
            and scores[0].data_ptr() == self.ptrs[0]
            and scores[0].device == self.device
            and list(map(torch.Tensor.data_ptr, scores)) == self.ptrs
            and list(map(torch.Tensor.size, scores)) == self.sizes
            and all(map(torch.Tensor.is_contiguous, scores))
            and all(map(operator.is_, map(_DTYPE, scores), repeat(self.dtype, self.count)))
        )

    def views(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The per-tensor masks as views of ``out`` (bool, ``total`` elements)."""
        flat: list[torch.Tensor] = []
        for size, stride, offset in self.groups:
            flat += out.as_strided(size, stride, offset).unbind(0)
        return list(self.reorder(flat)) if self.count > 1 else flat


_NM_PLANS: list[_NmPlan] = []  # most recently used first
plan_builds = 0  # plans built so far (tests and benchmarks read it)


def _nm_plan(scores: list[torch.Tensor], m: int) -> _NmPlan | None:
    """The cached plan that matches ``scores``, or None."""
    for i, plan in enumerate(_NM_PLANS):
        if plan.matches(scores, m):
            if i:
                _NM_PLANS.insert(0, _NM_PLANS.pop(i))
            return plan
    return None


def _build_nm_plan(scores: list[torch.Tensor], m: int) -> _NmPlan:
    global plan_builds
    plan = _NmPlan(scores, m)
    plan_builds += 1
    _NM_PLANS.insert(0, plan)
    del _NM_PLANS[_MAX_PLANS:]
    return plan


def clear_nm_plan_cache() -> None:
    """Drop the cached launch plans (their device tables are freed with them)."""
    _NM_PLANS.clear()


def _launch_nm_topk(
    scores: list[torch.Tensor], n: int, m: int, plan: _NmPlan
) -> list[torch.Tensor]:
    out = torch.empty(plan.total, dtype=torch.uint8, device=plan.device)
    if plan.grid:
        m_pow2 = triton.next_power_of_2(m)
        _nm_topk_kernel[(plan.grid,)](
            plan.table, plan.tensor_index, plan.chunk_index, out, n,
            M=m, M_POW2=m_pow2, WORDS=m == m_pow2 and m % 4 == 0,
            SCORE_DTYPE=_TORCH_TO_TL[plan.dtype], ALIGNED=plan.aligned, CHUNK_G=_CHUNK_G,
        )  # fmt: skip
    return plan.views(out.view(torch.bool))


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
    if not scores:
        return []
    if not 0 <= n <= m:
        raise ValueError(f"need 0 <= n <= m ({n}:{m})")
    # Fast path: a cached plan for these addresses/shapes/dtype (shapes checked when built).
    plan = _nm_plan(scores, m)
    if plan is not None and (plan.device.type == "cuda" or kernels_run_on(plan.device)):
        return _launch_nm_topk(scores, n, m, plan)
    for s in scores:
        if s.dim() == 0 or s.shape[-1] % m != 0:
            raise ValueError(
                f"need last dim % m == 0 and 0 <= n <= m (shape {tuple(s.shape)}, {n}:{m})"
            )
    usable = (
        kernels_run_on(scores[0].device)
        and m <= 32
        and all(s.dtype == scores[0].dtype and s.dtype in _TORCH_TO_TL for s in scores)
        and all(s.device == scores[0].device for s in scores)
    )
    if not usable:
        return [nm_topk_mask_reference(s, n, m) for s in scores]
    scores = [s.contiguous() for s in scores]
    plan = _nm_plan(scores, m) or _build_nm_plan(scores, m)
    return _launch_nm_topk(scores, n, m, plan)


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
