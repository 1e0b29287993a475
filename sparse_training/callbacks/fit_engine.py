"""The engine a fit of :class:`~sparse_training.SparsityCallback` trains with, and its start
under the Trainer.

The first fit, or a fit of another model, builds a new engine (on the checkpoint's state
where it resumes one). A later fit of the same model keeps the last fit's engine: resuming
(``ckpt_path``) restores the checkpoint's masks and schedule, a new Trainer without
``ckpt_path`` runs the schedule again from its start, beginning with the current masks, and
the same Trainer fitting on continues where it stopped. Masks a model carries into a fit
without ``ckpt_path`` (this callback's or another's) never get less sparse: each holds
until a mask update keeps no more of its weights
(:meth:`~sparse_training.engine.updaters.ScheduledMasks.carried`). A fit that fails before
its first training batch gives its start back (:class:`FitStart`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from sparse_training.callbacks.averaging import AveragedMasks, averaged_copies
from sparse_training.callbacks.fit_checks import counts, placeholder, schedule_warnings
from sparse_training.engine import SparsityEngine
from sparse_training.engine.distributed import (
    agree_compressed,
    keep_masks_out_of_buffer_broadcast,
)
from sparse_training.engine.optimizer_hooks import optimizer_problem
from sparse_training.engine.slots import MASK_SUFFIX
from sparse_training.layers.compress import held_apart

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig
    from sparse_training.engine.plan import SparsityPlan


class FitStart:
    """What a fit's start adds to the model, taken back where the fit fails before its
    first training batch (at its start, in another callback's, or in the sanity check), so
    that the model is left as it was: the mask buffers of ``plan``'s tensors that the
    model does not hold yet, and the engine this fit trains with (its optimizer hooks and
    tensors given up); ``engine``, the callback's before, is kept, and where the fit does
    not resume a checkpoint (``resuming``: Lightning loads its weights, which stay) with its
    state (a new Trainer's fit restarts its schedule: the progress comes back)."""

    def __init__(self, plan: SparsityPlan, engine: SparsityEngine | None,
                 resuming: bool) -> None:
        self.engine = engine
        kept = not resuming and engine is not None and engine.installed
        self.progress = engine.updater.state_dict() if kept else None
        statistics = engine.updater.statistics if kept else None
        self.statistics = None if statistics is None else statistics.state_dict(engine.slots)
        self.masks = [(module, attr + MASK_SUFFIX) for module, attr in
                      (tensor.store for _, tensor in plan.masked)
                      if attr + MASK_SUFFIX not in module._buffers]

    def undo(self, engine: SparsityEngine | None) -> SparsityEngine | None:
        """Detach ``engine``, this fit's, and drop the masks the start added; the engine
        the callback held before."""
        if engine is not None:
            engine.detach()
        for module, key in self.masks:
            module._buffers.pop(key, None)
        if engine is self.engine and self.progress is not None:  # its progress; masks stay
            engine.updater.load_state_dict(self.progress)
            if self.statistics is not None:
                engine.updater.statistics.load_state_dict(self.statistics, engine.slots)
        return self.engine


def engine_for_fit(engine: SparsityEngine | None, pl_module: nn.Module,
                   config: SparsityConfig, plan: SparsityPlan,
                   restored: dict[str, Any] | None, swapped: set[str],
                   global_step: int) -> SparsityEngine:
    """The engine this fit trains ``pl_module`` with (module doc): ``engine``, the last
    fit's, where it trained ``pl_module``, else a new one on ``restored`` (``engine``
    detached). ``swapped`` names the layers compressed at this fit's setup: a new engine
    without a restored state warns of the compressed layers held before them that keep
    another pattern or count than ``plan`` gives."""
    if engine is None or not engine.bound_to(pl_module):
        if restored is None and (apart := held_apart(pl_module, plan, swapped)):
            rank_zero_warn(f"SparsityCallback: {apart}")
        if engine is not None:
            engine.detach()
        return SparsityEngine(pl_module, config, state=restored, plan=plan)
    engine.claim()  # another callback may have taken the tensors since
    if restored is not None:
        engine.load_state_dict(restored)
    elif global_step == 0:  # the masks now (an earlier fit's or prune()'s) are held
        ran = engine.updater.last_update is not None
        engine.restart()
        if ran:
            rank_zero_info("SparsityCallback: a new fit runs the schedule again from its "
                           "start, beginning with the current masks")
    return engine


def start_engine(engine: SparsityEngine, trainer: pl.Trainer, config: SparsityConfig,
                 total: int | None, restored: bool) -> AveragedMasks | None:
    """Start ``engine`` for a fit of ``total`` steps (None: unknown) under ``trainer``: its
    plan's table and the schedule's warnings said, the loss scale read where AMP scales,
    every optimizer attached, rank 0's compressed layers where a rank's differ
    (:func:`~sparse_training.engine.distributed.agree_compressed`), the masks kept out of
    the strategy's buffer broadcast and put
    in the averaged copies of weight-averaging callbacks (returned, to follow the masks;
    None without such callbacks, so that a step pays nothing for them).

    Raises:
        ValueError: the engine selected no weight tensor.
    """
    if not engine.slots:
        raise ValueError("SparsityCallback selected no weight tensor (setup table below)\n"
                         + engine.plan.table())
    if trainer.ckpt_path is not None and not restored:
        rank_zero_warn("SparsityCallback: the checkpoint holds no SparsityCallback state; "
                       "the schedule starts at the resumed step")
    engine.start(total)
    for warning in schedule_warnings(config, engine.updater, total):
        rank_zero_warn(f"SparsityCallback: {warning}")
    rank_zero_info(f"SparsityCallback: {counts(engine)} of {len(engine.plans)} weight "
                   f"tensors; {engine.updater.describe(total)}\n"
                   + engine.plan.table())
    if held := engine.updater.held:
        rank_zero_info(f"SparsityCallback: {len(held)} tensors start from the masks they carry "
                       f"(an earlier fit's), each held until a mask update keeps no more of "
                       f"its weights: {', '.join(sorted(held)[:4])}"
                       + (", ..." if len(held) > 4 else ""))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:  # gradients are unscaled before on_before_optimizer_step
        engine.loss_scale = lambda: float(scaler.get_scale())
    for optimizer in trainer.optimizers:
        engine.attach(optimizer)
    agree_compressed(engine.slots)
    keep_masks_out_of_buffer_broadcast(trainer.strategy.model, engine.slots)
    copies = averaged_copies(trainer)
    return AveragedMasks(engine, trainer.lightning_module, copies) if copies else None


def follow_optimizers(engine: SparsityEngine, trainer: pl.Trainer, pl_module: nn.Module,
                      attached: list[Optimizer]) -> list[Optimizer]:
    """``trainer.optimizers``, each attached to ``engine``, where it is not ``attached``
    (the list the engine was given last): optimizers replaced during the fit
    (``trainer.strategy.setup_optimizers``, the ``trainer.optimizers`` setter) train the
    masks from their first step, the replaced ones are released.

    Raises:
        ValueError: the new optimizers do not train the model's sparse tensors, as at the
            fit's start (:func:`~sparse_training.engine.optimizer_hooks.optimizer_problem`).
    """
    if trainer.optimizers is attached:
        return attached
    optimizers = [o for o in trainer.optimizers if not placeholder(o)]
    if problem := optimizer_problem(pl_module, engine.plan, optimizers):
        raise ValueError(f"SparsityCallback: {problem}")
    for optimizer in optimizers:
        engine.attach(optimizer)
    for optimizer in set(engine.attached_optimizers) - set(optimizers):
        engine.release(optimizer)
    return trainer.optimizers


def end_engine(engine: SparsityEngine) -> None:
    """The end of a stage (or its failure): ``engine`` detached (:meth:`~sparse_training.
    SparsityEngine.detach`), and the tensors it keeps beside the model (a training score's
    statistics, SR-STE's dense weights) moved to where the strategy's teardown, which runs
    before the callbacks', left the weights: the CPU (under ``ModelParallelStrategy`` the
    weights stay on their GPUs, and so do they). The GPU memory of a finished fit is given
    back though the callback keeps its engine."""
    engine.detach()
    if engine.slots:
        engine.to(engine.slots[0].param.device)
