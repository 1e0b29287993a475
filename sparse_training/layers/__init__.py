"""Compressed layers and the one path that swaps them into a model and back.

:class:`~sparse_training.layers.block_sparse.BlockSparseLinear` (kept blocks only) and
:class:`~sparse_training.layers.semi_structured.SemiStructuredLinear` (2:4 on the sparse
tensor cores) and :class:`~sparse_training.layers.slim.SlimLinear` (whole heads and
neurons removed: a smaller dense layer) implement the engine's slot protocol through their storage
(:mod:`sparse_training.layers.storage`); :mod:`sparse_training.layers.swap` swaps them in
(``sparsify``, the config's ``compress``) and out (``densify``, ``make_permanent``).
"""
