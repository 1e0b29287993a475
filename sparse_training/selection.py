"""Selection: which weight tensors get masks, with what pattern and target, and why.

:func:`plan_tensors` decides for every weight-like tensor of the model
(:func:`sparse_training.tensors.find_weight_tensors`: any parameter of two or more
dimensions, tied ones once), in this order:

1. **type**: a tensor is eligible when a module owning it is one of ``layer_types``;
2. ``deny``: a regex found in any of the tensor's names keeps it dense;
3. ``allow``: when given, only tensors with a name matching one of them;
4. ``overrides``: the first regex matching a name sets the pattern and/or sparsity
   (explicit per-tensor settings win over the next two rules);
5. ``dense_ratio``: the first fraction of the eligible *blocks* stays dense, a block
   being the repeated unit that owns the tensor (the name up to its first numeric part:
   ``encoder.layer.0`` for BERT, ``net.2`` in a ``Sequential``);
6. **shape**: a tensor whose 2-D view cannot take its pattern, or an N:M tensor with fewer
   outputs than M (a task head, such as a 2-output QA head), stays dense; a tensor named
   by ``allow`` or ``overrides`` raises instead.

Regexes are searched (``re.search``) in the qualified tensor names, e.g.
``bert.encoder.layer.0.attention.self.query.weight``; every regex must match some
weight-like tensor. The result is a list of :class:`TensorPlan`, the setup table's rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from sparse_training.distributions import PER_LAYER
from sparse_training.masks import as_matrix
from sparse_training.patcher import COMPRESSED_LAYERS
from sparse_training.patterns import Pattern
from sparse_training.tensors import WeightTensor, find_weight_tensors

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

DEFAULT_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, nn.RNNBase)


@dataclass(frozen=True)
class LayerOverride:
    """Per-tensor settings from ``overrides``; None fields follow the model-wide ones."""

    pattern: Pattern | None = None
    sparsity: float | None = None


@dataclass(frozen=True)
class TensorPlan:
    """One row of the setup table.

    Attributes:
        names: every qualified name of the tensor (several when tied); ``name`` is the first.
        kind: class of the module owning it.
        shape: the tensor's shape.
        selected: whether the tensor gets a mask.
        reason: why it is selected or skipped.
        pattern: the tensor's pattern (selected tensors).
        sparsity: final target; None under the global distribution.
    """

    names: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]
    selected: bool
    reason: str
    pattern: Pattern | None = None
    sparsity: float | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def block_of(name: str) -> str:
    """The repeated unit a tensor belongs to: its name up to the first all-digit part
    (``bert.encoder.layer.3.attention.self.query.weight`` -> ``bert.encoder.layer.3``),
    or its module's name when there is none."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def _first_match(regexes: Sequence[str], names: Sequence[str]) -> str | None:
    return next((r for r in regexes if any(re.search(r, n) for n in names)), None)


def _check_every_regex_matches(kind: str, regexes: Sequence[str], names: list[str]) -> None:
    for regex in regexes:
        if not any(re.search(regex, n) for n in names):
            shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"{kind} regex {regex!r} matches no weight tensor; they are: "
                             f"{shown or 'none'} (regexes are searched in these names)")


def _final_sparsity(pattern: Pattern, sparsity: float | None) -> float | None:
    return pattern.nm_sparsity if pattern.is_nm else sparsity


def _shape_problem(tensor: WeightTensor, pattern: Pattern) -> str | None:
    return pattern.shape_error(*as_matrix(tensor.param).shape)


def _head_problem(tensor: WeightTensor, pattern: Pattern) -> str | None:
    outputs = tensor.param.shape[0]
    if pattern.is_nm and outputs < pattern.m:
        return (f"{outputs} outputs < M = {pattern.m}: a task head? name it in allow or "
                f"overrides to prune it")
    return None


