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

**The envelope.** cuSPARSELt is called (compress, search, matmul) only for weights of at
least :data:`SPARSE_MIN_FEATURES` outputs and inputs and products of at least
:data:`SPARSE_MIN_TOKENS` tokens: at 128 tokens (fp16, 128 -> 256 and 256 -> 128) its
search failed with a CUDA internal error and the next kernel with an illegal instruction,
which ends the CUDA context. The functions here raise ``RuntimeError`` outside it, so a
caller that forgot :func:`envelope_problem` fails in Python, not in the driver.

**Bytes per weight entry** (of the ``(out, in)`` weight; cuSPARSELt's packed size is its
own, about 1.125 B at 16 bits: half the entries' values plus 2 bits of metadata per kept
value): a :class:`PackedWeight` holds the packed copy (~1.125 B) and the kept positions as
uint8 (0.5 B). Packing adds, for its duration, the masked operand in the compute dtype
(2 B), ``_cslt_compress``'s reference copy for the layout check (~1.125 B) and a probe of
:data:`SPARSE_MIN_TOKENS` rows. Positions and refreshes work in row chunks of
:data:`CHUNK_ENTRIES` weight entries: at most 128 MiB of int64 sort indices while finding
positions, 64 MiB of int64 gather index while refreshing (and 32 MiB of gathered values
from float32 weights).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

DTYPES = (torch.bfloat16, torch.float16)  # what cuSPARSELt packs and multiplies
# what the 2:4 layer's sparse route takes: on an H100 (torch 2.11, cuSPARSELt 0.8) the
# algorithm search of an fp16 operand failed with "internal error when calling
# cusparseLtMatmulSearch" at 128->256 with 128 tokens and at 1024x1024 with 2048 tokens,
# and the CUDA context died with it; bf16 ran at every shape measured (BERT-large, LLM)
SPARSE_ROUTE_DTYPES = (torch.bfloat16,)
SPARSE_MULTIPLE = 16  # rows and columns of the packed operand (bf16/fp16)
TOKEN_MULTIPLE = 8  # columns of the dense operand
# The envelope inside which cuSPARSELt is called: conservative starting values, to be
# calibrated on a GPU (the smallest shapes and token counts where compress, search and mm
# run cleanly and the measured choice can go sparse at all).
SPARSE_MIN_FEATURES = 1024  # out_features and in_features, each
SPARSE_MIN_TOKENS = 1024  # rows of the dense operand (tokens, or dY's rows)
CHUNK_ENTRIES = 1 << 24  # weight entries per row chunk of positions and refreshes


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


def envelope_problem(out_features: int | None = None, in_features: int | None = None,
                     tokens: int | None = None) -> str | None:
    """Why a product with these sizes (those given) stays outside the envelope where
    cuSPARSELt is called (module doc), or None."""
    small = [f"{name} {size}" for name, size in (("out_features", out_features),
                                                  ("in_features", in_features))
             if size is not None and size < SPARSE_MIN_FEATURES]
    if small:
        return (f"{' and '.join(small)} under {SPARSE_MIN_FEATURES} (SPARSE_MIN_FEATURES: "
                "cuSPARSELt is called only on shapes inside its tested envelope, and cuBLAS "
                "is faster there)")
    if tokens is not None and tokens < SPARSE_MIN_TOKENS:
        return (f"{tokens} tokens, under {SPARSE_MIN_TOKENS} (SPARSE_MIN_TOKENS: cuSPARSELt's "
                "search crashed the CUDA context at 128 tokens, and cuBLAS is faster there)")
    return None


def _check_envelope(what: str, **sizes: int) -> None:
    """Raise ``RuntimeError`` where :func:`envelope_problem` of ``sizes`` names one."""
    if problem := envelope_problem(**sizes):
        raise RuntimeError(f"not calling cuSPARSELt ({what}): {problem}; the 2:4 layer runs "
                           "cuBLAS there (SemiStructuredLinear.path_problem)")


@dataclass(frozen=True)
class Algorithm:
    """cuSPARSELt's plan choice for one operand shape: ``_cslt_sparse_mm``'s arguments."""

    alg_id: int = 0
    split_k: int = 1
    split_k_mode: int = -1


