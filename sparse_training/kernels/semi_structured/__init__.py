"""2:4 Linear on the sparse tensor cores (cuSPARSELt): packing, the measured sparse/dense
choice, autograd, functional and the float64 references.

Public API: :func:`semi_structured_linear`, :class:`PackedWeight`, :func:`choose_paths`,
:class:`PathChoice`, :func:`cusparselt_problem`, :func:`shape_problem`,
:func:`envelope_problem` (with :data:`SPARSE_MIN_FEATURES` and :data:`SPARSE_MIN_TOKENS`),
and the references
(``forward_reference``, ``input_grad_reference``, ``weight_grad_reference``).
"""

from sparse_training.kernels.semi_structured.cusparselt import (
    DTYPES,
    SPARSE_MIN_FEATURES,
    SPARSE_MIN_TOKENS,
    SPARSE_ROUTE_DTYPES,
    TOKEN_MULTIPLE,
    PackedWeight,
    cusparselt_problem,
    envelope_problem,
    shape_problem,
)
from sparse_training.kernels.semi_structured.ops import semi_structured_linear
from sparse_training.kernels.semi_structured.paths import PathChoice, cached_choices, choose_paths
from sparse_training.kernels.semi_structured.reference import (
    forward_reference,
    input_grad_reference,
    weight_grad_reference,
)

__all__ = ["DTYPES", "SPARSE_ROUTE_DTYPES", "SPARSE_MIN_FEATURES", "SPARSE_MIN_TOKENS", "TOKEN_MULTIPLE", "PackedWeight",
           "PathChoice", "cached_choices", "choose_paths", "cusparselt_problem",
           "envelope_problem", "forward_reference", "input_grad_reference",
           "semi_structured_linear", "shape_problem", "weight_grad_reference"]
