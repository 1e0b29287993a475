"""The engine: owns the masks of one model and every change to them.

It knows nothing of Lightning. Without Lightning, a training loop uses it like this::

    engine = SparsityEngine(model, SparsityConfig(pattern="2:4"))
    engine.start(total_steps)            # resolve fractional start/end
    engine.attach(optimizer)             # re-mask weights after every step that ran
    for step, batch in enumerate(loader):
        engine.on_step_start(step)       # mask updates due at this step
        loss(model(batch)).backward()
        engine.mask_gradients()          # before clipping, so the norm is the masked one
        optimizer.step()
        optimizer.zero_grad()

How masks hold: a bool buffer ``<param>_mask`` on the owning module (persistent, so
``state_dict`` carries it); pruned weights zeroed in place; no reparametrization and no
forward hooks. Gradients are masked before the optimizer step, weights re-masked after it
(an ``Optimizer.register_step_post_hook``, so a step the AMP grad scaler skips triggers
nothing), and every optimizer-state tensor shaped like a masked weight is zeroed wherever a
mask update prunes or grows a position.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from sparse_training.config import SparsityConfig
from sparse_training.masks import global_masks, pattern_mask
from sparse_training.schedules import Schedule
from sparse_training.selection import LayerPlan, plan_layers

PARAM = "weight"
MASK = PARAM + "_mask"


def _check_loaded_mask(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       local_metadata: Any, strict: bool, *args: Any) -> None:
    """``load_state_dict`` pre-hook: a checkpoint's mask must fit the module's weight.

    A missing mask is left to torch: an error under ``strict=True``, kept as is otherwise.
    """
    key = prefix + MASK
    if MASK not in module._buffers or key not in state_dict:  # folded, or a partial load
        return
    loaded, weight = state_dict[key], getattr(module, PARAM)
    if loaded.shape != weight.shape or loaded.dtype != torch.bool:
        raise ValueError(f"checkpoint mask {key!r} ({loaded.dtype}, {tuple(loaded.shape)}) does "
                         f"not fit weight {prefix + PARAM!r} (needs torch.bool, "
                         f"{tuple(weight.shape)})")


@dataclass(frozen=True)
class MaskedLayer:
    """A selected layer; the weight and mask are read through the module, so device moves
    and checkpoint loads are always seen."""

    plan: LayerPlan
    module: nn.Module

    @property
    def weight(self) -> nn.Parameter:
        return getattr(self.module, PARAM)

    @property
    def mask(self) -> Tensor:
        return getattr(self.module, MASK)


def _register_mask(module: nn.Module) -> None:
    weight = getattr(module, PARAM)
    existing = module._buffers.get(MASK)
    if existing is not None:  # masks of an earlier sparse run: keep them
        if existing.dtype != torch.bool or existing.shape != weight.shape:
            raise ValueError(f"module {type(module).__name__} already has a {MASK!r} that is not "
                             f"a bool mask of its weight's shape (torch.nn.utils.prune?); "
                             f"remove it first")
        return
    if hasattr(module, MASK):
        raise ValueError(f"module {type(module).__name__} already has an attribute {MASK!r}")
    module.register_buffer(MASK, torch.ones_like(weight, dtype=torch.bool), persistent=True)
    module.register_load_state_dict_pre_hook(_check_loaded_mask)


class SparsityEngine:
    """Masks of one model: selection, schedule, updates, enforcement, state.

    Args:
        model: the model whose layers are masked; masks are registered on it at once.
        config: validated settings.

    Raises:
        ValueError: from layer selection (see :func:`sparse_training.selection.plan_layers`).
    """

    def __init__(self, model: nn.Module, config: SparsityConfig) -> None:
        self.config = config
        self.plans = plan_layers(
            model, pattern=config.parsed_pattern, sparsity=config.sparsity,
            layer_types=config.layer_types, allow=config.allow, deny=config.deny,
            dense_ratio=config.dense_ratio, overrides=config.parsed_overrides,
            distribution=config.distribution)
        self.layers = [MaskedLayer(p, model.get_submodule(p.name)) for p in self.plans
                       if p.selected]
        for layer in self.layers:
            _register_mask(layer.module)
        self.schedule: Schedule = config.parsed_schedule
        self.last_update: int | None = None
        self.target = 0.0
        self.layer_sparsity: dict[str, float] = {}
        self._attached: dict[Optimizer, tuple[list[MaskedLayer], RemovableHandle]] = {}
        self._refresh_stats()

    # -- schedule ---------------------------------------------------------------------------
    def start(self, total_steps: int | None) -> None:
        """Turn fractional ``start``/``end`` into steps of a run of ``total_steps``
        (None when unknown).

        A schedule restored by :meth:`load_state_dict` keeps its steps.
        """
        if not self.schedule.is_resolved:
            self.schedule = self.schedule.resolve(total_steps)

    def on_step_start(self, step: int) -> bool:
        """Apply the mask update due at optimizer step ``step``, if any; True if one ran."""
        if not self.schedule.is_resolved:
            raise RuntimeError("call SparsityEngine.start(total_steps) before training")
        due = self.schedule.latest_update_step(step)
        if due is None or (self.last_update is not None and due <= self.last_update):
            return False
        self.update_masks(self.schedule.fraction(due))
        self.last_update = due
        return True

    # -- masks ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_masks(self, fraction: float) -> None:
        """Recompute every mask at ``fraction`` of each layer's final sparsity and apply it."""
        global_layers = [layer for layer in self.layers if layer.plan.sparsity is None]
        new_masks: dict[int, Tensor] = {}
        if global_layers:
            target = self.config.sparsity * fraction
            for layer, mask in zip(global_layers, global_masks(
                    [layer.weight for layer in global_layers], self.config.parsed_pattern,
                    target), strict=True):
                new_masks[id(layer)] = mask
        for layer in self.layers:
            if layer.plan.sparsity is not None:
                new_masks[id(layer)] = pattern_mask(layer.weight, layer.plan.pattern,
                                                    layer.plan.sparsity * fraction)
        self.set_masks({id(layer): new_masks[id(layer)] for layer in self.layers})
        total = sum(layer.plan.numel for layer in self.layers)
        self.target = sum(layer.plan.numel * (
            self.config.sparsity if layer.plan.sparsity is None else layer.plan.sparsity)
            for layer in self.layers) * fraction / max(total, 1)

    @torch.no_grad()
    def set_masks(self, new_masks: dict[int, Tensor]) -> None:
        """Install masks (keyed by ``id(layer)``): zero pruned weights, and zero optimizer
        state wherever a position is not kept in both the old and the new mask."""
        for layer in self.layers:
            new = new_masks[id(layer)]
            reset = ~(new & layer.mask)
            layer.mask.copy_(new)
            layer.weight.masked_fill_(~new, 0)
            for optimizer in self._attached:
                for value in optimizer.state.get(layer.weight, {}).values():
                    if isinstance(value, Tensor) and value.shape == new.shape:
                        value.masked_fill_(reset, 0)
        self._refresh_stats()

    @torch.no_grad()
    def apply_masks(self, layers: Iterable[MaskedLayer] | None = None) -> None:
        """Zero every pruned weight (of ``layers``, default all)."""
        for layer in self.layers if layers is None else layers:
            layer.weight.masked_fill_(~layer.mask, 0)

    @torch.no_grad()
    def mask_gradients(self, optimizer: Optimizer | None = None) -> None:
        """Zero the gradients of pruned weights (of one optimizer's layers, default all)."""
        layers = self.layers if optimizer is None else self._layers_of(optimizer)
        for layer in layers:
            if layer.weight.grad is not None:
                layer.weight.grad.masked_fill_(~layer.mask, 0)

    # -- optimizers -------------------------------------------------------------------------
    def _layers_of(self, optimizer: Optimizer) -> list[MaskedLayer]:
        if optimizer in self._attached:
            return self._attached[optimizer][0]
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [layer for layer in self.layers if id(layer.weight) in params]

    def attach(self, optimizer: Optimizer) -> None:
        """Re-mask this optimizer's weights after each of its steps, and zero its state at
        pruned positions now and at every mask update. Attaching twice is a no-op."""
        if optimizer in self._attached:
            return
        layers = self._layers_of(optimizer)
        handle = optimizer.register_step_post_hook(
            functools.partial(_remask_after_step, self, layers))
        self._attached[optimizer] = (layers, handle)
        self.set_masks({id(layer): layer.mask.clone() for layer in self.layers})

    def detach(self) -> None:
        """Remove the optimizer hooks."""
        for _, handle in self._attached.values():
            handle.remove()
        self._attached.clear()

    # -- reporting and state ----------------------------------------------------------------
    def _refresh_stats(self) -> None:
        self.layer_sparsity = {layer.plan.name: 1.0 - layer.mask.sum().item() / layer.plan.numel
                               for layer in self.layers}

    @property
    def sparsity(self) -> float:
        """Fraction of zeros in the masks over all selected weights."""
        total = sum(layer.plan.numel for layer in self.layers)
        pruned = sum(s * layer.plan.numel for layer, s in
                     zip(self.layers, self.layer_sparsity.values(), strict=True))
        return pruned / total if total else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Schedule state; the masks themselves live in the model's ``state_dict``."""
        return {"start": self.schedule.start, "end": self.schedule.end,
                "last_update": self.last_update, "target": self.target}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule = Schedule(self.schedule.kind, state["start"], state["end"],
                                 self.schedule.frequency)
        self.last_update = state["last_update"]
        self.target = state["target"]
        self._refresh_stats()


def _remask_after_step(engine: SparsityEngine, layers: list[MaskedLayer], optimizer: Optimizer,
                       args: Any, kwargs: Any) -> None:
    engine.apply_masks(layers)


def make_permanent(model: nn.Module) -> nn.Module:
    """Fold every mask into its weight and remove the mask buffers, for inference or
    hand-off; the result has the model's plain ``state_dict`` keys. Returns ``model``."""
    with torch.no_grad():
        for module in model.modules():
            mask = module._buffers.get(MASK)
            if mask is not None:
                getattr(module, PARAM).masked_fill_(~mask, 0)
                del module._buffers[MASK]
    return model

