"""One validated settings object for the engine and the callback, and its YAML/dict form."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

from sparse_training.distributions import DISTRIBUTIONS
from sparse_training.masks import check_sparsity
from sparse_training.patterns import Pattern, parse_pattern
from sparse_training.regrowth import (
    DEFAULT_ALPHA,
    DEFAULT_REGROW_END,
    DEFAULT_SR_STE_DECAY,
    REGROW,
)
from sparse_training.schedules import Schedule, Step, check_step
from sparse_training.selection import DEFAULT_LAYER_TYPES, LayerOverride

OVERRIDE_KEYS = ("sparsity", "pattern")
SCORES = ("magnitude", "random")


def _regex_list(value: Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of regex strings, e.g. [{value!r}], got {value!r}")
    for regex in value:
        try:
            re.compile(regex)
        except re.error as error:
            raise ValueError(f"{name} regex {regex!r} is invalid: {error}") from None
    return tuple(value)


def _parse_overrides(overrides: Mapping[str, Mapping[str, Any]] | None
                     ) -> dict[str, LayerOverride]:
    parsed = {}
    for regex, settings in (overrides or {}).items():
        _regex_list([regex], "overrides")
        if not isinstance(settings, Mapping) or not settings or (
                set(settings) - set(OVERRIDE_KEYS)):
            raise ValueError(f"overrides[{regex!r}] must be a dict with keys from "
                             f"{OVERRIDE_KEYS}, got {settings!r}")
        pattern = parse_pattern(settings["pattern"]) if "pattern" in settings else None
        sparsity = settings.get("sparsity")
        if sparsity is not None:
            check_sparsity(sparsity, f"overrides[{regex!r}]['sparsity']")
        parsed[regex] = LayerOverride(pattern, sparsity)
    return parsed


def _check_target(pattern: Pattern | None, sparsity: float | None, where: str) -> None:
    if pattern is not None and pattern.is_nm and sparsity is not None and (
            abs(sparsity - pattern.nm_sparsity) > 1e-9):
        raise ValueError(f"{where}: pattern {pattern.spec!r} implies sparsity "
                         f"{pattern.nm_sparsity:g}; leave sparsity None or set it to that, "
                         f"got {sparsity!r}")


@dataclass(frozen=True)
class SparsityConfig:
    """Every setting of a sparse run, validated at construction (see SparsityCallback)."""

    pattern: str = "2:4"
    sparsity: float | None = None
    schedule: str = "oneshot"
    start: Step = 0
    end: Step | None = None
    frequency: int = 100
    allow: Sequence[str] | None = None
    deny: Sequence[str] | None = None
    dense_ratio: float = 0.0
    overrides: Mapping[str, Mapping[str, Any]] | None = None
    distribution: str = "uniform"
    layer_types: tuple[type[nn.Module], ...] = DEFAULT_LAYER_TYPES
    log_layers: bool = False
    score: str = "magnitude"
    regrow: str | None = None
    regrow_fraction: float = DEFAULT_ALPHA
    regrow_end: Step = DEFAULT_REGROW_END
    sr_ste_decay: float = DEFAULT_SR_STE_DECAY
    seed: int = 0
    check_masks: bool = True
    fused: bool | str = "auto"
    parsed_pattern: Pattern = field(init=False, repr=False)
    parsed_schedule: Schedule = field(init=False, repr=False)
    parsed_overrides: dict[str, LayerOverride] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pattern = parse_pattern(self.pattern)
        if self.sparsity is not None:
            check_sparsity(self.sparsity)
        elif not pattern.is_nm:
            raise ValueError(f"pattern {pattern.spec!r} needs a sparsity in [0, 1); only N:M "
                             f"patterns imply one")
        _check_target(pattern, self.sparsity, "SparsityCallback")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.distribution!r}; valid: "
                             f"{', '.join(DISTRIBUTIONS)}")
        if pattern.is_nm and self.distribution != "uniform":
            raise ValueError(f"distribution {self.distribution!r} needs an unstructured or "
                             f"block pattern; N:M ({pattern.spec!r}) fixes each group's count")
        if isinstance(self.dense_ratio, bool) or not isinstance(self.dense_ratio, int | float) \
                or not 0.0 <= self.dense_ratio < 1.0:
            raise ValueError(f"dense_ratio must be a number in [0, 1), got {self.dense_ratio!r}")
        self._check_regrowth(pattern)
        if not (self.fused == "auto" or isinstance(self.fused, bool)):
            raise ValueError(f"fused must be 'auto', True or False, got {self.fused!r}")
        types = tuple(self.layer_types)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise ValueError(f"layer_types must be torch.nn.Module subclasses, got "
                             f"{self.layer_types!r}")
        set_ = object.__setattr__  # frozen dataclass: derived fields are set once, here
        set_(self, "layer_types", types)
        set_(self, "allow", _regex_list(self.allow, "allow"))
        set_(self, "deny", _regex_list(self.deny, "deny"))
        set_(self, "parsed_pattern", pattern)
        set_(self, "parsed_overrides", _parse_overrides(self.overrides))
        self._check_overrides(pattern)
        set_(self, "parsed_schedule", Schedule(self.schedule, self.start, self.end,
                                               self.frequency))

    def _check_overrides(self, pattern: Pattern) -> None:
        """Each override must leave its layers a definite target: a sparsity for a
        non-N:M pattern, and none that contradicts an N:M pattern (0 keeps a layer dense)."""
        for regex, override in self.parsed_overrides.items():
            layer_pattern = override.pattern or pattern
            if override.sparsity == 0.0:
                continue
            if not layer_pattern.is_nm and override.sparsity is None and self.sparsity is None:
                raise ValueError(f"overrides[{regex!r}]: pattern {layer_pattern.spec!r} needs "
                                 f"a sparsity (the model-wide pattern {pattern.spec!r} gives "
                                 f"none); add 'sparsity' to the override")
            _check_target(layer_pattern, override.sparsity, f"overrides[{regex!r}]")

    def _check_regrowth(self, pattern: Pattern) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.score not in SCORES:
            raise ValueError(f"unknown score {self.score!r}; valid: {', '.join(SCORES)}")
        if self.score == "random" and self.schedule not in ("oneshot", "constant"):
            raise ValueError(f"score='random' draws one random mask; it needs schedule "
                             f"'oneshot' or 'constant', got {self.schedule!r} (a gradual "
                             f"schedule would prune trained weights at random)")
        if self.regrow is None:
            return
        if self.regrow not in REGROW:
            raise ValueError(f"unknown regrow {self.regrow!r}; valid: None, {', '.join(REGROW)}")
        if pattern.transposable:
            raise ValueError(f"regrow={self.regrow!r} does not support transposable patterns "
                             f"({pattern.spec!r}); use the plain N:M pattern")
        if self.regrow == "sr-ste" and not pattern.is_nm:
            raise ValueError(f"regrow='sr-ste' trains N:M masks; got pattern {pattern.spec!r}")
        if isinstance(self.regrow_fraction, bool) or not isinstance(
                self.regrow_fraction, int | float) or not 0.0 < self.regrow_fraction <= 1.0:
            raise ValueError(f"regrow_fraction must be a number in (0, 1], got "
                             f"{self.regrow_fraction!r}")
        check_step(self.regrow_end, "regrow_end")
        if isinstance(self.sr_ste_decay, bool) or not isinstance(
                self.sr_ste_decay, int | float) or self.sr_ste_decay < 0:
            raise ValueError(f"sr_ste_decay must be a number >= 0, got {self.sr_ste_decay!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The settings a config file may hold."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
        """Read settings from a YAML file or a dict (OmegaConf); unknown keys are an error.

        ``layer_types`` is given as names of ``torch.nn`` classes, e.g. ``[Linear, Conv2d]``.
        """
        from omegaconf import OmegaConf

        conf = OmegaConf.load(source) if isinstance(source, str | Path) else OmegaConf.create(
            dict(source))
        settings = OmegaConf.to_container(conf, resolve=True)
        if not isinstance(settings, dict):
            raise ValueError(f"a sparsity config must be a mapping, got {settings!r}")
        if unknown := sorted(set(settings) - set(cls.keys())):
            raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(cls.keys())}")
        if "layer_types" in settings:
            settings["layer_types"] = tuple(_nn_class(n) for n in settings["layer_types"])
        return settings


def _nn_class(name: str) -> type[nn.Module]:
    cls = getattr(nn, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"layer_types entry {name!r} is not a torch.nn module class "
                         f"(e.g. Linear, Conv2d)")
    return cls
