"""A Linear layer whose 2:4 weight runs on the sparse tensor cores: :class:`SemiStructuredLinear`.

The parameter ``weight`` keeps its dense ``(out_features, in_features)`` shape (2:4 halves
a weight; cuSPARSELt's packed form is a cache of it, not the parameter), with zeros where
the persistent bool buffer ``mask`` is False: 2 kept in every 4 consecutive inputs, and with
``transposable`` also in every 4 consecutive outputs (``2:4:2d``). The weight gradient is
masked, so pruned weights and their optimizer state stay zero with any optimizer.

On CUDA with cuSPARSELt, bf16 or fp16 (the weight's dtype, or autocast's), the forward
multiplies a packed copy of the weight and, for a transposable mask, the input gradient a
packed copy of its transpose; the copies are refreshed, values only, at the first forward
after any ``torch.optim`` optimizer stepped (a global step post-hook counts the steps: torch's
fused optimizers do not move a parameter's version counter) or the weight was written in
place. Each shape and token count
is timed once, sparse against dense, and the faster path is kept
(:mod:`sparse_training.kernels.semi_structured.paths`): by wall time for eager training, or
by GPU time where ``timing = "cuda_graph"`` (a step captured in a CUDA graph pays no host
time per call; a layer once captured refreshes its packed copies at every call, replays
included, since no Python sees the optimizer steps that replays take). What remains
slower than ``nn.Linear`` (host-bound small steps, bf16 weights) is measured in
docs/performance.md.
Elsewhere (CPU, fp32, a shape cuSPARSELt refuses) and where cuBLAS is faster the layer is
``nn.Linear`` on the weight as it is (zero where pruned: ``set_mask`` and
``load_state_dict`` zero it, the masked gradient keeps it so) with a masked weight gradient.

Under :class:`~sparse_training.engine.SparsityEngine` (the callback) the optimizer step
masks the gradient instead (inside the fused step, or with the engine's other masked
tensors in one pass) and ``masks_gradient`` is False: the dense route is then exactly
``F.linear`` and costs what ``nn.Linear`` costs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from sparse_training.kernels.semi_structured import (
    DTYPES,
    TOKEN_MULTIPLE,
    PackedWeight,
    PathChoice,
    choose_paths,
    cusparselt_problem,
    semi_structured_linear,
    shape_problem,
)
from sparse_training.kernels.semi_structured.paths import check_timing
from sparse_training.masks import pattern_mask

_OPTIMIZER_STEPS = [0]  # optimizer steps taken in this process, once counting starts
_COUNTING: list = []  # the global hook's handle, registered by the first layer


def _count_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _weights_changed_marker(weight: Tensor) -> tuple[int, int]:
    """What changes when the weight may have: (optimizer steps, the weight's version)."""
    return _OPTIMIZER_STEPS[0], weight._version


def check_mask(mask: Tensor, shape: tuple[int, int], transposable: bool) -> None:
    """Raise unless ``mask`` is a bool 2:4 mask of ``shape`` (and of its transpose where
    ``transposable``), naming the first bad group."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        what = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask)
        raise ValueError(f"mask must be a bool tensor of the weight's shape {shape}, got {what}")
    views = [("row", mask)] + ([("column", mask.T)] if transposable else [])
    for direction, view in views:
        kept = view.reshape(view.shape[0], -1, 4).sum(-1)
        bad = (kept != 2).nonzero()
        if len(bad):
            i, group = bad[0].tolist()
            raise ValueError(f"mask is not 2:4 along each {direction}: {direction} {i}, entries "
                             f"{4 * group}:{4 * group + 4} keep {int(kept[i, group])}")


class SemiStructuredLinear(nn.Module):
    """``y = x (W * M)^T + b`` with a 2:4 mask ``M`` on the sparse tensor cores (module doc).

    Args:
        in_features, out_features: multiples of 4 (of 16 for cuSPARSELt; other shapes
            run the masked dense path).
        transposable: the mask is 2:4 along outputs too (``2:4:2d``), so the input gradient
            runs sparse as well.
        mask: the bool mask; default: the magnitude mask of the initial weight.
    """

    trained_weight = "weight"  # the parameter holding the weight
    masks_gradient = True  # False while an engine's optimizer step masks the gradient
    _timing = "eager"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 *, transposable: bool = False, mask: Tensor | None = None) -> None:
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(size, int) or size < 4 or size % 4:
                raise ValueError(f"{name} must be a positive multiple of 4 (2:4 groups), got "
                                 f"{size!r}")
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.transposable = bool(transposable)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        self.reset_parameters()
        if mask is None:
            mask = pattern_mask(self.weight.detach(), self.pattern)
        self.register_buffer("mask", torch.empty_like(self.weight, dtype=torch.bool))
        self.set_mask(mask)
        self.register_load_state_dict_post_hook(_after_load)
        if not _COUNTING:
            _COUNTING.append(register_optimizer_step_post_hook(_count_step))

    @property
    def pattern(self) -> str:
        return "2:4:2d" if self.transposable else "2:4"

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(in_features)``, like ``nn.Linear``."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> None:
        """Keep ``mask`` from now on and zero the weights it prunes.

        Raises:
            ValueError: not a 2:4 bool mask of the weight's shape (both ways if transposable).
        """
        check_mask(mask, (self.out_features, self.in_features), self.transposable)
        self.mask.copy_(mask)
        self.weight.masked_fill_(~self.mask, 0)
        self._packs: dict[torch.dtype, list[list]] = {}  # by dtype: see _copies
        self._routes: dict[tuple, PathChoice | str] = {}  # by (device, dtype, tokens, timing)
        self._captured = False  # True once a forward ran under CUDA graph capture

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
        """Why this call runs the masked dense path instead of cuSPARSELt, or None."""
        dtype = self._compute_dtype(x)
        if problem := cusparselt_problem(x.device):
            return problem
        if dtype not in DTYPES:
            return f"{dtype} (cuSPARSELt takes bf16 or fp16; use bf16-mixed or bf16 weights)"
        if problem := shape_problem(self.out_features, self.in_features):
            return problem
        tokens = x.numel() // self.in_features
        if tokens % TOKEN_MULTIPLE:
            return f"{tokens} tokens are not a multiple of {TOKEN_MULTIPLE} (cuSPARSELt)"
        return None

    def forward(self, x: Tensor) -> Tensor:
        dtype = self._compute_dtype(x)
        route = self.paths(x, dtype)
        packed = packed_t = None  # cuBLAS on the weight as it is: zero where pruned
        if not isinstance(route, str) and (route.forward or route.input_grad):
            packed, packed_t = self._refreshed(dtype, route)
            packed, packed_t = (packed if route.forward else None,
                                packed_t if route.input_grad else None)
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
            route = self._routes[key] = self.path_problem(x) or self._measure(dtype, key[2])
        return route

    def _apply(self, fn, recurse: bool = True) -> SemiStructuredLinear:
        self._packs, self._routes = {}, {}  # a device or dtype move replaces the weight
        return super()._apply(fn, recurse)

    def _compute_dtype(self, x: Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.weight.dtype

    def _copies(self, dtype: torch.dtype) -> list[list]:
        """``[packed copy, marker when last packed]`` for W and, if transposable, W^T."""
        copies = self._packs.get(dtype)
        if copies is None:
            marker = _weights_changed_marker(self.weight)
            copies = self._packs[dtype] = [
                [PackedWeight.pack(self.weight.detach(), self.mask, dtype, transposed), marker]
                for transposed in ((False, True) if self.transposable else (False,))]
        return copies

    @torch.compiler.disable
    @torch.no_grad()
    def _measure(self, dtype: torch.dtype, tokens: int) -> PathChoice:
        copies = self._copies(dtype)
        return choose_paths(self.weight, copies[0][0],
                            copies[1][0] if len(copies) > 1 else None, tokens, self.timing)

    @torch.compiler.disable
    @torch.no_grad()
    def _refreshed(self, dtype: torch.dtype, route: PathChoice
                   ) -> tuple[PackedWeight, PackedWeight | None]:
        """The packed copies; those ``route`` uses repacked (values only) if the weights may
        have changed since they were last packed, and at every call once the layer was
        captured in a CUDA graph (replays take optimizer steps that no Python sees)."""
        copies = self._copies(dtype)
        marker = _weights_changed_marker(self.weight)
        if torch.cuda.is_current_stream_capturing():  # a sparse route runs on CUDA
            self._captured = True
        for copy, used in zip(copies, (route.forward, route.input_grad), strict=False):
            if used and (self._captured or copy[1] != marker):
                copy[0].refresh(self.weight)
                copy[1] = marker
        return copies[0][0], copies[1][0] if len(copies) > 1 else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, transposable: bool = False,
                   mask: Tensor | None = None) -> SemiStructuredLinear:
        """``linear``'s weight under ``mask`` (default: its magnitude 2:4 mask, transposable
        where asked) and its bias; device, dtype and ``requires_grad`` follow ``linear``'s.

        Raises:
            ValueError: not an ``nn.Linear``, features not multiples of 4, a bad mask.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_dense takes an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        pattern = "2:4:2d" if transposable else "2:4"
        mask = mask if mask is not None else pattern_mask(weight, pattern)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, transposable=transposable,
                    mask=mask)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        layer.set_mask(mask)  # zeroes the pruned copies
        layer.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` with the masked weight and the bias (same device, dtype and
        ``requires_grad``)."""
        linear = nn.utils.skip_init(nn.Linear, self.in_features, self.out_features,
                                    bias=self.bias is not None, device=self.weight.device,
                                    dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight * self.mask)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        linear.weight.requires_grad_(self.weight.requires_grad)
        if self.bias is not None:
            linear.bias.requires_grad_(self.bias.requires_grad)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"pattern={self.pattern}, bias={self.bias is not None}")


def _after_load(module: SemiStructuredLinear, incompatible_keys) -> None:
    """After ``load_state_dict``: the loaded mask must be 2:4; the packed copies go."""
    module.set_mask(module.mask.clone())
