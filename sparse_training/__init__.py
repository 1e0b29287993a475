"""sparse_training: sparse training for PyTorch Lightning.

The package is built in layers; a module imports only from the layers below its own (and
from its own folder), never up and never in a circle (``tests/test_layers.py`` checks every
import)::

    callbacks/     SparsityCallback, DistillationCallback: the Lightning side (its only import)
        |
    layers/        BlockSparseLinear, SemiStructuredLinear,         permutations/  ASP's
        |          SlimLinear (heads, neurons), their
        |          slots; the one swap path (sparsify, compress,    channel
        |          densify, make_permanent)                         permutations
        |
    engine/        SparsityEngine: slots (the Slot protocol, masked-dense storage),
        |          selection, updaters, optimizer hooks, state, distributed
        |
    config/        SparsityConfig: every setting, strings parsed once into pieces
        |
    pieces/        patterns, masks, schedules, distributions, scores, regrowth,
        |          the distillation loss (torch only)
        |
    kernels/       Triton kernels and their pure-torch references (nothing of the rest)

``SparsityCallback`` and ``DistillationCallback`` are loaded from
``sparse_training.callbacks`` on first use, so
``import sparse_training`` needs no Lightning.
"""

from typing import Any

from sparse_training.config import SparsityConfig
from sparse_training.engine import SparsityEngine
from sparse_training.engine.plan import SparsityPlan
from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.layers.slim import SlimLinear
from sparse_training.layers.swap import densify, make_permanent, sparsify
from sparse_training.permutations import (
    find_sites,
    kept_magnitude,
    permute_channels,
    search_permutation,
)
from sparse_training.pieces.distillation import DistillationLoss, TeacherCache
from sparse_training.pieces.masks import global_masks, pattern_mask
from sparse_training.pieces.patterns import Pattern, parse_pattern
from sparse_training.pieces.regrowth import SET, SRSTE, RigL
from sparse_training.pieces.schedules import GMP, Constant, OneShot, register_schedule
from sparse_training.pieces.second_order import SecondOrderScore
from sparse_training.pieces.training_scores import MovementScore, SoftMovementScore

__all__ = ["GMP", "SET", "SRSTE", "BlockSparseLinear", "Constant", "DistillationCallback",
           "DistillationLoss", "MovementScore", "OneShot", "Pattern", "RigL",
           "SecondOrderScore", "SemiStructuredLinear", "SlimLinear", "SoftMovementScore",
           "SparsityCallback",
           "SparsityConfig", "SparsityEngine", "SparsityPlan", "TeacherCache", "densify",
           "find_sites", "global_masks", "kept_magnitude", "make_permanent", "parse_pattern",
           "pattern_mask", "permute_channels", "register_schedule", "search_permutation",
           "sparsify"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("SparsityCallback", "DistillationCallback"):
        from sparse_training import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'sparse_training' has no attribute {name!r}")
