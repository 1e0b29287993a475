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
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from sparse_training.config import SparsityConfig
from sparse_training.masks import global_masks, pattern_mask
from sparse_training.regrowth import cosine_fraction, drop_and_grow, random_scores, sr_ste_gradient
from sparse_training.schedules import Schedule, to_steps
from sparse_training.selection import LayerPlan, plan_layers

PARAM = "weight"
MASK = PARAM + "_mask"
DENSE = PARAM + "_dense"  # SR-STE only: the dense weights behind the masked ones


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


def _register_mask(name: str, module: nn.Module) -> None:
    weight = getattr(module, PARAM)
    existing = module._buffers.get(MASK)
    if existing is not None:  # masks of an earlier sparse run: keep them
        if existing.dtype != torch.bool or existing.shape != weight.shape:
            raise ValueError(f"layer {name!r} already has a {MASK!r} ({existing.dtype}, "
                             f"{tuple(existing.shape)}) that is not a bool mask of its weight's "
                             f"shape {tuple(weight.shape)} (torch.nn.utils.prune?); remove it")
        return
    if hasattr(module, MASK):
        raise ValueError(f"layer {name!r} already has an attribute {MASK!r} that is not a "
                         f"buffer; rename it")
    module.register_buffer(MASK, torch.ones_like(weight, dtype=torch.bool), persistent=True)
    module.register_load_state_dict_pre_hook(_check_loaded_mask)


