"""cuSPARSELt through torch's private ops: packing a 2:4 weight, refreshing it after an
optimizer step, searching the algorithm, the sparse matmul.

cuSPARSELt multiplies a 2:4-sparse *left* operand ``A (m x k)``, 2 kept in every 4 along
``k``, by a dense ``B (k x n)``. A Linear's ``Y = X W^T`` is ``(W X^T)^T``: ``A = W`` and
``B = X^T`` (a transposed view of a contiguous ``X``, no copy), with ``transpose_result``
writing ``Y`` row-major directly. The input gradient ``dX = dY W = (W^T dY^T)^T`` needs
``W^T`` packed, so it is sparse only where the mask is 2:4 along both dimensions
(``2:4:2d``). ``torch._cslt_compress`` packs a weight that is already 2:4 (it does not
prune); its output is the kept values in row-major order (2 per group, ascending column)
followed by metadata that depends only on the mask (cuSPARSELt 0.8, checked bit-exact on an
H100). So while the mask holds, an optimizer step needs only the values rewritten
(:meth:`PackedWeight.refresh`, a gather: about 8x faster than ``_cslt_compress`` at LLM
shapes); the layout is undocumented, so each :class:`PackedWeight` checks once that a
product with the refreshed copy equals one with ``_cslt_compress``'s, and repacks in full
at every refresh if not. (Comparing the packed bytes is not a test: ``_cslt_compress``
leaves padding uninitialized, and bytewise checks failed at random on an H100.)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

DTYPES = (torch.bfloat16, torch.float16)
SPARSE_MULTIPLE = 16  # rows and columns of the packed operand (bf16/fp16)
TOKEN_MULTIPLE = 8  # columns of the dense operand


def cusparselt_problem(device: torch.device) -> str | None:
    """Why cuSPARSELt cannot run on ``device``, or None."""
    if device.type != "cuda":
        return f"cuSPARSELt runs on CUDA, not {device.type}"
    if not torch.backends.cusparselt.is_available():
        return "this torch build has no cuSPARSELt"
    return None


def shape_problem(out_features: int, in_features: int) -> str | None:
    """Why a weight of this shape cannot be packed for cuSPARSELt (bf16/fp16), or None."""
    bad = [f"{name} {size}" for name, size in (("out_features", out_features),
                                                ("in_features", in_features))
           if size % SPARSE_MULTIPLE]
    return (f"{' and '.join(bad)} not a multiple of {SPARSE_MULTIPLE} (cuSPARSELt)"
            if bad else None)


@dataclass(frozen=True)
class Algorithm:
    """cuSPARSELt's plan choice for one operand shape: ``_cslt_sparse_mm``'s arguments."""

    alg_id: int = 0
    split_k: int = 1
    split_k_mode: int = -1


def search_algorithm(packed: Tensor, dense_t: Tensor) -> Algorithm:
    """cuSPARSELt's fastest plan for ``packed @ dense_t`` (its own timing search); the
    default plan (``alg_id=0``) measured 0.6-0.85x of cuBLAS on an H100 at LLM shapes."""
    search = getattr(getattr(torch._C, "_cusparselt", None), "mm_search", None)
    if search is not None:  # torch >= 2.5: (alg_id, split_k, split_k_mode, max_alg_id)
        alg_id, split_k, split_k_mode, _ = search(packed, dense_t, None, None, None, True)
        return Algorithm(alg_id, split_k, split_k_mode)
    with warnings.catch_warnings():  # deprecated in favour of the above
        warnings.simplefilter("ignore")
        return Algorithm(torch._cslt_sparse_mm_search(packed, dense_t, transpose_result=True))


def sparse_mm(packed: Tensor, dense: Tensor, algorithm: Algorithm,
              bias: Tensor | None = None) -> Tensor:
    """``dense @ A^T (+ bias)`` for the packed ``A (m x k)`` and a contiguous ``dense
    (n x k)``: ``(n x m)`` row-major, through ``transpose_result`` (no copies)."""
    return torch._cslt_sparse_mm(packed, dense.t(), bias, transpose_result=True,
                                 alg_id=algorithm.alg_id, split_k=algorithm.split_k,
                                 split_k_mode=algorithm.split_k_mode)


def _kept_index(mask: Tensor) -> Tensor:
    """int64 ``(rows, cols / 4, 2)``: the positions (0-3) of the 2 kept entries of every
    group of 4, ascending, for a 2:4 ``mask``."""
    rows, cols = mask.shape
    return mask.view(rows, cols // 4, 4).nonzero()[:, 2].view(rows, cols // 4, 2)


@dataclass
class PackedWeight:
    """One operand packed for cuSPARSELt: the weight (``transposed=False``) or its transpose,
    in ``dtype``, for a fixed 2:4 mask.

    Build with :meth:`pack`; after an optimizer step call :meth:`refresh`.
    """

    packed: Tensor
    index: Tensor
    mask: Tensor  # of the weight, (out, in)
    transposed: bool
    fast: bool  # values-only refresh verified against _cslt_compress
    algorithms: dict[int, Algorithm] = field(default_factory=dict)  # by token count

    @classmethod
    @torch.no_grad()
    def pack(cls, weight: Tensor, mask: Tensor, dtype: torch.dtype,
             transposed: bool = False) -> PackedWeight:
        """Pack ``weight * mask`` (``(out, in)``; transposed: its ``(in, out)`` transpose)."""
        operand_mask = mask.t().contiguous() if transposed else mask
        full = torch._cslt_compress(_masked(weight, mask, transposed, dtype))
        template = torch._cslt_compress(operand_mask.to(dtype))  # metadata of the mask
        packed = cls(template, _kept_index(operand_mask), mask, transposed, fast=True)
        packed.refresh(weight)
        probe = torch.randn(TOKEN_MULTIPLE * 2, operand_mask.shape[1],
                            device=weight.device, dtype=dtype)
        if not torch.equal(sparse_mm(packed.packed, probe, Algorithm()),
                           sparse_mm(full, probe, Algorithm())):
            warnings.warn("cuSPARSELt's packed layout is not the one the values-only refresh "
                          "writes; every optimizer step repacks in full (slower)", stacklevel=2)
            packed = cls(full, packed.index, mask, transposed, fast=False)
        return packed

    @torch.no_grad()
    def refresh(self, weight: Tensor) -> None:
        """Rewrite the packed values from ``weight`` (same mask)."""
        if not self.fast:
            self.packed = torch._cslt_compress(
                _masked(weight, self.mask, self.transposed, self.packed.dtype))
            return
        source = weight.t() if self.transposed else weight  # a view: no copy
        rows, cols = source.shape
        groups = source.reshape(rows, cols // 4, 4)  # a view of the transpose too
        values = self.packed.view(-1)[: rows * cols // 2].view(rows, cols // 4, 2)
        if weight.dtype == values.dtype:  # no temporary (a full-size one at LLM shapes)
            torch.gather(groups, -1, self.index, out=values)
        else:  # fp32 master weights under autocast
            values.copy_(groups.gather(-1, self.index))

    def algorithm(self, dense: Tensor) -> Algorithm:
        """The searched plan for a dense operand of ``dense``'s token count (cached)."""
        tokens = dense.shape[0]
        if tokens not in self.algorithms:
            self.algorithms[tokens] = search_algorithm(self.packed, dense.t())
        return self.algorithms[tokens]


def _masked(weight: Tensor, mask: Tensor, transposed: bool, dtype: torch.dtype) -> Tensor:
    dense = torch.where(mask, weight, 0).to(dtype)
    return dense.t().contiguous() if transposed else dense
