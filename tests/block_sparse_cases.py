"""Block-sparse test cases and their float64 reference, shared by the kernel tests and the
bad-input table.

The reference shares no code with the package: the dense weight is built by explicit loops
over the kept blocks (row-major order of the block mask), each cut at the weight's edge,
and the products are plain float64 matmuls. Padded tail entries of ``values`` are set to
NaN (or another poison) by default: the op must never use them.

Tolerances (of the output scale): fp32 runs accumulate in fp32 (interpreter: numpy fp32,
no TF32), so errors are ~1e-6; 16-bit inputs are rounded *before* the reference sees
them, leaving the fp32 accumulation and the final rounding of each output (relative 2^-8
for bf16, 2^-11 for fp16); float64 runs the pure-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparse_training.kernels.block_sparse import BlockTopology

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3,
             torch.bfloat16: 1e-2}


def block_mask_of(out_f: int, in_f: int, block: tuple[int, int], kind: str,
                  seed: int) -> Tensor:
    """``random`` (about half kept), ``all``, or ``empty_rows``: an output block row and an
    input block column with no kept block (their outputs are the bias, their dX zero)."""
    grid = (-(-out_f // block[0]), -(-in_f // block[1]))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(grid, generator=g) < 0.5
    if kind == "all":
        mask[:] = True
    elif kind == "empty_rows":
        mask[0] = False
        mask[:, 0] = False
        mask[-1, -1] = True
    return mask


def kept_blocks(mask: Tensor, out_f: int, in_f: int, block: tuple[int, int]):
    """(position in values, row slice, column slice, rows inside, columns inside) of each
    kept block, in row-major order."""
    r, c = block
    for p, (i, j) in enumerate(mask.nonzero().tolist()):
        h, w = min(r, out_f - i * r), min(c, in_f - j * c)
        yield p, slice(i * r, i * r + h), slice(j * c, j * c + w), h, w


def tail_mask(mask: Tensor, out_f: int, in_f: int, block: tuple[int, int]) -> Tensor:
    """Bool ``[nnz, R, C]``: the entries of kept blocks past the weight's edge."""
    tail = torch.ones(int(mask.sum()), *block, dtype=torch.bool)
    for p, _, _, h, w in kept_blocks(mask, out_f, in_f, block):
        tail[p, :h, :w] = False
    return tail


def dense_weight(values: Tensor, mask: Tensor, out_f: int, in_f: int) -> Tensor:
    """The float64 dense weight: kept blocks copied in one by one, zeros elsewhere."""
    weight = torch.zeros(out_f, in_f, dtype=torch.float64)
    for p, rows, cols, h, w in kept_blocks(mask, out_f, in_f, tuple(values.shape[1:])):
        weight[rows, cols] = values[p, :h, :w].double()
    return weight


def reference(mask: Tensor, values: Tensor, x: Tensor, bias: Tensor | None, grad: Tensor,
              out_f: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(Y, dX, dValues, dBias) of ``Y = X W^T + b`` in float64, ``dValues`` zero in tails."""
    in_f, block = x.shape[-1], tuple(values.shape[1:])
    weight = dense_weight(values, mask, out_f, in_f)
    x64, g64 = x.double().reshape(-1, in_f), grad.double().reshape(-1, out_f)
    out = x64 @ weight.t() + (0 if bias is None else bias.double())
    grad_weight = g64.t() @ x64
    grad_values = torch.zeros(values.shape, dtype=torch.float64)
    for p, rows, cols, h, w in kept_blocks(mask, out_f, in_f, block):
        grad_values[p, :h, :w] = grad_weight[rows, cols]
    return (out.view(*x.shape[:-1], out_f), (g64 @ weight).view(x.shape), grad_values,
            None if bias is None else g64.sum(0))


def assert_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """Max error within the dtype's tolerance of the output scale (NaN fails)."""
    scale = want.abs().max().clamp_min(1.0)
    err = (got.double() - want).abs().max()
    assert err <= TOLERANCE[dtype] * scale, \
        f"max error {err:.3g} > {TOLERANCE[dtype]} x {scale:.3g}"


def strided(t: Tensor, how: str) -> Tensor:
    """The same values as ``t`` in a non-contiguous layout: ``transposed`` (last two dims
    stored swapped), ``every_other`` (stride 2 along dim 0), ``offset_rows`` (a 2-D slice
    of a wider buffer: row stride > width, base off 16-byte alignment)."""
    if how == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    junk = float("nan") if t.dtype.is_floating_point else -1  # between the entries: unread
    if how == "every_other":
        buffer = torch.full((2 * t.shape[0], *t.shape[1:]), junk, dtype=t.dtype)
        buffer[::2] = t
        return buffer[::2]
    if how == "offset_rows":
        buffer = torch.full((t.shape[0], t.shape[1] + 7), junk, dtype=t.dtype)
        buffer[:, 3:3 + t.shape[1]] = t
        return buffer[:, 3:3 + t.shape[1]]
    raise AssertionError(how)


@dataclass
class Case:
    """One block-sparse product: topology, block mask and fresh random operands."""

    topology: BlockTopology
    mask: Tensor
    values: Tensor
    x: Tensor
    bias: Tensor
    grad: Tensor

    def leaves(self) -> Case:
        """The operands as leaves that require grad (strides kept)."""
        for name in ("values", "x", "bias"):
            setattr(self, name, getattr(self, name).detach().requires_grad_())
        return self

    def want(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        return reference(self.mask, self.values.detach(), self.x.detach(), self.bias.detach(),
                         self.grad, self.topology.out_features)


def make_case(out_f: int, in_f: int, tokens: int, block: tuple[int, int], kind: str = "random",
              dtype: torch.dtype = torch.float32, seed: int = 0, lead: tuple[int, ...] = (3,),
              tail: float = float("nan")) -> Case:
    """Fresh random operands (``x`` shaped ``(*lead, tokens, in_f)``), tails of ``values``
    set to ``tail``."""
    mask = block_mask_of(out_f, in_f, block, kind, seed)
    topology = BlockTopology.from_block_mask(mask, out_f, in_f, block)
    g = torch.Generator().manual_seed(seed + 1)
    values = torch.randn(topology.nnz, *block, generator=g).to(dtype)
    values[tail_mask(mask, out_f, in_f, block)] = tail
    x = torch.randn(*lead, tokens, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    grad = torch.randn(*lead, tokens, out_f, generator=g).to(dtype)
    return Case(topology, mask, values, x, bias, grad)
