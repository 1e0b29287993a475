"""The 2:4 Linear's autograd and functional.

Forward ``Y = X W^T + b`` on cuSPARSELt when a packed weight is given, cuBLAS otherwise;
``dX = dY W`` on cuSPARSELt when the packed transpose is given (a 2:4 mask in both
dimensions), cuBLAS otherwise; ``dW = (dY^T X) * M`` always dense (cuSPARSELt has no
sampled product), masked so that pruned weights and their optimizer state stay zero.
``W`` is the dense parameter (zeros at pruned positions); under autocast the products run
in the autocast dtype and the weight gradient comes back in the parameter's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparse_training.kernels.semi_structured.cusparselt import PackedWeight, sparse_mm


class SemiStructuredLinearFunction(torch.autograd.Function):
    """Autograd of the 2:4 Linear on 2-D contiguous ``x`` in the compute dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None,
                packed: PackedWeight | None, packed_t: PackedWeight | None) -> Tensor:
        ctx.save_for_backward(x, weight, mask)
        ctx.packed_t, ctx.bias_dtype = packed_t, None if bias is None else bias.dtype
        bias = None if bias is None else bias.to(x.dtype)
        if packed is not None:
            return sparse_mm(packed.packed, x, packed.algorithm(x), bias)
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, mask = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        needs_x, needs_w, _, needs_b, _, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if needs_x:
            packed_t = ctx.packed_t
            grad_x = (sparse_mm(packed_t.packed, grad_out, packed_t.algorithm(grad_out))
                      if packed_t is not None else grad_out @ weight.to(grad_out.dtype))
        if needs_w:
            grad_w = (grad_out.T @ x).mul_(mask).to(weight.dtype)
        if needs_b and ctx.bias_dtype is not None:
            grad_b = grad_out.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, None, grad_b, None, None


def semi_structured_linear(x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None = None,
                           packed: PackedWeight | None = None,
                           packed_t: PackedWeight | None = None) -> Tensor:
    """``x W^T + b`` for a 2:4 ``weight`` (zeros where ``mask`` is False) of any leading
    dimensions; the forward on ``packed`` and the input gradient on ``packed_t`` where given
    (both packed in ``x``'s dtype), cuBLAS otherwise."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    y = SemiStructuredLinearFunction.apply(x2d, weight, mask, bias, packed, packed_t)
    return y.view(*x.shape[:-1], weight.shape[0])