class SparsityEngine:
    """Masks of one model: selection, schedule, regrowth, enforcement, state.

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
        self.sr_ste = config.regrow == "sr-ste"
        for layer in self.layers:
            _register_mask(layer.plan.name, layer.module)
            if self.sr_ste and DENSE not in layer.module._buffers:
                layer.module.register_buffer(DENSE, layer.weight.detach().clone())
        self.schedule: Schedule = config.parsed_schedule
        self.regrow_end: int | float = config.regrow_end
        self.last_update: int | None = None
        self.last_regrow: int | None = None
        self.regrown_slot: dict[str, int] = {}  # layer -> last regrowth period (step // freq)
        self._dense_in_weights = False  # SR-STE: dense weights in the parameters right now
        self.target = 0.0
        self._stats: dict[str, float] | None = None
        self._attached: dict[Optimizer, tuple[list[MaskedLayer], RemovableHandle]] = {}
        self.fused_optimizers: set[Optimizer] = set()

    # -- schedule ---------------------------------------------------------------------------
    def start(self, total_steps: int | None) -> None:
        """Turn fractional steps into steps of a run of ``total_steps`` (None when unknown).

        A schedule restored by :meth:`load_state_dict` keeps its steps.
        """
        if not self.schedule.is_resolved:
            self.schedule = self.schedule.resolve(total_steps)
        if self.config.regrow in ("rigl", "set"):
            self.regrow_end = to_steps(self.regrow_end, total_steps)

    def on_step_start(self, step: int) -> bool:
        """Apply the mask update due at optimizer step ``step``, if any; True if one ran.

        Under SR-STE the mask is recomputed from the dense weights at every step.
        """
        if not self.schedule.is_resolved:
            raise RuntimeError("call SparsityEngine.start(total_steps) before training")
        due = self.schedule.latest_update_step(step)
        if self.sr_ste and due is not None:
            created = self.last_update is None
            self._sr_ste_remask(self.schedule.fraction(step), first=created)
            self.last_update = step
            if created or (step - self.schedule.start) % self.schedule.frequency == 0:
                self._check_across_ranks(step, broadcast=created)
            return True
        if due is None or (self.last_update is not None and due <= self.last_update):
            return False
        created = self.last_update is None
        self.update_masks(self.schedule.fraction(due), step=due)
        self.last_update = due
        self._check_across_ranks(due, broadcast=created)
        return True

    def before_optimizer_step(self, optimizer: Optimizer, step: int,
                              clipping: bool = True) -> None:
        """Between backward and ``optimizer.step``: regrowth when due (it reads the dense
        gradients), then the gradients of pruned weights are zeroed; under SR-STE the
        dense weights come back and the sparse-refined decay is added instead.

        Args:
            clipping: whether something reads the gradients before the step (gradient
                clipping); if not, an optimizer served by the fused step skips this pass,
                since its kernel masks the gradients itself.
        """
        layers = self._layers_of(optimizer)
        if self.sr_ste:
            if self.last_update is not None:
                self._sr_ste_restore_dense(layers)
            return
        due = self._regrowth_due(step, layers)
        if due and self._gradients_finite(due):
            self.regrow(due, step)
        if clipping or optimizer not in self.fused_optimizers:
            self.mask_gradients(optimizer)

    # -- masks ------------------------------------------------------------------------------
    def _layer_targets(self, fraction: float) -> dict[str, float | None]:
        return {layer.plan.name: None if layer.plan.sparsity is None
                else layer.plan.sparsity * fraction for layer in self.layers}

    def _scores(self, layer: MaskedLayer, step: int) -> Tensor | None:
        if self.config.score == "magnitude":
            return None
        return random_scores(layer.weight.shape, self.config.seed, step,
                             self.layers.index(layer), layer.weight.device)

    @torch.no_grad()
    def update_masks(self, fraction: float, step: int = 0) -> None:
        """Recompute every mask at ``fraction`` of each layer's final sparsity and apply it
        (scores: |w|, or seeded random with ``score="random"``)."""
        targets = self._layer_targets(fraction)
        new_masks: dict[str, Tensor] = {}
        global_layers = [layer for layer in self.layers if targets[layer.plan.name] is None]
        if global_layers:
            masks = global_masks([layer.weight for layer in global_layers],
                                 self.config.parsed_pattern, self.config.sparsity * fraction,
                                 [self._scores(layer, step) for layer in global_layers])
            new_masks.update({layer.plan.name: m for layer, m in zip(global_layers, masks,
                                                                     strict=True)})
        for layer in self.layers:
            if targets[layer.plan.name] is not None:
                new_masks[layer.plan.name] = pattern_mask(
                    layer.weight, layer.plan.pattern, targets[layer.plan.name],
                    self._scores(layer, step))
        self.set_masks(new_masks)
        self.target = self._mean_target(fraction)

    @torch.no_grad()
    def set_masks(self, new_masks: dict[str, Tensor], reset_state: bool = True) -> None:
        """Install masks (keyed by layer name): zero the pruned weights and, with
        ``reset_state``, every optimizer-state tensor wherever a position is not kept in both
        the old and the new mask (pruned, or grown and so starting from zero)."""
        for layer in self.layers:
            new = new_masks.get(layer.plan.name)
            if new is None:
                continue
            reset = ~(new & layer.mask)
            layer.mask.copy_(new)
            layer.weight.masked_fill_(~new, 0)
            if not reset_state:
                continue
            for optimizer in self._attached:
                for value in optimizer.state.get(layer.weight, {}).values():
                    if isinstance(value, Tensor) and value.shape == new.shape:
                        value.masked_fill_(reset, 0)
        self._stats = None

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

    # -- regrowth ---------------------------------------------------------------------------
    def _slot(self, step: int) -> int:
        return (step - self.schedule.start) // self.schedule.frequency

    def _regrowth_due(self, step: int, layers: list[MaskedLayer]) -> list[MaskedLayer]:
        """The layers due to regrow at ``step``: the first step of each ``frequency``-long
        period after ``start`` and before ``regrow_end`` that reaches them (with several
        optimizers each sees its own steps), sparse and with a gradient."""
        if (self.config.regrow not in ("rigl", "set") or self.last_update is None
                or not self.schedule.start < step < self.regrow_end):
            return []
        slot = self._slot(step)
        return [layer for layer in layers if layer.plan.sparsity != 0.0  # dense: nothing to swap
                and layer.weight.grad is not None
                and self.regrown_slot.get(layer.plan.name, 0) < slot]

    @staticmethod
    def _gradients_finite(layers: list[MaskedLayer]) -> bool:
        """False when any gradient holds inf or NaN (an AMP overflow): no update then."""
        return bool(torch.stack([layer.weight.grad.isfinite().all() for layer in layers]).all())

    @torch.no_grad()
    def regrow(self, layers: list[MaskedLayer], step: int) -> None:
        """Drop the f(t) share of each layer's active weights with the smallest |w| and grow
        as many by |gradient| (RigL) or at random (SET), inside the pattern's structure."""
        fraction = cosine_fraction(step, self.regrow_end, self.config.regrow_fraction)
        new_masks = {}
        for layer in layers:
            self.regrown_slot[layer.plan.name] = self._slot(step)
            grow = (layer.weight.grad if self.config.regrow == "rigl" else random_scores(
                layer.weight.shape, self.config.seed, step, self.layers.index(layer),
                layer.weight.device))
            new_masks[layer.plan.name] = drop_and_grow(layer.mask, layer.weight, grow,
                                                       layer.plan.pattern, fraction)
        self.set_masks(new_masks)
        self.last_regrow = step
        self._check_across_ranks(step, broadcast=False)

    @torch.no_grad()
    def _sr_ste_remask(self, fraction: float, first: bool) -> None:
        """SR-STE step start: the N:M mask of the dense weights; the weights used in the
        forward pass are the dense ones, masked."""
        new_masks = {}
        for layer in self.layers:
            dense = getattr(layer.module, DENSE)
            if first:
                dense.copy_(layer.weight)
            layer.weight.copy_(dense)
            new_masks[layer.plan.name] = pattern_mask(dense, layer.plan.pattern,
                                                      layer.plan.sparsity * fraction)
        self.set_masks(new_masks, reset_state=False)
        self.target = self._mean_target(fraction)

    @torch.no_grad()
    def _sr_ste_restore_dense(self, layers: list[MaskedLayer]) -> None:
        """SR-STE before the optimizer: the straight-through gradient of the masked weights
        plus lambda (1 - mask) w is applied to the dense weights."""
        for layer in layers:
            dense = getattr(layer.module, DENSE)
            if layer.weight.grad is not None:
                sr_ste_gradient(layer.weight.grad, dense, layer.mask, self.config.sr_ste_decay)
            layer.weight.copy_(dense)
        self._dense_in_weights = True

    def on_step_end(self) -> None:
        """After the batch: under SR-STE, a step that the AMP grad scaler skipped left the
        dense weights in the parameters; mask them so that evaluation and checkpoints see
        N:M weights."""
        if self._dense_in_weights:
            self.apply_masks()
            self._dense_in_weights = False

    def _mean_target(self, fraction: float) -> float:
        total = sum(layer.plan.numel for layer in self.layers)
        return sum(layer.plan.numel * (
            self.config.sparsity if layer.plan.sparsity is None else layer.plan.sparsity)
            for layer in self.layers) * fraction / max(total, 1)

    # -- ranks ------------------------------------------------------------------------------
    @torch.no_grad()
    def _check_across_ranks(self, step: int, broadcast: bool) -> None:
        """Under torch.distributed: rank 0's masks are broadcast when created, and a checksum
        all-reduce (``check_masks``) raises if any rank's masks differ."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        if broadcast:
            for layer in self.layers:
                as_bytes = layer.mask.to(torch.uint8)
                dist.broadcast(as_bytes, src=0)
                layer.mask.copy_(as_bytes.bool())
                layer.weight.masked_fill_(~layer.mask, 0)
        if not self.config.check_masks:
            return
        sums = torch.stack([mask_checksum(layer.mask) for layer in self.layers])
        extremes = torch.cat([sums, -sums])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        high, low = extremes[: len(sums)], -extremes[len(sums):]
        if not torch.equal(high, low):
            differ = [layer.plan.name for layer, h, lo in zip(self.layers, high, low,
                                                              strict=True) if h != lo]
            raise RuntimeError(f"masks differ across ranks at step {step} in layers {differ}; "
                               f"every rank must see the same weights, gradients and seed")

    # -- optimizers -------------------------------------------------------------------------
    def _layers_of(self, optimizer: Optimizer) -> list[MaskedLayer]:
        if optimizer in self._attached:
            return self._attached[optimizer][0]
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [layer for layer in self.layers if id(layer.weight) in params]

    def attach(self, optimizer: Optimizer) -> None:
        """Take charge of this optimizer's masked weights; attaching twice is a no-op.

        With the fused step (``config.fused``, :mod:`sparse_training.kernels`) a step
        pre-hook updates the masked weights in one Triton pass per group of tensors and
        hands the rest to ``optimizer.step``; otherwise a step post-hook re-masks the
        weights. Either way the optimizer state is zeroed at pruned positions now and at
        every mask update.

        Raises:
            ValueError: ``fused=True`` and the fused step cannot serve this optimizer.
        """
        if optimizer in self._attached:
            return
        layers = self._layers_of(optimizer)
        if self._use_fused(optimizer, layers):
            handle = optimizer.register_step_pre_hook(
                functools.partial(_fused_step, layers))
            self.fused_optimizers.add(optimizer)
        else:
            handle = optimizer.register_step_post_hook(
                functools.partial(_after_step, self, layers))
        self._attached[optimizer] = (layers, handle)
        if not self.sr_ste:
            self.set_masks({layer.plan.name: layer.mask.clone() for layer in layers})

    def _use_fused(self, optimizer: Optimizer, layers: list[MaskedLayer]) -> bool:
        """The fused-step policy: ``"auto"`` on CUDA where the kernels serve the optimizer,
        ``True`` wherever they can (an error otherwise), ``False`` never."""
        if self.config.fused is False or not layers:
            return False
        from sparse_training.kernels import fused_unsupported_reason

        reason = ("SR-STE keeps dense optimizer state" if self.sr_ste
                  else fused_unsupported_reason(optimizer))
        if self.config.fused is True and reason is not None:
            raise ValueError(f"fused=True cannot serve {type(optimizer).__name__}: {reason}; "
                             f"use fused='auto' (fused where possible) or fused=False")
        return reason is None and (self.config.fused is True or all(
            layer.weight.is_cuda for layer in layers))

    def detach(self) -> None:
        """Remove the optimizer hooks."""
        for _, handle in self._attached.values():
            handle.remove()
        self._attached.clear()
        self.fused_optimizers.clear()

    # -- reporting and state ----------------------------------------------------------------
    @property
    def layer_sparsity(self) -> dict[str, float]:
        """Fraction of zeros in each selected layer's mask (one device sync per mask change)."""
        if self._stats is None:
            kept = torch.stack([layer.mask.sum() for layer in self.layers]).tolist() \
                if self.layers else []
            self._stats = {layer.plan.name: 1.0 - k / layer.plan.numel
                           for layer, k in zip(self.layers, kept, strict=True)}
        return self._stats

    @property
    def sparsity(self) -> float:
        """Fraction of zeros in the masks over all selected weights."""
        total = sum(layer.plan.numel for layer in self.layers)
        pruned = sum(s * layer.plan.numel for layer, s in
                     zip(self.layers, self.layer_sparsity.values(), strict=True))
        return pruned / total if total else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Schedule and regrowth state; the masks live in the model's ``state_dict``. Random
        draws depend on (seed, step) only, so no generator state is needed."""
        return {"start": self.schedule.start, "end": self.schedule.end,
                "last_update": self.last_update, "target": self.target,
                "regrow_end": self.regrow_end, "last_regrow": self.last_regrow,
                "regrown_slot": dict(self.regrown_slot)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule = Schedule(self.schedule.kind, state["start"], state["end"],
                                 self.schedule.frequency)
        self.last_update = state["last_update"]
        self.target = state["target"]
        self.regrow_end = state["regrow_end"]
        self.last_regrow = state["last_regrow"]
        self.regrown_slot = dict(state["regrown_slot"])
        self._stats = None


def mask_checksum(mask: Tensor) -> Tensor:
    """Sum over kept positions of a mixing hash of the position (int64, wrapping; the
    xor-shift-multiply rounds of splitmix64): equal masks give equal sums, and different
    masks collide only by chance."""
    flat = mask.reshape(-1)
    keys = (torch.arange(flat.numel(), device=flat.device) + 1) * 0x1E3779B97F4A7C15
    keys = (keys ^ (keys >> 30)) * 0x3F58476D1CE4E5B9
    keys = keys ^ (keys >> 27)
    return torch.where(flat, keys, 0).sum()


def _fused_step(layers: list[MaskedLayer], optimizer: Optimizer, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Optimizer pre-step hook: the masked weights in the fused kernels.

    A step called with a closure (Lightning's way: the closure runs the forward, backward,
    ``on_before_optimizer_step`` and clipping) runs the closure here first, so the kernels
    see the final gradients; the step then gets a closure that returns the same loss. The
    handled gradients become None, so ``optimizer.step`` goes on with the unmasked
    parameters only.
    """
    from sparse_training.kernels import fused_masked_step

    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: optimizer
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    fused_masked_step(optimizer, {layer.weight: layer.mask for layer in layers})
    if closure is None:
        return None
    return args[:1], {**kwargs, "closure": lambda: loss}


def _after_step(engine: SparsityEngine, layers: list[MaskedLayer], optimizer: Optimizer,
                args: Any, kwargs: Any) -> None:
    """Optimizer post-step hook: zero the pruned weights again; under SR-STE keep the dense
    weights aside first."""
    if engine.sr_ste and engine.last_update is not None:
        with torch.no_grad():
            for layer in layers:
                getattr(layer.module, DENSE).copy_(layer.weight)
        engine._dense_in_weights = False
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
                module._buffers.pop(DENSE, None)
    return model

