"""Sparsity schedules: how much of the final sparsity applies at an optimizer step.

Every schedule is a frozen dataclass with one signature (jaxpruner's split)::

    schedule.fraction(step) -> float               # share of the final sparsity in force
    schedule.latest_update_step(step) -> int | None  # last mask update at or before step

and ``resolve(total_steps)``, which turns fractions of training into steps. Steps are
optimizer steps (``trainer.global_step``), never batches, except under manual optimization,
where the callback counts batches (docs/schedules.md).

- :class:`OneShot` (``"oneshot"``): everything at ``start``, then hold (ASP: prune a trained
  model, fine-tune).
- :class:`Constant` (``"constant"``): the same level from ``start`` on; with regrowth, the
  masks keep moving.
- :class:`GMP` (``"gmp"``): s_t = s_f + (s_i - s_f)(1 - p)^3, p = (t - t0)/(t1 - t0),
  s_i = 0 (Zhu & Gupta 2017, "To prune, or not to prune"), updated every ``frequency``
  steps.
- :class:`Linear` (``"linear"``): s_t = s_f p.

:func:`parse_schedule` turns a setting's name into one (:data:`SCHEDULES`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from sparse_training.pieces.spelling import did_you_mean

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


def to_steps(value: Step, total_steps: int | None, name: str) -> int:
    """Optimizer steps of ``value`` (the setting ``name``): an int as it is, a float as that
    fraction of ``total_steps``, rounded.

    Raises:
        ValueError: a fraction when the training length is unknown, naming the setting.
    """
    if isinstance(value, int):
        return value
    if total_steps is None:
        raise ValueError(f"{value!r} ({name}) is a fraction of training, but the training "
                         f"length is unknown; set max_steps (or max_epochs, where the training "
                         f"data has a length), or give steps as ints")
    return int(value * total_steps + 0.5)


@dataclass(frozen=True)
class Schedule:
    """One mask update, at ``start``: the whole final sparsity from then on.

    Attributes:
        start: the update step (int) or fraction of training (float).
        frequency: optimizer steps between updates (gradual schedules) and between
            regrowth periods.
    """

    name: ClassVar[str]
    start: Step = 0
    frequency: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, numbers.Integral) \
                or self.frequency < 1:
            raise ValueError(f"frequency must be an int >= 1, got {self.frequency!r}")
        object.__setattr__(self, "frequency", int(self.frequency))
        object.__setattr__(self, "start", check_step(self.start, "start"))

    @property
    def end(self) -> Step | None:
        """The last update (gradual schedules); None for one update."""
        return None

    def fraction(self, step: int) -> float:
        """Share of the final sparsity in force at ``step`` (0 before start)."""
        return 0.0 if step < self.start else 1.0

    def latest_update_step(self, step: int) -> int | None:
        """The last step <= ``step`` at which masks are recomputed, None before start."""
        return None if step < self.start else self.start

    def updates(self) -> list[int]:
        """The mask-update steps of a resolved schedule."""
        return [self.start]

    def update_steps(self, total_steps: int | None, limit: int = 8) -> str:
        """The update steps within a run, for the log: "0, 100, ..., 900 (10 updates)"."""
        return f"{self.start} (one update)"

    def resolve(self, total_steps: int | None) -> Schedule:
        """This schedule with fractions turned into steps of a run of ``total_steps``.

        Raises:
            ValueError: a fraction and no finite ``total_steps``.
        """
        return replace(self, start=to_steps(self.start, total_steps, "start"))

    @property
    def is_resolved(self) -> bool:
        return isinstance(self.start, int)

    def as_list(self) -> list:
        """``[name, start, end, frequency]``: what a checkpoint keeps
        (:func:`parse_schedule` reads it back)."""
        return [self.name, self.start, self.end, self.frequency]


@dataclass(frozen=True)
class OneShot(Schedule):
    """Prune once at ``start`` and hold (ASP's prune, then fine-tune)."""

    name: ClassVar[str] = "oneshot"


@dataclass(frozen=True)
class Constant(Schedule):
    """The final sparsity from ``start`` on (regrowth moves the masks inside it)."""

    name: ClassVar[str] = "constant"


@dataclass(frozen=True)
class Gradual(Schedule):
    """Updates every ``frequency`` steps from ``start`` to ``end``, each at
    :meth:`ramp` of the progress ``p = (t - start) / (end - start)``.

    Attributes:
        end: the last update step or fraction of training; None means
            ``DEFAULT_GRADUAL_END`` of training.
    """

    end: Step | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.end is not None:
            object.__setattr__(self, "end", check_step(self.end, "end"))
            if type(self.start) is type(self.end) and self.start >= self.end:
                raise ValueError(f"start must come before end, got start={self.start!r}, "
                                 f"end={self.end!r}")

    def ramp(self, progress: float) -> float:
        """The share of the final sparsity at ``progress`` in [0, 1]."""
        raise NotImplementedError

    def fraction(self, step: int) -> float:
        """Share of the final sparsity in force at ``step`` (0 before start, 1 at end)."""
        if step < self.start:
            return 0.0
        if step >= self.end:
            return 1.0
        return self.ramp((step - self.start) / (self.end - self.start))

    def latest_update_step(self, step: int) -> int | None:
        if step < self.start:
            return None
        if step >= self.end:
            return self.end
        return self.start + (step - self.start) // self.frequency * self.frequency

    def updates(self) -> list[int]:
        return [*range(self.start, self.end, self.frequency), self.end]

    def update_steps(self, total_steps: int | None, limit: int = 8) -> str:
        steps = [s for s in self.updates() if total_steps is None or s < total_steps]
        shown = steps if len(steps) <= limit else [*steps[:3], "...", *steps[-2:]]
        count = "one update" if len(steps) == 1 else f"{len(steps)} updates"
        return f"{', '.join(map(str, shown))} ({count})"

    def resolve(self, total_steps: int | None) -> Gradual:
        """This schedule with fractions turned into steps of a run of ``total_steps``.

        Raises:
            ValueError: a fraction (or no ``end``) and no finite ``total_steps``, or start
                not before end once resolved.
        """
        start = to_steps(self.start, total_steps, "start")
        end = to_steps(DEFAULT_GRADUAL_END, total_steps, "end, the default") if (
            self.end is None) else to_steps(self.end, total_steps, "end")
        if start >= end:
            raise ValueError(f"start must come before end, got start={self.start!r} -> "
                             f"step {start}, end={self.end!r} -> step {end} "
                             f"of {total_steps} training steps")
        return replace(self, start=start, end=end)

    @property
    def is_resolved(self) -> bool:
        return isinstance(self.start, int) and isinstance(self.end, int)


@dataclass(frozen=True)
class GMP(Gradual):
    """Gradual magnitude pruning's cubic ramp, 1 - (1 - p)^3 (Zhu & Gupta 2017)."""

    name: ClassVar[str] = "gmp"

    def ramp(self, progress: float) -> float:
        return 1.0 - (1.0 - progress) ** 3


@dataclass(frozen=True)
class Linear(Gradual):
    """The linear ramp, p."""

    name: ClassVar[str] = "linear"

    def ramp(self, progress: float) -> float:
        return progress


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (OneShot, GMP, Linear, Constant)}


