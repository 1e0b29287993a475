"""A Linear layer whose 2:4 weight runs on the sparse tensor cores: :class:`SemiStructuredLinear`.

The parameter ``weight`` keeps its dense ``(out_features, in_features)`` shape (2:4 halves
a weight; cuSPARSELt's packed form is a cache of it, not the parameter), with zeros where
the bool buffer ``mask`` is False: 2 kept in every 4 consecutive inputs, and with
``transposable`` also in every 4 consecutive outputs (``2:4:2d``). The weight gradient is
masked, so pruned weights and their optimizer state stay zero with any optimizer.
The ``state_dict`` holds ``weight`` and ``bias`` only, the keys and values of an
``nn.Linear`` with zeros where pruned (``mask`` is not persistent); loading one keeps the
mask where the loaded weight is zero outside it, else installs the loaded weight's
magnitude 2:4 mask (its 2:4 nonzeros, whenever its kept entries are nonzero). A legacy
state dict with a ``mask`` installs that mask, checked before anything is copied.

On CUDA with cuSPARSELt, bf16 or fp16 (the weight's dtype, or autocast's), shapes and
token counts inside the envelope (at least
:data:`~sparse_training.kernels.semi_structured.cusparselt.SPARSE_MIN_FEATURES` outputs and
inputs, :data:`~sparse_training.kernels.semi_structured.cusparselt.SPARSE_MIN_TOKENS`
tokens: smaller products crashed cuSPARSELt), the forward may multiply a packed copy of the
weight and, for a transposable mask, the input gradient a packed copy of its transpose; the
copies are refreshed, values only, at the first forward after any ``torch.optim`` optimizer
stepped (a global step post-hook counts the steps: torch's fused optimizers do not move a
parameter's version counter) or the weight was written in place
(:mod:`sparse_training.layers.packed_copies`). Each shape and token
count is timed once, sparse against dense, and the faster path is kept
(:mod:`sparse_training.kernels.semi_structured.paths`): by wall time for eager training, or
by GPU time where ``timing = "cuda_graph"`` (a step captured in a CUDA graph pays no host
time per call; a layer once captured refreshes its packed copies at every call, replays
included, since no Python sees the optimizer steps that replays take). Elsewhere (CPU,
fp32, outside the envelope, where cuBLAS is faster, and under ``torch.compile``) the layer
is ``nn.Linear`` on the weight as it is (zero where pruned) with a masked weight gradient.

Under :class:`~sparse_training.engine.SparsityEngine` (the callback) the optimizer step
masks the gradient instead and ``masks_gradient`` is False: the dense route is then
exactly ``F.linear`` and costs what ``nn.Linear`` costs.

The bytes each route keeps per weight entry are tabled in ``docs/semi_structured.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparse_training.engine.protocol import CompressedLayer
from sparse_training.kernels._autograd import AUTOCAST_DTYPES
from sparse_training.kernels.semi_structured import (
    SPARSE_ROUTE_DTYPES,
    TOKEN_MULTIPLE,
    PathChoice,
    cusparselt_problem,
    envelope_problem,
    semi_structured_linear,
    shape_problem,
)
from sparse_training.kernels.semi_structured.masks import (
    check_mask,
    features_problem,
    zero_outside,
)
from sparse_training.kernels.semi_structured.paths import check_timing
from sparse_training.layers.blocks import transfer
from sparse_training.layers.packed_copies import PackedCopies, count_optimizer_steps
from sparse_training.layers.storage import SemiStructuredSlot
from sparse_training.pieces.masks import pattern_mask


def _check_arguments(in_features: object, out_features: object, transposable: object) -> None:
    if problem := features_problem(in_features, out_features):
        raise ValueError(problem)
    if not isinstance(transposable, bool):
        raise ValueError(f"transposable must be True or False, got {transposable!r}")


class SemiStructuredLinear(CompressedLayer):
    """``y = x (W * M)^T + b`` with a 2:4 mask ``M`` on the sparse tensor cores (module doc).

    Args:
        in_features, out_features: multiples of 4 (of 16 and at least
            ``SPARSE_MIN_FEATURES`` for cuSPARSELt; other shapes run the dense route).
        transposable: the mask is 2:4 along outputs too (``2:4:2d``), so the input gradient
            runs sparse as well.
        mask: the bool mask; default: the magnitude mask of the initial weight.

    Raises:
        ValueError: features that are not positive multiples of 4, a non-bool
            ``transposable``, a dtype that is not floating point, a bad mask, or a ``mask``
            for a layer on the meta device (``to_empty()`` would keep none of it).
    """

    trained_weight = "weight"  # the parameter holding the weight
    masks_gradient = True  # False while an engine's optimizer step masks the gradient
    _timing = "eager"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 *, transposable: bool = False, mask: Tensor | None = None) -> None:
        _check_arguments(in_features, out_features, transposable)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype (the weight's), got "
                             f"{dtype!r}")
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.transposable = transposable
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype))
                     if bias else None)
        self.register_buffer("mask", torch.empty_like(self.weight, dtype=torch.bool),
                             persistent=False)
        self.mask_unset = True  # reset_parameters takes the initial weight's mask
        if mask is not None and self.weight.is_meta:
            raise ValueError("SemiStructuredLinear on the meta device takes no mask: "
                             "to_empty() would keep none of it (reset_parameters() then takes "
                             "the drawn weight's); give the mask with set_mask() after "
                             "to_empty()")
        self.reset_parameters()
        if mask is not None:
            self.set_mask(mask)
        count_optimizer_steps()

    def slot(self, name: str) -> SemiStructuredSlot:
        """The engine's view of ``weight``: a fixed 2:4 mask the optimizer step enforces."""
        return SemiStructuredSlot(name, self)

    @property
    def pattern(self) -> str:
        return "2:4:2d" if self.transposable else "2:4"

    def _owner(self) -> str:
        return f"SemiStructuredLinear({self.in_features}->{self.out_features}, {self.pattern})"

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(in_features)``, like ``nn.Linear``, zero where the mask
        prunes; a layer without a mask yet (being built, or unset by ``to_empty()`` of a
        meta layer) takes the magnitude mask of the drawn weight."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)
        self.set_mask(pattern_mask(self.weight.detach(), self.pattern) if self.mask_unset
                      else self.mask)

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> None:
        """Keep ``mask`` from now on and zero the weights it prunes; packed copies and
        measured routes are dropped.

        Raises:
            ValueError: not a 2:4 bool mask of the weight's shape (both ways if transposable),
                before anything changes.
        """
        check_mask(mask, (self.out_features, self.in_features), self.transposable,
                   self._owner())
        self.mask.copy_(mask)
        self.mask_unset = False
        self.weight.masked_fill_(~self.mask, 0)
        self._packed = PackedCopies()
        self._routes: dict[tuple, PathChoice | str] = {}  # by (device, dtype, tokens, timing)

    @property
    def timing(self) -> str:
        """How the paths are timed: ``"eager"`` (wall time, the default) or ``"cuda_graph"``
        (GPU time of graph replays, for a step captured in a CUDA graph; module doc).

        Raises:
            ValueError: on setting any other value.
        """
        return self._timing

    @timing.setter
    def timing(self, timing: str) -> None:
        check_timing(timing)
        self._timing = timing

    @property
    def sparsity(self) -> float:
        """Fraction of the weight's entries that are pruned (0.5)."""
        return 1.0 - int(self.mask.sum()) / self.mask.numel()

    def path_problem(self, x: Tensor) -> str | None:
        """Why this call runs the dense route instead of cuSPARSELt, or None; checked
        before any packing or timing, per call (so small and odd token counts go dense).

        Raises:
            ValueError: an input this layer cannot take (see :meth:`forward`).
        """
        dtype = self._compute_dtype(x)
        if problem := cusparselt_problem(x.device):
            return problem
        if dtype not in SPARSE_ROUTE_DTYPES:
            return (f"{dtype}: the sparse route takes bf16 (cuSPARSELt's search failed on fp16 "
                    f"operands; use bf16-mixed or bf16 weights)")
        if problem := shape_problem(self.out_features, self.in_features):
            return problem
        tokens = x.numel() // self.in_features
        if problem := envelope_problem(self.out_features, self.in_features, tokens):
            return problem
        if tokens % TOKEN_MULTIPLE:
            return f"{tokens} tokens are not a multiple of {TOKEN_MULTIPLE} (cuSPARSELt)"
        return None

    def forward(self, x: Tensor) -> Tensor:
        """``x (W * M)^T + b`` for ``x`` of shape ``(..., in_features)``.

        Raises:
            ValueError: ``x`` is not a tensor whose last dimension is ``in_features``, not on
                the weight's device, or its dtype is not the weight's (under autocast: not
                one autocast casts).
            RuntimeError: the mask is unset (``to_empty()`` of a meta layer, before
                ``reset_parameters()`` or ``load_state_dict``).
        """
        self.check_mask_set()
        dtype = self._compute_dtype(x)
        if torch.compiler.is_compiling():  # cuBLAS, traced without Python-side caches
            if not self.masks_gradient:
                return F.linear(x, self.weight, self.bias)
            # W * M is W (zero where pruned) and its gradient is dW * M: the eager dense
            # route's products, on the same 2-D input
            y = F.linear(x.reshape(-1, self.in_features), self.weight * self.mask, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        route = self.paths(x, dtype)
        packed = packed_t = None  # cuBLAS on the weight as it is: zero where pruned
        if not isinstance(route, str) and (route.forward or route.input_grad):
            packed, packed_t = self._packed.refreshed(self.weight, self.mask, dtype, route)
        elif not self.masks_gradient:
            return F.linear(x, self.weight, self.bias)
        return semi_structured_linear(x.to(dtype), self.weight,
                                      self.mask if self.masks_gradient else None, self.bias,
                                      packed, packed_t)

    def paths(self, x: Tensor, dtype: torch.dtype | None = None) -> PathChoice | str:
        """The measured choice for an input like ``x`` (timed at its first call), or why
        cuSPARSELt does not serve it; cached per (device, dtype, token count, timing)."""
        dtype = dtype or self._compute_dtype(x)
        key = (x.device, dtype, x.numel() // self.in_features, self.timing)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self.path_problem(x) or self._packed.measure(
                self.weight, self.mask, dtype, key[2], self.timing, self.transposable)
        return route

    def _apply(self, fn, recurse: bool = True) -> SemiStructuredLinear:
        self._packed.copies, self._routes = {}, {}  # a device or dtype move replaces the weight
        return super()._apply(fn, recurse)

    def _compute_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the products run in: autocast's, else the weight's (``x``'s must be)."""
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{self._owner()}: the input's last dimension must be "
                             f"in_features = {self.in_features}, got {got}")
        if x.device != self.weight.device:
            raise ValueError(f"{self._owner()}: input on {x.device}, the layer's weight on "
                             f"{self.weight.device}; move one (x.to({str(self.weight.device)!r}) "
                             f"or layer.to({str(x.device)!r}))")
        if not x.is_meta and torch.is_autocast_enabled(x.device.type):  # meta: no autocast
            if x.dtype not in AUTOCAST_DTYPES:
                raise ValueError(f"{self._owner()}: input dtype {x.dtype}: autocast casts only "
                                 f"{', '.join(map(str, AUTOCAST_DTYPES))}; cast the input")
            return torch.get_autocast_dtype(x.device.type)
        if x.dtype != self.weight.dtype:
            raise ValueError(f"{self._owner()}: input dtype {x.dtype} is not the weight's "
                             f"{self.weight.dtype}; cast the input (x.to({self.weight.dtype})) "
                             "or the layer, or run under torch.autocast")
        return x.dtype

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list,
                              error_msgs: list) -> None:
        """Load ``weight`` and ``bias``, then install :meth:`_loaded_mask`, which checks the
        shapes and a legacy ``mask`` before anything is copied."""
        mask, errors = self._loaded_mask(state_dict, prefix), len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if prefix + "mask" in unexpected_keys:  # a legacy state dict's mask, used above
            unexpected_keys.remove(prefix + "mask")
        if len(error_msgs) == errors and mask is not None:  # torch refused nothing
            if self.mask.is_meta and not self.weight.is_meta:
                # assign=True gave the weight storage; the mask (not in the state dict) too
                self.mask = torch.empty_like(self.weight, dtype=torch.bool)
            self.set_mask(mask)

    @torch.no_grad()
    def _loaded_mask(self, state_dict: dict, prefix: str) -> Tensor | None:
        """The mask after loading ``state_dict``: its legacy ``mask`` if it has one, else the
        current mask if the loaded weight is zero outside it, else the loaded weight's
        magnitude mask of this layer's pattern (NaN ranks lowest); None (the mask stays
        unset) without a weight to take it from.

        Raises:
            ValueError: a ``weight`` or ``bias`` of another shape than the layer's, a legacy
                mask that is not a bool 2:4 mask of the weight's shape.
        """
        for name in ("weight", "bias"):
            loaded, own = state_dict.get(prefix + name), getattr(self, name)
            if isinstance(loaded, Tensor) and own is not None and loaded.shape != own.shape:
                raise ValueError(f"{self._owner()}, state dict key {prefix + name!r}: shape "
                                 f"{tuple(loaded.shape)} is not the layer's {tuple(own.shape)};"
                                 " load a state dict saved from a layer of this shape")
        legacy = state_dict.get(prefix + "mask")
        if legacy is not None:
            check_mask(legacy, (self.out_features, self.in_features), self.transposable,
                       f"{self._owner()}, state dict key {prefix + 'mask'!r}")
            return legacy
        weight = state_dict.get(prefix + "weight")
        unset = self.mask_unset or self.mask.is_meta  # no mask to keep
        if not isinstance(weight, Tensor):  # torch reports a missing weight, or no tensor
            return None if unset else self.mask
        if not unset and zero_outside(weight, self.mask):
            return self.mask
        return pattern_mask(weight, self.pattern)

    @classmethod
    def from_dense(cls, linear: nn.Linear, transposable: bool = False,
                   mask: Tensor | None = None) -> SemiStructuredLinear:
        """``linear``'s weight under ``mask`` (default: its magnitude 2:4 mask, transposable
        where asked) and its bias; device, dtype and ``requires_grad`` follow ``linear``'s.
        A ``linear`` on the meta device gives a meta layer: after ``to_empty()``,
        ``reset_parameters()`` takes the mask of the weight it draws.

        Raises:
            ValueError: not an ``nn.Linear``, features not multiples of 4, a bad mask; a
                ``mask`` for a meta ``linear`` (its values would not survive ``to_empty()``).
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_dense takes an nn.Linear, got {type(linear).__name__}; "
                             "for HF GPT-2's Conv1D (weight stored (in, out)) build an "
                             "nn.Linear from its transposed weight first")
        _check_arguments(linear.in_features, linear.out_features, transposable)
        weight = linear.weight.detach()
        if weight.is_meta and mask is not None:
            raise ValueError("from_dense of an nn.Linear on the meta device takes no mask: "
                             "to_empty() would leave none of it (reset_parameters() then "
                             "takes the drawn weight's); build the Linear's weights first")
        mask = mask if mask is not None else pattern_mask(weight, "2:4:2d" if transposable
                                                          else "2:4")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, transposable=transposable,
                    mask=None if weight.is_meta else mask)
        transfer(layer.weight, weight, linear.weight.requires_grad, layer.bias, linear.bias)
        layer.set_mask(mask)  # zeroes the pruned copies
        return layer

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` with the masked weight and the bias (same device, dtype and
        ``requires_grad``)."""
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features,
                                    bias=self.bias is not None, device=self.weight.device,
                                    dtype=self.weight.dtype)
        transfer(linear.weight, self.weight.detach() * self.mask, self.weight.requires_grad,
                 linear.bias, self.bias)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"pattern={self.pattern}, bias={self.bias is not None}")
