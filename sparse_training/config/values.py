"""Checks and parsers of single settings, shared by :class:`~sparse_training.config.
SparsityConfig`: numbers, regex lists, layer types, overrides, choices, and the message for
an unknown setting. Each raises a ValueError naming the bad value and the valid forms."""

from __future__ import annotations

import importlib
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from sparse_training.pieces.masks import check_sparsity
from sparse_training.pieces.patterns import Pattern, parse_pattern
from sparse_training.pieces.spelling import did_you_mean

OVERRIDE_KEYS = ("sparsity", "pattern")


@dataclass(frozen=True)
class LayerOverride:
    """Per-tensor settings from ``overrides``; None fields follow the model-wide ones."""

    pattern: Pattern | None = None
    sparsity: float | None = None


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def unknown_setting(keys: Iterable[str], valid: Sequence[str]) -> str | None:
    """The message for the first of ``keys`` not in ``valid``, naming the nearest valid one,
    or None."""
    for key in keys:
        if key not in valid:
            return (f"unknown setting {key!r}; {did_you_mean(key, valid)}valid settings: "
                    f"{', '.join(valid)}")
    return None


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def regex_list(value: Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not all(
            isinstance(v, str) for v in value):
        example = repr([value]) if isinstance(value, str) else "['encoder', r'\\.fc\\d']"
        raise ValueError(f"{name} must be a list of regex strings, e.g. {example}, got "
                         f"{value!r}")
    for regex in value:
        try:
            re.compile(regex)
        except re.error as error:
            raise ValueError(f"{name} regex {regex!r} is invalid: {error}") from None
    return tuple(value)


def layer_type(entry: Any) -> type[nn.Module]:
    """A module class from a class, a ``torch.nn`` name ("Linear") or an import path."""
    cls = entry
    if isinstance(entry, str):
        module_name, _, class_name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name) if module_name else nn,
                          class_name, None)
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        modules = [n for n, c in vars(nn).items() if isinstance(c, type) and issubclass(
            c, nn.Module)]
        raise ValueError(f"layer_types entry {entry!r} is not a torch.nn.Module subclass; "
                         f"{did_you_mean(entry, modules)}give classes, torch.nn names (e.g. "
                         f"'Linear', 'Conv2d') or import paths (e.g. "
                         f"'transformers.pytorch_utils.Conv1D')")
    return cls


def parse_overrides(overrides: Mapping[str, Mapping[str, Any]] | None
                     ) -> dict[str, LayerOverride]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"overrides must be a dict {{regex: {{'sparsity': ..., 'pattern': "
                         f"...}}}}, got {overrides!r}")
    parsed = {}
    for regex, settings in overrides.items():
        if not isinstance(regex, str):
            raise ValueError(f"overrides' keys must be regex strings naming tensors, e.g. "
                             f"{{r'\\.fc1\\.': {{'sparsity': 0.5}}}}, got the key {regex!r}")
        regex_list([regex], "overrides")
        if not isinstance(settings, Mapping) or not settings or (
                set(settings) - set(OVERRIDE_KEYS)):
            raise ValueError(f"overrides[{regex!r}] must be a dict with keys from "
                             f"{OVERRIDE_KEYS}, got {settings!r}")
        try:
            pattern = parse_pattern(settings["pattern"]) if "pattern" in settings else None
        except ValueError as error:
            raise ValueError(f"overrides[{regex!r}]: {error}") from error
        sparsity = settings.get("sparsity")
        if sparsity is not None:
            sparsity = check_sparsity(sparsity, f"overrides[{regex!r}]['sparsity']")
        parsed[regex] = LayerOverride(pattern, sparsity)
    return parsed


def check_target(pattern: Pattern | None, sparsity: float | None, where: str) -> None:
    if pattern is not None and pattern.is_nm and sparsity is not None and (
            abs(sparsity - pattern.nm_sparsity) > 1e-9):
        raise ValueError(f"{where}: pattern {pattern.spec!r} implies sparsity "
                         f"{pattern.nm_sparsity:g}; leave sparsity None or set it to that, "
                         f"got {sparsity!r}")


def check_choice(value: Any, name: str, valid: Sequence[Any]) -> None:
    if not any(value is v or (isinstance(v, str) and value == v) for v in valid):
        raise ValueError(f"unknown {name} {value!r}; {did_you_mean(value, valid)}valid: "
                         f"{', '.join(map(repr, valid))}")


def check_tokens(value: Any) -> None:
    """``auto_tokens``: a positive int."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"auto_tokens must be a positive int (the tokens per step, batch x "
                         f"sequence length, that compress='auto' times each layer at), got "
                         f"{value!r}")
