"""What :class:`~sparse_training.SparsityCallback` logs, and when.

``sparsity/global`` and ``sparsity/target`` are the pruned share and the schedule's target
over every weight the Trainer's SparsityCallbacks hold (several callbacks with disjoint
selections log them once, over all of them); with ``log_layers`` each callback adds
``sparsity/<tensor>`` of its own tensors. Every rank holds the same values (the masks agree
by construction): only rank 0's loggers write them, at the cadence of
:func:`~sparse_training.callbacks.steps.logs_batch` and at every epoch's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import pytorch_lightning as pl
import torch

from sparse_training.engine.names import replaced_name

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig
    from sparse_training.engine import SparsityEngine


class HoldsEngine(Protocol):
    """What logging reads of a SparsityCallback (named so without importing it)."""

    engine: SparsityEngine | None
    config: SparsityConfig


def log_sparsity(pl_module: pl.LightningModule, callback: HoldsEngine,
                 callbacks: Sequence[HoldsEngine], on_step: bool) -> None:
    """Log ``callback``'s metrics at a step or at the epoch's end.

    ``callbacks`` are the Trainer's SparsityCallbacks, ``callback`` among them: the last
    one logs the global and target sparsity over all of them (each logging its own under
    the one name would overwrite the others'), after every callback's step end.

    At a step: CPU tensors (a Python float would be copied to the GPU, a sync at every
    call), nothing sent between ranks. At the epoch's end: reduced across ranks with
    ``max`` (equal values: each of them, exactly, where a mean may round), one small
    all-reduce per metric on the module's device (NCCL reduces no CPU tensor); unreduced,
    Lightning warns under DDP and FSDP to add ``sync_dist=True`` to a ``self.log`` call the
    user does not own.
    """
    metrics = {}
    if callback is callbacks[-1]:
        shares = [(c.engine.sparsity, c.engine.target, c.engine.weights)
                  for c in callbacks if c.engine is not None]
        total = max(sum(n for *_, n in shares), 1)
        metrics["sparsity/global"] = sum(pruned * n for pruned, _, n in shares) / total
        metrics["sparsity/target"] = sum(target * n for _, target, n in shares) / total
    if callback.config.log_layers and callback.engine is not None:
        metrics.update(layer_metrics(callback.engine))
    if on_step:
        pl_module.log_dict({k: torch.tensor(v) for k, v in metrics.items()}, on_step=True,
                           on_epoch=False)
    else:
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True,
                           reduce_fx="max")


def layer_metrics(engine: SparsityEngine) -> dict[str, float]:
    """``sparsity/<weight>`` of every tensor ``engine`` holds, a compressed layer's under
    the name of the dense weight it replaced (``net.2.weight``, not ``net.2.values``): a
    dashboard's keys stay the same whichever path ``compress="auto"`` takes."""
    compressed = {s.name for s in engine.compressed}
    return {f"sparsity/{replaced_name(name) if name in compressed else name}": share
            for name, share in engine.tensor_sparsity.items()}

