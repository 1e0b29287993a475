"""The engine: owns the sparse-tensor slots of one model and every change to them.

It knows nothing of Lightning. Without Lightning, a training loop uses it like this::

    engine = SparsityEngine(model, SparsityConfig(pattern="2:4"))
    engine.start(total_steps)            # resolve fractional start/end
    engine.attach(optimizer)             # re-mask weights after every step (required)
    for step, batch in enumerate(loader):
        engine.on_step_start(step)       # mask updates due at this step
        loss(model(batch)).backward()
        engine.before_optimizer_step(optimizer, step)  # regrowth, masked gradients
        optimizer.step()
        optimizer.zero_grad()
    engine.detach()                      # then make_permanent(model) may drop the masks

The pieces: :func:`~sparse_training.engine.tensors.find_weight_tensors` finds every weight
tensor, :func:`~sparse_training.engine.selection.plan_tensors` decides, one
:class:`~sparse_training.engine.slots.MaskedSlot` per selected tensor holds its mask, an updater
(:mod:`sparse_training.engine.updaters`) changes masks, and one enforcement path keeps them:
pruned gradients are zeroed before the optimizer step and pruned weights after it, each
in one multi-tensor pass (:func:`sparse_training.kernels.zero_pruned_`), or by the fused
optimizer kernel; optimizer state is zeroed wherever a mask update prunes or grows.
Parameters sharded by FSDP2 (DTensors) get masks of the whole tensor, computed from it
gathered at mask updates, and enforced on the local shards (:mod:`sparse_training.engine.sharding`).
"""

from __future__ import annotations

import functools
import itertools
import numbers
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from sparse_training.config import SparsityConfig
from sparse_training.engine import ownership
from sparse_training.engine.distributed import sharding_problem
from sparse_training.engine.dynamic import make_updater
from sparse_training.engine.optimizer_hooks import (
    Attached,
    after_step,
    fused_step,
    masked_gradients_step,
    use_fused,
)
from sparse_training.engine.plan import SparsityPlan, plan_differences
from sparse_training.engine.protocol import Slot
from sparse_training.engine.slot_checks import (
    compressed_problem,
    masked_problem,
    ownership_problem,
)
from sparse_training.engine.slot_set import SlotSet
from sparse_training.engine.slots import MaskedSlot
from sparse_training.engine.state import FORMAT, checked_masks, pack_compressed, pack_masks


