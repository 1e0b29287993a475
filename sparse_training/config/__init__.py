"""Every setting of a sparse run, written once: :class:`SparsityConfig`.

``SparsityCallback`` takes exactly these keyword arguments (its signature is written out
with the same names, types and defaults; a test keeps the two equal),
:meth:`SparsityConfig.load` reads them from YAML or a dict, and a LightningCLI YAML gives
them as ``init_args``. Validation happens here, before anything
touches a model; every message names the bad value and the valid forms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

from sparse_training.config.checks import SettingChecks
from sparse_training.config.values import (
    LayerOverride,
    check_choice,
    check_target,
    check_tokens,
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
    SRSTE,
    Regrowth,
    RegrowthRule,
    SparseRefinement,
)
from sparse_training.pieces.schedules import (
    Schedule,
    Step,
    check_step,
    parse_schedule,
)
from sparse_training.pieces.score_registry import (
    parse_training_score,
    score_setting,
)
from sparse_training.pieces.scores import GradientScore, MagnitudeScore, RandomScore, Score
from sparse_training.pieces.training_scores import TrainingScore

COMPRESS = ("auto", True, False)
ScoreSetting = str | Mapping[str, Any] | TrainingScore
FUSED = ("auto", True, False)
LayerTypes = type[nn.Module] | str | Sequence[type[nn.Module] | str]
DEFAULT_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, nn.RNNBase)


@dataclass(frozen=True)
class SparsityConfig(SettingChecks):
    """Every setting of a sparse run, validated at construction.

    Args:
        pattern: see :mod:`sparse_training.pieces.patterns` ("2:4", "unstructured", "block:4x4",
            ...). Quote it in YAML: an unquoted 2:4 is read as the base-60 number 124.
        sparsity: target fraction of pruned weights per selected tensor; implied by N:M when None.
        schedule: "oneshot" | "gmp" | "linear" | "constant", or a schedule piece carrying
            its options (``GMP(start=0.1, end=0.8, frequency=50)``; a ``Schedule``
            subclass of your own, :func:`~sparse_training.pieces.schedules.register_schedule`)
            (:mod:`sparse_training.pieces.schedules`).
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
        log_layers: also log ``sparsity/<tensor>`` for every selected tensor (a compressed
            layer's under the dense weight's name, ``fc.weight``, whichever path it took).
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
        regrow: None | "rigl" | "set" | "sr-ste", or a piece carrying its options:
            ``RigL(fraction=0.5, end=0.8)``, ``SET(...)``, ``SRSTE(decay=1e-4)``
            (:mod:`sparse_training.pieces.regrowth`).
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
            masked-dense (each distinct layer timed both ways on the training device and
            compute dtype at setup, times cached: :mod:`sparse_training.layers.auto_paths`),
            False never.
        auto_tokens: the tokens (rows of a layer's input: batch x sequence length) of the
            training step that ``compress="auto"`` times each layer with; the swap happens
            at setup, before any batch is seen.

    Raises:
        ValueError: for any bad value, naming it and the valid forms.
    """

    pattern: str = "2:4"
    sparsity: float | None = None
    schedule: str | Schedule = "oneshot"
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
    regrow: str | RegrowthRule | SRSTE | None = None
    regrow_fraction: float = DEFAULT_ALPHA
    regrow_end: Step = DEFAULT_REGROW_END
    sr_ste_decay: float = DEFAULT_SR_STE_DECAY
    seed: int = 0
    check_masks: bool = True
    fused: bool | str = "auto"
    compress: bool | str = False
    auto_tokens: int = 8192  # a few sequences of 2-4k tokens: a typical LLM step per GPU
    parsed_pattern: Pattern = field(init=False, repr=False, compare=False)
    parsed_schedule: Schedule = field(init=False, repr=False, compare=False)
    parsed_overrides: dict[str, LayerOverride] = field(init=False, repr=False, compare=False)
    parsed_distribution: Distribution = field(init=False, repr=False, compare=False)
    parsed_score: Score | TrainingScore = field(init=False, repr=False, compare=False)
    parsed_regrowth: Regrowth | None = field(init=False, repr=False, compare=False)
    parsed_refinement: SparseRefinement | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalized fields are set once, here
        self._take_pieces()
        pattern = parse_pattern(self.pattern)
        if self.sparsity is not None:
            set_(self, "sparsity", check_sparsity(self.sparsity))
        elif not pattern.is_nm:
            raise ValueError(f"pattern {pattern.spec!r} needs a sparsity in [0, 1); only N:M "
                             f"patterns imply one")
        check_target(pattern, self.sparsity, "sparsity")
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
        check_tokens(self.auto_tokens)
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
        self._warn_if_nothing_pruned(pattern)
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
    def load(cls, source: str | Path | Mapping[str, Any] | SparsityConfig) -> dict[str, Any]:
        """Read settings from a YAML (or JSON) file, a dict (OmegaConf) or a config (its
        :meth:`as_dict`); unknown keys are an error.

        Args:
            source: the file's path (a str or ``pathlib.Path``), a mapping of settings, or
                a SparsityConfig.

        Raises:
            TypeError: ``source`` is neither a path nor a mapping.
            FileNotFoundError: no file at the path (it names the path as resolved).
            ValueError: the file holds no mapping, no setting or a LightningCLI entry
                (``class_path``, ``init_args``), or an unknown key (the nearest valid one
                named).
        """
        if isinstance(source, SparsityConfig):
            return source.as_dict()
        if not isinstance(source, str | Path | Mapping):
            raise TypeError(f"SparsityConfig.load takes the path of a YAML or JSON file (a str "
                            f"or pathlib.Path), a mapping of settings or a SparsityConfig, got "
                            f"{source!r} of type {type(source).__name__}")
        from omegaconf import OmegaConf

        if isinstance(source, str | Path) and not Path(source).is_file():
            raise FileNotFoundError(f"SparsityConfig.load: no file {str(source)!r} (resolved: "
                                    f"{Path(source).resolve()}); give the path of a YAML or "
                                    f"JSON file of settings, or a mapping of them")
        conf = OmegaConf.load(source) if isinstance(source, str | Path) else OmegaConf.create(
            dict(source))
        settings = OmegaConf.to_container(conf, resolve=True)
        if not isinstance(settings, dict):
            raise ValueError(f"a sparsity config must be a mapping, got {settings!r}")
        if "class_path" in settings:
            raise ValueError(f"a sparsity config holds the settings themselves; got a "
                             f"LightningCLI entry (class_path: {settings['class_path']!r}): give "
                             f"its init_args, or put the entry under trainer.callbacks of the "
                             f"CLI's config")
        if not settings and not isinstance(source, Mapping):
            raise ValueError(f"the sparsity config file {str(source)!r} holds no setting (an "
                             f"empty file would train with every default); give them, e.g. "
                             f"pattern: \"2:4\"")
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
