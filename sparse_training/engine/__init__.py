"""The engine: the sparse tensors of one model (slots), their selection, their updates on a
schedule, their enforcement in the optimizer step, their state and their agreement across
ranks. It imports pieces and the config, never a layer or Lightning.
"""

from sparse_training.engine.engine import SparsityEngine

__all__ = ["SparsityEngine"]
