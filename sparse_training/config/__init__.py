"""Every setting of a sparse run, written once: :class:`SparsityConfig`.

``SparsityCallback`` takes exactly these keyword arguments (its signature is written out
with the same names, types and defaults; a test keeps the two equal),
:meth:`SparsityConfig.load` reads them from YAML or a dict, and a LightningCLI YAML gives
them as ``init_args``. Validation happens here, before anything
touches a model; every message names the bad value and the valid forms.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

from sparse_training.config.values import (
    LayerOverride,
    check_choice,
    check_target,
    is_int,
    is_real,
    layer_type,
    parse_overrides,
    regex_list,
    unknown_setting,
)
from sparse_training.pieces.distributions import DISTRIBUTIONS, Distribution
from sparse_training.pieces.masks import check_sparsity
from sparse_training.pieces.patterns import Pattern, parse_pattern
from sparse_training.pieces.regrowth import (
    DEFAULT_ALPHA,
    DEFAULT_REGROW_END,
    DEFAULT_SR_STE_DECAY,
    Regrowth,
    SparseRefinement,
)
from sparse_training.pieces.schedules import Gradual, Schedule, Step, check_step, parse_schedule
from sparse_training.pieces.score_registry import (
    TRAINING_SCORES,
    parse_training_score,
    score_setting,
)
from sparse_training.pieces.scores import GradientScore, MagnitudeScore, RandomScore, Score
from sparse_training.pieces.training_scores import TrainingScore

COMPRESS = ("auto", True, False)
SCORES = ("magnitude", "random", *TRAINING_SCORES)
ScoreSetting = str | Mapping[str, Any] | TrainingScore
REGROW = ("rigl", "set", "sr-ste")
FUSED = ("auto", True, False)
LayerTypes = type[nn.Module] | str | Sequence[type[nn.Module] | str]
DEFAULT_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, nn.RNNBase)


# a warning of __post_init__ points at the line that built the config: this method, then
# __post_init__, the dataclass's __init__, and its caller
CALLER_LEVEL = 4


@dataclass(frozen=True)
class SparsityConfig:
    """Every setting of a sparse run, validated at construction.

    Args:
        pattern: see :mod:`sparse_training.pieces.patterns` ("2:4", "unstructured", "block:4x4",
            ...). Quote it in YAML: an unquoted 2:4 is read as the base-60 number 124.
        sparsity: target fraction of zeros per selected tensor; implied by N:M when None.
        schedule: "oneshot" | "gmp" | "linear" | "constant" (:mod:`sparse_training.pieces.schedules`).
        start: first mask update, in optimizer steps (int) or as a fraction of training
            (float). 0 prunes at the first step; ASP's recipe (train dense, prune, fine-tune)
            prunes a trained model: load trained weights, or start later.
        end: last update of a gradual schedule; None means 0.75 of training.
        frequency: optimizer steps between mask updates of gradual and regrowth schedules.
        allow: regexes searched in tensor names; when given, only matching tensors.
        deny: regexes searched in tensor names; matching tensors stay dense.
        dense_ratio: the first fraction of the eligible blocks (repeated units such as
            ``encoder.layer.0``, in module order) stays dense.
        overrides: ``{regex: {"sparsity": .., "pattern": ..}}`` per-tensor settings.
        distribution: "uniform" | "erk" | "global" (one magnitude threshold across tensors).
        layer_types: module classes whose weight tensors may be masked (every parameter of
            two or more dimensions they own); classes, ``torch.nn`` names or import paths.
        log_layers: also log ``sparsity/<tensor>`` for every selected tensor.
        score: what the schedule's mask updates keep (and regrowth drops last):
            "magnitude" (largest |w|), "random" (a random mask seeded by (seed, step):
            static sparse training), or a score that learns from training
            (:mod:`sparse_training.pieces.training_scores`): "movement" (Sanh et al.
            2020), "soft-movement" (learned scores), "second-order" (oBERT's, Kurtic et
            al. 2022); with options as a mapping (``{"name": "second-order",
            "block_size": 50}``) or a piece (``SecondOrderScore(damp=1e-3)``). A training
            score needs training steps before it ranks: its first update must come after
            step 0 (a gradual schedule, or ``start`` > 0), except under regrowth, whose
            first mask at step 0 keeps the largest |w|.
        regrow: None | "rigl" | "set" | "sr-ste" (:mod:`sparse_training.pieces.regrowth`).
        regrow_fraction: alpha, the share of active weights swapped at the first update.
        regrow_end: no more regrowth from this step (int) or fraction (float) on.
        sr_ste_decay: lambda of SR-STE's decay of the pruned weights.
        seed: seeds every random draw together with the step, equal on every rank.
        check_masks: under torch.distributed, compare mask checksums across ranks after
            every update and raise on a mismatch (one small all-reduce per update).
        fused: the masked optimizer step in fused Triton kernels: "auto" uses them on
            CUDA for ``torch.optim.AdamW``, ``Adam`` and ``SGD``, True requires them (an
            error where they cannot serve), False never uses them.
        compress: train selected ``nn.Linear`` weights as compressed layers from setup
            (:mod:`sparse_training.layers.compress`; ``BlockSparseLinear`` for block patterns,
            ``SemiStructuredLinear`` for 2:4): True wherever the kept count is fixed from
            the first step (an error otherwise), "auto" only where measured faster than
            masked-dense (blocks from 16M weights, 2:4 from 32M), False never.

    Raises:
        ValueError: for any bad value, naming it and the valid forms.
    """

    pattern: str = "2:4"
    sparsity: float | None = None
    schedule: str = "oneshot"
    start: Step = 0
    end: Step | None = None
    frequency: int = 100
    allow: Sequence[str] | None = None
    deny: Sequence[str] | None = None
    dense_ratio: float = 0.0
    overrides: Mapping[str, Mapping[str, str | float]] | None = None
    distribution: str = "uniform"
    layer_types: LayerTypes = DEFAULT_LAYER_TYPES
    log_layers: bool = False
    score: ScoreSetting = "magnitude"
    regrow: str | None = None
    regrow_fraction: float = DEFAULT_ALPHA
    regrow_end: Step = DEFAULT_REGROW_END
    sr_ste_decay: float = DEFAULT_SR_STE_DECAY
    seed: int = 0
    check_masks: bool = True
    fused: bool | str = "auto"
    compress: bool | str = False
    parsed_pattern: Pattern = field(init=False, repr=False, compare=False)
    parsed_schedule: Schedule = field(init=False, repr=False, compare=False)
    parsed_overrides: dict[str, LayerOverride] = field(init=False, repr=False, compare=False)
    parsed_distribution: Distribution = field(init=False, repr=False, compare=False)
    parsed_score: Score | TrainingScore = field(init=False, repr=False, compare=False)
    parsed_regrowth: Regrowth | None = field(init=False, repr=False, compare=False)
    parsed_refinement: SparseRefinement | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalized fields are set once, here
        pattern = parse_pattern(self.pattern)
        if self.sparsity is not None:
            set_(self, "sparsity", check_sparsity(self.sparsity))
        elif not pattern.is_nm:
            raise ValueError(f"pattern {pattern.spec!r} needs a sparsity in [0, 1); only N:M "
                             f"patterns imply one")
        check_target(pattern, self.sparsity, "SparsityCallback")
        check_choice(self.distribution, "distribution", DISTRIBUTIONS)
        if pattern.is_nm and self.distribution != "uniform":
            raise ValueError(f"distribution {self.distribution!r} needs an unstructured or "
                             f"block pattern; N:M ({pattern.spec!r}) fixes each group's count")
        if not is_real(self.dense_ratio) or not 0.0 <= self.dense_ratio < 1.0:
            raise ValueError(f"dense_ratio must be a number in [0, 1), got {self.dense_ratio!r}")
        for flag in ("log_layers", "check_masks"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        check_choice(self.fused, "fused", FUSED)
        check_choice(self.compress, "compress", COMPRESS)
        self._check_regrowth(pattern)
        types = self.layer_types
        types = (types,) if isinstance(types, type | str) else types
        if not isinstance(types, Sequence) or not types:
            raise ValueError(f"layer_types must be a non-empty list of torch.nn.Module "
                             f"classes, got {self.layer_types!r}")
        set_(self, "layer_types", tuple(layer_type(t) for t in types))
        set_(self, "allow", regex_list(self.allow, "allow"))
        set_(self, "deny", regex_list(self.deny, "deny"))
        set_(self, "dense_ratio", float(self.dense_ratio))
        set_(self, "parsed_pattern", pattern)
        set_(self, "parsed_overrides", parse_overrides(self.overrides))
        self._check_overrides(pattern)
        self._check_units(pattern)
        set_(self, "parsed_schedule", parse_schedule(self.schedule, self.start, self.end,
                                                     self.frequency))
        self._warn_about_unread_options()
        self._parse_pieces()
        if self.compress is True and (problem := self.fixed_count_problem()):
            raise ValueError(f"compress=True trains a fixed set of blocks from the first step, "
                             f"but {problem}; use compress='auto' (masked-dense where it "
                             f"cannot) or False")

    def _parse_pieces(self) -> None:
        """The checked strings as the typed pieces the engine is built from."""
        set_ = object.__setattr__
        set_(self, "parsed_distribution", DISTRIBUTIONS[self.distribution])
        seed = int(self.seed)
        set_(self, "parsed_score", parse_training_score(self.score) or (
            RandomScore(seed) if self.score == "random" else MagnitudeScore()))
        grow = {"rigl": GradientScore(), "set": RandomScore(seed)}.get(self.regrow)
        set_(self, "parsed_regrowth", None if grow is None else Regrowth(
            self.regrow, grow, float(self.regrow_fraction),
            check_step(self.regrow_end, "regrow_end")))
        set_(self, "parsed_refinement", SparseRefinement(float(self.sr_ste_decay))
             if self.regrow == "sr-ste" else None)

    def fixed_count_problem(self) -> str | None:
        """Why these settings do not fix the kept count from the first step (what a
        compressed layer needs), or None; block sizes are checked per tensor, at the swap."""
        pattern = self.parsed_pattern
        if problem := pattern.compression_problem:
            return problem
        if pattern.is_nm and self.regrow is not None:
            return (f"regrow={self.regrow!r} moves 2:4 entries; the 2:4 layer keeps a fixed "
                    f"mask, so it trains masked-dense")
        if self.schedule not in ("oneshot", "constant") or self.start != 0:
            return (f"schedule={self.schedule!r} from start={self.start!r} reaches its "
                    f"sparsity after the first step; it trains masked-dense "
                    f"(docs/block_sparse.md)")
        if self.distribution == "global":
            return "distribution='global' sets per-tensor counts at the update, not at setup"
        return None

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
        if not is_real(self.regrow_fraction) or not 0.0 < self.regrow_fraction <= 1.0:
            raise ValueError(f"regrow_fraction must be a number in (0, 1], got "
                             f"{self.regrow_fraction!r}")
        end, start = check_step(self.regrow_end, "regrow_end"), check_step(self.start, "start")
        if self.regrow != "sr-ste" and (end == 0 or (type(end) is type(start)
                                                     and end <= start)):
            raise ValueError(f"regrow_end={end!r} is not after start={start!r}: regrow="
                             f"{self.regrow!r} would never drop and grow; "
                             f"give a later step (int) or fraction of training (float; default "
                             f"{DEFAULT_REGROW_END})")
        if (not is_real(self.sr_ste_decay) or not math.isfinite(self.sr_ste_decay)
                or self.sr_ste_decay < 0):
            raise ValueError(f"sr_ste_decay must be a finite number >= 0, got "
                             f"{self.sr_ste_decay!r}")

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
                raise ValueError(f"unknown score {self.score!r}; valid: "
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

    def _warn_about_unread_options(self) -> None:
        """Settings that the chosen ``regrow`` and schedule never read are said, not dropped
        silently: RigL and SET read ``regrow_fraction`` and ``regrow_end``, SR-STE
        ``sr_ste_decay``; ``frequency`` spaces the updates of gradual schedules and of
        regrowth."""
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
        if unread:
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in unread)
            warnings.warn(f"SparsityConfig: {shown} not read with regrow={self.regrow!r} and "
                          f"schedule={self.schedule!r} (regrow_fraction and regrow_end: RigL "
                          f"and SET; sr_ste_decay: SR-STE; frequency: gradual schedules and "
                          f"regrowth); leave them out", UserWarning, stacklevel=CALLER_LEVEL)

    # -- the settings as data ----------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings a config may hold."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def unknown_setting(cls, keys: Iterable[str]) -> str | None:
        """The message for the first unknown key, naming the nearest valid one, or None."""
        return unknown_setting(keys, cls.names())

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> SparsityConfig:
        """The config of a mapping of settings (a sweep's, a file's).

        Raises:
            ValueError: an unknown key (the nearest valid one named) or a bad value.
        """
        if message := cls.unknown_setting(settings):
            raise ValueError(message)
        return cls(**settings)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
        """Read settings from a YAML file or a dict (OmegaConf); unknown keys are an error.

        Raises:
            ValueError: not a mapping, or an unknown key (the nearest valid one named).
        """
        from omegaconf import OmegaConf

        conf = OmegaConf.load(source) if isinstance(source, str | Path) else OmegaConf.create(
            dict(source))
        settings = OmegaConf.to_container(conf, resolve=True)
        if not isinstance(settings, dict):
            raise ValueError(f"a sparsity config must be a mapping, got {settings!r}")
        if message := cls.unknown_setting(settings):
            raise ValueError(message)
        return settings

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (classes as import paths): what a checkpoint keeps
        to compare with the settings it is resumed with."""
        plain = {k: v for k, v in asdict(self).items() if k in self.names()}
        plain["pattern"] = self.parsed_pattern.spec  # " 2:4" and "2:4" are one pattern
        plain["layer_types"] = [f"{t.__module__}.{t.__qualname__}" for t in self.layer_types]
        plain["allow"], plain["deny"] = list(self.allow), list(self.deny)
        if isinstance(self.parsed_score, TrainingScore):
            plain["score"] = score_setting(self.parsed_score)
        plain["overrides"] = {k: {**v, **({"pattern": o.pattern.spec} if o.pattern else {})}
                              for (k, v), o in zip((self.overrides or {}).items(),
                                                   self.parsed_overrides.values(), strict=True)}
        return plain
