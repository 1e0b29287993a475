"""Block-sparse Linear: topology, Triton kernels, custom ops and their references.

Public API: :class:`BlockTopology`, :func:`block_sparse_linear`, the references
(``forward_reference``, ``input_grad_reference``, ``weight_grad_reference``) and the
dense/compressed conversions (``values_to_dense``, ``dense_to_values``, ``block_norms``,
``top_blocks``).
"""

from sparse_training.kernels.block_sparse.ops import block_sparse_linear
from sparse_training.kernels.block_sparse.reference import (
    forward_reference,
    input_grad_reference,
    weight_grad_reference,
)
from sparse_training.kernels.block_sparse.topology import (
    BlockTopology,
    block_grid,
    block_norms,
    dense_to_values,
    top_blocks,
    values_to_dense,
)

__all__ = ["BlockTopology", "block_grid", "block_norms", "block_sparse_linear",
           "dense_to_values", "forward_reference", "input_grad_reference", "top_blocks",
           "values_to_dense", "weight_grad_reference"]
