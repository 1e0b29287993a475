"""The plan of a sparse run: one row per weight tensor, decided once.

:class:`SparsityPlan` is what selection (:func:`~sparse_training.engine.selection.plan_tensors`)
decides for a model under a :class:`~sparse_training.config.SparsityConfig`: for every
weight tensor its names, pattern, target and **path** (``masked-dense``, ``compressed``,
``dense``) with the reason. A fit builds it once; compressing layers, checking the
optimizers, the engine, the state check and the setup table all read it. Swapping layers
or sharding them (FSDP2's ``fully_shard``) changes the model's modules and parameters,
not its names: :meth:`SparsityPlan.bound` follows the rows to the tensors the model holds
now without deciding anything again.

Example::

    plan = SparsityPlan.build(model, SparsityConfig(pattern="block:32x32", sparsity=0.5))
    print(plan.table())
    engine = SparsityEngine(model, plan.config, plan=plan)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from sparse_training.config import SparsityConfig
from sparse_training.engine.names import replaced_name, searched_names
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.selection import TensorPlan, plan_tensors
from sparse_training.engine.structure import find_units
from sparse_training.engine.tensors import WeightTensor, find_weight_tensors


@dataclass(frozen=True)
class SparsityPlan:
    """Every weight tensor of a model with what a sparse run does to it.

    Attributes:
        config: the settings it was decided under.
        rows: one :class:`~sparse_training.engine.selection.TensorPlan` per weight tensor,
            in model order.
        tensors: the tensors the rows describe (``rows[i]`` is ``tensors[i]``'s).
    """

    config: SparsityConfig
    rows: tuple[TensorPlan, ...]
    tensors: tuple[WeightTensor, ...]

    @classmethod
    def build(cls, model: nn.Module, config: SparsityConfig) -> SparsityPlan:
        """Decide for every weight tensor of ``model`` under ``config`` (selection's rules,
        :mod:`sparse_training.engine.selection`).

        Raises:
            ValueError: what selection raises (a regex matching nothing, a tensor named by
                ``allow``/``overrides`` that cannot take its pattern, ...).
        """
        tensors = find_weight_tensors(model)
        patterns = [config.parsed_pattern, *(o.pattern for o in config.parsed_overrides.values()
                                             if o.pattern is not None)]
        units = {size: find_units(model, tensors, size)
                 for size in {p.unit_size for p in patterns if p.is_unit}}
        rows = plan_tensors(
            tensors, pattern=config.parsed_pattern, sparsity=config.sparsity,
            layer_types=config.layer_types, allow=config.allow, deny=config.deny,
            dense_ratio=config.dense_ratio, overrides=config.parsed_overrides,
            distribution=config.parsed_distribution, units=units)
        return cls(config, tuple(rows), tuple(tensors))

    def bound(self, model: nn.Module) -> SparsityPlan | None:
        """The plan for ``model`` as it is now, whose layers may have been swapped for
        compressed ones (a selected Linear weight's row becomes its compressed layer's) or
        sharded since the plan was built; None where its weight tensors are no longer the
        plan's (layers built or removed since): build a new plan then."""
        tensors = find_weight_tensors(model)
        by_name = {name: t for t in tensors for name in searched_names(t)}
        rows, bound = [], []
        for row, old in zip(self.rows, self.tensors, strict=True):
            tensor = by_name.get(row.name)
            if tensor is None or len(tensor.names) != len(old.names):
                return None
            now_compressed, was_compressed = (
                any(isinstance(m, CompressedLayer) for m, _ in t.owners) for t in (tensor, old))
            if now_compressed and not was_compressed:
                # swapped since: this plan's (selected) or another selection's
                reason = ("compressed: swapped at setup" if row.selected else
                          f"compressed, another selection's: {row.reason}")
                row = replace(row, names=tensor.names, kind=tensor.kind,
                              shape=tuple(tensor.param.shape), selected=False,
                              compressed=row.selected, reason=reason,
                              path_reason=row.path_reason if row.selected else "")
            elif now_compressed != was_compressed or tensor.names != row.names or (
                    not now_compressed and tensor.param.shape != row.shape):
                return None
            rows.append(row)
            bound.append(tensor)
        if len(bound) != len(tensors) or len({id(t.param) for t in bound}) != len(bound):
            return None
        return SparsityPlan(self.config, tuple(rows), tuple(bound))

    def with_rows(self, rows: Sequence[TensorPlan]) -> SparsityPlan:
        """The same tensors with ``rows`` (one per tensor) instead."""
        return replace(self, rows=tuple(rows))

    @property
    def masked(self) -> list[tuple[TensorPlan, WeightTensor]]:
        """The selected rows (masked-dense) with their tensors."""
        return [(p, t) for p, t in zip(self.rows, self.tensors, strict=True) if p.selected]

    def held_layers(self, model: nn.Module) -> list[tuple[str, CompressedLayer]]:
        """``(module name, layer)`` of each compressed layer of ``model`` whose trained
        tensor the plan holds (:attr:`TensorPlan.compressed`)."""
        held = {id(t.param) for p, t in zip(self.rows, self.tensors, strict=True)
                if p.compressed}
        return [(name, m) for name, m in model.named_modules()
                if isinstance(m, CompressedLayer) and id(getattr(m, m.trained_weight)) in held]

    def held_tensors(self) -> dict[int, str]:
        """The tensors an engine of this plan holds, ``id(parameter) -> name``, a
        compressed layer's by the name of the dense weight it replaced."""
        return {id(t.param): replaced_name(p.name) if p.compressed else p.name
                for p, t in zip(self.rows, self.tensors, strict=True)
                if p.selected or p.compressed}

    def as_state(self) -> list[dict[str, Any]]:
        """The rows a checkpoint keeps to compare plans on resume: name, path, pattern and
        target of every tensor the engine holds."""
        return [{"name": replaced_name(p.name) if p.compressed else p.name, "path": p.path,
                 "pattern": None if p.pattern is None else p.pattern.spec,
                 "sparsity": p.sparsity}
                for p in self.rows if p.selected or p.compressed]

    def table(self) -> str:
        """The setup table: one line per weight tensor, its path, and why."""
        return format_table(self.rows)


def plan_differences(saved: Any, plan: SparsityPlan) -> list[str]:
    """How a checkpoint's plan (:meth:`SparsityPlan.as_state`) differs from ``plan``: a
    tensor on another path (``compress="auto"`` on another device, say), with another
    pattern or target, or held by only one of them; empty if they agree or ``saved`` is not
    a list of rows."""
    if not isinstance(saved, list) or not all(isinstance(r, dict) and "name" in r
                                              for r in saved):
        return []
    before = {r["name"]: r for r in saved}
    now = {r["name"]: r for r in plan.as_state()}
    said = []
    for name in dict.fromkeys([*before, *now]):
        old, new = before.get(name), now.get(name)
        if old is None or new is None:
            where = "the checkpoint" if new is None else "this fit"
            said.append(f"{name!r} is held only in {where}")
        elif (changed := [f"{k} {old.get(k)!r} in the checkpoint, {new[k]!r} now"
                          for k in ("path", "pattern", "sparsity") if old.get(k) != new[k]]):
            reason = next((p.path_reason for p in plan.rows if p.name == name
                           and p.path_reason), "")
            said.append(f"{name!r}: " + ", ".join(changed) + (f" ({reason})" if reason else ""))
    return said


def pattern_label(plan: TensorPlan) -> str:
    """How the tables show a selected tensor's pattern: its spec, or under a unit pattern
    the unit and the block pattern of the tensor's share (``"head (block:64x768)"``)."""
    spec = plan.pattern.spec
    return spec if plan.tie is None else f"{plan.tie.kind} ({spec})"


def format_table(plans: Sequence[TensorPlan]) -> str:
    """The setup table: one line per weight tensor, selected or skipped, and why."""
    lines = []
    for p in plans:
        if not (p.selected or p.compressed) or p.sparsity is None and p.compressed:
            target = density = "-"
        elif p.sparsity is None:
            target = density = "global"
        else:
            target, density = f"{p.sparsity:.4f}", f"{1 - p.sparsity:.4f}"
        spec = "-" if p.pattern is None else pattern_label(p)
        # why it took its path: masked-dense rather than compressed, or auto's times
        reason = p.reason + ("" if not p.path_reason else f"; masked-dense: {p.path_reason}"
                             if p.selected else f"; {p.path_reason}")
        lines.append((p.name, p.kind, "x".join(map(str, p.shape)), spec, target, density,
                      p.path, reason))
    return text_table(("tensor", "type", "shape", "pattern", "sparsity", "density", "path",
                       "decision"), lines)


def text_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """``lines`` of cells in columns aligned under ``header`` and a rule of dashes."""
    lines = [tuple(header), *map(tuple, lines)]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)
