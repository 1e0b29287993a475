"""Mask updaters: when and how masks change, as small pieces of one lifecycle.

The engine calls its updater at four points of every optimizer step (jaxpruner's split of
one updater into overridable steps):

- ``on_step_start(engine, step)``: before the forward pass; scheduled mask updates;
- ``before_step(engine, slots, step)``: after backward, before ``optimizer.step``, while
  the gradients are still dense (regrowth reads them);
- ``after_step(engine, slots)``: after an ``optimizer.step`` that ran;
- ``on_step_end(engine)``: after the batch, whether or not the step ran.

``engine`` is the model's :class:`~sparse_training.engine.slot_set.SlotSet` (all an updater
sees of the engine), ``slots`` the slots of the optimizer stepping. An updater is built
from typed pieces (:func:`make_updater`), never from the settings:

- :class:`ScheduledMasks`: a schedule (:mod:`sparse_training.pieces.schedules`) and a score
  (:mod:`sparse_training.pieces.scores`): magnitude or seeded random masks, one-shot (ASP),
  GMP (Zhu & Gupta 2017), linear, constant;
- :class:`DropAndGrow`: on top, a :class:`~sparse_training.pieces.regrowth.Regrowth` rule:
  RigL and SET are one class with two grow scores, |gradient| (Evci et al. 2020) or random
  (Mocanu et al. 2018);
- :class:`SparseRefinedSTE`: the hooks overridden to keep dense weights aside, re-derive the
  N:M mask every step and add the sparse-refined decay of a
  :class:`~sparse_training.pieces.regrowth.SparseRefinement` to the gradient (Zhou et al.
  2021).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparse_training.engine.slot_set import SlotSet
from sparse_training.engine.slots import whole_counts
from sparse_training.pieces.masks import global_masks, pattern_masks
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.regrowth import Regrowth, SparseRefinement, drop_and_grow
from sparse_training.pieces.schedules import Schedule, parse_schedule
from sparse_training.pieces.scores import Score

if TYPE_CHECKING:
    from sparse_training.engine.protocol import Slot
    from sparse_training.engine.slots import MaskedSlot


UNKNOWN = -1
"""``resolved_for`` of a state saved before it was kept: the length is not known (no
warning, and it stays unknown)."""


class ScheduledMasks:
    """Masks recomputed at the ``schedule``'s update steps, keeping the largest ``score``.

    Attributes:
        dense_state: whether the optimizer state stays dense (SR-STE); the fused step,
            which zeroes state at pruned positions, cannot serve it then.
        masks_gradients: whether the engine zeroes pruned gradients before the step.
    """

    dense_state = False
    masks_gradients = True

    def __init__(self, schedule: Schedule, score: Score) -> None:
        self.initial_schedule = self.schedule = schedule
        self.keep_score = score
        self.last_update: int | None = None
        self.target = 0.0
        self.resolved_for: int | None = None  # the run length fractions were resolved for

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, total_steps: int | None) -> None:
        """Turn fractions of training into steps. A restored (or continued) schedule keeps
        its steps, with a warning where they were resolved for a run of another length (a
        resumed run made longer: its updates still end where the first run's would have)."""
        if not self.schedule.is_resolved:
            self.schedule = self.schedule.resolve(total_steps)
        if self.resolved_for is None:  # a first start
            self.resolved_for = total_steps
        elif (total_steps is not None and self.resolved_for not in (total_steps, UNKNOWN)
              and self.fractional()):
            warnings.warn(f"the schedule resumed (or continued) keeps its steps, resolved for "
                          f"a run of {self.resolved_for} optimizer steps; this run has "
                          f"{total_steps}: {self.describe(total_steps)}. Give start, end and "
                          f"regrow_end in steps to tie them to no run length", stacklevel=3)

    def fractional(self) -> bool:
        """Whether a setting is a fraction of training (its step depends on the run's
        length)."""
        return not self.initial_schedule.is_resolved

    def restart(self) -> None:
        """Forget the progress of an earlier fit: the schedule runs again from its start."""
        self.schedule, self.last_update, self.target = self.initial_schedule, None, 0.0
        self.resolved_for = None

    def describe(self, total_steps: int | None) -> str:
        """When masks change, for the log at fit start."""
        return f"mask updates at steps {self.schedule.update_steps(total_steps)}"

    def on_step_start(self, engine: SlotSet, step: int) -> bool:
        """Apply the update due at ``step`` if it has not run; True if masks changed."""
        due = self.schedule.latest_update_step(step)
        if due is None or (self.last_update is not None and due <= self.last_update):
            return False
        created = self.last_update is None
        self.update_masks(engine, self.schedule.fraction(due), due, created)
        self.last_update = due
        return True

    def before_step(self, engine: SlotSet, slots: list[MaskedSlot], step: int) -> None:
        """Between backward and the optimizer step (nothing for plain schedules)."""

    def after_step(self, engine: SlotSet, slots: list[MaskedSlot]) -> None:
        """After an optimizer step that ran (nothing for plain schedules)."""

    def on_step_end(self, engine: SlotSet) -> None:
        """After the batch (nothing for plain schedules)."""

    # -- masks ------------------------------------------------------------------------------
    def score(self, engine: SlotSet, slot: MaskedSlot, step: int) -> Tensor | None:
        """What a scheduled update keeps (None: |w|); random draws are seeded by the
        tensor's stream, equal on every rank and whether it trains masked or compressed."""
        return self.keep_score(slot, step, engine.streams[slot.name])

    @torch.no_grad()
    def update_masks(self, engine: SlotSet, fraction: float, step: int,
                     created: bool) -> None:
        """Every mask at ``fraction`` of its tensor's final sparsity."""
        new_masks: dict[str, Tensor] = {}
        pooled = [s for s in engine.masked if s.plan.sparsity is None]  # global distribution
        if pooled:
            masks = global_masks([s.full_param() for s in pooled], pooled[0].plan.pattern,
                                 engine.pooled_sparsity * fraction,
                                 [self.score(engine, s, step) for s in pooled],
                                 [s.plan.input_dim for s in pooled])
            new_masks.update({s.name: m for s, m in zip(pooled, masks, strict=True)})
        fixed = [s for s in engine.masked if s.plan.sparsity is not None]
        for (pattern, target), indices in _by_target(fixed).items():  # one ranking per shape
            group = [fixed[i] for i in indices]
            scores = [self.score(engine, s, step) for s in group]
            masks = pattern_masks([s.full_param() for s in group], pattern, target * fraction,
                                  None if scores[0] is None else scores,
                                  [s.plan.input_dim for s in group])
            new_masks.update({s.name: m for s, m in zip(group, masks, strict=True)})
        engine.set_masks(new_masks, step, broadcast=created)
        self.target = engine.masked_final_sparsity * fraction

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.as_list(), "last_update": self.last_update,
                "target": self.target, "resolved_for": self.resolved_for}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule = parse_schedule(*state["schedule"])
        self.last_update, self.target = state["last_update"], state["target"]
        self.resolved_for = state.get("resolved_for", UNKNOWN)  # (kept from 2026-11-26)


