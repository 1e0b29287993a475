"""SparsityCallback: the thin Lightning side of :class:`sparse_training.SparsityEngine`."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import FSDPStrategy
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from sparse_training.callbacks.averaging import AveragedMasks, averaged_copies, averaging_problem
from sparse_training.callbacks.fit_checks import (
    NO_ENGINE,
    compute_dtype,
    fit_problem,
    overlap_problem,
    placeholder,
    summary,
    uncompressed_problem,
    unused_warning,
)
from sparse_training.callbacks.fit_engine import (
    FitStart,
    end_engine,
    engine_for_fit,
    follow_optimizers,
    start_engine,
)
from sparse_training.callbacks.metrics import log_sparsity
from sparse_training.callbacks.resume import own_state, unreadable_checkpoint
from sparse_training.callbacks.steps import clips_gradients, fit_length, logs_batch, schedule_step
from sparse_training.config import (
    DEFAULT_LAYER_TYPES,
    LayerTypes,
    ScoreSetting,
    SparsityConfig,
)
from sparse_training.engine import SparsityEngine
from sparse_training.engine.optimizer_hooks import optimizer_problem
from sparse_training.engine.plan import SparsityPlan
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.sharding import FSDP1_PROBLEM
from sparse_training.engine.state import check_mask_settings, check_state
from sparse_training.engine.tensors import find_weight_tensors
from sparse_training.layers.auto_paths import compile_mode, dtype_name
from sparse_training.layers.compress import (
    compress_selected,
    follow_checkpoint,
    undo_swaps,
)
from sparse_training.layers.swap import format_swaps
from sparse_training.pieces.regrowth import (
    DEFAULT_ALPHA,
    DEFAULT_REGROW_END,
    DEFAULT_SR_STE_DECAY,
    SRSTE,
    RegrowthRule,
)
from sparse_training.pieces.schedules import Schedule, Step


class SparsityCallback(Callback):
    """Train sparse with any LightningModule: masks that hold, schedules, exact resume.

    Takes the settings of :class:`~sparse_training.SparsityConfig` as keyword arguments
    (documented there: ``help(SparsityConfig)``). At the start of every ``fit`` (after
    ``configure_model``, so layers built there count) the weight tensors are selected, a
    mask buffer is registered beside each selected one and the plan's table is logged with
    the resolved mask-update steps. Masks are updated at the start of the optimizer steps
    (batches under manual optimization: :mod:`~sparse_training.callbacks.steps`) the
    schedule names; gradients are masked in ``on_before_optimizer_step`` (after AMP
    unscaling, before gradient clipping), where regrowth also reads the dense gradients;
    pruned weights are zeroed after every optimizer step that ran. Under
    ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``) the masks
    are those of the whole tensors and each rank enforces its shard
    (:mod:`sparse_training.engine.sharding`); ``FSDPStrategy`` (FSDP1) is refused. The
    masks and the schedule's progress go into Lightning's checkpoints as this callback's
    state; the model's ``state_dict`` stays plain. ``fit`` ends with a one-line summary.

    A later ``fit`` with the same callback: resuming (``ckpt_path``) restores the
    checkpoint's masks and schedule; a new Trainer without ``ckpt_path`` runs the
    schedule again from its start, beginning with the current masks; the same Trainer
    fitting on continues where it stopped. Without ``ckpt_path``, masks the model carries
    (this callback's or another's) never get less sparse: each holds until a mask update
    keeps no more of its weights, and one sparser than these settings is refused.

    Raises:
        ValueError: at construction for a bad setting; at the start of ``fit`` for a
            regex that matches no tensor, a tensor named by ``allow``/``overrides`` that
            cannot take its pattern, a selection that overlaps another callback's, a
            carried mask sparser than these settings make its tensor, compress beside
            weight averaging, or a checkpoint that does not fit; always before any weight
            or mask changes. The message names the value and the valid forms.
        TypeError: an unknown setting (the nearest valid one is named).

    Example::

        trainer = pl.Trainer(max_epochs=3, callbacks=[SparsityCallback(pattern="2:4")])
        trainer.fit(model, loader)
    """

    def __init__(self, pattern: str = "2:4", sparsity: float | None = None,
                 schedule: str | Schedule = "oneshot", start: Step = 0,
                 end: Step | None = None,
                 frequency: int = 100, allow: Sequence[str] | None = None,
                 deny: Sequence[str] | None = None, dense_ratio: float = 0.0,
                 overrides: Mapping[str, Mapping[str, str | float]] | None = None,
                 distribution: str = "uniform", layer_types: LayerTypes = DEFAULT_LAYER_TYPES,
                 log_layers: bool = False, score: ScoreSetting = "magnitude",
                 regrow: str | RegrowthRule | SRSTE | None = None,
                 regrow_fraction: float = DEFAULT_ALPHA, regrow_end: Step = DEFAULT_REGROW_END,
                 sr_ste_decay: float = DEFAULT_SR_STE_DECAY, seed: int = 0,
                 check_masks: bool = True, fused: bool | str = "auto",
                 compress: bool | str = False, auto_tokens: int = 8192,
                 **unknown: Any) -> None:
        if message := SparsityConfig.unknown_setting(unknown):
            raise TypeError(message)
        arguments = dict(locals())  # the settings, by the names of SparsityConfig's fields
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            self.config = SparsityConfig(**{name: arguments[name]
                                            for name in SparsityConfig.names()})
        for warning in said:  # said again at the line that built the callback
            warnings.warn(warning.message, warning.category, stacklevel=2)
        self.engine: SparsityEngine | None = None  # the last fit's, in this process
        self._restored: dict[str, Any] | None = None
        self._unused_checked = False
        self._fitting = False  # between on_fit_start and teardown
        self._swapped: list[tuple[str, nn.Module]] = []  # (name, Linear) swapped at setup
        # (module, trainer, device, compute dtype) from setup to fit start
        self._compressing: tuple[nn.Module, pl.Trainer, torch.device,
                                 torch.dtype | None] | None = None
        self._plan: SparsityPlan | None = None  # this fit's, built once, followed by swaps
        self._compress_ran = False  # compress() swapped this fit's layers (setup or
        # configure_model); a resumed fit may then have given them back to its checkpoint
        self._start: FitStart | None = None  # this fit's, until its first training batch
        self._averaged: AveragedMasks | None = None  # weight averaging's copies, fit start on
        self._optimizers: list[Optimizer] = []  # trainer.optimizers as the engine has them

    @classmethod
    def from_config(cls, source: str | Path | Mapping[str, Any] | SparsityConfig
                    ) -> SparsityCallback:
        """Build from a YAML file, a dict with the constructor's keys (unknown keys raise)
        or a SparsityConfig."""
        return cls(**SparsityConfig.load(source))

    def __repr__(self) -> str:
        """The settings that tell callbacks apart: pattern, sparsity, selection, compress."""
        c = self.config
        shown = {"pattern": c.parsed_pattern.spec, "sparsity": c.sparsity,
                 "allow": list(c.allow), "deny": list(c.deny), "compress": c.compress}
        return "SparsityCallback(" + ", ".join(
            f"{k}={v!r}" for k, v in shown.items() if v or (k == "sparsity" and v is not None)) + ")"

    @functools.cached_property
    def state_key(self) -> str:
        """Lightning's key of this callback's state: its selection (allow, deny, layer
        types). Lightning reads it at every hook call; the config is frozen, so it is built
        once."""
        c = self.config
        return self._generate_state_key(allow=list(c.allow), deny=list(c.deny),
                                        layer_types=[t.__name__ for t in c.layer_types])

    @staticmethod
    def _all(trainer: pl.Trainer) -> list[SparsityCallback]:
        """The Trainer's SparsityCallbacks, in its order."""
        return [c for c in trainer.callbacks if isinstance(c, SparsityCallback)]

    def _engine(self) -> SparsityEngine:
        if self.engine is None:
            raise RuntimeError(NO_ENGINE)
        return self.engine

    # -- setup and fit start ---------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Build this fit's plan (:class:`~sparse_training.engine.plan.SparsityPlan`) and,
        with ``compress``, swap the selected Linear layers for compressed ones here, before
        ``configure_optimizers`` (the optimizers see compressed parameters), deciding
        ``"auto"`` for the strategy's root device and the precision's compute dtype (each
        distinct layer timed there both ways, or read from the timing cache:
        :mod:`sparse_training.layers.auto_paths`; a line per measurement). A
        model with no weights yet is planned and swapped when its ``configure_model`` calls
        :meth:`compress`. Resuming (``ckpt_path``), the layers are swapped the same way and
        Lightning then loads the checkpoint's weights into them: each compressed layer
        takes the blocks its loaded weight holds, and this callback's state the exact
        masks; a state saved with other settings is refused then, before any step."""
        self._restored = None  # a state Lightning restores comes after setup, for this run
        self._compress_ran = False
        if stage != "fit":
            return
        if problem := self._overlap(trainer, pl_module):
            raise ValueError(f"SparsityCallback: {problem}")
        if not self.config.compress:
            return
        self._compressing = (pl_module, trainer, trainer.strategy.root_device,
                             compute_dtype(trainer.precision))
        if find_weight_tensors(pl_module):
            self.compress(pl_module)

    def _plan_for(self, pl_module: nn.Module) -> SparsityPlan:
        """This fit's plan of ``pl_module``: built at its first use in the fit, then
        followed through swaps and sharding (built again only where layers were built or
        removed since, as ``configure_model`` does).

        Raises:
            ValueError: what selection raises.
        """
        plan = None if self._plan is None else self._plan.bound(pl_module)
        # kept bound to the model as it is now: a plan of swapped-out layers would keep
        # their dense weights alive through the fit
        self._plan = plan = plan or SparsityPlan.build(pl_module, self.config)
        return plan

    def compress(self, pl_module: pl.LightningModule) -> None:
        """Swap the selected Linear layers of ``pl_module``, the LightningModule being fit,
        for compressed ones now (nothing with ``compress=False``).

        ``setup`` calls it when the model has weights then. A model that builds its layers
        in ``configure_model`` calls it there, once they are built and initialized (the
        initial weights choose the kept blocks) and before ``fully_shard``, which then
        shards the compressed values (docs/distributed.md has an example).

        Raises:
            RuntimeError: called outside ``setup`` and ``configure_model`` of a fit, or with
                another module than the one being fit.
            ValueError: weights on the meta device, or what ``setup``'s swap raises; before
                anything is swapped.
        """
        if not self.config.compress:
            return
        if self._compressing is None or self._compressing[0] is not pl_module:
            raise RuntimeError("SparsityCallback.compress(pl_module) swaps layers between "
                               "setup and the optimizers: call it in configure_model with the "
                               "LightningModule being fit")
        _, trainer, device, dtype = self._compressing
        if problem := self._overlap(trainer, pl_module):
            raise ValueError(f"SparsityCallback: {problem}")
        before = dict(pl_module.named_modules())
        # "auto" says each layer it measures; every rank takes rank 0's times
        rows, self._plan = compress_selected(
            pl_module, self._plan_for(pl_module), device, dtype, progress=rank_zero_info,
            agree=functools.partial(trainer.strategy.broadcast, src=0),
            mode=compile_mode(pl_module))
        self._compress_ran = True
        # kept until the optimizers are checked at fit start, to put back if they are wrong
        self._swapped += [(name, before[name]) for name, module in pl_module.named_modules()
                          if isinstance(module, CompressedLayer) and before.get(name) is not
                          module]
        target = f"{device}, {dtype_name(dtype)} compute" if dtype is not None else device
        rank_zero_info(f"SparsityCallback: training paths (compress={self.config.compress!r} "
                       f"for {target})\n" + format_swaps(rows))

    def _overlap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        """One owner per tensor: which tensor two SparsityCallbacks of this Trainer would
        both hold (a compressed layer's by the dense weight it replaced), naming both; checked
        before any of them swaps or masks anything."""
        callbacks = self._all(trainer)
        if len(callbacks) < 2 or not find_weight_tensors(pl_module):
            return None
        return overlap_problem(callbacks, [c._plan_or_none(pl_module) for c in callbacks])

    def _plan_or_none(self, pl_module: nn.Module) -> SparsityPlan | None:
        """:meth:`_plan_for`, None where selection raises (this callback raises it itself)."""
        try:
            return self._plan_for(pl_module)
        except ValueError:
            return None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(f"SparsityCallback cannot mask under FSDPStrategy: {FSDP1_PROBLEM}")
        optimizers = [o for o in trainer.optimizers if not placeholder(o)]
        restored, self._restored = self._restored, None  # this fit's, whatever follows
        self._compressing = None
        # any error from here on: on_exception gives the layers swapped at setup back
        try:
            plan = self._plan_for(pl_module)
            # layers built in configure_model count in the overlap
            problem = (self._overlap(trainer, pl_module)
                       or optimizer_problem(pl_module, plan, optimizers)
                       or averaging_problem(averaged_copies(trainer), pl_module, plan))
        except ValueError as error:
            problem = str(error)
        if problem:
            raise ValueError(f"SparsityCallback: {problem}")
        total = fit_length(trainer, len(optimizers))
        if problem := (uncompressed_problem(self.config, plan, pl_module, self._compress_ran)
                       or fit_problem(self.config, plan, optimizers, total, restored)):
            raise ValueError(f"SparsityCallback: {problem}")
        self._start = FitStart(plan, self.engine, restored is not None)  # back on an error
        self.engine = engine_for_fit(self.engine, pl_module, self.config, plan, restored,
                                     {name for name, _ in self._swapped}, trainer.global_step)
        self._averaged = start_engine(self._engine(), trainer, self.config, total,
                                      restored is not None)
        self._unused_checked, self._fitting, self._optimizers = False, True, trainer.optimizers

    # -- steps ----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._start, self._swapped = None, []  # trained from now on: an error keeps them
        self._optimizers = follow_optimizers(self._engine(), trainer, pl_module, self._optimizers)
        self._engine().on_step_start(schedule_step(trainer))
        if self._averaged is not None:
            self._averaged.sync()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Optimizer) -> None:
        engine = self._engine()
        self._optimizers = follow_optimizers(engine, trainer, pl_module, self._optimizers)
        if not self._unused_checked:
            self._unused_checked = True
            if warning := unused_warning(engine, optimizer):
                rank_zero_warn(f"SparsityCallback: {warning}")
        engine.before_optimizer_step(optimizer, schedule_step(trainer),
                                     clipping=clips_gradients(trainer))
        if self._averaged is not None:  # regrowth changes masks here
            self._averaged.sync()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._engine().on_step_end()
        # at the loggers' cadence: a ``self.log`` costs about half a millisecond of Python,
        # too much for every step
        if logs_batch(trainer):
            log_sparsity(pl_module, self, self._all(trainer), on_step=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_sparsity(pl_module, self, self._all(trainer), on_step=False)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(f"SparsityCallback: {summary(self._engine())}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fitting = False
        self._restored, self._swapped, self._start = None, [], None  # ends with the stage
        self._compressing, self._plan, self._averaged, self._optimizers = None, None, None, []
        if self.engine is not None:  # kept for inspection; its GPU memory given back
            end_engine(self.engine)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """A fit that failed (ours or another callback's error) gives the tensors up too;
        one that failed before its first training batch (a checkpoint Lightning could not
        load, or whose state does not fit, a check at the start, the sanity check) gets its
        Linear layers back and loses the masks its start added: the model is as it was. A
        checkpoint that cannot be read gets a note naming it. With tensors of the model
        still on the meta device the error is raised from here: Lightning's teardown, next,
        moves the model to the CPU, which fails on meta tensors and would replace the error
        with its own."""
        if self._start is not None:
            self.engine = self._start.undo(self.engine)
        undo_swaps(pl_module, self._swapped)
        self.teardown(trainer, pl_module, "fit")
        unreadable_checkpoint(trainer.ckpt_path, exception)
        if isinstance(exception, Exception) and any(
                t.is_meta for t in itertools.chain(pl_module.parameters(), pl_module.buffers())):
            raise exception

    # -- checkpointing ----------------------------------------------------------------------
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Check the state first: a checkpoint whose SparsityCallback state is filed under
        another key was saved with another selection, one with other mask settings is
        refused naming them. Where Lightning restores before building the optimizers (every
        strategy but ``ModelParallelStrategy``), the layers the checkpoint trained
        compressed become this fit's (:func:`~sparse_training.layers.compress.
        follow_checkpoint`): ``compress="auto"`` may have decided otherwise here."""
        claimed = [c.state_key for c in self._all(trainer)]
        state = own_state(checkpoint.get("callbacks") or {}, (self.state_key, claimed),
                          self.config)
        if state is None:
            return
        check_state(state)
        check_mask_settings(state["settings"], self.config.as_dict())
        if self.config.compress and not self._fitting and self._plan is not None:
            self._plan = follow_checkpoint(pl_module, self._plan, state.get("compressed"),
                                           self._swapped)

    def state_dict(self) -> dict[str, Any]:
        if self.engine is not None:
            return self.engine.state_dict()
        return dict(self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fitting:  # strategies that restore checkpoints after on_fit_start
            self._engine().load_state_dict(state_dict)
        else:  # the usual order: installed at on_fit_start, once the model is final
            self._restored = dict(state_dict)
