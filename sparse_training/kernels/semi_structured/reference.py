"""Pure-torch references of the 2:4 Linear's three products (float64 in the tests)."""

from __future__ import annotations

from torch import Tensor


def forward_reference(x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None) -> Tensor:
    """``Y = X (W * M)^T + b``."""
    y = x @ (weight * mask).T
    return y if bias is None else y + bias


def input_grad_reference(grad_out: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    """``dX = dY (W * M)``."""
    return grad_out @ (weight * mask)


def weight_grad_reference(grad_out: Tensor, x: Tensor, mask: Tensor) -> Tensor:
    """``dW = (dY^T X) * M``: the dense gradient at the kept positions only."""
    return (grad_out.T @ x) * mask
