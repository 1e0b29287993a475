"""SparsityCallback: the thin Lightning side of :class:`sparse_training.SparsityEngine`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from sparse_training.config import SparsityConfig
from sparse_training.engine import SparsityEngine
from sparse_training.regrowth import DEFAULT_ALPHA, DEFAULT_REGROW_END, DEFAULT_SR_STE_DECAY
from sparse_training.schedules import Step
from sparse_training.selection import DEFAULT_LAYER_TYPES, format_table


class SparsityCallback(Callback):
    """Train sparse with any LightningModule: masks that hold, schedules, exact resume.

    At ``setup`` the layers are selected, a bool mask buffer is registered beside each
    selected weight and the selection table is logged. Masks are updated at the start of
    the optimizer steps the schedule names; gradients are masked in
    ``on_before_optimizer_step`` (after AMP unscaling, before gradient clipping), where
    regrowth also reads the dense gradients; weights are re-masked after every optimizer
    step that ran.

    Args:
        pattern: see :mod:`sparse_training.patterns` ("2:4", "unstructured", "block:4x4", ...).
        sparsity: target fraction of zeros per selected layer; implied by N:M when None.
        schedule: "oneshot" | "gmp" | "linear" | "constant" (:mod:`sparse_training.schedules`).
        start: first update, optimizer steps (int) or fraction of
            ``trainer.estimated_stepping_batches`` (float).
        end: last update of a gradual schedule; None means 0.75 of training.
        frequency: optimizer steps between mask updates of a gradual schedule.
        allow: regexes searched in module names; when given, only matching layers.
        deny: regexes searched in module names; matching layers stay dense.
        dense_ratio: the first fraction of the eligible layers, in module order, stays dense.
        overrides: ``{regex: {"sparsity": .., "pattern": ..}}`` per-layer settings.
        distribution: "uniform" | "erk" | "global" (one magnitude threshold across layers).
        layer_types: module classes whose ``weight`` may be masked.
        log_layers: also log ``sparsity/<layer>`` for every selected layer.
        score: what the schedule's mask updates keep: "magnitude" (largest |w|) or
            "random" (a random mask, seeded by (seed, step): static sparse training).
        regrow: None | "rigl" | "set" | "sr-ste" (:mod:`sparse_training.regrowth`).
        regrow_fraction: alpha, the share of active weights swapped at step 0 (RigL: 0.3).
        regrow_end: no more regrowth from this step (int) or fraction (float) on.
        sr_ste_decay: lambda of SR-STE's decay of the pruned weights.
        seed: seeds every random draw together with the step, equal on every rank.
        check_masks: under torch.distributed, compare mask checksums across ranks after
            every update and raise on a mismatch (one small all-reduce per update).
        fused: the masked optimizer step in fused Triton kernels
            (:mod:`sparse_training.kernels`): "auto" uses it on CUDA for
            ``torch.optim.AdamW``, ``Adam`` and ``SGD``, True requires it (an error where it
            cannot serve), False never uses it.

    Raises:
        ValueError: at construction for a bad setting, at setup for a regex that matches no
            layer or a named layer that cannot take its pattern; always before any weight
            changes. The message names the value and the valid forms.

    Example::

        trainer = pl.Trainer(max_epochs=3, callbacks=[SparsityCallback("2:4")])
        trainer.fit(model, loader)
    """

    def __init__(
        self,
        pattern: str = "2:4",
        sparsity: float | None = None,
        schedule: str = "oneshot",
        start: Step = 0,
        end: Step | None = None,
        frequency: int = 100,
        allow: Sequence[str] | None = None,
        deny: Sequence[str] | None = None,
        dense_ratio: float = 0.0,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        distribution: str = "uniform",
        layer_types: tuple[type[nn.Module], ...] = DEFAULT_LAYER_TYPES,
        log_layers: bool = False,
        score: str = "magnitude",
        regrow: str | None = None,
        regrow_fraction: float = DEFAULT_ALPHA,
        regrow_end: Step = DEFAULT_REGROW_END,
        sr_ste_decay: float = DEFAULT_SR_STE_DECAY,
        seed: int = 0,
        check_masks: bool = True,
        fused: bool | str = "auto",
    ) -> None:
        self.config = SparsityConfig(
            pattern=pattern, sparsity=sparsity, schedule=schedule, start=start, end=end,
            frequency=frequency, allow=allow, deny=deny, dense_ratio=dense_ratio,
            overrides=overrides, distribution=distribution, layer_types=layer_types,
            log_layers=log_layers, score=score, regrow=regrow, regrow_fraction=regrow_fraction,
            regrow_end=regrow_end, sr_ste_decay=sr_ste_decay, seed=seed,
            check_masks=check_masks, fused=fused)
        self.engine: SparsityEngine | None = None
        self._model: nn.Module | None = None
        self._restored_state: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, source: str | Path | Mapping[str, Any]) -> SparsityCallback:
        """Build from a YAML file or dict with the constructor's keys; unknown keys raise."""
        return cls(**SparsityConfig.load(source))

    @property
    def state_key(self) -> str:
        c = self.config
        return self._generate_state_key(pattern=c.pattern, sparsity=c.sparsity,
                                        schedule=c.schedule, regrow=c.regrow, allow=c.allow,
                                        deny=c.deny)

    def _engine(self) -> SparsityEngine:
        if self.engine is None:
            raise RuntimeError("SparsityCallback was not set up: add it to a Trainer")
        return self.engine

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.engine is not None and self._model is pl_module:
            return
        engine = SparsityEngine(pl_module, self.config)
        if not engine.layers:
            raise ValueError("SparsityCallback selected no layer (setup table below); layers "
                             "that a LightningModule builds in configure_model are not seen, "
                             "since masks are registered at setup, before configure_model: "
                             "build them in __init__\n" + format_table(engine.plans))
        self.engine, self._model = engine, pl_module
        if self._restored_state is not None:  # a state loaded before setup: once, here
            self.engine.load_state_dict(self._restored_state)
            self._restored_state = None
        rank_zero_info(f"SparsityCallback: {len(self.engine.layers)} of "
                       f"{len(self.engine.plans)} candidate layers selected\n"
                       + format_table(self.engine.plans))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine()
        total = trainer.estimated_stepping_batches
        total = None if math.isinf(total) else int(total)
        engine.start(total)
        last = engine.schedule.end if engine.schedule.end is not None else engine.schedule.start
        if total is not None and last >= total:
            rank_zero_warn(f"SparsityCallback: the schedule's last update (step {last}) comes "
                           f"after the last training step ({total - 1}); the final "
                           f"sparsity will not be reached")
        for optimizer in trainer.optimizers:
            engine.attach(optimizer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._engine().on_step_start(trainer.global_step)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Optimizer) -> None:
        self._engine().before_optimizer_step(optimizer, trainer.global_step,
                                             clipping=trainer.gradient_clip_val is not None)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._engine().on_step_end()
        # the steps at which the Trainer's loggers write (``log_every_n_steps``): a
        # ``self.log`` costs about half a millisecond of Python, too much for every step
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._log(pl_module, on_step=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(pl_module, on_step=False)

    def _log(self, pl_module: pl.LightningModule, on_step: bool) -> None:
        engine = self._engine()
        metrics = {"sparsity/global": engine.sparsity, "sparsity/target": engine.target}
        if self.config.log_layers:
            metrics.update({f"sparsity/{name}": s for name, s in engine.layer_sparsity.items()})
        # CPU tensors: a Python float would be copied to the GPU, a sync at every call
        pl_module.log_dict({k: torch.tensor(v) for k, v in metrics.items()}, on_step=on_step,
                           on_epoch=not on_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.engine is not None:
            self.engine.detach()

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._engine().state_dict() if self.engine else dict(self._restored_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine is not None:
            self.engine.load_state_dict(state_dict)
        else:
            self._restored_state = dict(state_dict)
