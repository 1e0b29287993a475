"""The optimizer hooks of the engine: what keeps pruned weights and their state at zero.

:meth:`SparsityEngine.attach <sparse_training.engine.engine.SparsityEngine.attach>` registers, per
optimizer, either the fused path (a step pre-hook running the masked Triton step,
:func:`fused_step`) or the hook path (a pre-hook zeroing pruned gradients right before the
update, :func:`masked_gradients_step`, and a post-hook zeroing pruned weights after it,
:func:`after_step`, and their optimizer state where the optimizer's update may move a zero:
:data:`KEEPS_ZERO_STATE`). Both run a step's closure first, so everything that changes gradients
inside it (Lightning's backward, clipping) has happened. :func:`optimizer_problem` checks,
before any of this, that the optimizers train the model's sparse tensors.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from sparse_training.engine.sharding import is_sharded, local
from sparse_training.engine.slots import state_tensors
from sparse_training.kernels import zero_pruned_

if TYPE_CHECKING:
    from sparse_training.engine.plan import SparsityPlan
    from sparse_training.engine.protocol import Slot
    from sparse_training.engine.slot_set import SlotSet
    from sparse_training.engine.updaters import ScheduledMasks

_GRAD = operator.attrgetter("grad")

# Optimizers whose update keeps every state entry at zero where the gradient, the weight and
# the state are zero (the hooks make them so: state zeroed at attach and at mask updates,
# gradients before the step, weights after it). Each state is a sum of terms proportional to
# g, g^2, the weight or the state itself: Adam's m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
# SGD's b = mu b + g, Adagrad's s = s + g^2 (its initial_accumulator_value is zeroed at
# attach), Adadelta's a = rho a + (1 - rho) (sqrt(d + eps) / sqrt(v + eps) g)^2, ASGD's
# ax = ax + mu (w - ax). Exact classes: a subclass may change the update. Any other optimizer
# (Adamax: u = max(b2 u, |g| + eps); Rprop: step sizes clamped to step_size_min; a user's) gets
# its weight-shaped state zeroed at pruned positions after every step, in the weights' pass.
KEEPS_ZERO_STATE: frozenset[type[Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD})


class Attached:
    """An optimizer's slots and the lists its per-step passes read, built once (the hot
    path is a few C-level maps, not a Python loop over slots): the ``enforced`` slots'
    weights and gradients are masked (masked-dense tensors, 2:4 layers' dense weights),
    the others keep their structure themselves (block layers). ``groups``: the optimizer's
    parameter groups when they were read. ``zeroes_state``: whether the step's post-hook
    zeroes the optimizer's state too (one not in :data:`KEEPS_ZERO_STATE`)."""

    def __init__(self, slots: list[Slot], groups: int) -> None:
        self.handles: list[RemovableHandle] = []
        # True while the optimizer re-runs a step's closure (LBFGS): the step's once-only
        # work (the updater's before_step, RigL's dense-gradient reads) is not repeated
        self.repeating = False
        self.zeroes_state = False
        self.use(slots, groups)

    def use(self, slots: list[Slot], groups: int) -> None:
        """Serve these slots from now on (the hooks keep this object)."""
        self.slots, self.groups = slots, groups
        self.enforced = [s for s in slots if s.enforced]
        self.params = [s.param for s in self.enforced]
        # FSDP2's DTensors: their local shards are zeroed, looked up at every pass (FSDP
        # swaps a parameter's local tensor at its lazy init)
        self.sharded = any(map(is_sharded, self.params))
        self._buffers = [s.module._buffers for s in self.enforced]
        self._keys = [s.mask_key for s in self.enforced]
        self._masks: list[Tensor] = []
        self._by_param: dict[Tensor, Tensor] = {}

    def start(self, optimizer: Optimizer, dense_state: bool) -> None:
        """The optimizer trains the slots from now on (:meth:`Slot.attach
        <sparse_training.engine.protocol.Slot.attach>`: unless the updater keeps
        ``dense_state``, state and weights are zeroed where pruned; a 2:4 layer leaves
        masking its gradient to the step)."""
        self.zeroes_state = not dense_state and type(optimizer) not in KEEPS_ZERO_STATE
        for slot in self.slots:
            slot.attach(optimizer, dense_state)

    @property
    def masks(self) -> list[Tensor]:
        """The mask buffers, checked by identity (C-level maps): a ``.to()`` of the model or
        of any submodule replaces buffers, and the lists follow."""
        current = list(map(dict.__getitem__, self._buffers, self._keys))
        if len(current) != len(self._masks) or not all(map(operator.is_, current, self._masks)):
            self._masks = current
            self._by_param = dict(zip(self.params, current, strict=True))
        return self._masks

    @property
    def masks_by_param(self) -> dict[Tensor, Tensor]:
        """Parameter -> mask, for the fused step."""
        self.masks  # noqa: B018  (refreshes after a device move)
        return self._by_param

    def zero_pruned_gradients(self) -> None:
        grads = list(map(_GRAD, self.params))
        if self.sharded:
            grads = list(map(local, grads))  # local(None) is None
        masks = self.masks
        if any(g is None for g in grads):  # unused tensors (`None in grads` calls __eq__)
            pairs = [(g, m) for g, m in zip(grads, masks, strict=True) if g is not None]
            grads, masks = [g for g, _ in pairs], [m for _, m in pairs]
        zero_pruned_(grads, masks)

    def zero_pruned_weights(self, optimizer: Optimizer | None = None) -> None:
        """Zero the pruned weights and, given ``optimizer``, its state tensors shaped like
        them (``state[~mask] = 0``), in the same pass."""
        tensors = list(map(local, self.params)) if self.sharded else self.params
        masks = self.masks
        if optimizer is not None:
            pairs = [(local(value), mask) for param, mask in zip(self.params, masks, strict=True)
                     for value in state_tensors(optimizer, param)]
            tensors = tensors + [value for value, _ in pairs]
            masks = masks + [mask for _, mask in pairs]
        with torch.no_grad():
            zero_pruned_(tensors, masks)


def use_fused(fused: bool | str, dense_state: bool, optimizer: Optimizer,
              slots: list[Slot]) -> bool:
    """The fused-step policy for an engine's ``fused`` setting: ``"auto"`` on CUDA where the
    kernels serve the optimizer, ``True`` wherever they can (an error otherwise), ``False``
    never; never for no ``slots``, nor while the updater keeps ``dense_state`` (SR-STE).

    Raises:
        ValueError: ``fused=True`` and the kernels cannot serve ``optimizer``.
    """
    if fused is False or not slots:
        return False
    reason = fused_problem(dense_state, optimizer)
    if fused is True and reason is not None:
        raise ValueError(f"fused=True {reason}")
    return reason is None and (fused is True or all(slot.param.is_cuda for slot in slots))


def fused_problem(dense_state: bool, optimizer: Optimizer) -> str | None:
    """Why the fused step cannot serve ``optimizer`` (the sentence after "fused=True"), or
    None: the kernels' reasons, or an updater that keeps ``dense_state`` (SR-STE)."""
    from sparse_training.kernels import fused_unsupported_reason

    reason = ("SR-STE keeps dense optimizer state" if dense_state
              else fused_unsupported_reason(optimizer))
    return None if reason is None else (
        f"cannot serve {type(optimizer).__name__}: {reason}; use fused='auto' (fused where "
        f"possible) or fused=False")


StepArgs = tuple[tuple[Any, ...], dict[str, Any]]


def _closure_first(attached: Attached, mask: bool, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> StepArgs | None:
    """Run a step's closure now (Lightning's: forward, backward, ``on_before_optimizer_step``
    of every callback and the module, clipping), so that what follows sees the final
    gradients; the step then gets a closure that returns that loss at its first call and, at
    every later one (LBFGS re-evaluates), runs the closure again, as a repeat of the step
    (:attr:`Attached.repeating`), and zeroes the pruned gradients if ``mask``. None: no
    closure."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: optimizer
    if closure is None:
        return None
    with torch.enable_grad():
        first = [closure()]

    def evaluate() -> Any:
        if first:
            return first.pop()
        attached.repeating = True
        try:
            with torch.enable_grad():
                loss = closure()
        finally:
            attached.repeating = False
        if mask:
            attached.zero_pruned_gradients()
        return loss

    return args[:1], {**kwargs, "closure": evaluate}


def masked_gradients_step(updater: ScheduledMasks, attached: Attached, optimizer: Optimizer,
                          args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepArgs | None:
    """Optimizer pre-step hook of the hook path: the pruned gradients zeroed right before the
    update, after everything that may have changed them, so pruned weights and their
    optimizer state see exact zeros (at each evaluation of an optimizer that re-runs the
    closure, too)."""
    new_args = _closure_first(attached, updater.masks_gradients, args, kwargs)
    if updater.masks_gradients:
        attached.zero_pruned_gradients()
    return new_args


def fused_step(attached: Attached, optimizer: Optimizer, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> StepArgs | None:
    """Optimizer pre-step hook of the fused path: the masked weights in the fused kernels
    (they ignore pruned gradients). The handled gradients become None, so
    ``optimizer.step`` goes on with the unmasked parameters only."""
    from sparse_training import kernels

    new_args = _closure_first(attached, False, args, kwargs)
    # torch's own fused optimizers step on scaled gradients: GradScaler hands them its
    # scale and overflow flag as attributes (and calls step even on an overflow)
    kernels.fused_masked_step(optimizer, attached.masks_by_param,
                              grad_scale=getattr(optimizer, "grad_scale", None),
                              found_inf=getattr(optimizer, "found_inf", None))
    return new_args


def after_step(updater: ScheduledMasks, slot_set: SlotSet, attached: Attached,
               optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer post-step hook: the updater's step end, then the pruned weights zeroed,
    whatever moved them (the optimizer, or gradients changed after they were masked), and
    the state of an optimizer whose update may move a zero (:attr:`Attached.zeroes_state`)."""
    updater.after_step(slot_set, attached.slots)
    attached.zero_pruned_weights(optimizer if attached.zeroes_state else None)


def optimizer_problem(model: nn.Module, plan: SparsityPlan,
                      optimizers: list[Optimizer]) -> str | None:
    """Why ``optimizers`` do not train ``model``'s sparse tensors, or None.

    Two ways to train the wrong tensors without a word: an optimizer holding parameters
    that are not the model's (captured before ``compress`` swapped layers at ``setup``, or
    another module's), and a selected weight or a compressed layer's parameter that requires
    grad but is in no optimizer (its pruned weights, or the compressed values, would never
    be updated by an attached optimizer).
    """
    owned = {id(p) for p in model.parameters()}
    held: set[int] = set()
    problems = []
    for index, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held.update(map(id, params))
        foreign = [tuple(p.shape) for p in params if id(p) not in owned]
        if foreign:
            shown = ", ".join(map(str, foreign[:4])) + (", ..." if len(foreign) > 4 else "")
            problems.append(f"optimizer {index} ({type(optimizer).__name__}) holds "
                            f"{len(foreign)} parameters that are not the model's (shapes "
                            f"{shown})")
    trained = [(p.name, t.param) for p, t in plan.masked]
    trained += [(f"{name}.{attr}", param) for name, layer in plan.held_layers(model)
                for attr, param in layer.named_parameters(recurse=False)]
    missing = [name for name, param in trained if param.requires_grad and id(param) not in held]
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        where = "no optimizer" if held else "no optimizer (configure_optimizers returned None)"
        problems.append(f"{len(missing)} parameters of the sparse layers require grad but are "
                        f"in {where}: {shown}")
    if not problems:
        return None
    return ("; ".join(problems) + ". Build the optimizers in configure_optimizers from "
            "self.parameters() (compress swaps layers at setup, before it), and freeze "
            "(requires_grad_(False)) or deny the sparse tensors no optimizer should train")


