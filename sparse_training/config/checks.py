"""The checks of :class:`~sparse_training.config.SparsityConfig` that weigh several
settings together (overrides against the pattern, regrowth, unit patterns, scores), the
pieces given for ``schedule`` and ``regrow``, and the options no chosen method reads."""

from __future__ import annotations

import warnings
from dataclasses import fields

from sparse_training.config.values import check_choice, check_target, is_int
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.regrowth import (
    DEFAULT_REGROW_END,
    SRSTE,
    RegrowthRule,
    check_decay,
    check_fraction,
)
from sparse_training.pieces.schedules import (
    SCHEDULES,
    Gradual,
    Schedule,
    check_step,
    schedule_settings,
)
from sparse_training.pieces.score_registry import TRAINING_SCORES, parse_training_score
from sparse_training.pieces.spelling import did_you_mean

SCORES = ("magnitude", "random", *TRAINING_SCORES)
REGROW = ("rigl", "set", "sr-ste")
# a warning of __post_init__ points at the line that built the config: the warning's
# method, then __post_init__, the dataclass's __init__, and its caller
CALLER_LEVEL = 4


class SettingChecks:
    """Checks mixed into :class:`~sparse_training.config.SparsityConfig` (they read its
    fields; ``parsed_overrides`` and ``parsed_schedule`` are set before they run)."""

    def _take_pieces(self) -> None:
        """A piece given for ``schedule`` (``GMP(start=0.1, end=0.8)``) or ``regrow``
        (``RigL(fraction=0.5)``, ``SET``, ``SRSTE``) becomes the flat settings it stands
        for, so checkpoints and messages read the same either way.

        Raises:
            ValueError: a piece's class given for its instance (``score=MovementScore``),
                or a flat option given beside the piece that carries it.
        """
        names = {"schedule": tuple(SCHEDULES), "regrow": REGROW, "score": SCORES}
        for name, valid in names.items():
            if isinstance(cls := getattr(self, name), type):
                raise ValueError(f"{name}={cls.__name__} is a class; give an instance, "
                                 f"{cls.__name__}(), or a name: {', '.join(map(repr, valid))}")
        defaults = {f.name: f.default for f in fields(self)}
        for name, kinds in (("schedule", Schedule), ("regrow", (RegrowthRule, SRSTE))):
            piece = getattr(self, name)
            if not isinstance(piece, kinds):
                continue
            settings = (schedule_settings(piece) if isinstance(piece, Schedule)
                        else piece.settings())
            if given := [k for k in settings if k != name and getattr(self, k) != defaults[k]]:
                shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in given)
                raise ValueError(f"{name}={piece!r} carries its options; {shown} given beside "
                                 f"it: set them on the piece")
            for key, value in settings.items():
                object.__setattr__(self, key, value)

    def _check_overrides(self, pattern: Pattern) -> None:
        """Each override must leave its tensors a definite target: a sparsity for a
        non-N:M pattern, and none that contradicts an N:M pattern (0 keeps them dense)."""
        for regex, override in self.parsed_overrides.items():
            layer_pattern = override.pattern or pattern
            if override.sparsity == 0.0:
                continue
            if self.regrow is not None and layer_pattern.transposable:
                raise ValueError(f"overrides[{regex!r}]: regrow={self.regrow!r} does not support "
                                 f"transposable patterns ({layer_pattern.spec!r})")
            if self.regrow == "sr-ste" and not layer_pattern.is_nm:
                raise ValueError(f"overrides[{regex!r}]: regrow='sr-ste' trains N:M masks; got "
                                 f"pattern {layer_pattern.spec!r}")
            if not layer_pattern.is_nm and override.sparsity is None and self.sparsity is None:
                raise ValueError(f"overrides[{regex!r}]: pattern {layer_pattern.spec!r} needs "
                                 f"a sparsity (the model-wide pattern {pattern.spec!r} gives "
                                 f"none); add 'sparsity' to the override")
            check_target(layer_pattern, override.sparsity, f"overrides[{regex!r}]")

    def _check_regrowth(self, pattern: Pattern) -> None:
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self._check_score()
        if self.score == "random" and self.schedule not in ("oneshot", "constant"):
            raise ValueError(f"score='random' draws one random mask; it needs schedule "
                             f"'oneshot' or 'constant', got {self.schedule!r} (a gradual "
                             f"schedule would prune trained weights at random)")
        check_choice(self.regrow, "regrow", (None, *REGROW))
        if self.regrow is None:
            return
        if pattern.transposable:
            raise ValueError(f"regrow={self.regrow!r} does not support transposable patterns "
                             f"({pattern.spec!r}); use the plain N:M pattern")
        if self.regrow == "sr-ste" and not pattern.is_nm:
            raise ValueError(f"regrow='sr-ste' trains N:M masks; got pattern {pattern.spec!r}")
        check_fraction(self.regrow_fraction, "regrow_fraction")
        end, start = check_step(self.regrow_end, "regrow_end"), check_step(self.start, "start")
        if self.regrow != "sr-ste" and (end == 0 or (type(end) is type(start)
                                                     and end <= start)):
            raise ValueError(f"regrow_end={end!r} is not after start={start!r}: regrow="
                             f"{self.regrow!r} would never drop and grow; "
                             f"give a later step (int) or fraction of training (float; default "
                             f"{DEFAULT_REGROW_END})")
        check_decay(self.sr_ste_decay, "sr_ste_decay")

    def _check_units(self, pattern: Pattern) -> None:
        """Unit patterns (heads, neurons) tie several tensors to one choice of units: one
        target per block, units that stay put."""
        for where, unit in [("pattern", pattern), *(
                (f"overrides[{regex!r}]", o.pattern)
                for regex, o in self.parsed_overrides.items())]:
            if unit is None or not unit.is_unit:
                continue
            if self.distribution != "uniform":
                raise ValueError(f"{where} {unit.spec!r} prunes the same share of units in "
                                 f"every block; distribution {self.distribution!r} would give "
                                 f"the tensors of one block different targets: use 'uniform'")
            if self.regrow is not None:
                raise ValueError(f"{where} {unit.spec!r}: regrow={self.regrow!r} moves "
                                 f"entries of single tensors, not whole units; leave regrow "
                                 f"None")

    def _check_score(self) -> None:
        """A score that names one, and a training score that has steps to learn from."""
        try:
            training = parse_training_score(self.score)
        except (TypeError, ValueError) as error:
            raise ValueError(f"score {self.score!r}: {error}") from None
        if training is None:
            if not isinstance(self.score, str) or self.score not in SCORES:
                raise ValueError(f"unknown score {self.score!r}; "
                                 f"{did_you_mean(self.score, SCORES)}valid: "
                                 f"{', '.join(map(repr, SCORES))}, a mapping {{'name': ..., "
                                 f"options}} or a training score piece")
            return
        if self.regrow == "sr-ste":
            raise ValueError(f"score {training.name!r} with regrow='sr-ste': SR-STE re-derives "
                             f"its N:M masks from |w| at every step; use score='magnitude'")
        start = check_step(self.start, "start")
        if self.schedule in ("oneshot", "constant") and start == 0 and self.regrow is None:
            raise ValueError(f"score {training.name!r} ranks what training observed, but "
                             f"schedule={self.schedule!r} at start=0 makes its only mask "
                             f"before the first step: start later (e.g. start=0.1), use a "
                             f"gradual schedule ('gmp'), or score='magnitude'")

    def _warn_if_nothing_pruned(self, pattern: Pattern) -> None:
        """Targets that are all 0 (``sparsity=0.0``, an N:N pattern such as ``"4:4"``,
        overrides of 0) train dense behind masks that keep every weight: said, not silent."""
        def target(layer: Pattern, sparsity: float | None, default: float) -> float:
            if sparsity is not None:
                return sparsity
            return layer.nm_sparsity if layer.is_nm else default

        model_wide = target(pattern, self.sparsity, 0.0)
        if not any(target(o.pattern or pattern, o.sparsity, model_wide) > 0
                   for o in self.parsed_overrides.values()) and model_wide == 0:
            given = f"pattern={pattern.spec!r}" + (
                "" if self.sparsity is None else f", sparsity={self.sparsity!r}") + (
                " and every override" if self.parsed_overrides else "")
            warnings.warn(f"SparsityConfig: with {given} nothing is pruned (the masks keep every "
                          f"weight) and the fit trains dense; give a sparsity in (0, 1), e.g. "
                          f"0.9", UserWarning, stacklevel=CALLER_LEVEL)

    def _warn_about_unread_options(self) -> None:
        """Settings that the chosen ``regrow`` and schedule never read are said, not dropped
        silently: RigL and SET read ``regrow_fraction`` and ``regrow_end``, SR-STE
        ``sr_ste_decay``; ``frequency`` spaces the updates of gradual schedules and of
        regrowth; ``compress="auto"`` reads ``auto_tokens``."""
        reads = {None: (), "rigl": ("regrow_fraction", "regrow_end"),
                 "set": ("regrow_fraction", "regrow_end"), "sr-ste": ("sr_ste_decay",)}
        defaults = {name: type(self).__dataclass_fields__[name].default
                    for name in ("regrow_fraction", "regrow_end", "sr_ste_decay", "frequency")}
        unread = [name for name in ("regrow_fraction", "regrow_end", "sr_ste_decay")
                  if name not in reads[self.regrow] and getattr(self, name) != defaults[name]]
        # SR-STE reads frequency too: how often the ranks compare their masks
        if (self.regrow is None and not isinstance(self.parsed_schedule, Gradual)
                and self.frequency != defaults["frequency"]):
            unread.append("frequency")
        if self.compress != "auto" and self.auto_tokens != type(self).auto_tokens:
            warnings.warn(f"SparsityConfig: auto_tokens={self.auto_tokens!r} not read with "
                          f"compress={self.compress!r} (it sizes compress='auto''s "
                          f"measurements); leave it out", UserWarning, stacklevel=CALLER_LEVEL)
        if unread:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in unread)
            warnings.warn(f"SparsityConfig: {shown} not read with regrow={self.regrow!r} and "
                          f"schedule={self.schedule!r} (regrow_fraction and regrow_end: RigL "
                          f"and SET; sr_ste_decay: SR-STE; frequency: gradual schedules and "
                          f"regrowth); leave them out", UserWarning, stacklevel=CALLER_LEVEL)
