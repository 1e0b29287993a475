"""Host side of the masked optimizer step, shared by the kernels and the reference: what
it supports, and the plan of one step.

``plan_batches`` walks the optimizer's param groups, creates missing state with exactly torch's
layout and groups the tensors into batches that one kernel launch can serve
(``StepBatch``). Parameters may be FSDP2's DTensors: a batch then holds their local
shards, with masks of the shards' shapes, and the state stays DTensors in the optimizer.
``_step_run`` runs the plans.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ._shards import is_sharded, local
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
        keys: The optimizer's parameters (DTensors under FSDP2), keys of its state.
        params, grads, masks: Parallel lists of what the kernel reads and writes: the
            parameters' local shards (the parameters themselves when not sharded), their
            gradients' local shards, and masks of the local shards' shapes (bool, or
            bit-packed uint8, see ``pack_mask``).
        exp_avgs, exp_avg_sqs: Adam's moments (local shards).
        steps: Adam's step counters (plain 0-d tensors, already advanced).
        momentum_buffers: SGD state (local shards; empty without momentum).
        group_index: Index of the param group in ``optimizer.param_groups``.
        step_buffer: In a cached plan, the 1-D tensor whose elements ``steps`` are
            views of (one in-place add advances them all); else None.
        launch: Launcher-side cache (addresses, tables) kept with a cached plan.
    """

    algo: str
    hparams: dict
    sgd_first: bool = False
    keys: list[torch.Tensor] = field(default_factory=list)
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
        for option in ("amsgrad", "differentiable"):
            if group.get(option, False):
                return f"param group {i} sets {option}=True, which the fused masked step does not support"
        if group.get("capturable", False) and isinstance(group["lr"], torch.Tensor):
            return (f"param group {i} sets capturable=True with a tensor lr; the fused masked "
                    "step reads lr on the host (a float lr is supported; a captured step keeps "
                    "the lr it was captured with, as torch's does)")
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


def group_hparams(optimizer: torch.optim.Optimizer, group: dict) -> dict:
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
            raise ValueError(f"mask shape {tuple(mask.shape)} != parameter shape {tuple(p.shape)} "
                             "(of its local shard for a DTensor)")
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


def _check_alike(p: torch.Tensor, shard: torch.Tensor, name: str, tensor: torch.Tensor
                 ) -> torch.Tensor:
    """``tensor``'s part beside ``shard`` (the kernel writes it with the shard's element
    count): sharded like ``p`` and of the shard's shape, else an error."""
    part = local(tensor)
    if is_sharded(tensor) != is_sharded(p) or part.shape != shard.shape:
        what = "a DTensor" if is_sharded(tensor) else "a plain tensor"
        raise ValueError(
            f"{name} is {what} of local shape {tuple(part.shape)} for a parameter "
            f"{'sharded as a DTensor' if is_sharded(p) else 'not sharded'} whose "
            f"{'local shard' if is_sharded(p) else 'shape'} is {tuple(shard.shape)}; "
            "state loaded with another sharding must be resharded like the parameters")
    return part


def plan_batches(
    optimizer: torch.optim.Optimizer, masks: Mapping[torch.Tensor, torch.Tensor]
) -> tuple[list[StepBatch], list[torch.Tensor]]:
    """The batches of one step (and the parameters they handle): every parameter with a
    gradient and a mask, its missing Adam state created as torch creates it, grouped by
    param group, dtypes, mask format and devices; local shards for DTensors.

    Raises:
        ValueError: a sparse gradient, a malformed mask, or a gradient or state tensor that
            does not match the parameter (shape, or sharding).
    """
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
            shard = local(p)
            _check_mask(shard, mask)
            hp = hp or group_hparams(optimizer, group)
            state = optimizer.state[p]
            if is_sgd:
                buf = state.get("momentum_buffer")
                first = hp["momentum"] != 0 and buf is None
                key = (gi, p.dtype, grad.dtype, mask.dtype, shard.device, first)
            else:
                if len(state) == 0:
                    state["step"] = _new_step(group, p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                first = False
                key = (gi, p.dtype, grad.dtype, mask.dtype, shard.device,
                       state["step"].device)
            batch = batches.get(key)
            if batch is None:
                batch = batches[key] = StepBatch(
                    "sgd" if is_sgd else "adam", hp, sgd_first=first, group_index=gi
                )
            batch.keys.append(p)
            batch.params.append(shard)
            batch.grads.append(_check_alike(p, shard, "the gradient", grad))
            batch.masks.append(mask)
            if not is_sgd:
                batch.exp_avgs.append(_check_alike(p, shard, "exp_avg", state["exp_avg"]))
                batch.exp_avg_sqs.append(
                    _check_alike(p, shard, "exp_avg_sq", state["exp_avg_sq"]))
                batch.steps.append(state["step"])
            elif not first and hp["momentum"] != 0:
                batch.momentum_buffers.append(_check_alike(p, shard, "momentum_buffer", buf))
            handled.append(p)
    return list(batches.values()), handled