class SparsityEngine(SlotSet):
    """The masks of one model: selection, updates, enforcement, state.

    Args:
        model: the model whose weight tensors are masked; mask buffers are registered on
            it at once (not persistent: its ``state_dict`` stays plain).
        config: validated settings.
        state: a :meth:`state_dict` to resume from; checked in full before anything changes.
            Without it, masks the model carries (an earlier engine's) are the start, each
            held until a scheduled update keeps no more of its weights.

    Raises:
        ValueError: from selection, for a selected tensor that cannot be masked (on the
            meta device, a parametrization that does not keep zeros, the ``weight_g`` or
            ``weight_v`` of old-style ``torch.nn.utils.weight_norm``, a foreign
            ``<name>_mask`` attribute, held by another live engine), a compressed layer
            whose mask is not set (meta, or after ``to_empty()``), a carried mask sparser
            than these settings make its tensor, or for a state that does not fit; always
            before any weight or mask changes.
    """

    def __init__(self, model: nn.Module, config: SparsityConfig,
                 state: dict[str, Any] | None = None, plan: SparsityPlan | None = None) -> None:
        if not isinstance(model, nn.Module) or not isinstance(config, SparsityConfig):
            raise TypeError(f"SparsityEngine(model, config) takes a torch.nn.Module and a "
                            f"SparsityConfig (SparsityConfig(**settings) from a dict), got "
                            f"{type(model).__name__} and {type(config).__name__}")
        if plan is not None and plan.config is not config:
            raise ValueError("SparsityEngine(model, config, plan=...): the plan was built "
                             "under another config; give plan.config")
        self.config = config
        bound = None if plan is None else plan.bound(model)
        if plan is not None and bound is None:
            raise ValueError("SparsityEngine(model, config, plan=...): the plan's weight "
                             "tensors are not the model's (layers built or removed since it "
                             "was made); build it again with SparsityPlan.build(model, config)")
        self.plan = bound or SparsityPlan.build(model, config)
        self.plans = list(self.plan.rows)
        tensors = self.plan.tensors
        layers = self.plan.held_layers(model)  # others are another selection's
        # random streams by tensor, in model order over masked and compressed tensors: a
        # tensor draws the same scores whether it trains masked-dense or compressed, sharded
        # (FSDP2's FSDPBlockSparseLinear) or not
        super().__init__(
            slots=[MaskedSlot(p, t) for p, t in zip(self.plans, tensors, strict=True)
                   if p.selected] + [m.slot(f"{name}.{m.trained_weight}") for name, m in layers],
            streams={p.name: i for i, p in enumerate(
                p for p in self.plans if p.selected or p.compressed)},
            pooled_sparsity=config.sparsity, check_masks=config.check_masks)
        self.model = model
        self.fused_optimizers: set[Optimizer] = set()
        self._check_slots()
        self.updater = make_updater(config.parsed_schedule, config.parsed_score,
                                    config.parsed_regrowth, config.parsed_refinement)
        restored = None if state is None else self._checked(state)
        held = self.updater.carried(self, [s for s in self.masked if s.installed]) if (
            state is None) else set()  # masks the model carries: an earlier fit's
        self._take()
        self.updater.hold(self, held)
        if restored is not None:
            self._restore(state, *restored)

    def _check_slots(self) -> None:
        if problem := sharding_problem(self.model, self.slots,
                                       self.config.parsed_refinement is not None):
            raise ValueError(problem)
        problems = itertools.chain(map(masked_problem, self.masked),
                                   map(compressed_problem, self.compressed),
                                   (ownership_problem(slot, self) for slot in self.slots))
        if problem := next(filter(None, problems), None):  # the first, as it is found
            raise ValueError(problem)

    def _take(self) -> None:
        """Own the selected and compressed tensors; put the mask buffers on the model."""
        for slot in self.slots:
            ownership.take(slot.param, self)
        for slot in self.masked:
            slot.install()
        self.recount()

    def claim(self) -> None:
        """Check the selected tensors again and own them (an engine reused for a later
        fit: another engine may have taken them since, or the model changed).

        Raises:
            ValueError: as at construction.
        """
        self._check_slots()
        self._take()

    def bound_to(self, model: nn.Module) -> bool:
        """Whether this engine's tensors are ``model``'s, masks installed (not after
        ``make_permanent``, nor after ``configure_model`` built new layers)."""
        params = {id(p) for p in model.parameters()}
        return self.model is model and self.installed and all(
            id(slot.param) in params for slot in self.slots)

    def _restore(self, state: dict[str, Any], masks: dict[str, Tensor],
                 compressed: dict[str, Tensor]) -> None:
        """Install a checked state (:func:`~sparse_training.engine.state.checked_masks`): the
        updater's progress, then the masks; a compressed layer's blocks move (values and
        optimizer state follow) only where its mask differs (a swap at setup already made
        it the checkpoint's)."""
        self.updater.load_state_dict(state["updater"])
        self.set_masks({**masks, **compressed}, step=None, broadcast=False, check=False)
        if self.updater.statistics is not None and "statistics" in state:
            self.updater.statistics.load_state_dict(state["statistics"], self.slots)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, total_steps: int | None) -> None:
        """Turn fractional steps into steps of a run of ``total_steps`` (None: unknown).

        Raises:
            ValueError: ``total_steps`` neither None nor an int >= 0.
        """
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(
                total_steps, numbers.Integral) or total_steps < 0):
            raise ValueError(f"start(total_steps) takes the run's optimizer steps, an int >= 0, "
                             f"or None where unknown, got {total_steps!r}")
        self.updater.start(total_steps)

    def restart(self) -> None:
        """A new run from the current masks: the schedule and regrowth start over, each mask
        held until an update keeps no more of its weights (ValueError: as ``carried``)."""
        held = self.updater.carried(self, self.masked)
        self.updater.restart()
        self.updater.hold(self, held)

    def on_step_start(self, step: int) -> bool:
        """Apply the mask update due at optimizer step ``step``; True if masks changed."""
        if not self.updater.schedule.is_resolved:
            raise RuntimeError("call SparsityEngine.start(total_steps) before training")
        if not self._attached:
            raise RuntimeError("no optimizer is attached to this SparsityEngine: call engine."
                               "attach(optimizer) before the training loop (unattached, its steps "
                               "move pruned weights); for masks without training, engine.prune()")
        return self.updater.on_step_start(self, step)

    def before_optimizer_step(self, optimizer: Optimizer, step: int,
                              clipping: bool = True) -> None:
        """Between backward and ``optimizer.step``: regrowth when due (it reads the dense
        gradients), then, for readers of the gradients before the step (``clipping``), the
        pruned gradients are zeroed. The optimizer's step pre-hook zeroes them again right
        before the update (or its fused kernel ignores them), so without ``clipping`` this
        pass is skipped. Parameter groups the optimizer gained since :meth:`attach`
        (Lightning's ``BackboneFinetuning`` adds unfrozen layers so) are taken in first.

        Raises:
            RuntimeError: ``optimizer`` is not attached (its step would move pruned weights).
        """
        attached = self._attached_of(optimizer, "before_optimizer_step", (
            ": call engine.attach(optimizer) once before training (its step would move "
            "pruned weights)"))
        if len(optimizer.param_groups) != attached.groups:  # groups added since attach
            attached.use(_of_optimizer(self.slots, optimizer), len(optimizer.param_groups))
            attached.start(optimizer, self.updater.dense_state)
        if not attached.repeating:  # once a step, not at an optimizer's re-evaluation
            self.updater.before_step(self, attached.slots, step)
        if self.updater.masks_gradients and clipping:
            attached.zero_pruned_gradients()

    def zero_pruned_gradients(self, optimizer: Optimizer) -> None:
        """Zero the pruned positions' gradients of the tensors ``optimizer`` trains now, for
        code that reads gradients before the step does (manual optimization's
        ``clip_gradients`` before ``opt.step()``); a no-op where the updater keeps dense
        gradients (SR-STE).

        Raises:
            RuntimeError: ``optimizer`` is not attached to this engine.
        """
        attached = self._attached_of(optimizer, "zero_pruned_gradients", (
            " (under Lightning, pass the torch optimizer: self.optimizers().optimizer)"))
        if self.updater.masks_gradients:
            attached.zero_pruned_gradients()

    def _attached_of(self, optimizer: Optimizer, caller: str, fix: str) -> Attached:
        """The hooks of ``optimizer``.

        Raises:
            RuntimeError: ``optimizer`` is not attached, naming ``caller`` and the ``fix``.
        """
        attached = self._attached.get(optimizer)
        if attached is None:
            raise RuntimeError(f"{caller} got a {type(optimizer).__name__} that is not attached "
                               f"to this SparsityEngine{fix}")
        return attached

    def on_step_end(self) -> None:
        """After the batch, whether or not the optimizer step ran."""
        self.updater.on_step_end(self)

    # -- masks --------------------------------------------------------------------------------
    def prune(self, fraction: float = 1.0) -> None:
        """Masks at ``fraction`` of each tensor's final sparsity, now: ASP's one-shot prune
        of a trained model, without a training loop.

        Raises:
            ValueError: ``fraction`` not a number in [0, 1], or a training score (movement,
                second order) that has observed no training step of some tensor; before
                any mask changes.
        """
        if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
                or not 0.0 <= fraction <= 1.0):
            raise ValueError(f"prune(fraction) takes the share of each tensor's final sparsity "
                             f"to reach, a number in [0, 1] (1: the final sparsity), got "
                             f"{fraction!r}")
        self.updater.update_masks(self, float(fraction), step=0, created=True, hold=False)

    @property
    def final_sparsity(self) -> float:
        """The final target over all selected and compressed weights."""
        return self.overall(self.masked_final_sparsity)

    @property
    def target(self) -> float:
        """The sparsity the schedule asks for now, over all selected and compressed weights."""
        return self.overall(self.updater.target)

    # -- optimizers -------------------------------------------------------------------------
    def slots_of(self, optimizer: Optimizer) -> list[Slot]:
        """The slots whose parameter ``optimizer`` updates."""
        if optimizer in self._attached:
            return self._attached[optimizer].slots
        return _of_optimizer(self.slots, optimizer)

    def attach(self, optimizer: Optimizer) -> None:
        """Take charge of this optimizer's masked weights; attaching twice is a no-op.

        With the fused step (``config.fused``, :mod:`sparse_training.kernels`) a step
        pre-hook updates the masked weights in one Triton pass per group of tensors and
        hands the rest to ``optimizer.step``; otherwise a step post-hook zeroes the pruned
        weights. Either way the optimizer state is zeroed at pruned positions now and at
        every mask update. While any optimizer is attached, the model's layers cannot be
        swapped (``sparsify``, ``densify``, ``make_permanent`` raise) until :meth:`detach`.

        Raises:
            ValueError: ``fused=True`` and the fused step cannot serve this optimizer, or
                (attached again after :meth:`detach`) another engine took its tensors.
            RuntimeError: the masks or layers are gone (``make_permanent``): build a new
                engine.
        """
        if optimizer in self._attached:
            return
        if not self.bound_to(self.model):
            raise RuntimeError("this SparsityEngine's masks or compressed layers are no longer "
                               "in its model (make_permanent, densify): build a new "
                               "SparsityEngine for the model")
        if not self._attached:  # the first since construction or detach(): own them again
            self.claim()
        attached = Attached(self.slots_of(optimizer), len(optimizer.param_groups))
        fused = use_fused(self.config.fused, self.updater.dense_state, optimizer,
                          attached.enforced)  # raises before any change
        if not self._attached:
            ownership.hold_for_training(self.model, self, held=True)
        self._attached[optimizer] = attached
        if fused:
            attached.handles.append(optimizer.register_step_pre_hook(
                functools.partial(fused_step, attached)))
            self.fused_optimizers.add(optimizer)
        else:
            attached.handles += [
                optimizer.register_step_pre_hook(
                    functools.partial(masked_gradients_step, self.updater, attached)),
                optimizer.register_step_post_hook(
                    functools.partial(after_step, self.updater, self, attached))]
        attached.start(optimizer, self.updater.dense_state)

    @property
    def attached_optimizers(self) -> list[Optimizer]:
        """The optimizers attached, in the order they were."""
        return list(self._attached)

    def release(self, optimizer: Optimizer) -> None:
        """Remove ``optimizer``'s hooks and forget it (an optimizer the training loop
        replaced: the engine keeps neither it nor its state alive)."""
        for handle in self._attached.pop(optimizer).handles:
            handle.remove()
        self.fused_optimizers.discard(optimizer)

    def detach(self) -> None:
        """Remove the optimizer hooks and give up the tensors (another engine may take
        them); the masks stay on the model."""
        if self._attached:
            ownership.hold_for_training(self.model, self, held=False)
        for optimizer in list(self._attached):
            self.release(optimizer)
        for slot in self.slots:
            slot.detach()
            ownership.give_up(slot.param, self)

    def to(self, device: torch.device | str) -> SparsityEngine:
        """Move the tensors kept beside the model (a training score's statistics, SR-STE's
        dense weights; masks are the model's buffers) to ``device``, as the model moves:
        each goes back to its weights' device at the next step that uses it. A dtype
        (no device) raises a TypeError: they keep theirs."""
        self.updater.to(device)
        return self

    @property
    def installed(self) -> bool:
        """Whether every mask buffer is still on the model (``make_permanent`` drops them)."""
        return all(slot.installed for slot in self.masked)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Masks (bit-packed; the compressed layers' too), the settings that made them, the
        updater's progress and a training score's statistics; random draws depend on
        (seed, step) only, so no generator state is needed."""
        state = {"format": FORMAT, "settings": self.config.as_dict(),
                 "plan": self.plan.as_state(), "masks": pack_masks(self.masked),
                 "compressed": pack_compressed(self.compressed),
                 "updater": self.updater.state_dict()}
        if self.updater.statistics is not None:  # a training score's: what it observed
            state["statistics"] = self.updater.statistics.state_dict(self.slots)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; everything is checked before anything changes.

        Raises:
            ValueError: the state does not fit (see :mod:`sparse_training.engine.state`).
        """
        self._restore(state, *self._checked(state))

    def _checked(self, state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The state's masks, checked (:func:`~sparse_training.engine.state.checked_masks`);
        a state whose plan trained tensors on other paths is refused naming them first.

        Raises:
            ValueError: the state does not fit.
        """
        if isinstance(state, dict) and (changed := plan_differences(state.get("plan"),
                                                                    self.plan)):
            raise ValueError("cannot resume: the checkpoint's plan differs from this fit's: "
                             + "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
                             + ". Resume with the same compress setting on the same kind of "
                             "device and precision (compress='auto' decides per device and "
                             "dtype), or start a new fit from the checkpoint's weights")
        return checked_masks(state, self.config, self.masked, self.compressed)


def _of_optimizer(slots: list, optimizer: Optimizer) -> list:
    """The ``slots`` whose parameter ``optimizer`` updates."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [slot for slot in slots if id(slot.param) in params]
