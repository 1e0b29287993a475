"""Lightning integrations (the only part of sparse_training that imports Lightning)."""

from sparse_training.callbacks.distillation import DistillationCallback
from sparse_training.callbacks.sparsity import SparsityCallback

__all__ = ["DistillationCallback", "SparsityCallback"]
