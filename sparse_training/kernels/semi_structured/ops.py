"""The 2:4 Linear's autograd and functional.

Forward ``Y = X W^T + b`` on cuSPARSELt when a packed weight is given, cuBLAS otherwise;
``dX = dY W`` on cuSPARSELt when the packed transpose is given (a 2:4 mask in both
dimensions), cuBLAS otherwise; ``dW = (dY^T X) * M`` always dense (cuSPARSELt has no
sampled product), masked so that pruned weights and their optimizer state stay zero.
``W`` is the dense parameter with zeros at pruned positions, so the cuBLAS products use it
as it is: the dense route costs what ``nn.Linear`` costs plus one masked pass over dW,
which under autocast is the cast to the parameter's dtype that ``nn.Linear`` also pays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparse_training.kernels._autograd import refuse_create_graph
from sparse_training.kernels.semi_structured.cusparselt import PackedWeight


class SemiStructuredLinearFunction(torch.autograd.Function):
    """Autograd of the 2:4 Linear on 2-D contiguous ``x`` in the compute dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, mask: Tensor | None, bias: Tensor | None,
                packed: PackedWeight | None, packed_t: PackedWeight | None) -> Tensor:
        weight_c = weight.to(x.dtype)  # the cast autocast makes for nn.Linear, kept likewise
        ctx.save_for_backward(x, mask, None if packed_t is not None else weight_c)
        ctx.packed_t, ctx.weight_dtype = packed_t, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        bias = None if bias is None else bias.to(x.dtype)
        if packed is not None:
            return packed.matmul(x, bias)
        return F.linear(x, weight_c, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        refuse_create_graph("semi_structured_linear")
        x, mask, weight_c = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        needs_x, needs_w, _, needs_b, _, _ = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if needs_x:
            packed_t = ctx.packed_t
            grad_x = packed_t.matmul(grad_out) if packed_t is not None else grad_out @ weight_c
        if needs_w:
            grad_w = masked_weight_grad(grad_out, x, mask, ctx.weight_dtype)
        if needs_b and ctx.bias_dtype is not None:
            grad_b = grad_out.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, None, grad_b, None, None


def masked_weight_grad(grad_out: Tensor, x: Tensor, mask: Tensor | None, dtype: torch.dtype
                       ) -> Tensor:
    """``(dY^T X) * M`` in ``dtype``: one pass after the product, the mask multiply fused
    into the cast where ``dtype`` differs (autocast), in place where it does not; no mask
    (the optimizer step masks it): the plain product, cast."""
    grad = grad_out.T @ x
    if mask is None:
        return grad.to(dtype)
    if grad.dtype == dtype:
        return grad.mul_(mask)
    return torch.mul(grad, mask, out=torch.empty_like(grad, dtype=dtype))


def semi_structured_linear(x: Tensor, weight: Tensor, mask: Tensor | None,
                           bias: Tensor | None = None, packed: PackedWeight | None = None,
                           packed_t: PackedWeight | None = None) -> Tensor:
    """``x W^T + b`` for a 2:4 ``weight`` (zeros where ``mask`` is False) of any leading
    dimensions; the forward on ``packed`` and the input gradient on ``packed_t`` where given
    (both packed in ``x``'s dtype), cuBLAS otherwise; the weight gradient masked by
    ``mask`` (None: left to the optimizer step)."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    y = SemiStructuredLinearFunction.apply(x2d, weight, mask, bias, packed, packed_t)
    return y.view(*x.shape[:-1], weight.shape[0])
