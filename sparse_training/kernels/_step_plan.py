"""Host side of the masked optimizer step, shared by the kernels and the reference.

``run_masked_step`` walks the optimizer's param groups, creates missing state with
exactly torch's layout, advances the ``step`` counters like torch does, groups the
tensors into batches that one kernel launch can serve, and hands each batch to an
``apply`` function (the Triton launcher or the pure-torch reference). Afterwards it
sets ``p.grad = None`` for every parameter it handled, so that the optimizer's own
``step()`` only updates the unmasked parameters.

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
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._triton import TRITON_IMPORT_ERROR, interpret_mode

_SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class StepBatch:
    """Tensors of one param group that one kernel launch updates together.

    Attributes:
        algo: ``"adam"`` (Adam and AdamW) or ``"sgd"``.
        hparams: Scalars read from the param group (``lr``, ``beta1``, ``beta2``,
            ``eps``, ``weight_decay``, ``decoupled``, ``maximize``, ``momentum``,
            ``dampening``, ``nesterov``).
        sgd_first: SGD only: the momentum buffers were just created; this step
            initialises them with the gradient, as torch does.
        params, grads, masks: Parallel lists; a mask is bool of the param's shape
            or bit-packed uint8 (see ``pack_mask``).
        exp_avgs, exp_avg_sqs, steps: Adam state tensors (steps already advanced).
        momentum_buffers: SGD state (empty without momentum).
        group_index: Index of the param group in ``optimizer.param_groups``.
        step_buffer: In a cached plan, the 1-D tensor whose elements ``steps`` are
            views of (one in-place add advances them all); else None.
        launch: Launcher-side cache (addresses, tables) kept with a cached plan.
    """

    algo: str
    hparams: dict
    sgd_first: bool = False
    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    momentum_buffers: list[torch.Tensor] = field(default_factory=list)
    group_index: int = -1
    step_buffer: torch.Tensor | None = None
    launch: object = None


def options_unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the masked step cannot run this optimizer's math, or None (device not checked)."""
    kind = type(optimizer)
    if kind not in _SUPPORTED:
        return (
            f"{kind.__module__}.{kind.__qualname__} is not one of torch.optim.AdamW, "
            "torch.optim.Adam, torch.optim.SGD (subclasses may change the math)"
        )
    for i, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "differentiable", "capturable"):
            if group.get(option, False):
                return f"param group {i} sets {option}=True, which the fused masked step does not support"
        if (
            kind is torch.optim.SGD
            and group["nesterov"]
            and (group["momentum"] <= 0 or group["dampening"] != 0)
        ):
            return f"param group {i}: Nesterov momentum requires momentum > 0 and zero dampening"
    return None


def device_unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the Triton kernels cannot serve this optimizer's parameters, or None."""
    if TRITON_IMPORT_ERROR is not None:
        return f"{TRITON_IMPORT_ERROR}; install sparse_training[kernels]"
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.dtype not in _PARAM_DTYPES:
                return (f"a parameter has dtype {p.dtype}; the fused masked step needs "
                        "float32, bfloat16 or float16 parameters")
            if p.device.type != "cuda" and not (p.device.type == "cpu" and interpret_mode()):
                return f"a parameter is on {p.device}; the fused masked step needs CUDA tensors"
    return None


def _hparams(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    lr = group["lr"]
    hp = {
        "lr": float(lr),
        "weight_decay": float(group["weight_decay"]),
        "maximize": bool(group.get("maximize", False)),
    }
    if isinstance(optimizer, torch.optim.SGD):
        hp.update(
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
        )
    else:
        beta1, beta2 = group["betas"]
        hp.update(
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            decoupled=bool(
                group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
            ),
        )
    return hp


def _check_mask(p: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.device != p.device:
        raise ValueError(f"mask on {mask.device} for a parameter on {p.device}")
    if mask.dtype == torch.bool:
        if mask.shape != p.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != parameter shape {tuple(p.shape)}")
    elif mask.dtype == torch.uint8:
        if mask.dim() != 1 or mask.numel() != (p.numel() + 7) // 8:
            raise ValueError(
                f"packed mask of {mask.numel()} bytes for a parameter of {p.numel()} elements"
            )
    else:
        raise ValueError(f"mask dtype {mask.dtype}; expected torch.bool or bit-packed torch.uint8")


def _new_step(group: dict, p: torch.Tensor) -> torch.Tensor:
    # Same placement as torch's Adam._init_group: on the device only for fused/capturable.
    if group.get("fused") or group.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=p.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=dtype)


def _plan(
    optimizer: torch.optim.Optimizer, masks: Mapping[torch.Tensor, torch.Tensor]
) -> tuple[list[StepBatch], list[torch.Tensor]]:
    batches: dict[tuple, StepBatch] = {}
    handled = []
    is_sgd = isinstance(optimizer, torch.optim.SGD)
    for gi, group in enumerate(optimizer.param_groups):
        hp = None
        for p in group["params"]:
            grad = p.grad
            mask = masks.get(p)
            if grad is None or mask is None:
                continue
            if grad.is_sparse:
                raise ValueError("sparse gradients are not supported by the masked step")
            _check_mask(p, mask)
            hp = hp or _hparams(optimizer, group)
            state = optimizer.state[p]
            if is_sgd:
                buf = state.get("momentum_buffer")
                first = hp["momentum"] != 0 and buf is None
                key = (gi, p.dtype, grad.dtype, mask.dtype, p.device, first)
            else:
                if len(state) == 0:
                    state["step"] = _new_step(group, p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                first = False
                key = (gi, p.dtype, grad.dtype, mask.dtype, p.device, state["step"].device)
            batch = batches.get(key)
            if batch is None:
                batch = batches[key] = StepBatch(
                    "sgd" if is_sgd else "adam", hp, sgd_first=first, group_index=gi
                )
            batch.params.append(p)
            batch.grads.append(grad)
            batch.masks.append(mask)
            if not is_sgd:
                batch.exp_avgs.append(state["exp_avg"])
                batch.exp_avg_sqs.append(state["exp_avg_sq"])
                batch.steps.append(state["step"])
            elif not first and hp["momentum"] != 0:
                batch.momentum_buffers.append(buf)
            handled.append(p)
    return list(batches.values()), handled


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
        masks: Parameter tensor -> bool mask of its shape (or packed uint8).
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
    batches, handled = _plan(optimizer, masks)
    host_state = any(b.sgd_first or any(s.device.type == "cpu" for s in b.steps) for b in batches)
    skip = found_inf is not None and host_state and bool(found_inf.item())
    if not skip:
        for b in batches:
            if b.sgd_first:
                b.momentum_buffers = [torch.empty_like(p) for p in b.params]
                for p, buf in zip(b.params, b.momentum_buffers, strict=True):
                    optimizer.state[p]["momentum_buffer"] = buf
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
    params: list  # handled parameters, batch after batch
    param_ptrs: list[int]
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
            and list(map(Tensor.data_ptr, self.params)) == self.param_ptrs
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
    batches, handled = _plan(optimizer, masks)
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
        for p, v in zip(b.params, views, strict=True):
            optimizer.state[p]["step"] = v
        b.steps, b.step_buffer = views, buf
    params = [p for b in batches for p in b.params]
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
        param_ptrs=[p.data_ptr() for p in params],
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
        plan = _build_plan(optimizer, masks)
        if plan is None:
            _PLANS.pop(optimizer, None)
            return False
        _PLANS[optimizer] = plan
    params = plan.params
    grads = list(map(_GRAD, params))
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
            hp = hps[b.group_index] = _hparams(optimizer, groups[b.group_index])
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
