"""Scores that learn from training: statistics observed at every optimizer step, ranked at
mask updates.

Every training score is a frozen dataclass with one signature (the state lives outside,
as an optimizer's does, so that the engine checkpoints, moves and shards it)::

    score.statistics(param) -> dict[str, Tensor]              # zeros for one tensor
    score.observe(statistics, weight, gradient, count) -> None  # one step, in place
    score(statistics, weight, count) -> Tensor                # ranks shaped like weight

``weight`` and ``gradient`` are what the optimizer steps on (a sharded parameter's local
shard: every statistic here is elementwise or lies within rows, dim 0 leading), the
gradient dense (pruned entries included), reduced over ranks and unscaled; ``count`` the
steps observed, this one included. Larger ranks are kept; they pool over blocks, N:M groups
and units by summation, as ``|w|`` does (:mod:`sparse_training.pieces.masks`).
``window`` says what the statistics describe: the steps since the last mask update (they
restart then), or the whole run (they follow the mask as optimizer state does: a weight
that is pruned or grown restarts at zero).

- :class:`MovementScore` (``"movement"``): S = -sum_t w_t * g_t, hard top-k (Sanh et al.
  2020, "Movement Pruning: Adaptive Sparsity by Fine-Tuning"): weights moving away from
  zero are kept.
- :class:`SoftMovementScore` (``"soft-movement"``): learned scores S trained with Adam on
  their straight-through gradient dL/dS = g * w plus an L1 term lambda * sigmoid(S) (Sanh
  et al.'s soft movement); kept above the threshold that meets the schedule's target.
- :class:`~sparse_training.pieces.second_order.SecondOrderScore` (``"second-order"``):
  the optimal-brain-surgeon saliency under an empirical Fisher (Kurtic et al. 2022).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class TrainingScore(Protocol):
    """A score that learns from training (module docstring)."""

    name: ClassVar[str]
    window: ClassVar[bool]

    def statistics(self, param: Tensor) -> dict[str, Tensor]: ...

    def observe(self, statistics: dict[str, Tensor], weight: Tensor, gradient: Tensor,
                count: int) -> None: ...

    def __call__(self, statistics: dict[str, Tensor], weight: Tensor, count: int) -> Tensor: ...


def statistics_dtype(param: Tensor) -> torch.dtype:
    """float64 for float64 weights, float32 otherwise: statistics are sums over many steps."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def finite(values: Tensor) -> Tensor:
    """``values`` with non-finite entries (an overflowed fp16 step's) as zeros."""
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number, not a bool (nor a string YAML left
    unparsed, such as ``1e-2``)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class MovementScore:
    """S = -sum over steps of w * g: the first-order estimate of how much the loss falls
    as each weight moves away from zero (Sanh et al. 2020); kept where largest."""

    name: ClassVar[str] = "movement"
    window: ClassVar[bool] = False

    def statistics(self, param: Tensor) -> dict[str, Tensor]:
        return {"movement": torch.zeros(param.shape, dtype=statistics_dtype(param),
                                        device=param.device)}

    def observe(self, statistics: dict[str, Tensor], weight: Tensor, gradient: Tensor,
                count: int) -> None:
        movement = statistics["movement"]
        movement.sub_(finite(weight.to(movement.dtype) * gradient.to(movement.dtype)))

    def __call__(self, statistics: dict[str, Tensor], weight: Tensor, count: int) -> Tensor:
        return statistics["movement"]


@dataclass(frozen=True)
class SoftMovementScore:
    """Learned scores S, one per weight, trained by Adam on L + lambda * mean(sigmoid(S))
    per tensor: the straight-through gradient of W' = W * mask(S) gives dL/dS = g * w, and
    the L1 term pulls every score down by lambda * sigmoid'(S) / numel (Sanh et al. 2020,
    soft movement: Adam, scores from 0). Sanh et al. keep sigmoid(S) > tau for a hand-set
    threshold tau, so lambda decides the sparsity; here tau is the threshold that keeps the
    schedule's count (one threshold across the model with ``distribution="global"``, as
    theirs).

    Attributes:
        lr: the scores' learning rate (Sanh et al.: 1e-2).
        l1: lambda, the weight of each tensor's mean sigmoid(S) in the scores' loss.
        betas, eps: Adam's.
    """

    lr: float = 1e-2
    l1: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    name: ClassVar[str] = "soft-movement"
    window: ClassVar[bool] = False

    def __post_init__(self) -> None:
        betas = self.betas
        pair = isinstance(betas, Sequence) and not isinstance(betas, str) and len(betas) == 2
        numbers_ = (self.lr, self.l1, self.eps, *(betas if pair else ()))
        if not (pair and all(is_finite_number(v) for v in numbers_) and self.lr > 0
                and self.l1 >= 0 and self.eps > 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"SoftMovementScore needs finite numbers lr > 0, l1 >= 0, eps > 0 "
                             f"and two betas in [0, 1), got {self!r}")

    def statistics(self, param: Tensor) -> dict[str, Tensor]:
        zeros = torch.zeros(param.shape, dtype=statistics_dtype(param), device=param.device)
        return {"scores": zeros, "exp_avg": zeros.clone(), "exp_avg_sq": zeros.clone()}

    @torch.no_grad()
    def observe(self, statistics: dict[str, Tensor], weight: Tensor, gradient: Tensor,
                count: int) -> None:
        scores, exp_avg, exp_avg_sq = (statistics[k] for k in ("scores", "exp_avg",
                                                                "exp_avg_sq"))
        sigmoid = scores.sigmoid()
        grad = finite(weight.to(scores.dtype) * gradient.to(scores.dtype))
        grad.add_(sigmoid * (1 - sigmoid), alpha=self.l1 / scores.numel())
        beta1, beta2 = self.betas
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1 ** count)
        denominator = (exp_avg_sq / (1 - beta2 ** count)).sqrt_().add_(self.eps)
        scores.addcdiv_(exp_avg, denominator, value=-step_size)

    def __call__(self, statistics: dict[str, Tensor], weight: Tensor, count: int) -> Tensor:
        return statistics["scores"]
