"""Who owns what: which live engine holds a tensor, and which engines train a model.

One owner per weight tensor: an engine holds the tensors its selection reaches, masked ones
and compressed layers' (:attr:`TensorPlan.compressed
<sparse_training.engine.selection.TensorPlan.compressed>`). :func:`shared_tensor` finds a
tensor that two selections would both hold, before any engine exists (the callbacks refuse
the overlap at setup, naming both); the registries hold weak references only (an engine
lives as long as its optimizer hooks do): the engine refuses a tensor another live engine
holds, and the swap path (:mod:`sparse_training.layers.swap`) refuses to swap the modules
of a model an attached engine trains.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from sparse_training.engine.plan import SparsityPlan

def shared_tensor(plans: Sequence[SparsityPlan | None]) -> tuple[str, int, int] | None:
    """The first tensor that two of ``plans`` (of one model) would hold, as ``(name, i, j)``
    with ``i < j`` their positions, or None. A None plan (its selection raised; its own
    engine raises that) is left out."""
    first: dict[int, int] = {}
    for index, plan in enumerate(plans):
        if plan is None:
            continue
        for key, name in plan.held_tensors().items():
            if key in first:
                return name, first[key], index
            first[key] = index
    return None


# id(parameter) -> (parameter, engine), both weak: which live engine holds a tensor
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def owner(param: Tensor) -> Any | None:
    """The live engine that holds ``param``, or None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def take(param: Tensor, engine: object) -> None:
    """Record ``engine`` as the owner of ``param``."""
    _OWNERS[id(param)] = (weakref.ref(param), weakref.ref(engine))


def give_up(param: Tensor, engine: object) -> None:
    """Forget ``engine``'s ownership of ``param`` (another engine may take it)."""
    if owner(param) is engine:
        del _OWNERS[id(param)]


# model -> the engines attached to optimizers that train it (weak both ways: an engine
# lives as long as its optimizer hooks do)
_TRAINED_BY: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet] = (
    weakref.WeakKeyDictionary())


def hold_for_training(model: nn.Module, engine: object, held: bool) -> None:
    """Mark ``model`` as trained by ``engine`` (``held``, at its first ``attach``) or no
    longer (at its ``detach``): until then ``sparsify``, ``densify`` and
    ``make_permanent`` refuse to swap any of its modules."""
    engines = _TRAINED_BY.setdefault(model, weakref.WeakSet())
    if held:
        engines.add(engine)
    else:
        engines.discard(engine)


def check_not_in_training(model: nn.Module, action: str) -> None:
    """Raise if ``model`` shares a module with a model an attached engine trains.

    Raises:
        RuntimeError: naming ``action``, the trained model and when to call it instead.
    """
    ours = {id(m) for m in model.modules()}
    for trained, engines in list(_TRAINED_BY.items()):
        if engines and any(id(m) in ours for m in trained.modules()):
            raise RuntimeError(
                f"{action} would swap modules of a {type(trained).__name__} that a "
                f"SparsityEngine is training (attached to its optimizer: the optimizer and the "
                f"mask updates would go on with the replaced tensors); call it after "
                f"trainer.fit returns (SparsityCallback detaches its engine when the fit "
                f"ends) or after engine.detach()")