def register_schedule(cls: type[Schedule]) -> type[Schedule]:
    """Make a :class:`Schedule` subclass a setting by its ``name`` (``schedule="cosine"``)
    and readable back from checkpoints; usable as a class decorator. A schedule given as a
    piece (``schedule=Cosine(start=...)``) is registered when the config takes it.

    Raises:
        ValueError: not a Schedule subclass with a string ``name``, or the name of another
            registered class.
    """
    name = getattr(cls, "name", None)
    if not (isinstance(cls, type) and issubclass(cls, Schedule) and isinstance(name, str)):
        raise ValueError(f"register_schedule takes a Schedule subclass with a string class "
                         f"attribute 'name', got {cls!r}")
    if SCHEDULES.setdefault(name, cls) is not cls:
        raise ValueError(f"schedule name {name!r} is {SCHEDULES[name].__qualname__}'s; give "
                         f"{cls.__qualname__} another name")
    return cls


def schedule_settings(schedule: Schedule) -> dict[str, Any]:
    """The flat settings a schedule piece stands for (its class registered by name).

    Raises:
        ValueError: a piece those settings do not rebuild (an option of its own class,
            such as a ``power``, that checkpoints and the config's flat settings cannot
            carry): it would train with the option's default.
    """
    register_schedule(type(schedule))
    settings = {"schedule": schedule.name, "start": schedule.start, "end": schedule.end,
                "frequency": schedule.frequency}
    rebuilt = parse_schedule(*settings.values())
    if rebuilt != schedule:
        raise ValueError(f"schedule={schedule!r}: its flat settings (start, end, frequency) "
                         f"rebuild {rebuilt!r}; an option of its own class cannot be carried "
                         f"through checkpoints: make it the class's default (a subclass per "
                         f"value)")
    return settings


def parse_schedule(name: str, start: Step = 0, end: Step | None = None,
                   frequency: int = 100) -> Schedule:
    """The schedule a setting names (:data:`SCHEDULES`), or a checkpoint's
    :meth:`Schedule.as_list`.

    Raises:
        ValueError: an unknown name, ``end`` for a schedule of one update, or a bad value.
    """
    cls = SCHEDULES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown schedule {name!r}; {did_you_mean(name, SCHEDULES)}valid: "
                         f"{', '.join(SCHEDULES)}")
    if not issubclass(cls, Gradual):
        if end is not None:
            gradual = ", ".join(n for n, c in SCHEDULES.items() if issubclass(c, Gradual))
            raise ValueError(f"end applies to gradual schedules ({gradual}), not to {name!r}; "
                             f"got end={end!r}")
        return cls(start, frequency)
    return cls(start, frequency, end)
