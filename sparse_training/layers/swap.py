"""Swap a model's ``nn.Linear`` layers for compressed ones and back, in place.

:func:`sparsify` takes rules, a mapping from a regex to ``{"pattern": "block:RxC",
"sparsity": s}`` (or ``"density": d`` instead of ``"sparsity"``) for a
:class:`BlockSparseLinear`, or ``{"pattern": "2:4"}`` (or ``"2:4:2d"``) for a
:class:`~sparse_training.layers.semi_structured.SemiStructuredLinear`. Regexes are searched
(``re.search``) in the qualified module names (``bert.encoder.layer.0.output.dense``); the
first matching rule wins and every regex must match some ``nn.Linear``. Each matching
Linear is replaced by ``from_dense`` (the largest blocks by L2 norm; the magnitude 2:4
mask), except where a swap would change what the model computes:

* ``out_proj`` of ``nn.MultiheadAttention``, which reads ``out_proj.weight`` itself;
* a weight or bias tied to another parameter (the same ``Parameter`` under two names);
* parametrized weights (``torch.nn.utils.parametrize``), Linears with hooks, and
  subclasses that override ``forward``;
* a Linear the rule cannot make sparse: a block rule whose kept count rounds up to every
  block of the weight (``block:64x64`` on a 32x16 weight keeps its one block at any
  sparsity), or a 2:4 rule on features that are not multiples of 4. A rule that compresses
  none of the Linears it matches for these reasons is an error.

Everything is validated, and every new layer built, before the first swap.
:func:`densify` swaps every compressed layer back with ``to_dense``.

Neither swaps the layers of a model that an attached
:class:`~sparse_training.engine.SparsityEngine` trains (:func:`hold_for_training`): its
optimizer and mask updates would go on with the replaced tensors.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from sparse_training.engine.ownership import check_not_in_training
from sparse_training.engine.plan import text_table
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.sharding import local
from sparse_training.engine.slots import MASK_SUFFIX
from sparse_training.engine.tensors import is_conv1d
from sparse_training.kernels.block_sparse import block_grid
from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.layers.blocks import blocks_kept, check_block, check_density
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.layers.slim import sync_head_counts
from sparse_training.pieces.masks import check_sparsity
from sparse_training.pieces.patterns import Pattern, parse_pattern

RULE_KEYS = ("pattern", "sparsity", "density")

def _parse_rule(regex: str, rule: Any) -> tuple[Pattern, tuple[int, int] | None, float]:
    """A rule's ``(pattern, block, density)`` (block None for 2:4).

    Raises:
        ValueError: naming the rule and its bad key or value.
    """
    if not isinstance(rule, Mapping):
        raise ValueError(f"rule {regex!r} must be a dict with keys {RULE_KEYS}, got {rule!r}")
    unknown = sorted(set(rule) - set(RULE_KEYS), key=str)
    if unknown:
        raise ValueError(f"rule {regex!r}: unknown key(s) {unknown}; valid keys: "
                         f"'pattern' and one of 'sparsity', 'density'")
    if "pattern" not in rule:
        raise ValueError(f"rule {regex!r} has no 'pattern' (a block pattern, e.g. "
                         f"'block:64x64')")
    try:
        pattern = parse_pattern(rule["pattern"])
    except ValueError as err:
        raise ValueError(f"rule {regex!r}: {err}") from None
    if pattern.is_2_4:
        if rule.get("sparsity", 0.5) != 0.5 or rule.get("density", 0.5) != 0.5:
            raise ValueError(f"rule {regex!r}: 2:4 keeps half the weights; leave out "
                             f"'sparsity' and 'density' (or give 0.5), got {dict(rule)!r}")
        return pattern, None, 0.5
    if not pattern.spec.startswith("block:") or pattern.is_nm:
        raise ValueError(f"rule {regex!r}: pattern {pattern.spec!r} is neither a block pattern "
                         f"nor 2:4; 'block:RxC' (R, C each one of 16, 32, 64, 128), '2:4' and "
                         f"'2:4:2d' compress")
    try:
        block = check_block((pattern.block_rows, pattern.block_cols))
    except ValueError as err:
        raise ValueError(f"rule {regex!r}, pattern {pattern.spec!r}: {err}") from None
    if ("sparsity" in rule) == ("density" in rule):
        raise ValueError(f"rule {regex!r} must give exactly one of 'sparsity' in [0, 1) and "
                         f"'density' in (0, 1], got {dict(rule)!r}")
    if "density" in rule:
        try:
            return pattern, block, check_density(rule["density"])
        except ValueError as err:
            raise ValueError(f"rule {regex!r}: {err}") from None
    return pattern, block, 1.0 - check_sparsity(rule["sparsity"], f"rule {regex!r}: sparsity")


def swap_checker(model: nn.Module) -> Callable[[str, nn.Linear], str | None]:
    """``problem(name, linear)``: why swapping that Linear of ``model`` would change what
    the model computes, or None (module names and ties read once)."""
    parents = dict(model.named_modules())
    names_of: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(param_name)
    return functools.partial(_swap_problem, parents=parents, names_of=names_of)


def _swap_problem(name: str, module: nn.Linear, parents: dict[str, nn.Module],
                  names_of: dict[int, list[str]]) -> str | None:
    if not name:
        return "skipped: the root module cannot be swapped in place (use from_dense)"
    parent_name, _, attr = name.rpartition(".")
    if isinstance(parents[parent_name], nn.MultiheadAttention) and attr == "out_proj":
        return "skipped: nn.MultiheadAttention reads out_proj.weight, not out_proj's forward"
    if type(module).forward is not nn.Linear.forward and not is_conv1d(module):
        return f"skipped: {type(module).__name__} overrides nn.Linear.forward"
    if parametrize.is_parametrized(module):
        return (f"skipped: parametrized {', '.join(module.parametrizations)} "
                f"(a swap would drop the parametrization)")
    hooks = [kind for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                               "_backward_hooks") if getattr(module, kind)]
    if hooks:
        return f"skipped: has {', '.join(h.strip('_') for h in hooks)} (a swap would drop them)"
    for attr in ("weight", "bias"):
        param = module._parameters.get(attr)
        if param is not None and len(names_of[id(param)]) > 1:
            others = [n for n in names_of[id(param)] if n != f"{name}.{attr}"]
            return f"skipped: {attr} tied to {', '.join(others)}"
    return None


@dataclass(frozen=True)
class SwapRow:
    """One module's line in a swap table: the compressed layer it becomes, or why not.

    Attributes:
        name: the module's qualified name.
        shape: its weight's shape.
        rule: what asked for the swap: a :func:`sparsify` regex, or the pattern of a tensor
            selected under ``compress``; None when nothing did.
        decision: ``"compressed"``, or why not.
        layer: the compressed layer that replaces the module, None where it stays.
    """

    name: str
    shape: tuple[int, ...]
    rule: str | None
    decision: str
    layer: CompressedLayer | None = None

    def as_dict(self) -> dict[str, Any]:
        """``name``, ``shape``, ``rule``, ``block``, ``density`` (kept blocks / all blocks;
        the kept share of a layer of other kinds: 0.5 for 2:4, kept bands for heads and
        neurons) and ``nnz`` (None unless block-compressed), ``decision``."""
        blocks = isinstance(self.layer, BlockSparseLinear)
        return {"name": self.name, "shape": self.shape, "rule": self.rule,
                "block": self.layer.block if blocks else None,
                "density": None if self.layer is None else self.layer.density if blocks
                else 1.0 - self.layer.sparsity, "nnz": self.layer.nnz if blocks else None,
                "decision": self.decision}


def format_swaps(rows: Sequence[SwapRow]) -> str:
    """The swap table: one aligned line per module, compressed or not, and why."""
    lines = []
    for row in map(SwapRow.as_dict, rows):
        lines.append((row["name"] or "(root)", "x".join(map(str, row["shape"])),
                      "-" if row["rule"] is None else repr(row["rule"]),
                      "x".join(map(str, row["block"])) if row["block"] else "-",
                      "-" if row["density"] is None else f"{row['density']:.4f}",
                      "-" if row["nnz"] is None else str(row["nnz"]), row["decision"]))
    return text_table(("module", "shape", "rule", "block", "density", "nnz", "decision"), lines)


def swap_in(model: nn.Module, rows: Sequence[SwapRow]) -> None:
    """Put each row's compressed layer where its module is (every check done before)."""
    for row in rows:
        if row.layer is not None:
            replace_module(model, row.name, row.layer)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


