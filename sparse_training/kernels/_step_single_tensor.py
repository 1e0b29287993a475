"""The masked optimizer step in pure torch, one tensor at a time (the role of torch.optim's
``_single_tensor_*`` functions beside its fused kernels).

It updates what the Triton kernel cannot take (parameters on the CPU without
``TRITON_INTERPRET=1``, half-precision weights whose state was made float32) and stands in
for ``fused_masked_step`` where Triton is not installed. It shares the planner and runner
(``_step_plan``, ``_step_run``) with the kernel; the tests check both against
``reference.masked_step_reference``, which shares nothing with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ._step_plan import StepBatch
from ._step_run import run_masked_step
from .bitpack import unpack_mask

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def dense_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bool mask of ``like``'s shape from a bool or bit-packed uint8 mask."""
    return mask if mask.dtype == torch.bool else unpack_mask(mask, like.shape)


def _masked_grad(grad: torch.Tensor, mask: torch.Tensor, like: torch.Tensor,
                 grad_scale: torch.Tensor | None, maximize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept positions and ``g = ±keep * grad / grad_scale`` in ``like``'s dtype."""
    keep = dense_mask(mask, like)
    g = grad.to(like.dtype)
    if grad_scale is not None:
        g = g / grad_scale.to(dtype=like.dtype, device=g.device)
    g = torch.where(keep, g, torch.zeros((), dtype=like.dtype, device=g.device))
    return keep, -g if maximize else g


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    mask: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Masked Adam/AdamW update of one tensor, in place, in ``param``'s dtype.

    With ``k`` the mask, ``g = k * grad / grad_scale`` (negated if ``maximize``) and
    ``t = step`` (already advanced)::

        p <- p * (1 - lr * wd)                 if decoupled (AdamW, Loshchilov & Hutter 2019)
        g <- g + wd * p                        otherwise (Adam's L2 penalty)
        m <- m + (1 - beta1) * (g - m)
        v <- beta2 * v + (1 - beta2) * g^2
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
        p, m, v <- 0 where k is False

    Args:
        param, grad, exp_avg, exp_avg_sq: Tensors of one shape; updated in place
            (``grad`` is read only).
        mask: Bool mask of ``param``'s shape or bit-packed uint8.
        step: Step count after this step (1 on the first step).
        lr, beta1, beta2, eps, weight_decay: As in ``torch.optim.AdamW``.
        decoupled: Decoupled weight decay (AdamW) instead of L2 (Adam).
        maximize: Ascend instead of descend.
        grad_scale: Optional scale the gradient is divided by.
    """
    keep, g = _masked_grad(grad, mask, param, grad_scale, maximize)
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    pruned = ~keep
    for t in (param, exp_avg, exp_avg_sq):
        t.masked_fill_(pruned, 0)


def sgd_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    mask: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    first: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Masked SGD update of one tensor (momentum, Nesterov, weight decay), in place.

    With ``k`` the mask and ``g = k * grad / grad_scale`` (negated if ``maximize``)::

        g <- g + wd * p
        b <- g                                 on the first step
        b <- momentum * b + (1 - dampening) * g   afterwards
        d <- g + momentum * b if nesterov else b
        p <- p - lr * d
        p, b <- 0 where k is False

    Args:
        param, grad: Tensors of one shape; ``param`` updated in place.
        mask: Bool mask of ``param``'s shape or bit-packed uint8.
        momentum_buffer: State tensor updated in place; None when ``momentum == 0``.
        first: The buffer is new and is initialised with ``g``.
        lr, momentum, dampening, weight_decay, nesterov, maximize: As in
            ``torch.optim.SGD``.
        grad_scale: Optional scale the gradient is divided by.
    """
    keep, g = _masked_grad(grad, mask, param, grad_scale, maximize)
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0:
        if first:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)
    param.masked_fill_(~keep, 0)
    if momentum_buffer is not None:
        momentum_buffer.masked_fill_(~keep, 0)


def apply_batch(
    batch: StepBatch, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """Update every tensor of a ``StepBatch`` with ``adam_update`` or ``sgd_update``.

    bfloat16 and float16 parameters and their state are updated on float32 copies and
    rounded once, as the kernel and torch's ``fused=True`` optimizers do."""
    if found_inf is not None and bool(found_inf.item()):
        return
    hp = batch.hparams
    for i, (p, g, k) in enumerate(zip(batch.params, batch.grads, batch.masks, strict=True)):
        if batch.algo == "adam":
            state = [batch.exp_avgs[i], batch.exp_avg_sqs[i]]
        else:
            state = [batch.momentum_buffers[i]] if batch.momentum_buffers else []
        stored = [p, *state]
        work = [t.float() if t.dtype in _LOW_PRECISION else t for t in stored]
        if batch.algo == "adam":
            adam_update(work[0], g, k, work[1], work[2], float(batch.steps[i]),
                                  grad_scale=grad_scale, **hp)
        else:
            buf = work[1] if state else None
            sgd_update(work[0], g, k, buf, first=batch.sgd_first,
                                 grad_scale=grad_scale, **hp)
        for tensor, updated in zip(stored, work, strict=True):
            if updated is not tensor:
                tensor.copy_(updated)


def masked_step_single_tensor(
    optimizer: torch.optim.Optimizer,
    masks: Mapping[torch.Tensor, torch.Tensor],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``fused_masked_step`` in pure torch: the same arguments, planning and state handling,
    each tensor updated by ``adam_update`` or ``sgd_update``.

    Raises:
        ValueError: For an unsupported optimizer or option, or a malformed mask.
    """
    run_masked_step(optimizer, masks, grad_scale, found_inf, apply_batch)
