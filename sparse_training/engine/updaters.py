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
from typed pieces (:func:`~sparse_training.engine.dynamic.make_updater`), never from the
settings:

- :class:`ScheduledMasks`: a schedule (:mod:`sparse_training.pieces.schedules`) and a score
  (:mod:`sparse_training.pieces.scores`): magnitude or seeded random masks, one-shot (ASP),
  GMP (Zhu & Gupta 2017), linear, constant; or a training score
  (:mod:`sparse_training.pieces.training_scores`: movement, soft movement, second order),
  observed at every step until the last update (:class:`~sparse_training.engine.
  statistics.Statistics`), whose updates prune monotonically (what an update pruned ranks
  below everything kept) and, for the second-order score, move the kept weights by the
  optimal brain surgeon's update;
- :class:`~sparse_training.engine.dynamic.DropAndGrow` (RigL, SET) and
  :class:`~sparse_training.engine.dynamic.SparseRefinedSTE` (SR-STE) override its hooks
  (:mod:`sparse_training.engine.dynamic`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparse_training.engine.sharding import shard_like
from sparse_training.engine.slot_set import SlotSet
from sparse_training.engine.slots import whole_counts
from sparse_training.engine.statistics import Statistics
from sparse_training.pieces.masks import global_masks, pattern_masks
from sparse_training.pieces.schedules import Schedule, parse_schedule
from sparse_training.pieces.scores import Score
from sparse_training.pieces.training_scores import TrainingScore
from sparse_training.pieces.units import unit_masks

if TYPE_CHECKING:
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
        regrows: whether masks move between scheduled updates, compressed layers' too.
    """

    dense_state = False
    masks_gradients = True
    regrows = False  # whether masks move between scheduled updates (compressed layers too)

    def __init__(self, schedule: Schedule, score: Score | TrainingScore) -> None:
        self.initial_schedule = self.schedule = schedule
        self.keep_score = score
        self.statistics = Statistics(score) if isinstance(score, TrainingScore) else None
        self.last_update: int | None = None
        self.target = 0.0
        self.resolved_for: int | None = None  # the run length fractions were resolved for
        self.held: set[str] = set()  # tensors whose carried masks hold (:meth:`carried`)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, total_steps: int | None) -> None:
        """Turn fractions of training into steps. A restored (or continued) schedule keeps
        its steps, with a warning where they were resolved for a run of another length (a
        resumed run made longer: its updates still end where the first run's would have).

        Raises:
            ValueError: a training score whose updates come every ``frequency`` steps, more
                than the run has: it would observe steps that no update reads.
        """
        if not self.schedule.is_resolved:
            self.schedule = self.schedule.resolve(total_steps)
        frequency = self.schedule.frequency
        if (self.statistics is not None and total_steps is not None and frequency > total_steps
                and (self.schedule.end is not None or self.regrows)):
            raise ValueError(f"score {self.statistics.score.name!r} ranks what training observed "
                             f"between mask updates, but frequency={frequency} is more than "
                             f"the run's {total_steps} optimizer steps: no update after the "
                             f"first would read it; lower frequency")
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
        """Forget the progress of an earlier fit: the schedule runs again from its start
        (the engine then says which masks it holds: :meth:`carried`)."""
        self.schedule, self.last_update, self.target = self.initial_schedule, None, 0.0
        self.resolved_for, self.held = None, set()
        if self.statistics is not None:
            self.statistics.restart()

    def to(self, device: torch.device | str) -> None:
        """Move the tensors kept beside the model (a training score's statistics) to
        ``device``; they go back to their weights' device at their next use.

        Raises:
            TypeError: ``device`` is no device (a dtype would cast them for good).
        """
        if not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"SparsityEngine.to(device) takes a device, as model.to(device), "
                            f"got {device!r}: what it keeps beside the model keeps its dtype")
        if self.statistics is not None:
            self.statistics.to(device)

    def describe(self, total_steps: int | None) -> str:
        """When masks change, for the log at fit start."""
        return f"mask updates at steps {self.schedule.update_steps(total_steps)}"

    def on_step_start(self, engine: SlotSet, step: int) -> bool:
        """Apply the update due at ``step`` if it has not run; True if masks changed."""
        due = self.schedule.latest_update_step(step)
        if due is None or (self.last_update is not None and due <= self.last_update):
            return False
        created = self.last_update is None
        changed = self.update_masks(engine, self.schedule.fraction(due), due, created)
        self.last_update = due
        return changed

    def before_step(self, engine: SlotSet, slots: list[MaskedSlot], step: int) -> None:
        """Between backward and the optimizer step: a training score observes the slots
        whose masks a later update may change."""
        if self.statistics is not None and self.observing(step):
            self.statistics.observe([s for s in slots if s.movable and (
                not s.compressed or self.regrows)])

    def observing(self, step: int) -> bool:
        """Whether a mask update comes after ``step`` (a training score observes until the
        last)."""
        last = self.schedule.end if self.schedule.end is not None else self.schedule.start
        return step < last

    def after_step(self, engine: SlotSet, slots: list[MaskedSlot]) -> None:
        """After an optimizer step that ran (nothing for plain schedules)."""

    def on_step_end(self, engine: SlotSet) -> None:
        """After the batch (nothing for plain schedules)."""

    # -- masks ------------------------------------------------------------------------------
    def score(self, engine: SlotSet, slot: MaskedSlot, step: int) -> Tensor | None:
        """What a scheduled update keeps (None: |w|); random draws are seeded by the
        tensor's stream, equal on every rank and whether it trains masked or compressed; a
        training score's ranks are the whole tensor's, what earlier updates pruned ranking
        lowest (pruning is monotone, as magnitude's is: pruned weights are zero)."""
        if self.statistics is None:
            return self.keep_score(slot, step, engine.streams[slot.name])
        if self.regrows and self.last_update is None and not self.statistics.observed(slot):
            return None  # regrowth's first mask, before any step: the largest |w|
        ranks = slot.drop_scores(self.statistics.ranks(slot))
        return torch.where(slot.full_mask(), ranks, -torch.inf)

    @torch.no_grad()
    def update_masks(self, engine: SlotSet, fraction: float, step: int, created: bool,
                     hold: bool = True) -> bool:
        """Every mask at ``fraction`` of its tensor's final sparsity (a fraction of 0 keeps
        every weight, whatever the score), but, with ``hold``, the held masks that would
        keep more weights (:meth:`held_back`); True if any mask was set."""
        new_masks = self.masks_at(engine, fraction, step)
        for name in self.held_back(engine, new_masks) if hold else ():
            del new_masks[name]
        if new_masks and fraction == 0.0:
            engine.set_masks(new_masks, step, broadcast=created)
        elif new_masks:
            self.install(engine, new_masks, step, created)
        self.target = self.target_at(engine, fraction)
        return bool(new_masks)

    def target_at(self, engine: SlotSet, fraction: float) -> float:
        """The sparsity of the masked weights at ``fraction`` of the schedule: each tensor's
        final target times ``fraction``, a held tensor's carried mask's (it never gets less
        sparse, and the target says so)."""
        held = [s for s in engine.masked if s.name in self.held]
        if not held:
            return engine.masked_final_sparsity * fraction
        kept, _ = whole_counts(held)
        pruned = sum(s.numel - k for s, k in zip(held, kept, strict=True))
        asked = sum(s.numel * engine.final(s) for s in engine.masked if s.name not in self.held)
        return (pruned + asked * fraction) / sum(s.numel for s in engine.masked)

    def hold(self, engine: SlotSet, names: set[str]) -> None:
        """Hold the carried masks of the tensors ``names`` (:meth:`carried`) in a run that
        has not updated masks yet."""
        self.held = names
        self.target = self.target_at(engine, 0.0)

    def masks_at(self, engine: SlotSet, fraction: float, step: int,
                 ranked: bool = True) -> dict[str, Tensor]:
        """Every masked tensor's mask at ``fraction`` of its final sparsity, by the score
        (``ranked``) or by ``|w|``: the counts are the same either way."""
        if fraction == 0.0:
            return {s.name: torch.ones_like(s.full_mask()) for s in engine.masked}
        new_masks: dict[str, Tensor] = {}
        pooled = [s for s in engine.masked if s.plan.sparsity is None]  # global distribution
        if pooled:
            masks = global_masks([s.full_param() for s in pooled], pooled[0].plan.pattern,
                                 engine.pooled_sparsity * fraction,
                                 [self.score(engine, s, step) for s in pooled] if ranked
                                 else None, [s.plan.input_dim for s in pooled])
            new_masks.update({s.name: m for s, m in zip(pooled, masks, strict=True)})
        fixed = [s for s in engine.masked if s.plan.sparsity is not None]
        for (pattern, target, tied), indices in by_target(fixed).items():  # one ranking
            group = [fixed[i] for i in indices]                             # per shape
            scores = [self.score(engine, s, step) for s in group] if (
                ranked and target * fraction) else [None]  # nothing pruned: no ranking
            weights, dims = [s.full_param() for s in group], [s.plan.input_dim for s in group]
            scores = None if scores[0] is None else scores
            masks = (unit_masks(weights, [s.plan.tie for s in group], target * fraction,
                                scores, dims) if tied else
                     pattern_masks(weights, pattern, target * fraction, scores, dims))
            new_masks.update({s.name: m for s, m in zip(group, masks, strict=True)})
        return new_masks

    # -- masks carried from an earlier run --------------------------------------------------
    def carried(self, engine: SlotSet, slots: list[MaskedSlot]) -> set[str]:
        """The names of ``slots`` whose installed masks (an earlier run's) prune something:
        a new run holds them (:meth:`held_back`) until its schedule keeps no more weights.

        Raises:
            ValueError: a mask sparser than its tensor's final target under these settings
                (the global distribution's tensors: together), which the schedule would
                never reach; nothing is changed.
        """
        kept, _ = whole_counts(slots)
        counts = {s.name: k for s, k in zip(slots, kept, strict=True) if k < s.numel}
        if not counts:
            return set()
        final = self.masks_at(engine, 1.0, step=0, ranked=False)
        problems = []
        for group in _groups([s for s in slots if s.name in counts]):
            total = sum(s.numel for s in group)
            now = sum(counts[s.name] for s in group)
            want = sum(int(final[s.name].sum()) for s in group)
            if now < want:
                plan = group[0].plan
                what = (f"tensor {plan.name!r}" if plan.sparsity is not None else
                        f"the tensors {[s.name for s in group]} of distribution='global'")
                problems.append(f"{what} carries a mask {1 - now / total:.2%} sparse, sparser "
                                f"than these settings' final {1 - want / total:.2%} (pattern "
                                f"{plan.pattern.spec!r})")
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more"
                                               if len(problems) > 3 else "")
            raise ValueError(f"{shown}. A run without a checkpoint starts from the masks "
                             f"the model carries (an earlier fit's) and never makes them less "
                             f"sparse: choose settings at least as sparse for these tensors, "
                             f"or call make_permanent(model) before the fit to drop the masks "
                             f"(the pruned weights, zero, may then grow back)")
        return set(counts)

    def held_back(self, engine: SlotSet, new_masks: dict[str, Tensor]) -> set[str]:
        """The held tensors of ``new_masks`` whose new mask would keep more weights than the
        mask they carry (the global distribution's: together): they keep theirs. The others
        are released: from now on the schedule sets their masks."""
        slots = [s for s in engine.masked if s.name in self.held and s.name in new_masks]
        if not slots:
            return set()
        kept, _ = whole_counts(slots)
        carried = dict(zip([s.name for s in slots], kept, strict=True))
        back = set()
        for group in _groups(slots):
            names = {s.name for s in group}
            if sum(int(new_masks[n].sum()) for n in names) > sum(carried[n] for n in names):
                back |= names
        self.held -= {s.name for s in slots} - back
        return back

    def install(self, engine: SlotSet, new_masks: dict[str, Tensor], step: int,
                created: bool) -> None:
        """Install a scheduled update's masks; a training score's statistics follow them
        (or restart), and the second-order score first moves the kept weights to make up
        for the newly pruned ones (every weight the new mask prunes is in its set Q: those
        an earlier update pruned stay at zero)."""
        if self.statistics is None:
            engine.set_masks(new_masks, step, broadcast=created)
            return
        for slot in engine.masked:
            if slot.name in new_masks:
                new = shard_like(new_masks[slot.name], slot.param) if slot.sharded else (
                    new_masks[slot.name])
                self.statistics.compensate(slot, ~new)
        engine.set_masks(new_masks, step, broadcast=created, carried=self.statistics.carried(
            s for s in engine.slots if s.name in new_masks))
        self.statistics.changed(new_masks)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.as_list(), "last_update": self.last_update,
                "target": self.target, "resolved_for": self.resolved_for,
                "held": sorted(self.held)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule = parse_schedule(*state["schedule"])
        self.last_update, self.target = state["last_update"], state["target"]
        self.resolved_for = state.get("resolved_for", UNKNOWN)
        self.held = set(state.get("held", ()))  # states saved before it: none held


def _groups(slots: list[MaskedSlot]) -> list[list[MaskedSlot]]:
    """``slots`` as the units whose counts a schedule sets: each tensor of its own target
    alone, the global distribution's pooled tensors together."""
    pooled = [s for s in slots if s.plan.sparsity is None]
    return [[s] for s in slots if s.plan.sparsity is not None] + ([pooled] if pooled else [])


def by_target(slots: list[MaskedSlot]) -> dict[tuple[Any, float | None, bool], list[int]]:
    """Indices of ``slots`` grouped by (pattern, final sparsity, tied by units): what one
    ranking serves (tied tensors: every unit group of one target together)."""
    groups: dict[tuple[Any, float | None, bool], list[int]] = {}
    for i, slot in enumerate(slots):
        tied = slot.plan.tie is not None
        key = (None if tied else slot.plan.pattern, slot.plan.sparsity, tied)
        groups.setdefault(key, []).append(i)
    return groups
