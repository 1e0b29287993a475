"""Sparsity schedules: how much of the final sparsity applies at an optimizer step.

Every schedule answers two questions (jaxpruner's split): :meth:`Schedule.fraction` (the
share of each layer's final sparsity in force at step t) and
:meth:`Schedule.latest_update_step` (the last mask-update step at or before t). Steps are
optimizer steps (``trainer.global_step``), never batches.

- ``oneshot``: everything at ``start``, then hold (ASP: prune a trained model, fine-tune).
- ``constant``: the same level from ``start`` on; with regrowth, the masks keep moving.
- ``gmp``: s_t = s_f + (s_i - s_f)(1 - p)^3, p = (t - t0)/(t1 - t0), s_i = 0
  (Zhu & Gupta 2017, "To prune, or not to prune"), updated every ``frequency`` steps.
- ``linear``: s_t = s_f p.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

SCHEDULES = ("oneshot", "gmp", "linear", "constant")
GRADUAL = ("gmp", "linear")
DEFAULT_GRADUAL_END = 0.75  # leave the last quarter of training to fine-tune at the final mask

Step = int | float


def check_step(value: Step, name: str) -> Step:
    """``value`` as a Python int (optimizer steps) or float (fraction of training), numpy
    scalars included; ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an int (optimizer steps) or a float in [0, 1] "
                         f"(fraction of training), got {value!r}")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 optimizer steps, got {value}")
        return int(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} as a fraction of training must lie in [0, 1], got {value}")
    return float(value)


def to_steps(value: Step, total_steps: int | None) -> int:
    """Optimizer steps of ``value``: an int as it is, a float as that fraction of
    ``total_steps``, rounded.

    Raises:
        ValueError: a fraction when the training length is unknown.
    """
    if isinstance(value, int):
        return value
    if total_steps is None:
        raise ValueError(f"{value!r} is a fraction of training, but the training length is "
                         f"unknown; set max_steps or max_epochs, or give steps as ints")
    return int(value * total_steps + 0.5)


@dataclass(frozen=True)
class Schedule:
    """When masks change and how sparse they are.

    Attributes:
        kind: one of ``SCHEDULES``.
        start: first update step (int) or fraction of training (float).
        end: last update step or fraction for gradual schedules; None means
            ``DEFAULT_GRADUAL_END`` of training.
        frequency: optimizer steps between updates of a gradual schedule.
    """

    kind: str = "oneshot"
    start: Step = 0
    end: Step | None = None
    frequency: int = 100

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}; valid: {', '.join(SCHEDULES)}")
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, numbers.Integral) \
                or self.frequency < 1:
            raise ValueError(f"frequency must be an int >= 1, got {self.frequency!r}")
        object.__setattr__(self, "frequency", int(self.frequency))
        object.__setattr__(self, "start", check_step(self.start, "start"))
        if self.end is not None:
            if self.kind not in GRADUAL:
                raise ValueError(f"end applies to gradual schedules ({', '.join(GRADUAL)}), "
                                 f"not to {self.kind!r}; got end={self.end!r}")
            object.__setattr__(self, "end", check_step(self.end, "end"))
            if type(self.start) is type(self.end) and self.start >= self.end:
                raise ValueError(f"start must come before end, got start={self.start!r}, "
                                 f"end={self.end!r}")

    def updates(self) -> list[int]:
        """The mask-update steps of a resolved schedule."""
        if self.kind not in GRADUAL:
            return [self.start]
        return [*range(self.start, self.end, self.frequency), self.end]

    def update_steps(self, total_steps: int | None, limit: int = 8) -> str:
        """The update steps within a run, for the log: "0, 100, ..., 900 (10 updates)"."""
        if self.kind not in GRADUAL:
            return f"{self.start} (one update)"
        steps = [s for s in self.updates() if total_steps is None or s < total_steps]
        shown = steps if len(steps) <= limit else [*steps[:3], "...", *steps[-2:]]
        return f"{', '.join(map(str, shown))} ({len(steps)} updates)"

    def resolve(self, total_steps: int | None) -> Schedule:
        """This schedule with fractions turned into steps of a run of ``total_steps``.

        Raises:
            ValueError: a fraction (or a gradual schedule without ``end``) and no finite
                ``total_steps``, or start not before end once resolved.
        """
        start, end = to_steps(self.start, total_steps), self.end
        if self.kind in GRADUAL:
            end = to_steps(DEFAULT_GRADUAL_END if end is None else end, total_steps)
            if start >= end:
                raise ValueError(f"start must come before end, got start={self.start!r} -> "
                                 f"step {start}, end={self.end!r} -> step {end} "
                                 f"of {total_steps} training steps")
        return replace(self, start=start, end=end)

    @property
    def is_resolved(self) -> bool:
        return isinstance(self.start, int) and (
            isinstance(self.end, int) if self.kind in GRADUAL else self.end is None)

    def fraction(self, step: int) -> float:
        """Share of the final sparsity in force at ``step`` (0 before start, 1 at end)."""
        if step < self.start:
            return 0.0
        if self.kind not in GRADUAL or step >= self.end:
            return 1.0
        progress = (step - self.start) / (self.end - self.start)
        return 1.0 - (1.0 - progress) ** 3 if self.kind == "gmp" else progress

    def latest_update_step(self, step: int) -> int | None:
        """The last step <= ``step`` at which masks are recomputed, None before start."""
        if step < self.start:
            return None
        if self.kind not in GRADUAL:
            return self.start
        if step >= self.end:
            return self.end
        return self.start + (step - self.start) // self.frequency * self.frequency
