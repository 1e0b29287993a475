"""Pure pieces: patterns, masks, schedules, distributions, scores and regrowth rules.

They import torch and :mod:`sparse_training.kernels` only; the engine is configured with
them.
"""