def _linear_names(model: nn.Module, names: Sequence[str]) -> str:
    """The names rules are searched in, and the compressed layers, which they skip."""
    shown = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
    text = f"their names are: {shown or 'none'} (regexes are searched in these names)"
    if compressed := [n for n, m in model.named_modules() if isinstance(m, CompressedLayer)]:
        text += (f"; compressed already: {', '.join(repr(n) for n in compressed[:8])}"
                 f"{', ...' if len(compressed) > 8 else ''} (densify them first)")
    return text


def sparsify(model: nn.Module, rules: Mapping[str, Mapping[str, Any]], *,
             verbose: bool = True) -> list[dict]:
    """Replace the ``nn.Linear`` layers that ``rules`` name by compressed layers (module
    docstring), in place.

    Returns:
        One dict per ``nn.Linear`` of the model: ``name``, ``shape`` (out, in), ``rule``
        (the matching regex or None), ``block``, ``density`` (kept blocks / all blocks) and
        ``nnz`` (None unless compressed), and ``decision`` ("compressed", or why not).
        With ``verbose`` the rows are printed as a table.

    Raises:
        ValueError: a bad rule (not a dict, unknown key, pattern other than ``block:RxC``,
            a block entry other than 16, 32, 64, 128, both or neither of sparsity and
            density, a value out of range), a regex that does not compile or matches no
            ``nn.Linear``, a rule that can make none of its Linears sparse. Raised before
            anything is swapped.
        RuntimeError: ``model`` is being trained by an attached engine.
    """
    _check_model(model, "sparsify")
    check_not_in_training(model, "sparsify")
    if not isinstance(rules, Mapping) or not rules:
        raise ValueError(f"rules must be a non-empty dict of regex -> {{'pattern': "
                         f"'block:RxC', 'sparsity' or 'density': value}}, got {rules!r}")
    if "pattern" in rules and not isinstance(rules["pattern"], Mapping):
        raise ValueError(f"rules map a regex of module names to a rule; got one rule, "
                         f"{dict(rules)!r}: name the Linears it is for, e.g. "
                         f"{{'.': {dict(rules)!r}}} for all of them")
    parsed = {regex: _parse_rule(regex, rule) for regex, rule in rules.items()}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for regex in parsed:
        try:
            matched = any(re.search(regex, n) for n, _ in linears)
        except (re.error, TypeError) as err:
            raise ValueError(f"rule regex {regex!r} is not a valid regex: {err}") from None
        if not matched:
            raise ValueError(f"rule regex {regex!r} matches no nn.Linear; "
                             f"{_linear_names(model, [n for n, _ in linears])}")

    if meta := [n for n, m in linears if m.weight.is_meta
                and any(re.search(r, n) for r in parsed)]:
        raise ValueError(f"sparsify: {meta} are on the meta device: a layer keeps the blocks "
                         f"or 2:4 groups its weights' values choose; initialize the weights "
                         f"first (build the model on its device, or to_empty and "
                         f"reset_parameters), nothing was swapped")
    swap_problem = swap_checker(model)
    rows = []
    won = dict.fromkeys(parsed, 0)  # Linears each rule is the first match of
    not_sparse: dict[str, list[str]] = {regex: [] for regex in parsed}
    for name, module in linears:
        regex = next((r for r in parsed if re.search(r, name)), None)
        shape = (module.out_features, module.in_features)
        if regex is None:
            rows.append(SwapRow(name, shape, None, "matches no rule"))
            continue
        won[regex] += 1
        if (reason := swap_problem(name, module)) is not None:
            rows.append(SwapRow(name, shape, regex, reason))
        elif isinstance(layer := _compressed(module, parsed[regex], rules[regex]), str):
            rows.append(SwapRow(name, shape, regex, f"skipped: {layer}"))
            not_sparse[regex].append(f"{name}: {layer}")
        else:
            rows.append(SwapRow(name, shape, regex, "compressed", layer.train(module.training)))
    for regex, reasons in not_sparse.items():
        if reasons and len(reasons) == won[regex]:
            raise ValueError(f"rule {regex!r} can make none of the Linears it matches sparse "
                             f"(nothing was swapped):\n  " + "\n  ".join(reasons))
    swap_in(model, rows)
    if verbose:
        print(format_swaps(rows))
    return [row.as_dict() for row in rows]


