"""Every weight-like tensor of a model, found once, by identity.

A *weight-like tensor* is a parameter of two or more dimensions, whatever its name:
``weight``, ``nn.MultiheadAttention.in_proj_weight``, ``nn.LSTM.weight_hh_l0``, a custom
``kernel``. :func:`find_weight_tensors` returns one :class:`WeightTensor` per tensor:

- **Tied parameters** (one ``Parameter`` object under several names, e.g. an LM head that
  shares the embedding's weight) are one entry listing every name; one mask covers them.
- **Parametrized weights** (``torch.nn.utils.parametrize``: ``weight_norm``,
  ``spectral_norm``, ...) are listed under their forward name (``fc.weight``); the tensor
  that is masked and updated is the stored original of the forward weight's shape
  (``fc.parametrizations.weight.original``, or ``original1``, the direction ``v`` of
  weight norm). :func:`zeros_problem` checks that zeros of the original stay zeros of
  the forward weight: true for spectral norm, for weight norm unless a whole row is zero
  (it divides by the row's norm), not in general.

Each tensor also records where its owners store the input (reduction) dimension
(:func:`input_dim_of`): dim 1 for ``(out, in, ...)`` weights, dim 0 for HF ``Conv1D``'s
``(in, out)`` and ``nn.ConvTranspose*d``'s ``(in, out / groups, *kernel)``; N:M groups and
block columns run along it (:func:`sparse_training.pieces.masks.as_matrix`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from sparse_training.engine.sharding import FSDPModule

# module classes that store their weight input-first, ``(in, out)``, by qualified name (the
# core imports no model library): Hugging Face's Conv1D (GPT-2, GPT, CTRL), y = x W + b
INPUT_FIRST_CLASSES = frozenset({"transformers.pytorch_utils.Conv1D",
                                 "transformers.modeling_utils.Conv1D"})


@dataclass(frozen=True, eq=False)
class WeightTensor:
    """One weight-like tensor of a model.

    Attributes:
        names: every qualified forward name (``model.named_parameters`` style, the
            parametrized ``fc.weight`` rather than its original); the first is canonical.
        owners: the (module, attribute) pair of each name; ``getattr`` gives the tensor
            the forward pass uses.
        store: the (module, attribute) holding the stored parameter (the original of a
            parametrized weight); the mask buffer is registered beside it.
        parametrized: whether the forward weight is computed from ``store``.
        input_dims: each owner's :func:`input_dim_of` (they differ only for a tensor tied
            across layouts, which selection refuses for structured patterns).
    """

    names: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    store: tuple[nn.Module, str]
    parametrized: bool
    input_dims: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def param(self) -> nn.Parameter:
        """The stored parameter: what the optimizer updates and the mask covers."""
        module, attr = self.store
        return module._parameters[attr]

    @property
    def input_dim(self) -> int:
        """Where the first owner stores the input dimension: 1 ``(out, in, ...)``, 0
        ``(in, out, ...)``."""
        return self.input_dims[0]

    @property
    def kind(self) -> str:
        """Class name of the first owning module (``Linear``, ``LSTM``, ...), not of the
        subclasses swapped in at run time by FSDP2's ``fully_shard`` (``FSDPLinear``) and by
        parametrizations (``ParametrizedLinear``)."""
        return original_class(type(self.owners[0][0])).__name__

    def forward_weight(self) -> Tensor:
        """The tensor the forward pass uses (a parametrization is evaluated, without
        side effects such as spectral norm's power iteration)."""
        module, attr = self.owners[0]
        if not self.parametrized:
            return getattr(module, attr)
        with torch.no_grad(), _eval(module.parametrizations[attr]):
            return getattr(module, attr)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly HF's ``Conv1D`` (a subclass may compute otherwise)."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}" in INPUT_FIRST_CLASSES


def input_dim_of(module: nn.Module) -> int:
    """Where ``module`` stores the input (reduction) dimension of its weights.

    0 for input-first layouts: HF ``Conv1D`` (``(in, out)``, ``y = x W + b``) and
    ``nn.ConvTranspose*d`` (``(in, out / groups, *kernel)``); 1 for everything else:
    ``(out, in, ...)`` as in Linear, Conv, RNN and attention weights, and embeddings
    ``(num, dim)`` (a tied LM head reads them as ``(vocab, hidden)``).
    """
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return 0
    classes = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
    return 0 if classes & INPUT_FIRST_CLASSES else 1


def original_class(cls: type) -> type:
    """``cls`` before the subclasses swapped in at run time, in either order: FSDP2's
    ``fully_shard`` (``FSDPLinear(FSDPModule, Linear)``) and parametrizations
    (``ParametrizedLinear(Linear)``)."""
    while True:
        if FSDPModule is not None and FSDPModule in cls.__bases__:
            cls = next(base for base in cls.__bases__ if base is not FSDPModule)
        elif len(cls.__bases__) == 1 and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}":
            cls = cls.__bases__[0]
        else:
            return cls


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    """Evaluation mode inside the block; the previous modes restored after it."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _parametrized(module_name: str, module: nn.Module) -> Iterator[tuple[str, str, str]]:
    """(forward name, attribute, original attribute) for each parametrized weight of
    ``module`` whose forward weight has two or more dimensions."""
    if not parametrize.is_parametrized(module):
        return
    for attr, plist in module.parametrizations.items():
        originals = ["original"] if plist.is_tensor else sorted(
            name for name in plist._parameters if name.startswith("original"))
        with torch.no_grad(), _eval(plist):
            shape = getattr(module, attr).shape
        if len(shape) < 2:
            continue
        same = [o for o in originals if plist._parameters[o].shape == shape]
        if len(same) != 1:
            raise ValueError(
                f"parametrized weight {_join(module_name, attr)!r} ({type(plist[0]).__name__})"
                f" has {len(same)} stored originals of its shape {tuple(shape)}; a mask needs "
                f"exactly one: deny it, or remove the parametrization")
        yield _join(module_name, attr), attr, same[0]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_weight_tensors(model: nn.Module) -> list[WeightTensor]:
    """Every weight-like tensor of ``model`` (2-D or more, not a bias whatever its shape:
    ``nn.MultiheadAttention``'s ``bias_k``/``bias_v``), in module order, ties merged by
    identity.

    Raises:
        ValueError: a parametrized weight whose stored originals are ambiguous, or a
            parameter not initialized yet (a lazy module before its first forward).
    """
    names: dict[int, list[str]] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    stores: dict[int, tuple[tuple[nn.Module, str], bool]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, parametrize.ParametrizationList):
            continue  # its originals are listed under their forward names
        _check_initialized(module_name, module)
        entries = [(_join(module_name, attr), attr, (module, attr), False)
                   for attr, p in module._parameters.items()
                   if p is not None and p.dim() >= 2 and not attr.startswith("bias")]
        entries += [(name, attr, (module.parametrizations[attr], original), True)
                    for name, attr, original in _parametrized(module_name, module)]
        for name, attr, store, is_parametrized in entries:
            key = id(store[0]._parameters[store[1]])
            names.setdefault(key, []).append(name)
            owners.setdefault(key, []).append((module, attr))
            stores.setdefault(key, (store, is_parametrized))
    return [WeightTensor(tuple(names[k]), tuple(owners[k]), *stores[k],
                         tuple(input_dim_of(module) for module, _ in owners[k])) for k in names]


def _check_initialized(module_name: str, module: nn.Module) -> None:
    """Raise ValueError naming the first parameter of ``module`` that a lazy module has not
    initialized yet: its shape, so whether it is a weight, is unknown until a forward."""
    for attr, param in module._parameters.items():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {_join(module_name, attr)!r} of {type(module).__name__} is not "
                f"initialized yet (a lazy module): its shape is unknown until the first "
                f"forward; run one forward pass with a real batch before fit (e.g. in "
                f"__init__ or configure_model), or give the layer its input size")


@torch.no_grad()
def zeros_problem(tensor: WeightTensor, whole_rows: bool) -> str | None:
    """Why zeros of the stored original would not be zeros of the forward weight, or None.

    Probed once on the real weights (restored after; parametrizations run in eval mode):
    half the positions zeroed at random, and, when the pattern can prune a whole output
    row (``whole_rows``: unstructured and block patterns), a whole row zeroed, which makes
    weight norm divide by a zero norm.
    """
    if not tensor.parametrized:
        return None
    plist_owner, original = tensor.store
    stored = plist_owner._parameters[original]
    generator = torch.Generator(device=stored.device).manual_seed(0)
    probes = {"zeros at random positions": torch.rand(stored.shape, generator=generator,
                                                      device=stored.device) < 0.5}
    if whole_rows:
        row = torch.ones(stored.shape, dtype=torch.bool, device=stored.device)
        row[0] = False
        probes["a whole row of zeros, which this pattern can prune,"] = row
    saved = stored.detach().clone()
    try:
        for what, keep in probes.items():
            stored.copy_(saved.masked_fill(~keep, 0))
            forward = tensor.forward_weight()
            if forward.shape != keep.shape or forward[~keep].any() or forward.isnan().any():
                return f"{what} in its original do not stay zeros of the weight"
    finally:
        stored.copy_(saved)
    return None