def search_algorithm(packed: Tensor, dense_t: Tensor) -> Algorithm:
    """cuSPARSELt's fastest plan for ``packed @ dense_t`` (its own timing search); the
    default plan (``alg_id=0``) measured 0.6-0.85x of cuBLAS on an H100 at LLM shapes.

    Raises:
        RuntimeError: ``dense_t`` outside the envelope (module doc).
    """
    _check_envelope("search", in_features=dense_t.shape[0], tokens=dense_t.shape[1])
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
    (n x k)``: ``(n x m)`` row-major, through ``transpose_result`` (no copies).

    Raises:
        RuntimeError: ``dense`` outside the envelope (module doc).
    """
    _check_envelope("matmul", in_features=dense.shape[1], tokens=dense.shape[0])
    return torch._cslt_sparse_mm(packed, dense.t(), bias, transpose_result=True,
                                 alg_id=algorithm.alg_id, split_k=algorithm.split_k,
                                 split_k_mode=algorithm.split_k_mode)


def _compress(operand: Tensor) -> Tensor:
    """``torch._cslt_compress`` of a 2:4 ``(rows, cols)`` operand inside the envelope."""
    _check_envelope("compress", out_features=operand.shape[0], in_features=operand.shape[1])
    return torch._cslt_compress(operand)


def row_chunks(rows: int, cols: int) -> Iterator[slice]:
    """Slices of ``rows`` holding at most :data:`CHUNK_ENTRIES` entries of ``cols`` each
    (at least one row)."""
    step = max(1, CHUNK_ENTRIES // cols)
    for start in range(0, rows, step):
        yield slice(start, start + step)


def masked_operand(weight: Tensor, mask: Tensor, transposed: bool, dtype: torch.dtype
                   ) -> Tensor:
    """``weight * mask`` (transposed: its transpose) as a contiguous ``dtype`` tensor, written
    in row chunks: no float32 copy of the whole weight."""
    source, kept = (weight.t(), mask.t()) if transposed else (weight, mask)
    operand = torch.empty(source.shape, dtype=dtype, device=weight.device)
    for rows in row_chunks(*source.shape):
        operand[rows].copy_(source[rows]).masked_fill_(~kept[rows], 0)
    return operand


def kept_positions(mask: Tensor, transposed: bool = False) -> Tensor:
    """uint8 ``(rows, cols / 4, 2)``: the positions (0-3) of the 2 kept entries of every
    group of 4, ascending, for a 2:4 ``mask`` (transposed: of ``mask.t()``); by row chunks,
    with no device sync."""
    operand_mask = mask.t() if transposed else mask
    rows, cols = operand_mask.shape
    positions = torch.empty(rows, cols // 4, 2, dtype=torch.uint8, device=mask.device)
    for chunk in row_chunks(rows, cols):
        groups = operand_mask[chunk].reshape(-1, cols // 4, 4).to(torch.uint8)
        # a stable descending sort puts the 2 kept entries first, in ascending order
        positions[chunk] = groups.argsort(dim=-1, descending=True, stable=True)[..., :2]
    return positions


@dataclass
class PackedWeight:
    """One operand packed for cuSPARSELt: the weight (``transposed=False``) or its transpose,
    in ``dtype``, for a fixed 2:4 mask.

    Build with :meth:`pack`; after an optimizer step call :meth:`refresh`.
    """

    packed: Tensor
    positions: Tensor | None  # uint8 (rows, cols / 4, 2): kept_positions; None if not fast
    mask: Tensor  # of the weight, (out, in): the layer's buffer, not a copy
    transposed: bool
    fast: bool  # values-only refresh verified against _cslt_compress
    algorithms: dict[int, Algorithm] = field(default_factory=dict)  # by token count

    @classmethod
    @torch.no_grad()
    def pack(cls, weight: Tensor, mask: Tensor, dtype: torch.dtype,
             transposed: bool = False) -> PackedWeight:
        """Pack ``weight * mask`` (``(out, in)``; transposed: its ``(in, out)`` transpose).

        Raises:
            RuntimeError: the weight is outside the envelope (module doc).
        """
        _check_envelope("pack", out_features=weight.shape[0], in_features=weight.shape[1])
        operand = masked_operand(weight, mask, transposed, dtype)
        full = _compress(operand)  # the reference for the layout check
        operand.copy_(mask.t() if transposed else mask)  # ones where kept: the metadata
        packed = cls(_compress(operand), kept_positions(mask, transposed), mask, transposed,
                     fast=True)
        del operand
        packed.refresh(weight)
        probe = torch.randn(SPARSE_MIN_TOKENS, packed.shape[1], device=weight.device,
                            dtype=dtype)
        if not torch.equal(sparse_mm(packed.packed, probe, Algorithm()),
                           sparse_mm(full, probe, Algorithm())):
            warnings.warn("cuSPARSELt's packed layout is not the one the values-only refresh "
                          "writes; every optimizer step repacks in full (slower)", stacklevel=2)
            packed = cls(full, None, mask, transposed, fast=False)
        return packed

    @property
    def shape(self) -> tuple[int, int]:
        """The packed operand's ``(rows, cols)``: ``(out, in)``, transposed ``(in, out)``."""
        rows, cols = self.mask.shape
        return (cols, rows) if self.transposed else (rows, cols)

    @torch.no_grad()
    def refresh(self, weight: Tensor) -> None:
        """Rewrite the packed values from ``weight`` (same mask): ``values[r, g, j] =
        source[r, 4 g + positions[r, g, j]]``, by row chunks."""
        if not self.fast:
            self.packed = _compress(masked_operand(weight, self.mask, self.transposed,
                                                   self.packed.dtype))
            return
        source = weight.t() if self.transposed else weight  # a view: no copy
        rows, cols = source.shape
        groups = source.reshape(rows, cols // 4, 4)  # a view of the transpose too
        values = self.packed.view(-1)[: rows * cols // 2].view(rows, cols // 4, 2)
        for chunk in row_chunks(rows, cols):
            index = self.positions[chunk].long()
            if weight.dtype == values.dtype:  # straight into the packed buffer
                torch.gather(groups[chunk], -1, index, out=values[chunk])
            else:  # float32 master weights under autocast: a chunk of them at a time
                values[chunk].copy_(groups[chunk].gather(-1, index))

    def algorithm(self, dense: Tensor) -> Algorithm:
        """The searched plan for a dense operand of ``dense``'s token count (cached)."""
        tokens = dense.shape[0]
        if tokens not in self.algorithms:
            self.algorithms[tokens] = search_algorithm(self.packed, dense.t())
        return self.algorithms[tokens]

    def matmul(self, dense: Tensor, bias: Tensor | None = None) -> Tensor:
        """``dense @ operand^T (+ bias)`` for a contiguous ``(tokens, cols)`` ``dense``, on
        the searched plan."""
        return sparse_mm(self.packed, dense, self.algorithm(dense), bias)
