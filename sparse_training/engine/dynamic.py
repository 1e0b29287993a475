"""Updaters that move masks inside a fixed count: drop and grow (RigL, SET) and SR-STE's
refined gradient, as overrides of :class:`~sparse_training.engine.updaters.ScheduledMasks`'
step hooks (the lifecycle is described in :mod:`sparse_training.engine.updaters`), and
:func:`make_updater`, which builds the updater of a run's pieces.

- :class:`DropAndGrow`: on top of the schedule, a
  :class:`~sparse_training.pieces.regrowth.Regrowth` rule: RigL and SET are one class with
  two grow scores, |gradient| (Evci et al. 2020) or random (Mocanu et al. 2018); a
  training score, if any, ranks what is dropped;
- :class:`SparseRefinedSTE`: the hooks overridden to keep dense weights aside, re-derive the
  N:M mask every step and add the sparse-refined decay of a
  :class:`~sparse_training.pieces.regrowth.SparseRefinement` to the gradient (Zhou et al.
  2021).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparse_training.engine.slot_set import SlotSet
from sparse_training.engine.slots import whole_counts
from sparse_training.engine.updaters import ScheduledMasks, by_target
from sparse_training.pieces.masks import pattern_masks
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.regrowth import Regrowth, SparseRefinement, drop_and_grow
from sparse_training.pieces.schedules import Schedule
from sparse_training.pieces.scores import Score
from sparse_training.pieces.training_scores import TrainingScore

if TYPE_CHECKING:
    from sparse_training.engine.protocol import Slot


class DropAndGrow(ScheduledMasks):
    """Regrowth on top of the schedule: at the first step of every ``frequency``-long
    period from ``start`` until the ``regrowth``'s end, each tensor swaps the cosine-decayed
    share f(t) = alpha/2 (1 + cos(pi t / T_end)) of its active blocks: the smallest |w| (or
    training score) out, the largest grow score in, exactly as many
    (:func:`~sparse_training.pieces.regrowth.drop_and_grow`).

    Compressed layers (:class:`~sparse_training.layers.storage.BlockSparseSlot`) swap whole
    blocks of their grid the same way; their values, optimizer state and score statistics
    move with their blocks, and they record the dense gradient at the steps they are due to
    regrow (RigL ranks growth by it; with SET too it is the first gradient of the grown
    blocks)."""

    regrows = True

    def __init__(self, schedule: Schedule, score: Score | TrainingScore,
                 regrowth: Regrowth) -> None:
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
        every = "step" if self.schedule.frequency == 1 else f"{self.schedule.frequency} steps"
        return (f"{super().describe(total_steps)}; drop and grow every {every} from step "
                f"{self.schedule.start} until step {self.regrowth.end}")

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

    def observing(self, step: int) -> bool:
        return super().observing(step) or step < self.regrowth.end

    def before_step(self, engine: SlotSet, slots: list[Slot], step: int) -> None:
        super().before_step(engine, slots, step)
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
        statistics = self.statistics
        for pattern, indices in _by_pattern(slots).items():  # one ranking per shape
            group = [slots[i] for i in indices]
            masks = drop_and_grow(
                [s.full_mask() for s in group], [s.drop_scores() for s in group],
                [s.grow_scores(self.grow_score(engine, s, step)) for s in group], pattern,
                fraction, [kept[i] for i in indices], [s.input_dim for s in group],
                None if statistics is None else [s.drop_scores(statistics.ranks(s))
                                                 for s in group])
            new_masks.update({s.name: m for s, m in zip(group, masks, strict=True)})
        engine.set_masks(new_masks, step, broadcast=False, gradients={
            s.name: s.dense_gradient for s in slots if s.records_gradient},
            carried={} if statistics is None else statistics.carried(slots))
        if statistics is not None:
            statistics.changed(new_masks)
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
    magnitude (a gradual schedule's N':M stage that of its latest update step), and the
    gradient gets the ``refinement``'s sparse-refined term g <- g + lambda (1 - mask) w
    (Zhou et al. 2021)."""

    dense_state = True
    masks_gradients = False

    def __init__(self, schedule: Schedule, score: Score | TrainingScore,
                 refinement: SparseRefinement) -> None:
        super().__init__(schedule, score)
        self.refinement = refinement
        self.dense: dict[str, Tensor] = {}
        self._dense_in_params: set[str] = set()  # tensors holding their dense weights now

    def restart(self) -> None:
        super().restart()
        self.dense, self._dense_in_params = {}, set()

    def to(self, device: torch.device | str) -> None:
        super().to(device)  # the dense weights too: back on the weights' device at a step
        self.dense = {name: dense.to(device) for name, dense in self.dense.items()}

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
        fraction = self.schedule.fraction(due)  # the stage of the latest update step
        for slot in masked:
            slot.param.copy_(self.dense[slot.name])
        masks = {}
        for (pattern, target, _), indices in by_target(masked).items():
            group = [masked[i] for i in indices]
            found = pattern_masks([s.param for s in group], pattern, target * fraction,
                                  input_dims=[s.plan.input_dim for s in group])
            masks.update({s.name: m for s, m in zip(group, found, strict=True)})
        held = self.held_back(engine, masks)  # their carried masks, over the dense weights
        masks.update({s.name: s.full_mask() for s in masked if s.name in held})
        check = created or (step - self.schedule.start) % self.schedule.frequency == 0
        engine.set_masks(masks, step, broadcast=created, reset_state=False, check=check)
        self.target = self.target_at(engine, fraction)
        self.last_update = due
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



def make_updater(schedule: Schedule, score: Score | TrainingScore,
                 regrowth: Regrowth | None = None,
                 refinement: SparseRefinement | None = None) -> ScheduledMasks:
    """The updater of these pieces: SR-STE with a ``refinement``, drop and grow with a
    ``regrowth`` rule, else scheduled masks."""
    if refinement is not None:
        return SparseRefinedSTE(schedule, score, refinement)
    if regrowth is not None:
        return DropAndGrow(schedule, score, regrowth)
    return ScheduledMasks(schedule, score)