def plan_tensors(
    tensors: Sequence[WeightTensor],
    *,
    pattern: Pattern,
    sparsity: float | None,
    layer_types: tuple[type[nn.Module], ...] = DEFAULT_LAYER_TYPES,
    allow: Sequence[str] = (),
    deny: Sequence[str] = (),
    dense_ratio: float = 0.0,
    overrides: Mapping[str, LayerOverride] | None = None,
    distribution: str = "uniform",
) -> list[TensorPlan]:
    """Decide, for every weight tensor, whether and how it is masked (module docstring).

    Raises:
        ValueError: an ``allow``, ``deny`` or ``overrides`` regex that matches no weight
            tensor, or a tensor named by ``allow``/``overrides`` that cannot take its
            pattern.
    """
    overrides = dict(overrides or {})
    all_names = [n for t in tensors for n in t.names]
    _check_every_regex_matches("allow", allow, all_names)
    _check_every_regex_matches("deny", deny, all_names)
    _check_every_regex_matches("overrides", list(overrides), all_names)

    def row(tensor: WeightTensor, selected: bool, reason: str, layer_pattern=None,
            target=None) -> TensorPlan:
        if len(tensor.names) > 1:
            reason += f" (tied: {', '.join(tensor.names[1:])})"
        return TensorPlan(tensor.names, tensor.kind, tuple(tensor.param.shape), selected,
                          reason, layer_pattern, target)

    rows: list[TensorPlan | None] = []
    eligible: list[int] = []
    for tensor in tensors:
        if any(isinstance(module, COMPRESSED_LAYERS) for module, _ in tensor.owners):
            rows.append(row(tensor, False, f"compressed: {tensor.kind} holds its own "
                                           f"sparsity"))
        elif not any(isinstance(module, layer_types) for module, _ in tensor.owners):
            rows.append(row(tensor, False, f"type {tensor.kind} not in layer_types"))
        elif (regex := _first_match(deny, tensor.names)) is not None:
            rows.append(row(tensor, False, f"deny {regex!r}"))
        elif allow and _first_match(allow, tensor.names) is None:
            rows.append(row(tensor, False, "matches no allow regex"))
        else:
            eligible.append(len(rows))
            rows.append(None)

    blocks = list(dict.fromkeys(block_of(tensors[i].name) for i in eligible))
    dense_blocks = set(blocks[: math.floor(dense_ratio * len(blocks) + 0.5)])
    following: list[int] = []  # selected tensors that take the model-wide target
    for index in eligible:
        tensor = tensors[index]
        override_regex = _first_match(list(overrides), tensor.names)
        override = overrides.get(override_regex, LayerOverride())
        layer_pattern = override.pattern or pattern
        named = override_regex is not None or _first_match(allow, tensor.names) is not None
        if override_regex is None and block_of(tensor.name) in dense_blocks:
            rows[index] = row(tensor, False, f"dense_ratio {dense_ratio}: block "
                              f"{block_of(tensor.name)!r} is one of the first "
                              f"{len(dense_blocks)} of {len(blocks)} blocks")
        elif override.sparsity == 0.0:
            rows[index] = row(tensor, False, f"override {override_regex!r}: sparsity 0")
        elif (problem := _shape_problem(tensor, layer_pattern)) and named:
            raise ValueError(f"tensor {tensor.name!r} (shape {tuple(tensor.param.shape)}) was "
                             f"asked for by name but cannot take pattern "
                             f"{layer_pattern.spec!r}: {problem}")
        elif problem:
            rows[index] = row(tensor, False, f"shape cannot take {layer_pattern.spec!r}: "
                                             f"{problem}")
        elif not named and (problem := _head_problem(tensor, layer_pattern)):
            rows[index] = row(tensor, False, problem)
        elif override_regex is not None:
            target = sparsity if override.sparsity is None else override.sparsity
            rows[index] = row(tensor, True, f"override {override_regex!r}", layer_pattern,
                              _final_sparsity(layer_pattern, target))
        else:
            following.append(index)
            rows[index] = row(tensor, True, "selected", layer_pattern,
                              _final_sparsity(layer_pattern, sparsity))

    if following and not pattern.is_nm:
        if distribution in PER_LAYER:
            targets = PER_LAYER[distribution]([rows[i].shape for i in following], sparsity)
        else:  # "global": one threshold at every update, no fixed per-tensor value
            targets = [None] * len(following)
        for index, target in zip(following, targets, strict=True):
            old = rows[index]
            rows[index] = TensorPlan(old.names, old.kind, old.shape, True,
                                     old.reason.replace("selected", f"selected ({distribution})",
                                                        1), old.pattern, target)
    return rows


def plan_model(model: nn.Module, config: SparsityConfig
               ) -> tuple[list[WeightTensor], list[TensorPlan]]:
    """The weight tensors of ``model`` and their plans under ``config``'s selection."""
    tensors = find_weight_tensors(model)
    return tensors, plan_tensors(
        tensors, pattern=config.parsed_pattern, sparsity=config.sparsity,
        layer_types=config.layer_types, allow=config.allow, deny=config.deny,
        dense_ratio=config.dense_ratio, overrides=config.parsed_overrides,
        distribution=config.distribution)


def format_table(plans: Sequence[TensorPlan]) -> str:
    """The setup table: one line per weight tensor, selected or skipped, and why."""
    header = ("tensor", "type", "shape", "pattern", "sparsity", "density", "decision")
    lines = [header]
    for p in plans:
        if not p.selected:
            target = density = "-"
        elif p.sparsity is None:
            target = density = "global"
        else:
            target, density = f"{p.sparsity:.4f}", f"{1 - p.sparsity:.4f}"
        lines.append((p.name, p.kind, "x".join(map(str, p.shape)),
                      p.pattern.spec if p.pattern else "-", target, density, p.reason))
    widths = [max(len(r[c]) for r in lines) for c in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)
