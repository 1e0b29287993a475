"""Running the masked optimizer step: plans from ``_step_plan``, applied.

``run_masked_step`` plans the step, advances the ``step`` counters like torch does, and
hands each batch to an ``apply`` function (the Triton launcher or the pure-torch
reference). Afterwards it sets ``p.grad = None`` for every parameter it handled, so that
the optimizer's own ``step()`` only updates the unmasked parameters.

With ``cache=True`` (the fused step) the plan is kept per optimizer and reused while
the same parameters, masks and state objects come back (the engine passes the same
ones every step): a step is then a few identity checks, one read of the gradients, one
in-place add on a stacked ``step`` buffer and the launches. The Adam ``step``
counters of a cached plan are 0-d views of one 1-D tensor (same dtype and device as
torch places them), so ``optimizer.state[p]["step"]`` is always current and
``state_dict()`` / a plain ``optimizer.step()`` see ordinary step tensors.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ._shards import is_sharded, local
from ._step_plan import StepBatch, group_hparams, options_unsupported_reason, plan_batches


def run_masked_step(
    optimizer: torch.optim.Optimizer,
    masks: Mapping[torch.Tensor, torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    apply: Callable[[StepBatch, torch.Tensor | None, torch.Tensor | None], None],
    cache: bool = False,
) -> None:
    """Masked optimizer step: plan batches, create state, advance steps, ``apply``.

    ``found_inf`` is handled like torch's fused optimizers: device-side ``step``
    counters are advanced by ``1 - found_inf`` and the kernels write nothing when it is
    nonzero. Where host state depends on it (``step`` counters on the CPU, as torch
    keeps them for non-fused optimizers, or SGD momentum buffers still to create), its
    value is read once, which synchronises, as ``GradScaler.step`` does for such
    optimizers.

    Args:
        optimizer: A ``torch.optim.AdamW``, ``Adam`` or ``SGD``.
        masks: Parameter tensor -> bool mask of its shape, or of its local shard's for a
            DTensor (or packed uint8).
        grad_scale: Optional scale the gradients are divided by.
        found_inf: Optional float tensor; nonzero skips the step.
        apply: Updates one batch in place.
        cache: Keep the plan per optimizer and reuse it while parameters, masks,
            param groups and state objects are the same ones (see the module doc).

    Raises:
        ValueError: For an unsupported optimizer or option, or a malformed mask.
    """
    reason = options_unsupported_reason(optimizer)
    if reason is not None:
        raise ValueError(f"fused masked step unavailable: {reason}")
    with torch.no_grad():
        if not cache or not _run_cached(optimizer, masks, grad_scale, found_inf, apply):
            _run(optimizer, masks, grad_scale, found_inf, apply)


def _run(optimizer, masks, grad_scale, found_inf, apply) -> None:
    batches, handled = plan_batches(optimizer, masks)
    host_state = any(b.sgd_first or any(s.device.type == "cpu" for s in b.steps) for b in batches)
    skip = found_inf is not None and host_state and bool(found_inf.item())
    if not skip:
        for b in batches:
            if b.sgd_first:
                for p in b.keys:  # a DTensor's empty_like is a DTensor
                    buf = optimizer.state[p]["momentum_buffer"] = torch.empty_like(p)
                    b.momentum_buffers.append(local(buf))
            steps = b.steps
            if steps:
                torch._foreach_add_(steps, 1)
                if found_inf is not None and steps[0].device.type != "cpu":
                    torch._foreach_sub_(steps, [found_inf.to(steps[0].device)] * len(steps))
            apply(b, grad_scale, found_inf)
    for p in handled:
        p.grad = None


# ---------------------------------------------------------------------------------
# Cached plans (fused step): one per optimizer, validated by identity at every call.

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _CachedPlan:
    mask_keys: list  # the masks mapping's keys and values, in its order (strong refs)
    mask_vals: list
    mask_ptrs: list[int]
    state: object  # optimizer.state and its values (the per-parameter state dicts)
    state_dicts: list
    groups: list  # (group["params"] list, its length) per param group
    params: list  # handled parameters (the optimizer's), batch after batch
    param_ptrs: list[int]  # addresses of their local shards
    sharded: bool  # some are DTensors: shards and gradients looked up through ``local``
    grad_dtypes: list
    batches: list[StepBatch]
    slices: list[tuple[int, int]]
    momentum_on: list[bool]
    host_state: bool

    def valid(self, optimizer: torch.optim.Optimizer, masks: Mapping) -> bool:
        groups = optimizer.param_groups
        state = optimizer.state
        return (
            len(masks) == len(self.mask_keys)
            and all(map(operator.is_, masks, self.mask_keys))
            and all(map(operator.is_, masks.values(), self.mask_vals))
            and state is self.state
            and len(groups) == len(self.groups)
            and all(
                g["params"] is ps and len(ps) == n
                for g, (ps, n) in zip(groups, self.groups, strict=True)
            )
            and len(state) == len(self.state_dicts)
            and all(map(operator.is_, state.values(), self.state_dicts))
            and list(map(Tensor.data_ptr, map(local, self.params) if self.sharded
                         else self.params)) == self.param_ptrs  # FSDP swaps shards
            and list(map(Tensor.data_ptr, self.mask_vals)) == self.mask_ptrs
        )


def clear_plan_cache(optimizer: torch.optim.Optimizer | None = None) -> None:
    """Forget the cached plan of ``optimizer`` (all plans if None).

    Needed only after replacing a single state tensor inside an existing per-parameter
    state dict by hand (``optimizer.state[p]["exp_avg"] = t``); new masks, parameters,
    param groups, ``load_state_dict`` and moved state dicts are detected.
    """
    if optimizer is None:
        _PLANS.clear()
    else:
        _PLANS.pop(optimizer, None)


def _build_plan(optimizer, masks) -> _CachedPlan | None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None and masks.get(p) is not None:
                return None  # the handled set would change with the gradients: no cache
    batches, handled = plan_batches(optimizer, masks)
    if any(b.sgd_first for b in batches):
        return None  # momentum buffers are created by this step; plan the next one
    slices, start = [], 0
    for b in batches:
        slices.append((start, start + len(b.params)))
        start += len(b.params)
        steps = b.steps
        if not steps:
            continue
        s0 = steps[0]
        if not all(s.dim() == 0 and s.device == s0.device and s.dtype == s0.dtype for s in steps):
            return None
        buf = torch.stack(steps)
        views = list(buf.unbind(0))
        for p, v in zip(b.keys, views, strict=True):
            optimizer.state[p]["step"] = v
        b.steps, b.step_buffer = views, buf
    params = [p for b in batches for p in b.keys]
    if not params:
        return None
    mask_vals = list(masks.values())
    return _CachedPlan(
        mask_keys=list(masks),
        mask_vals=mask_vals,
        mask_ptrs=[k.data_ptr() for k in mask_vals],
        state=optimizer.state,
        state_dicts=list(optimizer.state.values()),
        groups=[(g["params"], len(g["params"])) for g in optimizer.param_groups],
        params=params,
        param_ptrs=[shard.data_ptr() for b in batches for shard in b.params],
        sharded=any(map(is_sharded, params)),
        grad_dtypes=[p.grad.dtype for p in params],
        batches=batches,
        slices=slices,
        momentum_on=[b.algo == "sgd" and b.hparams["momentum"] != 0 for b in batches],
        host_state=any(
            b.step_buffer is not None and b.step_buffer.device.type == "cpu" for b in batches
        ),
    )


def _run_cached(optimizer, masks, grad_scale, found_inf, apply) -> bool:
    """One step through the cached plan; False (nothing done) if the slow path must run."""
    plan = _PLANS.get(optimizer)
    if plan is None or not plan.valid(optimizer, masks):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # the graph would replay the state's creation and the step counters' stacking
            raise RuntimeError(
                "the fused masked step was captured in a CUDA graph before it was planned "
                "(first step, or new masks, parameters or optimizer state): run one step "
                "before capturing, and capture again after such changes")
        plan = _build_plan(optimizer, masks)
        if plan is None:
            _PLANS.pop(optimizer, None)
            return False
        _PLANS[optimizer] = plan
    params = plan.params
    grads = list(map(_GRAD, params))
    if plan.sharded:
        grads = list(map(local, grads))  # local(None) is None
    try:  # None (TypeError) or sparse (RuntimeError) gradients take the slow path
        if not all(map(Tensor.is_contiguous, grads)):
            return False
    except (TypeError, RuntimeError):
        return False
    if not all(map(operator.is_, map(_DTYPE, grads), plan.grad_dtypes)):
        return False
    groups = optimizer.param_groups
    hps = {}
    for b, momentum_on in zip(plan.batches, plan.momentum_on, strict=True):
        hp = hps.get(b.group_index)
        if hp is None:
            hp = hps[b.group_index] = group_hparams(optimizer, groups[b.group_index])
        if b.algo == "sgd" and (hp["momentum"] != 0) != momentum_on:
            _PLANS.pop(optimizer, None)  # momentum switched on/off: buffers change
            return False
    skip = found_inf is not None and plan.host_state and bool(found_inf.item())
    if not skip:
        for b, (lo, hi) in zip(plan.batches, plan.slices, strict=True):
            b.hparams = hps[b.group_index]
            b.grads = grads[lo:hi]
            buf = b.step_buffer
            if buf is not None:
                buf.add_(1)
                if found_inf is not None and buf.device.type != "cpu":
                    buf.sub_(found_inf.to(buf.device))
            apply(b, grad_scale, found_inf)
            b.grads = []
    for p in params:
        p.grad = None
    return True
