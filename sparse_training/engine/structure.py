"""Where a model's attention heads and FFN neurons are: the units of the ``"head"`` and
``"neuron"`` patterns (:mod:`sparse_training.pieces.units`).

:func:`find_units` walks the modules once and recognizes the layouts of the transformer
families people fine-tune, by the names of their projections (the core imports no model
library):

==================================  ====================================================
attention (query, key, value; out)  families
==================================  ====================================================
``query key value`` + the parent's  BERT, RoBERTa, ELECTRA, ViT (``attention.self`` and
``output.dense``                    ``attention.output.dense``)
``q_proj k_proj v_proj`` +          Llama, Mistral, Qwen, OPT, BART, Whisper, CLIP
``o_proj``/``out_proj``/``dense``   (grouped-query attention: a unit is one key/value
                                    head with its query heads)
``q k v`` + ``o``                   T5
``q_lin k_lin v_lin`` + ``out_lin`` DistilBERT
``query_proj key_proj value_proj``  DeBERTa
+ the parent's ``output.dense``
``c_attn`` + ``c_proj``             GPT-2 (query, key and value side by side in one
                                    ``Conv1D``); GPTBigCode (StarCoder, SantaCoder: its
                                    attention states ``multi_query``) holds each head's
                                    query, key and value in turn
``query_key_value`` + ``dense``     GPT-NeoX/Pythia, BLOOM (each head's query, key and
                                    value in turn in one projection)
``in_proj_weight`` + ``out_proj``   ``torch.nn.MultiheadAttention``
                                    (``nn.TransformerEncoderLayer``)
==================================  ====================================================

FFN neurons: ``intermediate.dense``/``output.dense`` (BERT, ViT), ``gate_proj``,
``up_proj``/``down_proj`` (Llama), ``c_fc``/``c_proj`` (GPT-2), ``wi`` or ``wi_0``,
``wi_1``/``wo`` (T5), ``fc1``/``fc2`` (OPT, BART), ``linear1``/``linear2``
(``nn.TransformerEncoderLayer``), ``lin1``/``lin2`` (DistilBERT), ``w1``, ``w3``/``w2``
(torchtitan's Llama; Mixtral's experts before transformers 5, whose ``MixtralExperts`` holds
each projection of all experts as one 3-D tensor: no neuron layout, see
:func:`~sparse_training.engine.shape_rules.shape_problem`),
``dense_h_to_4h``/``dense_4h_to_h``; the shapes must chain (up rows = down columns).

The head size is the pattern's (``"head:64"``) or the attention module's own
(``head_dim``, ``attention_head_size``, ``key_value_proj_dim``, or the projection's rows
over ``num_heads``/``num_attention_heads``/``n_heads``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from sparse_training.engine.tensors import WeightTensor
from sparse_training.pieces.masks import as_matrix
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.units import COLUMNS, ROWS, UnitTie

SEPARATE_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"),
                ("q_lin", "k_lin", "v_lin"), ("query_proj", "key_proj", "value_proj"))
OUT_NAMES = ("o_proj", "out_proj", "o", "out_lin", "dense")
PARENT_OUT = "output.dense"  # BERT-like: attention.self (query, key, value), attention.output
FUSED_QKV = (("c_attn", "c_proj"),)  # GPT-2: [Q | K | V] in one projection
# an attribute of GPTBigCode's attention, whose c_attn holds [q k v] of each head in turn
# (multi-query: [Q | k | v], whose shapes do not chain: no unit is found)
INTERLEAVED_MARK = "multi_query"
# GPT-NeoX/Pythia, BLOOM: [q k v] of each head in turn, in one projection
INTERLEAVED_QKV = (("query_key_value", "dense"),)
FFN_NAMES = ((("intermediate.dense",), "output.dense"), (("gate_proj", "up_proj"), "down_proj"),
             (("up_proj",), "down_proj"), (("c_fc",), "c_proj"), (("wi_0", "wi_1"), "wo"),
             (("wi",), "wo"), (("fc1",), "fc2"), (("linear1",), "linear2"),
             (("lin1",), "lin2"), (("w1", "w3"), "w2"), (("dense_h_to_4h",), "dense_4h_to_h"))
HEAD_SIZE_ATTRIBUTES = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
HEADS_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_heads", "n_head")
LAYOUTS = ("BERT/RoBERTa/ViT (query, key, value; attention.output.dense)",
           "Llama/OPT/BART (q_proj, k_proj, v_proj; o_proj or out_proj)", "T5 (q, k, v, o)",
           "DistilBERT (q_lin, k_lin, v_lin, out_lin)", "GPT-2/GPTBigCode (c_attn, c_proj)",
           "GPT-NeoX/BLOOM (query_key_value, dense)",
           "torch.nn.MultiheadAttention (in_proj_weight, out_proj)")

Units = dict[str, dict[str, UnitTie]]  # kind ("head", "neuron") -> tensor name -> tie


def find_units(model: nn.Module, tensors: Sequence[WeightTensor],
               head_size: int | None = None) -> Units:
    """The heads and neurons of ``model``: for each member weight tensor (by every name of
    it), its :class:`~sparse_training.pieces.units.UnitTie`.

    Args:
        model: the model.
        tensors: its weight tensors (:func:`~sparse_training.engine.tensors.find_weight_tensors`).
        head_size: the head size to use (a ``"head:D"`` pattern's), or None for each
            attention module's own.

    Raises:
        ValueError: a ``head_size`` that does not divide an attention module's projections,
            or an attention module whose head size cannot be read (name it: ``"head:D"``).
    """
    views = {}
    for tensor in tensors:
        view = tuple(as_matrix(tensor.param.detach(), tensor.input_dim).shape) if (
            tensor.param.dim() >= 2) else None
        views.update(dict.fromkeys(tensor.names, view))
    units: Units = {"head": {}, "neuron": {}}
    for name, module in model.named_modules():
        for members in _attention(name, module, views, head_size):
            units["head"].update(members)
        if (members := _ffn(name, module, views)) is not None:
            units["neuron"].update(members)
    return units


def _weight(prefix: str, path: str) -> str:
    return f"{prefix}.{path}.weight" if prefix else f"{path}.weight"


def _attention(name: str, module: nn.Module, views: dict[str, tuple | None],
               head_size: int | None
               ) -> Iterator[dict[str, UnitTie]]:
    """The head ties of ``module`` if it is an attention module of a known layout."""
    if isinstance(module, nn.MultiheadAttention) and module._qkv_same_embed_dim:
        fused = f"{name}.in_proj_weight" if name else "in_proj_weight"
        yield from _heads(name, module, views, head_size, (fused,), _weight(name, "out_proj"),
                          fused=True)
        return
    for qkv in SEPARATE_QKV:
        weights = tuple(_weight(name, n) for n in qkv)
        if not all(views.get(w) for w in weights):
            continue
        out = next((_weight(name, n) for n in OUT_NAMES if views.get(_weight(name, n))), None)
        parent = name.rpartition(".")[0]
        if out is None and name and views.get(_weight(parent, PARENT_OUT)):
            out = _weight(parent, PARENT_OUT)
        if out is not None:
            yield from _heads(name, module, views, head_size, weights, out, fused=False)
        return
    for layout, interleaved in ((FUSED_QKV, False), (INTERLEAVED_QKV, True)):
        for qkv, out in layout:
            fused, out = _weight(name, qkv), _weight(name, out)
            if views.get(fused) and views.get(out):
                yield from _heads(name, module, views, head_size, (fused,), out, fused=True,
                                  interleaved=interleaved or hasattr(module, INTERLEAVED_MARK))
                return


def _heads(name: str, module: nn.Module, views: dict[str, tuple | None],
           head_size: int | None, projections: tuple[str, ...], out: str, fused: bool,
           interleaved: bool = False) -> Iterator[dict[str, UnitTie]]:
    """The ties of one attention module's query/key/value ``projections`` (one fused, or
    three) and output projection ``out``; nothing when the shapes do not chain. A fused
    projection holds ``[Q | K | V]`` (GPT-2), or with ``interleaved`` each head's ``[q k v]``
    in turn (GPT-NeoX: one band of three head sizes a head)."""
    rows = [views[p][0] for p in projections]
    width = rows[0] // 3 if fused else rows[0]  # the query projection's outputs
    if (fused and rows[0] % 3) or views[out][1] != width:
        return
    size = head_size or own_head_size(module, width)
    where = f"attention {name or 'model'!r}"
    if size is None:
        raise ValueError(f"{where}: cannot read its head size (none of the attributes "
                         f"{', '.join(HEAD_SIZE_ATTRIBUTES + HEADS_ATTRIBUTES)}); give it in "
                         f"the pattern, e.g. 'head:64'")
    kv_rows = width if fused else rows[1]
    if width % size or kv_rows % size or (not fused and rows[2] != kv_rows):
        given = f"pattern 'head:{size}'" if head_size else f"its head size {size}"
        raise ValueError(f"{where}: {given} does not divide its query projection's {width} "
                         f"and key/value projections' {kv_rows} outputs into whole heads")
    heads, units = width // size, kv_rows // size
    if heads % units:
        raise ValueError(f"{where}: {heads} query heads do not share {units} key/value "
                         f"heads evenly")
    group = size * heads // units  # query rows per unit (grouped-query attention: > size)
    ties = {}
    if interleaved:  # [q k v] of head 0, of head 1, ... (heads of the module's own size)
        ties[projections[0]] = _interleaved_tie(name, units, size,
                                                own_head_size(module, width) or size, width)
    elif fused:  # [Q | K | V]: three bands per head
        ties[projections[0]] = UnitTie(name, "head", units, ROWS, size, tuple(range(units)) * 3)
    else:
        ties[projections[0]] = UnitTie(name, "head", units, ROWS, group, tuple(range(units)))
        for kv in projections[1:]:
            ties[kv] = UnitTie(name, "head", units, ROWS, size, tuple(range(units)))
    ties[out] = UnitTie(name, "head", units, COLUMNS, group, tuple(range(units)))
    yield ties


def _interleaved_tie(name: str, units: int, size: int, own: int, width: int) -> UnitTie:
    """The tie of a projection holding ``[q k v]`` of each of its own heads (of ``own``
    features) in turn, for units of ``size`` features: whole heads are one band of their
    query, key and value; a part of a head (``"head:D"``, D dividing ``own``) is a band in
    each of its query, key and value.

    Raises:
        ValueError: ``size`` neither a multiple nor a divisor of ``own``.
    """
    if size % own == 0:
        return UnitTie(name, "head", units, ROWS, 3 * size, tuple(range(units)))
    if own % size:
        raise ValueError(f"attention {name or 'model'!r}: pattern 'head:{size}' splits its "
                         f"heads of {own} (query, key and value in turn in one projection) "
                         f"unevenly; give 'head:D' with D a divisor or a multiple of {own}")
    parts = own // size
    return UnitTie(name, "head", units, ROWS, size, tuple(
        head * parts + part for head in range(width // own) for _ in range(3)
        for part in range(parts)))


def own_head_size(module: nn.Module, width: int) -> int | None:
    """The head size an attention module states, or its query outputs over its heads."""
    config = getattr(module, "config", None)
    for source in (module, config):
        for attribute in HEAD_SIZE_ATTRIBUTES:
            value = getattr(source, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
        for attribute in HEADS_ATTRIBUTES:
            heads = getattr(source, attribute, None)
            if isinstance(heads, int) and heads > 0 and width % heads == 0:
                return width // heads
    return None


def _ffn(name: str, module: nn.Module, views: dict[str, tuple | None]
         ) -> dict[str, UnitTie] | None:
    """The neuron ties of ``module`` if it holds an FFN of a known layout whose shapes
    chain (every up projection's rows are the down projection's columns, and back)."""
    for ups, down in FFN_NAMES:
        up_weights = [_weight(name, u) for u in ups]
        down_weight = _weight(name, down)
        if not all(views.get(w) for w in (*up_weights, down_weight)):
            continue
        neurons, width = views[up_weights[0]]
        if any(views[u] != (neurons, width) for u in up_weights) or (
                views[down_weight] != (width, neurons)):
            return None
        ties = {u: UnitTie(name, "neuron", neurons, ROWS, 1, tuple(range(neurons)))
                for u in up_weights}
        ties[down_weight] = UnitTie(name, "neuron", neurons, COLUMNS, 1, tuple(range(neurons)))
        return ties
    return None


def tie_of(names: Sequence[str], pattern: Pattern, units: Units | None) -> UnitTie | None:
    """The tie of the tensor named ``names`` under the unit ``pattern``, or None where it is
    no member of a recognized block of that unit."""
    ties = (units or {}).get(pattern.unit, {})
    return next((ties[n] for n in names if n in ties), None)


def not_a_member(pattern: Pattern) -> str:
    """Why a tensor does not take the unit ``pattern``."""
    if pattern.unit == "head":
        return (f"pattern {pattern.spec!r} prunes whole heads: not a query, key, value or "
                f"output projection of a recognized attention layout")
    return (f"pattern {pattern.spec!r} prunes whole FFN neurons: not an up, gate or down "
            f"projection of a recognized FFN layout")


def check_unit_rows(rows: Sequence[Any], patterns: Sequence[Pattern]) -> None:
    """Selection's rows under unit patterns (``TensorPlan``\\ s: ``selected``, ``tie``,
    ``sparsity``, ``reason``, ``name``): a unit pattern some tensor asked for must find
    units in the model, and the selected members of one block must share one target.

    Raises:
        ValueError: naming the pattern and the recognized layouts, or the block and its
            members' targets.
    """
    for pattern in patterns:
        if not pattern.is_unit:
            continue
        wanted = any(not row.selected and row.reason == not_a_member(pattern) for row in rows)
        if wanted and not any(row.selected and row.tie is not None
                              and row.tie.kind == pattern.unit for row in rows):
            layouts = "; ".join(LAYOUTS) if pattern.unit == "head" else ", ".join(
                "/".join((*ups, down)) for ups, down in FFN_NAMES)
            raise ValueError(f"pattern {pattern.spec!r} found no {pattern.unit} in the model: "
                             f"no module of a recognized layout ({layouts}); use a block "
                             f"pattern, or deny these tensors")
    targets: dict[str, dict[str, float | None]] = {}
    for row in rows:
        if row.selected and row.tie is not None:
            targets.setdefault(row.tie.group, {})[row.name] = row.sparsity
    for group, members in targets.items():
        if len(set(members.values())) > 1:
            shown = ", ".join(f"{name}: {target}" for name, target in members.items())
            raise ValueError(f"block {group!r} prunes whole units across its tensors, which "
                             f"need one target; they got {shown}: give them one sparsity (an "
                             f"override matching them all)")
