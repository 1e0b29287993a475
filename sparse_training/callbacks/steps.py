"""The schedule's step under a Trainer, and a fit's length in those steps.

Under automatic optimization a step is an optimizer step (``trainer.global_step``; with
``accumulate_grad_batches=4`` four batches make one). Under manual optimization
``global_step`` counts every ``opt.step()`` of every optimizer, so a step is a training
batch: the unit of ``trainer.estimated_stepping_batches``, which fractions of training are
resolved against, whichever optimizers step in it.

The loggers count neither: they write step metrics every ``log_every_n_steps`` batches that
stepped (:func:`logs_batch`).
"""

from __future__ import annotations

import math

import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden


def schedule_step(trainer: pl.Trainer) -> int:
    """The schedule's step of the batch in progress (module doc): under manual optimization
    the batch's number over the fit's epochs, which Lightning's loop state restores on a
    resume."""
    if trainer.lightning_module.automatic_optimization:
        return trainer.global_step
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1


def fit_length(trainer: pl.Trainer, optimizers: int) -> int | None:
    """The fit's schedule steps (None: unknown), ``optimizers`` stepping under it. Under
    manual optimization ``max_steps`` counts every optimizer's steps: it ends the fit after
    ``ceil(max_steps / optimizers)`` batches, each optimizer taken to step once a batch."""
    # inf: max_epochs=-1; -1: an iterable of unknown length under max_epochs (Lightning
    # returns max_steps): the length is unknown either way, and fractions are refused
    total = trainer.estimated_stepping_batches
    if math.isinf(total) or total < 0:
        return None
    if trainer.lightning_module.automatic_optimization or trainer.max_steps < 0:
        return int(total)
    return min(int(total), math.ceil(trainer.max_steps / max(optimizers, 1)))


def clips_gradients(trainer: pl.Trainer) -> bool:
    """Whether Lightning may clip the gradients of the step in progress after
    ``on_before_optimizer_step``: the Trainer's ``gradient_clip_val`` is set, or the
    LightningModule clips by its own ``configure_gradient_clipping``."""
    return trainer.gradient_clip_val is not None or is_overridden(
        "configure_gradient_clipping", trainer.lightning_module)


def logs_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning's loggers write the step metrics of the batch ending now: its own
    decision (every ``log_every_n_steps`` batches that stepped, 0: never, and when the fit
    stops), which no step count above gives (manual optimization's ``global_step`` counts
    every ``opt.step()``, and an optimizer that skips batches leaves it behind)."""
    return trainer._logger_connector.should_update_logs
