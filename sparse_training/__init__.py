"""sparse_training: sparse training for PyTorch Lightning.

The core (patterns, masks, tensors, selection, schedules, distributions, updaters, slots,
state, ranks, engine, block_sparse, patcher, distillation) imports torch (and Triton where
installed) only; ``SparsityCallback`` and ``DistillationCallback`` are loaded from
``sparse_training.callbacks`` on first use.
"""

from typing import Any

from sparse_training.block_sparse import BlockSparseLinear
from sparse_training.config import SparsityConfig
from sparse_training.distillation import DistillationLoss, TeacherCache
from sparse_training.engine import SparsityEngine
from sparse_training.masks import global_masks, pattern_mask
from sparse_training.patcher import densify, sparsify
from sparse_training.patterns import Pattern, parse_pattern
from sparse_training.permutations import (
    find_sites,
    kept_magnitude,
    permute_channels,
    search_permutation,
)
from sparse_training.semi_structured import SemiStructuredLinear
from sparse_training.slots import make_permanent

__all__ = ["BlockSparseLinear", "DistillationCallback", "DistillationLoss", "Pattern",
           "SemiStructuredLinear", "SparsityCallback", "SparsityConfig", "SparsityEngine",
           "TeacherCache", "densify", "find_sites", "global_masks",
           "kept_magnitude", "make_permanent", "parse_pattern", "pattern_mask",
           "permute_channels", "search_permutation", "sparsify"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("SparsityCallback", "DistillationCallback"):
        from sparse_training import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'sparse_training' has no attribute {name!r}")
