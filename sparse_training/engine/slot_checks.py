"""Why a selected tensor cannot be masked, or a compressed layer trained: one function per
mechanism of torch or another library that would undo or bypass a mask, each returning the
problem (a sentence) or None. The engine runs them all before it changes anything:
:func:`masked_problem` on its masked-dense slots, :func:`compressed_problem` on its
compressed ones, then :func:`ownership_problem` on every slot."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils.weight_norm import WeightNorm

from sparse_training.engine import ownership
from sparse_training.engine.protocol import Slot
from sparse_training.engine.slots import MaskedSlot
from sparse_training.engine.tensors import original_class, zeros_problem


def _on_meta(slot: MaskedSlot) -> str | None:
    if slot.param.is_meta:
        return ("is on the meta device: materialize the model (to_empty() and initialize "
                "it) before masks are made")
    return None


def _foreign_mask(slot: MaskedSlot) -> str | None:
    problem = slot.existing_mask_problem()
    return None if problem is None else f": {problem}"


def _sparse_gradients(slot: MaskedSlot) -> str | None:
    if getattr(slot.module, "sparse", False) is True:  # nn.Embedding(sparse=True)
        return ("has sparse gradients (sparse=True), whose pruned positions a mask cannot "
                "zero; build it with sparse=False, or deny the tensor")
    return None


def _torch_pruned(slot: MaskedSlot) -> str | None:
    if any(isinstance(hook, torch.nn.utils.prune.BasePruningMethod)
           for hook in slot.module._forward_pre_hooks.values()):
        return ("is pruned by torch.nn.utils.prune (a forward pre-hook multiplies it by "
                "another mask); call torch.nn.utils.prune.remove(module, name) first")
    return None


def _old_weight_norm(slot: MaskedSlot) -> str | None:
    norm = next((h for h in slot.module._forward_pre_hooks.values()
                 if isinstance(h, WeightNorm) and slot.tensor.store[1] in
                 (f"{h.name}_g", f"{h.name}_v")), None)
    if norm is None:
        return None
    return (f"belongs to the old-style torch.nn.utils.weight_norm of layer "
            f"{slot.name.rpartition('.')[0]!r}: a forward pre-hook recomputes {norm.name!r} "
            f"from {norm.name}_g and {norm.name}_v, so a mask on either is not the forward "
            f"weight's sparsity; call torch.nn.utils.remove_weight_norm on the layer first, "
            f"use torch.nn.utils.parametrizations.weight_norm (with an N:M pattern), or deny "
            f"the layer")


def _parametrized(slot: MaskedSlot) -> str | None:
    problem = zeros_problem(slot.tensor, whole_rows=not slot.plan.pattern.is_nm)
    if problem is None:
        return None
    kind = type(slot.tensor.store[0][0]).__name__
    return (f"is parametrized ({kind}) so that {problem}; use an N:M pattern (it keeps N in "
            f"every group), deny the tensor, or remove the parametrization")


MASKED_PROBLEMS: tuple[Callable[[MaskedSlot], str | None], ...] = (
    _on_meta, _foreign_mask, _sparse_gradients, _torch_pruned, _old_weight_norm,
    _parametrized)
"""The checks of a masked-dense slot, in order: the first problem found is raised."""


def masked_problem(slot: MaskedSlot) -> str | None:
    """The first of :data:`MASKED_PROBLEMS` for ``slot``, as the error's sentence naming the
    tensor, or None."""
    for check in MASKED_PROBLEMS:
        if problem := check(slot):
            sep = "" if problem.startswith(":") else " "
            return f"tensor {slot.name!r} ({slot.plan.kind}){sep}{problem}"
    return None


def compressed_problem(slot: Slot) -> str | None:
    """Why the compressed layer of ``slot`` cannot train (its mask unset), or None."""
    if problem := slot.module.mask_problem():
        kind = original_class(type(slot.module)).__name__
        return f"compressed layer {slot.name.rpartition('.')[0]!r} ({kind}): {problem}"
    return None


def ownership_problem(slot: Slot, engine: object) -> str | None:
    """The tensor of ``slot`` held by a live engine other than ``engine``, or None."""
    owner = ownership.owner(slot.param)
    if owner is None or owner is engine:
        return None
    kind, held = ((original_class(type(slot.module)).__name__, "held") if slot.compressed
                  else (slot.plan.kind, "masked"))
    return (f"tensor {slot.name!r} ({kind}) is already {held} by another SparsityEngine "
            f"(pattern {owner.config.pattern!r}); give two callbacks disjoint selections "
            f"(allow/deny), or detach() the other engine first")
