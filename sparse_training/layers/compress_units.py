"""Which head and neuron groups train as physically smaller layers, and with which units.

A group of tied tensors (one attention module's heads, one FFN's neurons;
:mod:`sparse_training.pieces.units`) shrinks all together or not at all: the query, key and
value projections output only the kept heads' features, so the output projection must read
only those (:class:`~sparse_training.layers.slim.SlimLinear`). A group shrinks when every
member the model has (:func:`~sparse_training.engine.structure.find_units`) is a selected,
swappable ``nn.Linear`` (units are fixed from the first step: the settings refuse
regrowth of units), and, for
heads, when the attention module's ``forward`` infers the head count from the projections'
shapes (BERT, ViT, Llama, BART) or reads it from int attributes (:data:`HEAD_COUNTS`:
OPT's ``num_heads``, GPT-2's ``split_size``), which are scaled to the kept heads while the
heads are removed (:func:`~sparse_training.layers.slim.sync_head_counts`); T5's relative
attention bias per head keeps its heads masked-dense, as does any other tensor sized by the
heads (OLMo-2's and Cohere's query/key norms, StableLM's per-head norms, DeBERTa's
``pos_key_proj``). The kept units are the ones the masked-dense engine keeps at step 0 (the
same score and ranking, :func:`~sparse_training.pieces.units.unit_masks`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Sequence

from torch import Tensor, nn

from sparse_training.engine.plan import SparsityPlan
from sparse_training.engine.selection import TensorPlan
from sparse_training.engine.structure import find_units, own_head_size
from sparse_training.layers.slim import DENSE_HEAD_COUNTS
from sparse_training.pieces.masks import as_matrix, kept_count
from sparse_training.pieces.units import ROWS, UnitTie, unit_masks

# attributes an attention forward may read the head count from, which a slim layer changes
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_key_value_heads",
               "all_head_size", "inner_dim", "split_size")

# the norms of the query and key features some attention modules hold (Qwen3, OLMo-2, ...)
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm",
            "key_layernorm")

Entry = tuple[int, TensorPlan, "str | None", nn.Module]  # (stream index, row, reason, module)


def _counts_read(attention: nn.Module) -> list[str]:
    """The :data:`HEAD_COUNTS` that ``attention``'s ``forward`` reads (``self.<name>`` in its
    source or in the source of the methods of its own it calls, as Persimmon's
    ``self._split_heads`` reads ``self.num_heads``).

    Raises:
        OSError, TypeError: the source cannot be read.
    """
    cls, read, todo, seen = type(attention), set(), ["forward"], set()
    while todo:
        seen.add(name := todo.pop())
        names = set(re.findall(r"self\.(\w+)", inspect.getsource(getattr(cls, name))))
        read |= names
        todo += [n for n in names - seen if inspect.isfunction(getattr(cls, n, None))]
    return sorted(read & set(HEAD_COUNTS))


def head_counts(attention: nn.Module, names: list[str] | None = None) -> dict[str, int]:
    """The head counts that ``attention``'s ``forward`` reads (or ``names`` of them), with
    their values (an attribute that is no int is left out: :func:`heads_problem` refuses
    it)."""
    return {name: value for name in (_counts_read(attention) if names is None else names)
            if isinstance(value := getattr(attention, name, None), int)}


def heads_problem(attention: nn.Module, kept: int, units: int, band: int, width: int,
                  members: Collection[str] = ()) -> str | None:
    """Why the heads of ``attention`` cannot shrink to ``kept`` of its ``units``, or None:
    a unit (``band`` key/value features of the ``width`` query outputs) is not whole heads
    of the module's own size (``"head:D"`` with D no multiple of it: the slimmer module
    would split the kept features into heads of its own size across units), its
    ``forward`` cannot be read, reads a head count that is not an int attribute or that
    ``kept / units`` does not scale to a whole number, the module holds a relative
    attention bias per head (T5: layer 0's bias serves every layer), its forward takes
    an ALiBi bias (BLOOM: the model builds it for every head of its config), or it holds
    another tensor sized by its heads (:func:`_per_head_tensor`; ``members``: the names of
    its projections in it, which shrink)."""
    kind = type(attention).__name__
    if hasattr(attention, "relative_attention_bias") or hasattr(
            attention, "has_relative_attention_bias"):
        return f"{kind} has a relative attention bias per head, shared across layers"
    try:
        alibi = "alibi" in inspect.signature(attention.forward).parameters
    except (TypeError, ValueError):
        alibi = False
    if alibi:  # BLOOM: the model builds one ALiBi slope per head of its config
        return f"{kind}.forward takes an ALiBi bias that the model builds for all its heads"
    own = own_head_size(attention, width)
    if own is None:
        return (f"{kind}'s own head size cannot be read, so units of {band} features "
                f"cannot be checked to be whole heads")
    if band % own:
        return (f"units of {band} features split {kind}'s heads of {own}, which a slimmer "
                f"module would regroup; removing whole heads takes 'head' or 'head:D' with "
                f"D a multiple of {own}")
    if tensor := _per_head_tensor(attention, members, {units, width // own},
                                  {width, band * units}, own):
        return (f"{kind}.{tensor} is sized by all its heads: with some removed it would "
                f"serve the kept heads' features as if they were all")
    try:
        read = _counts_read(attention)
    except (OSError, TypeError):
        return f"the source of {kind}.forward cannot be read to check how it counts heads"
    counts = head_counts(attention, read)
    if other := [name for name in read if name not in counts]:
        return f"{kind}.forward reads self.{other[0]}, which is not an int head count"
    if odd := [name for name, value in counts.items() if value * kept % units]:
        return f"{kind}.{odd[0]} = {counts[odd[0]]} does not scale to {kept} of {units} heads"
    return None


def _per_head_tensor(attention: nn.Module, members: Collection[str], heads: set[int],
                     widths: set[int], size: int) -> str | None:
    """The first tensor of ``attention`` outside its projections ``members`` that is sized
    by its ``heads`` (query and key/value head counts) or their features (``widths``), or
    None: a dimension of one per head (Cohere's query norm, ``(heads, size)``), a module
    list of one per head (StableLM's per-head norms), a query or key norm wider than one
    head of ``size`` (OLMo-2's, over every head's features), or another projection into
    the heads' features (DeBERTa's ``pos_key_proj`` without shared keys)."""
    def inside_member(name: str) -> bool:
        return any(name == m or name.startswith(f"{m}.") for m in members)

    for name, child in attention.named_modules():
        if not name or inside_member(name):
            continue
        if isinstance(child, nn.ModuleList) and len(child) in heads:
            return name
        if isinstance(child, nn.Linear) and child.weight.shape[0] in widths:
            return f"{name}.weight"
    for name, param in attention.named_parameters():
        owner = name.rpartition(".")[0]
        if not inside_member(owner) and (set(param.shape) & heads or (
                owner in QK_NORMS and param.numel() > size)):
            return name
    return None


def record_head_counts(model: nn.Module, groups: set[str]) -> None:
    """Keep each attention module's own head counts (of ``groups``, the names of those
    whose heads are being removed) for :func:`~sparse_training.layers.slim.sync_head_counts`
    (once: a record already there holds the dense counts)."""
    for group in groups:
        attention = model.get_submodule(group)
        if not hasattr(attention, DENSE_HEAD_COUNTS) and (counts := head_counts(attention)):
            setattr(attention, DENSE_HEAD_COUNTS, counts)


def shrinkable_units(model: nn.Module, plan: SparsityPlan, entries: Sequence[Entry],
                     score: Callable[[Tensor, int], Tensor | None]
                     ) -> dict[str, tuple[str | None, Tensor | None]]:
    """For each unit-tied row of ``entries``: ``(None, band grid)`` where its group shrinks
    (the grid is True at the kept bands, ``(bands, 1)`` for row bands and ``(1, bands)`` for
    column bands), or ``(why it stays masked-dense, None)``.

    Args:
        entries: the selected rows with their stream index, the reason a row cannot swap
            already known (or None) and its module.
        score: the score of a weight at step 0 given its stream index (None: ``|w|``).
    """
    tied = [e for e in entries if e[1].tie is not None]
    groups: dict[str, list[Entry]] = {}
    for entry in tied:
        groups.setdefault(entry[1].tie.group, []).append(entry)
    decided: dict[str, tuple[str | None, Tensor | None]] = {}
    members_of = _members(model, plan, [g[0][1].tie for g in groups.values()])
    ready: list[list[Entry]] = []
    for group, rows in groups.items():
        why = _group_problem(model, group, rows, members_of[group])
        if why is None:
            ready.append(rows)
        else:
            decided.update({row.name: (why, None) for _, row, _, _ in rows})
    by_target: dict[float, list[Entry]] = {}
    for rows in ready:
        by_target.setdefault(rows[0][1].sparsity, []).extend(rows)
    for target, rows in by_target.items():
        weights = [module.weight for _, _, _, module in rows]
        scores = [score(w, index) for w, (index, _, _, _) in zip(weights, rows, strict=True)]
        masks = unit_masks([w.detach() for w in weights], [r.tie for _, r, _, _ in rows], target,
                           None if any(s is None for s in scores) else scores,
                           [r.input_dim for _, r, _, _ in rows])
        for (_, row, _, _), mask in zip(rows, masks, strict=True):
            decided[row.name] = (None, _band_grid(as_matrix(mask, row.input_dim), row.tie))
    return decided


def _members(model: nn.Module, plan: SparsityPlan, ties: Sequence[UnitTie]
             ) -> dict[str, set[str]]:
    """Every member weight name of each group of ``ties``, as the model has them (by name:
    the head size only sets the bands, so the model's own serves, else the group's
    smallest band)."""
    members: dict[str, set[str]] = {}
    found: dict[str, dict[str, UnitTie]] = {}
    for tie in ties:
        if tie.kind not in found:
            try:
                found[tie.kind] = find_units(model, plan.tensors)[tie.kind]
            except ValueError:  # no head size of its own: the bands' serves
                found[tie.kind] = {}
        units = found[tie.kind]
        if not any(t.group == tie.group for t in units.values()):
            units = find_units(model, plan.tensors, tie.size)[tie.kind]
        members[tie.group] = {name for name, t in units.items() if t.group == tie.group}
    return members


def _group_problem(model: nn.Module, group: str, rows: Sequence[Entry],
                   members: set[str]) -> str | None:
    """Why the group of ``rows`` cannot shrink, or None."""
    kind = rows[0][1].tie.kind
    where = f"{kind}s of {group or 'the model'!r}"
    if blocked := next(((row.name, why) for _, row, why, _ in rows if why is not None), None):
        return f"{where} shrink together, and {blocked[0]} cannot: {blocked[1]}"
    named = {name for _, row, _, _ in rows for name in row.names}
    if missing := sorted(members - named):
        return f"{where} shrink together, and {missing[0]} is not selected"
    tie, target = rows[0][1].tie, rows[0][1].sparsity or 0.0
    if tie.kept_blocks(target) >= len(tie.of_block):
        return f"{where}: sparsity {target:g} prunes no {kind}"
    if {row.tie.axis for _, row, _, _ in rows} != {0, 1}:
        return f"{where}: no projection on both sides of the units"
    if kind == "head":  # key/value bands: a unit's head size; query bands: its group's
        sizes = [row.tie.size for _, row, _, _ in rows if row.tie.axis == ROWS]
        inside = {name[len(group) + 1:].rpartition(".")[0] if group else name.rpartition(".")[0]
                  for name in members if name.startswith(f"{group}.") or not group}
        return heads_problem(model.get_submodule(group), kept_count(tie.units, target),
                             tie.units, min(sizes), max(sizes) * tie.units, inside)
    return None


def _band_grid(mask: Tensor, tie: UnitTie) -> Tensor:
    """The kept bands of a member's 2-D mask ``(out, in)`` as its band grid (module doc)."""
    along = mask if tie.axis == ROWS else mask.T
    kept = along.reshape(len(tie.of_block), -1).any(1)
    return kept.view(-1, 1) if tie.axis == ROWS else kept.view(1, -1)