class DropAndGrow(ScheduledMasks):
    """Regrowth on top of the schedule: at the first step of every ``frequency``-long
    period from ``start`` until the ``regrowth``'s end, each tensor swaps the cosine-decayed
    share f(t) = alpha/2 (1 + cos(pi t / T_end)) of its active blocks: the smallest |w| out,
    the largest grow score in, exactly as many
    (:func:`~sparse_training.pieces.regrowth.drop_and_grow`).

    Compressed layers (:class:`~sparse_training.layers.storage.BlockSparseSlot`) swap whole blocks of
    their grid the same way; their values and optimizer state move with their blocks, and
    they record the dense gradient at the steps they are due to regrow (RigL ranks growth by
    it; with SET too it is the first gradient of the grown blocks)."""

    def __init__(self, schedule: Schedule, score: Score, regrowth: Regrowth) -> None:
        super().__init__(schedule, score)
        self.initial_regrowth = self.regrowth = regrowth
        self.last_regrow: int | None = None
        self.regrown_period: dict[str, int] = {}  # tensor -> last period it regrew in
        self._period_done = -1  # every tensor has regrown in this period

    def start(self, total_steps: int | None) -> None:
        super().start(total_steps)
        self.regrowth = self.regrowth.resolve(total_steps)

    def fractional(self) -> bool:
        return super().fractional() or isinstance(self.initial_regrowth.end, float)

    def restart(self) -> None:
        super().restart()
        self.regrowth, self.last_regrow = self.initial_regrowth, None
        self.regrown_period, self._period_done = {}, -1

    def describe(self, total_steps: int | None) -> str:
        return (f"{super().describe(total_steps)}; drop and grow every "
                f"{self.schedule.frequency} steps from step {self.schedule.start} until step "
                f"{self.regrowth.end}")

    def grow_score(self, engine: SlotSet, slot: Slot, step: int) -> Tensor:
        """Dense-shaped scores where blocks grow (the regrowth rule's)."""
        return self.regrowth.grow(slot, step, engine.streams[slot.name])

    def _period(self, step: int) -> int | None:
        """The regrowth period ``step`` falls in, or None outside regrowth."""
        start = self.schedule.start
        if self.last_update is None or not start <= step < self.regrowth.end:
            return None
        return (step - start) // self.schedule.frequency

    def on_step_start(self, engine: SlotSet, step: int) -> bool:
        """Scheduled updates; then slots without a dense gradient of their own (compressed
        block layers) record it at the steps where they are due to regrow."""
        changed = super().on_step_start(engine, step)
        period = self._period(step)
        for slot in engine.slots:
            if slot.records_gradient:
                slot.recording = period is not None and (
                    self.regrown_period.get(slot.name, -1) < period)
        return changed

    def before_step(self, engine: SlotSet, slots: list[Slot], step: int) -> None:
        period = self._period(step)
        try:
            if period is not None and period > self._period_done:
                self._regrow_due(engine, slots, step, period)
        finally:  # a recorded gradient serves one step's update
            for slot in slots:
                if slot.records_gradient:
                    slot.clear_gradient()

    def _regrow_due(self, engine: SlotSet, slots: list[Slot], step: int,
                    period: int) -> None:
        due = [s for s in slots if self.regrown_period.get(s.name, -1) < period]
        # dense tensors have nothing to swap, unused ones no gradient: they count as done
        swap = [s for s in due if s.movable and s.gradient_ready]
        kept, nonfinite = whole_counts(swap, gradients=True)
        if nonfinite:
            return  # an AMP overflow step: no swaps; the next step of the period retries
        for slot in due:
            self.regrown_period[slot.name] = period
        if swap:
            self.regrow(engine, swap, step, kept)
        if len(self.regrown_period) == len(engine.slots) and all(
                p == period for p in self.regrown_period.values()):
            self._period_done = period

    @torch.no_grad()
    def regrow(self, engine: SlotSet, slots: list[Slot], step: int,
               kept: list[int] | None = None) -> None:
        """Drop and grow in ``slots`` (``kept``: their masks' counts, if known)."""
        fraction = self.regrowth.fraction(step)
        kept = kept if kept is not None else whole_counts(slots)[0]
        engine.reduce_dense_gradients(slots)
        new_masks = {}
        for pattern, indices in _by_pattern(slots).items():  # one ranking per shape
            group = [slots[i] for i in indices]
            masks = drop_and_grow(
                [s.full_mask() for s in group], [s.drop_scores() for s in group],
                [s.grow_scores(self.grow_score(engine, s, step)) for s in group], pattern,
                fraction, [kept[i] for i in indices], [s.input_dim for s in group])
            new_masks.update({s.name: m for s, m in zip(group, masks, strict=True)})
        engine.set_masks(new_masks, step, broadcast=False, gradients={
            s.name: s.dense_gradient for s in slots if s.records_gradient})
        self.last_regrow = step

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "regrow_end": self.regrowth.end,
                "last_regrow": self.last_regrow, "regrown_period": dict(self.regrown_period)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.regrowth = replace(self.regrowth, end=state["regrow_end"])
        self.last_regrow = state["last_regrow"]
        self.regrown_period, self._period_done = dict(state["regrown_period"]), -1


