"""Pure-torch references of the block-sparse Linear ops (any device, any floating dtype).

They materialize the dense weight, so they cost a dense matmul: the path where the Triton
kernels do not run (CPU without the interpreter, float64). Like the kernels they never use
the padded entries of ``values`` past the weight's edge, and take operands of any strides.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from sparse_training.kernels.block_sparse.topology import (
    BlockTopology,
    check_operands,
    dense_to_values,
    values_to_dense,
)


def forward_reference(x: Tensor, values: Tensor, topology: BlockTopology,
                      bias: Tensor | None) -> Tensor:
    """``Y = X W^T + b`` with ``W`` the dense form of ``values``.

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`).
    """
    check_operands(topology, values=values, x=x, bias=bias)
    return F.linear(x, values_to_dense(values, topology), bias)


def input_grad_reference(grad_out: Tensor, values: Tensor, topology: BlockTopology) -> Tensor:
    """``dX = dY W``.

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`).
    """
    check_operands(topology, values=values, grad_out=grad_out)
    return grad_out @ values_to_dense(values, topology)


def weight_grad_reference(grad_out: Tensor, x: Tensor, topology: BlockTopology) -> Tensor:
    """``dW = dY^T X`` at the kept blocks, as ``[nnz, R, C]`` (zeros past the edge).

    Raises:
        ValueError: an operand that does not fit (:func:`~.topology.check_operands`).
    """
    check_operands(topology, x=x, grad_out=grad_out)
    return dense_to_values(grad_out.t() @ x, topology)
