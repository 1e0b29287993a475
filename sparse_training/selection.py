"""Layer selection: which weights get masks, with what pattern and target, and why.

:func:`plan_layers` walks ``model.named_modules()`` once and decides for every candidate
(a module of ``layer_types``, or any module owning a weight of two or more dimensions), in
this order: type, ``deny``, ``allow``, ``overrides`` (explicit per-layer settings win over
the next rule), ``dense_ratio`` (the first fraction of the eligible layers stays dense), and
shape (a layer whose shape cannot take its pattern is skipped, or an error when a name rule
asked for it). The result is a list of :class:`LayerPlan`, the setup table's rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from sparse_training.distributions import PER_LAYER
from sparse_training.masks import as_matrix
from sparse_training.patterns import Pattern

DEFAULT_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LayerOverride:
    """Per-layer settings from ``overrides``; None fields follow the model-wide ones."""

    pattern: Pattern | None = None
    sparsity: float | None = None


@dataclass(frozen=True)
class LayerPlan:
    """One row of the setup table.

    Attributes:
        name: qualified module name (``model.named_modules()``).
        kind: the module's class name.
        shape: the weight's shape.
        selected: whether the weight gets a mask.
        reason: why it is selected or skipped.
        pattern: the layer's pattern (selected layers).
        sparsity: final target; None under the global distribution.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    selected: bool
    reason: str
    pattern: Pattern | None = None
    sparsity: float | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _first_match(patterns: Sequence[str], name: str) -> str | None:
    return next((p for p in patterns if re.search(p, name)), None)


def _unmatched_error(kind: str, regex: str, names: Sequence[str]) -> ValueError:
    shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
    return ValueError(f"{kind} regex {regex!r} matches no layer; layers are: {shown}")


def _final_sparsity(pattern: Pattern, sparsity: float | None) -> float | None:
    return pattern.nm_sparsity if pattern.is_nm else sparsity


def plan_layers(
    model: nn.Module,
    *,
    pattern: Pattern,
    sparsity: float | None,
    layer_types: tuple[type[nn.Module], ...] = DEFAULT_LAYER_TYPES,
    allow: Sequence[str] | None = None,
    deny: Sequence[str] | None = None,
    dense_ratio: float = 0.0,
    overrides: Mapping[str, LayerOverride] | None = None,
    distribution: str = "uniform",
) -> list[LayerPlan]:
    """Decide, for every candidate layer of ``model``, whether and how it is masked.

    Raises:
        ValueError: an ``allow`` or ``overrides`` regex that matches no candidate layer, or
            a layer named by one whose shape cannot take its pattern.
    """
    allow, deny, overrides = list(allow or []), list(deny or []), dict(overrides or {})
    candidates = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, layer_types) or (
                      isinstance(getattr(module, "weight", None), nn.Parameter)
                      and module.weight.dim() >= 2)]
    names = [name for name, _ in candidates]
    for regex in allow:
        if not any(re.search(regex, n) for n in names):
            raise _unmatched_error("allow", regex, names)
    for regex in overrides:
        if not any(re.search(regex, n) for n in names):
            raise _unmatched_error("overrides", regex, names)

    rows: list[LayerPlan | None] = []
    eligible: list[int] = []
    for name, module in candidates:
        shape = tuple(module.weight.shape)
        kind = type(module).__name__
        if not isinstance(module, layer_types):
            rows.append(LayerPlan(name, kind, shape, False, f"type {kind} not in layer_types"))
        elif (regex := _first_match(deny, name)) is not None:
            rows.append(LayerPlan(name, kind, shape, False, f"deny {regex!r}"))
        elif allow and _first_match(allow, name) is None:
            rows.append(LayerPlan(name, kind, shape, False, "matches no allow regex"))
        else:
            eligible.append(len(rows))
            rows.append(None)

    n_dense = math.floor(dense_ratio * len(eligible) + 0.5)
    following: list[int] = []  # selected layers that take the model-wide target
    for rank, index in enumerate(eligible):
        name, module = candidates[index]
        shape, kind = tuple(module.weight.shape), type(module).__name__
        override_regex = _first_match(list(overrides), name)
        override = overrides.get(override_regex, LayerOverride())
        layer_pattern = override.pattern or pattern
        if override_regex is None and rank < n_dense:
            rows[index] = LayerPlan(name, kind, shape, False,
                                    f"dense_ratio {dense_ratio}: first {n_dense} of "
                                    f"{len(eligible)} eligible layers stay dense")
        elif override.sparsity == 0.0:
            rows[index] = LayerPlan(name, kind, shape, False,
                                    f"override {override_regex!r}: sparsity 0")
        elif problem := layer_pattern.shape_error(*as_matrix(module.weight).shape):
            if override_regex is not None or _first_match(allow, name) is not None:
                raise ValueError(f"layer {name!r} (weight {shape}) was asked for by name but "
                                 f"cannot take pattern {layer_pattern.spec!r}: {problem}")
            rows[index] = LayerPlan(name, kind, shape, False,
                                    f"shape cannot take {layer_pattern.spec!r}: {problem}")
        elif override_regex is not None:
            target = sparsity if override.sparsity is None else override.sparsity
            rows[index] = LayerPlan(name, kind, shape, True, f"override {override_regex!r}",
                                    layer_pattern, _final_sparsity(layer_pattern, target))
        else:
            following.append(index)
            rows[index] = LayerPlan(name, kind, shape, True, "selected", layer_pattern,
                                    _final_sparsity(layer_pattern, sparsity))

    if following and not pattern.is_nm:
        if distribution in PER_LAYER:
            targets = PER_LAYER[distribution]([rows[i].shape for i in following], sparsity)
        else:  # "global": one threshold at every update, no fixed per-layer value
            targets = [None] * len(following)
        for index, target in zip(following, targets, strict=True):
            row = rows[index]
            rows[index] = LayerPlan(row.name, row.kind, row.shape, True,
                                    f"selected ({distribution})", row.pattern, target)
    return rows


def format_table(plans: Sequence[LayerPlan]) -> str:
    """The setup table: one line per candidate layer, selected or skipped, and why."""
    header = ("layer", "type", "shape", "pattern", "sparsity", "density", "decision")
    lines = [header]
    for p in plans:
        if not p.selected:
            target = density = "-"
        elif p.sparsity is None:
            target = density = "global"
        else:
            target, density = f"{p.sparsity:.4f}", f"{1 - p.sparsity:.4f}"
        lines.append((p.name or "<root>", p.kind, "x".join(map(str, p.shape)),
                      p.pattern.spec if p.pattern else "-", target, density, p.reason))
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)
