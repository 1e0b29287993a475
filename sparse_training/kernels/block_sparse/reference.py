"""Pure-torch references of the block-sparse Linear ops (any device, any dtype).

They materialize the dense weight, so they cost a dense matmul: the CPU path without the
Triton interpreter, and the float64 ground truth the kernel tests compare against.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from sparse_training.kernels.block_sparse.topology import (
    BlockTopology,
    dense_to_values,
    values_to_dense,
)


def forward_reference(x: Tensor, values: Tensor, topology: BlockTopology,
                      bias: Tensor | None) -> Tensor:
    """``Y = X W^T + b`` with ``W`` the dense form of ``values``."""
    return F.linear(x, values_to_dense(values, topology), bias)


def input_grad_reference(grad_out: Tensor, values: Tensor, topology: BlockTopology) -> Tensor:
    """``dX = dY W``."""
    return grad_out @ values_to_dense(values, topology)


def weight_grad_reference(grad_out: Tensor, x: Tensor, topology: BlockTopology) -> Tensor:
    """``dW = dY^T X`` at the kept blocks, as ``[nnz, R, C]``."""
    return dense_to_values(grad_out.t() @ x, topology)
