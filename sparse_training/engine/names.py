"""The names a selection reads a weight tensor by: the names its regexes are searched in
(a compressed layer's tensor also under the dense weight it replaced) and the repeated unit
(``dense_ratio``'s block) that owns it."""

from __future__ import annotations

from sparse_training.engine.protocol import CompressedLayer
from sparse_training.engine.tensors import WeightTensor


def unit_of(name: str) -> str | None:
    """The repeated unit that owns tensor ``name``: its name up to the first all-digit part
    (``bert.encoder.layer.3.attention.self.query.weight`` -> ``bert.encoder.layer.3``), or
    None outside any."""
    parts = name.split(".")
    digit = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return None if digit is None else ".".join(parts[: digit + 1])


def block_of(tensor: WeightTensor) -> str:
    """The ``dense_ratio`` block of a (possibly tied) tensor: the first repeated unit among
    its names (:func:`unit_of`), else its last name's module (a task head, a pooler: one
    block each), so that an embedding tied to an LM head counts as the head (``lm_head``),
    a block after the layers."""
    units = [unit for unit in map(unit_of, tensor.names) if unit is not None]
    return units[0] if units else tensor.names[-1].rpartition(".")[0]


def searched_names(tensor: WeightTensor) -> tuple[str, ...]:
    """The names regexes are searched in: the tensor's, and for a compressed layer's
    trained tensor also the name of the weight it replaced (``...query.weight`` beside
    ``...query.values``), so that one setting selects the same tensors before and after
    compression."""
    if not any(isinstance(module, CompressedLayer) for module, _ in tensor.owners):
        return tensor.names
    return tuple(dict.fromkeys(tensor.names + tuple(map(replaced_name, tensor.names))))


def replaced_name(name: str) -> str:
    """The name of the dense weight a compressed layer's tensor ``name`` replaced
    (``encoder.query.values`` -> ``encoder.query.weight``)."""
    return ".".join(filter(None, (name.rpartition(".")[0], "weight")))