def _compressed(linear: nn.Linear, parsed: tuple[Pattern, tuple[int, int] | None, float],
                rule: Mapping[str, Any]) -> BlockSparseLinear | SemiStructuredLinear | str:
    """``linear`` compressed under a parsed rule, or why the rule cannot make it sparse: a
    2:4 layer refusing its shape, or a block layer keeping every block although the rule
    asks to prune (``kept_count`` rounds to whole blocks and keeps at least one)."""
    pattern, block, density = parsed
    if block is None:
        try:
            return SemiStructuredLinear.from_dense(linear, pattern.transposable)
        except ValueError as err:  # features that are not multiples of 4
            return f"{pattern.spec}: {err}"
    shape = (linear.out_features, linear.in_features)
    grid = block_grid(*shape, block)
    try:
        blocks_kept(grid, density, shape, block)
    except ValueError:  # the rule prunes, but rounding keeps every block
        asked = "sparsity" if "sparsity" in rule else "density"
        return nothing_pruned(shape, block, f"{asked} {rule[asked]}")
    return BlockSparseLinear.from_dense(linear, block, density=density)


def nothing_pruned(shape: tuple[int, int], block: tuple[int, int], asked: str) -> str:
    """Why a ``shape`` weight in ``block`` blocks stays as it is although the setting
    ``asked`` ("sparsity 0.02") prunes: rounded to whole blocks, it keeps every one."""
    (rows, cols), (r, c) = block_grid(*shape, block), block
    blocks = rows * cols
    where = (f"block {r}x{c} covers the whole {shape[0]}x{shape[1]} weight" if blocks == 1
             else f"the {shape[0]}x{shape[1]} weight has {blocks} blocks of {r}x{c}")
    return (f"{where}: {asked} keeps {blocks} of {blocks} blocks (nothing pruned; use "
            f"smaller blocks or a higher sparsity)")