class SparseRefinedSTE(ScheduledMasks):
    """SR-STE, as overrides of the step hooks: the optimizer updates dense weights (kept
    aside between steps); at every step the forward pass sees them N:M-masked by
    magnitude, and the gradient gets the ``refinement``'s sparse-refined term
    g <- g + lambda (1 - mask) w (Zhou et al. 2021)."""

    dense_state = True
    masks_gradients = False

    def __init__(self, schedule: Schedule, score: Score, refinement: SparseRefinement) -> None:
        super().__init__(schedule, score)
        self.refinement = refinement
        self.dense: dict[str, Tensor] = {}
        self._dense_in_params: set[str] = set()  # tensors holding their dense weights now

    def restart(self) -> None:
        super().restart()
        self.dense, self._dense_in_params = {}, set()

    def describe(self, total_steps: int | None) -> str:
        return f"N:M masks of the dense weights at every step from step {self.schedule.start}"

    @torch.no_grad()
    def on_step_start(self, engine: SlotSet, step: int) -> bool:
        due = self.schedule.latest_update_step(step)
        if due is None:
            return False
        created, masked = not self.dense, engine.masked
        if created:
            self.dense = {s.name: s.param.detach().clone() for s in masked}
        elif next(iter(self.dense.values())).device != masked[0].param.device:
            self.dense = {s.name: self.dense[s.name].to(s.param.device) for s in masked}
        fraction = self.schedule.fraction(step)
        for slot in masked:
            slot.param.copy_(self.dense[slot.name])
        masks = {}
        for (pattern, target), indices in _by_target(masked).items():
            group = [masked[i] for i in indices]
            found = pattern_masks([s.param for s in group], pattern, target * fraction,
                                  input_dims=[s.plan.input_dim for s in group])
            masks.update({s.name: m for s, m in zip(group, found, strict=True)})
        check = created or (step - self.schedule.start) % self.schedule.frequency == 0
        engine.set_masks(masks, step, broadcast=created, reset_state=False, check=check)
        self.target = engine.masked_final_sparsity * fraction
        self.last_update = step
        return True

    @torch.no_grad()
    def before_step(self, engine: SlotSet, slots: list[Slot], step: int) -> None:
        if not self.dense:
            return
        for slot in slots:
            dense = self.dense.get(slot.name)
            if dense is None:  # a compressed layer's: no dense weights kept aside
                continue
            if slot.param.grad is not None:
                self.refinement(slot.param.grad, dense, slot.mask)
            slot.param.copy_(dense)
            self._dense_in_params.add(slot.name)

    @torch.no_grad()
    def after_step(self, engine: SlotSet, slots: list[Slot]) -> None:
        for slot in slots:
            if slot.name in self.dense:  # not a compressed layer's
                self.dense[slot.name].copy_(slot.param)
                self._dense_in_params.discard(slot.name)

    def on_step_end(self, engine: SlotSet) -> None:
        """A step the AMP grad scaler skipped (of any of several optimizers) left dense
        weights in its parameters: mask them, so that evaluation and checkpoints see N:M
        weights."""
        if self._dense_in_params:
            engine.zero_pruned_weights(
                [s for s in engine.masked if s.name in self._dense_in_params])
            self._dense_in_params.clear()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dense": dict(self.dense)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dense = dict(state["dense"])  # moved to the weights' device at the next step


def _by_pattern(slots: list[Slot]) -> dict[Pattern, list[int]]:
    """Indices of ``slots`` grouped by the pattern regrowth applies to their masks."""
    groups: dict[Pattern, list[int]] = {}
    for i, slot in enumerate(slots):
        groups.setdefault(slot.grid_pattern, []).append(i)
    return groups


def _by_target(slots: list[MaskedSlot]) -> dict[tuple[Any, float | None], list[int]]:
    """Indices of ``slots`` grouped by (pattern, final sparsity): what one ranking serves."""
    groups: dict[tuple[Any, float | None], list[int]] = {}
    for i, slot in enumerate(slots):
        groups.setdefault((slot.plan.pattern, slot.plan.sparsity), []).append(i)
    return groups





def make_updater(schedule: Schedule, score: Score, regrowth: Regrowth | None = None,
                 refinement: SparseRefinement | None = None) -> ScheduledMasks:
    """The updater of these pieces: SR-STE with a ``refinement``, drop and grow with a
    ``regrowth`` rule, else scheduled masks."""
    if refinement is not None:
        return SparseRefinedSTE(schedule, score, refinement)
    if regrowth is not None:
        return DropAndGrow(schedule, score, regrowth)
    return ScheduledMasks(schedule, score)
