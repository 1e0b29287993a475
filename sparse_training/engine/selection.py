"""Selection: which weight tensors get masks, with what pattern and target, and why.

:func:`plan_tensors` decides for every weight-like tensor of the model
(:func:`sparse_training.engine.tensors.find_weight_tensors`: any parameter of two or more
dimensions, tied ones once), in this order:

1. **type**: a tensor is eligible when a module owning it is one of ``layer_types`` (the
   default types take Hugging Face's ``Conv1D`` too: GPT-2's layers);
2. ``deny``: a regex found in any of the tensor's names keeps it dense;
3. ``allow``: when given, only tensors with a name matching one of them;
4. ``overrides``: the first regex matching a name sets the pattern and/or sparsity
   (explicit per-tensor settings win over the next two rules); the names of a tied tensor
   must agree on one setting;
5. ``dense_ratio``: the first fraction of the eligible *blocks* stays dense, a block
   being the repeated unit that owns the tensor (the name up to its first numeric part:
   ``encoder.layer.0`` for BERT, ``net.2`` in a ``Sequential``; a module outside any, a
   task head or a pooler, is one block; a tied tensor counts in the first repeated unit
   among its names, else as its last name's module: GPT-2's ``wte``/``lm_head`` as the
   head, after the layers); compressed layers that rules 1-3 would leave eligible count as
   the blocks they are in, so the same blocks stay dense before and after compression;
6. **units**: under a unit pattern (``"head"``, ``"neuron"``) a tensor is selected when it
   is a member of a recognized attention or FFN block
   (:func:`~sparse_training.engine.structure.find_units`): it takes the block pattern of
   its share, tied to the other selected members of its block, which must share one
   target;
7. **shape**: a tensor stays dense when its 2-D view cannot take its N:M pattern (block
   patterns take any shape, the last blocks overhanging), when it has three or more
   dimensions, a pattern other than unstructured and an owner that is not a convolution
   (stacked MoE experts: which dimension is the input is not known), or when its target
   keeps none of its blocks; so does a task head: fewer outputs than M under N:M (a
   2-output QA head), fewer rows than the block under a block pattern. A tensor named by
   ``allow`` or ``overrides`` raises instead for the first three, and is pruned for the
   last.

Regexes are searched (``re.search``) in the qualified tensor names, e.g.
``bert.encoder.layer.0.attention.self.query.weight`` (a compressed layer's tensor also
under the name of the weight it replaced:
:func:`~sparse_training.engine.names.searched_names`); every regex must match some
weight-like tensor, every ``allow`` and ``overrides`` regex one that rules 1-3 leave
eligible (or a compressed layer's), and every ``overrides`` regex one that no earlier
override takes. A compressed layer is this selection's (``TensorPlan.compressed``: its
engine holds it) where rules 1-3 reach it as the ``nn.Linear`` it replaced; one they leave
out belongs to another selection, so callbacks with disjoint selections each hold their
own. The result is a list of :class:`TensorPlan`, the setup table's rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn

from sparse_training.config import DEFAULT_LAYER_TYPES, LayerOverride
from sparse_training.engine.names import block_of, searched_names, unit_of
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.shape_rules import (
    empty_problem,
    head_problem,
    layout_problem,
    shape_problem,
)
from sparse_training.engine.structure import (
    Units,
    check_unit_rows,
    not_a_member,
    tie_of,
)
from sparse_training.engine.tensors import WeightTensor, is_conv1d
from sparse_training.pieces.distributions import DISTRIBUTIONS, Distribution, Uniform
from sparse_training.pieces.masks import as_matrix, block_grid
from sparse_training.pieces.patterns import Pattern, parse_pattern
from sparse_training.pieces.units import UnitTie


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
        input_dim: where the tensor stores its input dimension (1: ``(out, in, ...)``, 0:
            ``(in, out, ...)``, HF ``Conv1D``), which its masks group along.
        tie: under a unit pattern, the tensor's share of its heads or neurons (``pattern``
            is then the block pattern of that share), else None.
        compressed: a compressed layer's tensor that rules 1-3 reach as they would the
            ``nn.Linear`` it replaced: the engine holds it (the layer keeps its own
            sparsity); one outside them is another selection's.
        path_reason: why a selected tensor trains masked-dense rather than compressed, or
            a compressed one's measured times under ``compress="auto"`` (set by
            ``compress``), else empty.
    """

    names: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]
    selected: bool
    reason: str
    pattern: Pattern | None = None
    sparsity: float | None = None
    input_dim: int = 1
    tie: UnitTie | None = None
    compressed: bool = False
    path_reason: str = ""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def path(self) -> str:
        """How the tensor trains: ``"masked-dense"`` (selected), ``"compressed"`` (a
        compressed layer's, its engine holds it) or ``"dense"``."""
        return "masked-dense" if self.selected else "compressed" if self.compressed else "dense"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def block_count(self) -> int:
        """The blocks of its pattern in the tensor's 2-D view (overhanging ones included):
        what a block target's kept count rounds (a selected tensor's)."""
        cols = self.shape[self.input_dim]
        return math.prod(block_grid(self.numel // cols, cols, self.pattern))


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


def _setting(regex: str | None, overrides: Mapping[str, LayerOverride], pattern: Pattern,
             sparsity: float | None, distribution: Distribution
             ) -> tuple[str, float | str | None]:
    """The (pattern, final target) a name gets from override ``regex`` (None: model-wide)."""
    if regex is None:
        uniform = pattern.is_nm or isinstance(distribution, Uniform)
        return pattern.spec, (_final_sparsity(pattern, sparsity) if uniform
                              else distribution.name)
    override = overrides[regex]
    layer_pattern = override.pattern or pattern
    if override.sparsity == 0.0:  # kept dense, whatever the pattern
        return layer_pattern.spec, 0.0
    target = sparsity if override.sparsity is None else override.sparsity
    return layer_pattern.spec, _final_sparsity(layer_pattern, target)


def _tensor_override(tensor: WeightTensor, overrides: Mapping[str, LayerOverride],
                     pattern: Pattern, sparsity: float | None, distribution: Distribution
                     ) -> tuple[str | None, set[str]]:
    """The override regex that sets ``tensor`` (the first matching any name, None if none)
    and every regex matching one of its names first.

    Raises:
        ValueError: the names of a tied tensor get different settings (one mask covers
            them all), naming both names and both settings.
    """
    by_name = {name: _first_match(list(overrides), [name]) for name in tensor.names}
    settings = {name: _setting(regex, overrides, pattern, sparsity, distribution)
                for name, regex in by_name.items()}

    def said(name: str) -> str:
        regex, (spec, target) = by_name[name], settings[name]
        where = "the model-wide setting" if regex is None else f"overrides[{regex!r}]"
        return f"{name!r} takes {where}: pattern {spec!r}, sparsity {target}"

    first, *others = tensor.names
    for other in others:
        if settings[other] != settings[first]:
            every = "|".join(tensor.names)
            raise ValueError(
                f"tied tensor (one Parameter, one mask) gets two settings: {said(first)}; "
                f"{said(other)}. Give its names one setting: an override whose regex matches "
                f"every name (e.g. {every!r}), or deny the tensor")
    used = {regex for regex in by_name.values() if regex is not None}
    return _first_match(list(overrides), tensor.names), used


def _check_regexes_reach(kind: str, regexes: Sequence[str], tensors: Sequence[WeightTensor],
                         rows: Sequence[TensorPlan | None], reached: set[int],
                         used: set[str] | None = None) -> None:
    """Every ``allow``/``overrides`` regex must match a tensor that rules 1-3 leave eligible
    or that is compressed (``reached``), and (``used`` given) every override regex matching
    an eligible tensor must set one.

    Raises:
        ValueError: naming the regex and why the tensors it matches are not reached.
    """
    for regex in regexes:
        matched = [i for i, t in enumerate(tensors)
                   if any(re.search(regex, n) for n in searched_names(t))]
        if not reached.intersection(matched):
            shown = "; ".join(f"{tensors[i].name!r} ({rows[i].reason})" for i in matched[:4])
            raise ValueError(f"{kind} regex {regex!r} matches only tensors that earlier rules "
                             f"skip: {shown}{'; ...' if len(matched) > 4 else ''}. Widen "
                             f"layer_types, narrow deny/allow, or remove the regex")
        eligible = [tensors[i] for i in matched if rows[i] is None]
        if used is not None and eligible and regex not in used:
            earlier = _first_match(list(regexes), eligible[0].names)
            raise ValueError(f"overrides regex {regex!r} never applies: every eligible tensor "
                             f"it matches (e.g. {eligible[0].name!r}) takes the earlier "
                             f"override {earlier!r} (the first matching regex wins); put "
                             f"{regex!r} first or narrow {earlier!r}")


def _compressed_outside(tensor: WeightTensor, layer_types: tuple[type[nn.Module], ...],
                        allow: Sequence[str], deny: Sequence[str]) -> str | None:
    """Why rules 1-3 leave a compressed layer's tensor out, judged as the ``nn.Linear`` it
    replaced (its type, and its dense weight's name beside its own), or None."""
    names = searched_names(tensor)
    if not any(isinstance(module, layer_types) for module, _ in tensor.owners) and not (
            issubclass(nn.Linear, layer_types)):
        return "type Linear not in layer_types"
    if (regex := _first_match(deny, names)) is not None:
        return f"deny {regex!r}"
    if allow and _first_match(allow, names) is None:
        return "matches no allow regex"
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
    distribution: Distribution = DISTRIBUTIONS["uniform"],
    units: Mapping[int | None, Units] | None = None,
) -> list[TensorPlan]:
    """Decide, for every weight tensor, whether and how it is masked (module docstring).

    ``units`` are the model's heads and neurons (:func:`~sparse_training.engine.structure.
    find_units`) by the head size of the unit patterns in use (None: the model's own).

    Raises:
        ValueError: an ``allow``, ``deny`` or ``overrides`` regex that matches no weight
            tensor, an ``allow``/``overrides`` regex that reaches no eligible one or (an
            override) is taken over by an earlier one, tied names given different
            settings, a tensor named by ``allow``/``overrides`` that cannot take its
            pattern or would keep no block, a unit pattern that finds no unit, or the
            members of one unit block given different targets; all before anything
            changes.
    """
    overrides = dict(overrides or {})
    all_names = [n for t in tensors for n in searched_names(t)]
    _check_every_regex_matches("allow", allow, all_names)
    _check_every_regex_matches("deny", deny, all_names)
    _check_every_regex_matches("overrides", list(overrides), all_names)

    def row(tensor: WeightTensor, selected: bool, reason: str, layer_pattern=None,
            target=None, tie=None) -> TensorPlan:
        if len(tensor.names) > 1:
            reason += f" (tied: {', '.join(tensor.names[1:])})"
        return TensorPlan(tensor.names, tensor.kind, tuple(tensor.param.shape), selected,
                          reason, layer_pattern, target, tensor.input_dim, tie)

    conv1d = layer_types == DEFAULT_LAYER_TYPES  # the default types take HF's Conv1D too
    rows: list[TensorPlan | None] = []
    eligible: list[int] = []
    compressed: set[int] = set()  # compressed tensors rules 1-3 reach (as at the swap)
    counted: list[int] = []  # the blocks of dense_ratio: eligible, or compressed and reached
    for tensor in tensors:
        if any(isinstance(module, CompressedLayer) for module, _ in tensor.owners):
            if outside := _compressed_outside(tensor, layer_types, allow, deny):
                rows.append(row(tensor, False, f"compressed, another selection's: {outside}"))
                continue
            counted.append(len(rows))
            compressed.add(len(rows))
            spec, target = _setting(_first_match(list(overrides), searched_names(tensor)),
                                    overrides, pattern, sparsity, distribution)
            rows.append(replace(row(tensor, False, f"compressed: {tensor.kind} holds its own "
                                                   f"sparsity"), compressed=True,
                                pattern=parse_pattern(spec),
                                sparsity=None if isinstance(target, str) else target))
        elif not any(isinstance(module, layer_types) or (conv1d and is_conv1d(module))
                     for module, _ in tensor.owners):
            rows.append(row(tensor, False, f"type {tensor.kind} not in layer_types"))
        elif tensor.param.numel() == 0:
            rows.append(row(tensor, False, "empty: no entries to prune"))
        elif (regex := _first_match(deny, tensor.names)) is not None:
            rows.append(row(tensor, False, f"deny {regex!r}"))
        elif allow and _first_match(allow, tensor.names) is None:
            rows.append(row(tensor, False, "matches no allow regex"))
        else:
            eligible.append(len(rows))
            counted.append(len(rows))
            rows.append(None)
    reached = compressed.union(eligible)
    _check_regexes_reach("allow", allow, tensors, rows, reached)
    settings = {i: _tensor_override(tensors[i], overrides, pattern, sparsity, distribution)
                for i in eligible}
    _check_regexes_reach("overrides", list(overrides), tensors, rows, reached,
                         set().union(*(used for _, used in settings.values())))

    # the same blocks before and after compression, in model order; a tied tensor counted
    # as a later name's module (an LM head) comes after the rest, as that module does
    block = {i: block_of(tensors[i]) for i in range(len(tensors))}
    later = {i for i in counted  # counted under another name than its first
             if block[i] != (unit_of(tensors[i].name) or tensors[i].name.rpartition(".")[0])}
    blocks = list(dict.fromkeys(block[i] for i in sorted(counted, key=lambda i: (i in later, i))))
    dense_blocks = set(blocks[: math.floor(dense_ratio * len(blocks) + 0.5)])
    following: list[int] = []  # selected tensors that take the model-wide target
    named: set[int] = set()
    for index in eligible:
        tensor = tensors[index]
        override_regex = settings[index][0]
        override = overrides.get(override_regex, LayerOverride())
        layer_pattern = override.pattern or pattern
        if override_regex is not None or _first_match(allow, tensor.names) is not None:
            named.add(index)
        if override_regex is None and block[index] in dense_blocks:
            rows[index] = row(tensor, False, f"dense_ratio {dense_ratio}: block "
                              f"{block[index]!r} is one of the first "
                              f"{len(dense_blocks)} of {len(blocks)} blocks")
        elif override.sparsity == 0.0:
            rows[index] = row(tensor, False, f"override {override_regex!r}: sparsity 0")
        elif layer_pattern.is_unit:
            tie = tie_of(tensor.names, layer_pattern, (units or {}).get(layer_pattern.unit_size))
            if tie is None and index in named:
                raise ValueError(f"tensor {tensor.name!r} was asked for by name but "
                                 f"{not_a_member(layer_pattern)}")
            target = sparsity if override.sparsity is None else override.sparsity
            rows[index] = row(tensor, False, not_a_member(layer_pattern)) if tie is None else (
                row(tensor, True, f"override {override_regex!r}" if override_regex else
                    f"selected ({tie.kind} of {tie.group})",
                    tie.block_pattern(as_matrix(tensor.param, tensor.input_dim).shape),
                    target, tie))
        elif problem := layout_problem(tensor, layer_pattern):
            raise ValueError(problem)
        elif (problem := shape_problem(tensor, layer_pattern)) and index in named:
            raise ValueError(f"tensor {tensor.name!r} (shape {tuple(tensor.param.shape)}) was "
                             f"asked for by name but cannot take pattern "
                             f"{layer_pattern.spec!r}: {problem}")
        elif problem:
            rows[index] = row(tensor, False, f"shape cannot take {layer_pattern.spec!r}: "
                                             f"{problem}")
        elif index not in named and (problem := head_problem(tensor, layer_pattern)):
            rows[index] = row(tensor, False, problem)
        elif override_regex is not None:
            target = sparsity if override.sparsity is None else override.sparsity
            rows[index] = row(tensor, True, f"override {override_regex!r}", layer_pattern,
                              _final_sparsity(layer_pattern, target))
        else:
            following.append(index)
            rows[index] = row(tensor, True, "selected", layer_pattern,
                              _final_sparsity(layer_pattern, sparsity))

    check_unit_rows([rows[i] for i in eligible], [pattern, *(
        o.pattern for o in overrides.values() if o.pattern is not None)])
    if following and not pattern.is_nm:
        targets = distribution([rows[i].shape for i in following], sparsity)
        for index, target in zip(following, targets, strict=True):
            rows[index] = replace(rows[index], sparsity=target, reason=rows[index].reason.replace(
                "selected", f"selected ({distribution.name})", 1))
    for index in eligible:
        plan = rows[index]
        if plan.selected and (problem := empty_problem(
                plan.pattern, plan.sparsity, plan.block_count if plan.tie is None else
                plan.tie.units, None if plan.tie is None else plan.tie.kind)):
            if index in named:
                fix = "" if plan.tie is not None else " or use smaller blocks"
                raise ValueError(f"tensor {rows[index].name!r} (shape {rows[index].shape}) "
                                 f"was asked for by name but {problem}; lower its "
                                 f"sparsity{fix}")
            rows[index] = row(tensors[index], False, problem)
    return rows