def _check_model(model: Any, what: str) -> None:
    """Raise ``ValueError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what} takes the model (an nn.Module) whose layers it swaps, got "
                         f"{type(model).__name__}")


def densify(model: nn.Module) -> int:
    """Replace every compressed layer of ``model`` (``BlockSparseLinear``,
    ``SemiStructuredLinear``, ``SlimLinear``) by its ``to_dense()`` ``nn.Linear`` (or
    ``Conv1D``), in place; a layer shared under several names stays shared, and the head
    counts an attention module reads are restored. Returns how many were replaced.

    Raises:
        ValueError: ``model`` itself is a compressed layer (call its ``to_dense``).
        RuntimeError: ``model`` is being trained by an attached engine.
    """
    _check_model(model, "densify")
    if isinstance(model, CompressedLayer):
        raise ValueError(f"densify swaps submodules in place; for a {type(model).__name__} "
                         f"itself call model.to_dense()")
    check_not_in_training(model, "densify")
    dense: dict[int, nn.Linear] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, CompressedLayer):
            if id(module) not in dense:
                dense[id(module)] = module.to_dense().train(module.training)
            replace_module(model, name, dense[id(module)])
    sync_head_counts(model)  # heads that SlimLinear layers removed: their counts back
    return len(dense)


def make_permanent(model: nn.Module) -> nn.Module:
    """Remove the mask buffers and swap compressed layers back to ``nn.Linear``
    (:func:`densify`), for inference or hand-off (a later fit
    starts from fresh masks). Returns ``model``.

    A mask in force has zero weights at every pruned position (the engine keeps them so);
    its buffer goes, the zeros stay. A mask that is not in force, left by an earlier fit on
    a tensor trained dense since, goes without touching the weights.

    Raises:
        RuntimeError: an engine attached to an optimizer trains ``model`` (mid-fit): call
            it after the fit (the callback detaches then) or after ``engine.detach()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_permanent takes a torch.nn.Module, got {type(model).__name__}")
    check_not_in_training(model, "make_permanent")
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                param = module._parameters.get(name.removesuffix(MASK_SUFFIX))
                if (name.endswith(MASK_SUFFIX) and param is not None and buffer is not None
                        and buffer.dtype == torch.bool and buffer.shape == local(param).shape):
                    del module._buffers[name]
    densify(model)
    return model
