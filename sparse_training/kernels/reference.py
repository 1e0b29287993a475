"""Pure-torch references for the kernels, sharing no code with them.

They give the tests their ground truth (run on float64 copies) and serve as the CPU
fallback of the mask kernels. They loop over tensors in Python and make several passes
over memory, so they are slow on a GPU; the kernels exist to avoid exactly that.

The masked optimizer step's reference runs torch's own optimizer on the masked gradient
and zeroes the pruned entries by hand (the ASP recipe), not the fused step's planner; its
pure-torch fallback is ``_step_single_tensor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def zero_pruned_reference(tensors: Sequence[torch.Tensor],
                          masks: Sequence[torch.Tensor]) -> None:
    """In place, for every pair: ``tensor[~mask] = 0`` (one ``torch.where`` each)."""
    for tensor, mask in zip(tensors, masks, strict=True):
        torch.where(mask, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device),
                    out=tensor)


def masked_step_reference(
    optimizer: torch.optim.Optimizer,
    masks: Mapping[torch.Tensor, torch.Tensor],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The masked optimizer step as torch's own optimizer takes it, masked by hand.

    For every parameter ``p`` of ``masks`` that has a gradient, with ``k`` its mask::

        p.grad <- p.grad / grad_scale where k, else 0
        optimizer.step()                  # torch.optim.AdamW / Adam / SGD, unchanged
        p, s <- 0 where k is False        # every state tensor s of p's shape

    Elementwise optimizers update each entry from its own gradient and state, so the kept
    entries take torch's update and the pruned ones stay exact zeros: what
    ``fused_masked_step`` must compute. Parameters without a mask keep their gradients and
    are not stepped; masked ones end with ``grad = None``, also when a nonzero
    ``found_inf`` skips the step (the fused step's convention). The step runs with
    ``capturable=False``: torch refuses capturable CPU tensors, and the flag changes where
    the bias corrections are computed, not their values.

    Args:
        optimizer: A torch optimizer over copies of the parameters (float64 for the
            ground truth); stepped in place.
        masks: Parameter -> bool mask of its shape.
        grad_scale: Optional scale the gradients are divided by.
        found_inf: Optional tensor; nonzero skips the step.

    Raises:
        ValueError: If a mask is not a bool tensor of its parameter's shape.
    """
    for p, k in masks.items():
        if k.dtype != torch.bool or k.shape != p.shape:
            raise ValueError(f"masked_step_reference takes bool masks of the parameter's "
                             f"shape {tuple(p.shape)}, got {k.dtype} of {tuple(k.shape)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stepped = [p for p in params if p in masks and p.grad is not None]
    held = {p: p.grad for p in params if p not in masks and p.grad is not None}
    if found_inf is None or not bool(found_inf.item()):
        for p in held:
            p.grad = None
        with torch.no_grad():
            for p in stepped:
                grad = p.grad.to(p.dtype)
                if grad_scale is not None:
                    grad = grad / grad_scale.to(p.dtype)
                p.grad = torch.where(masks[p], grad, torch.zeros((), dtype=p.dtype))
        capturable = [group.get("capturable", False) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["capturable"] = False
        try:
            optimizer.step()
        finally:
            for group, flag in zip(optimizer.param_groups, capturable, strict=True):
                group["capturable"] = flag
        with torch.no_grad():
            for p in stepped:
                pruned = ~masks[p]
                p.masked_fill_(pruned, 0)
                for value in optimizer.state[p].values():
                    if torch.is_tensor(value) and value.shape == p.shape:
                        value.masked_fill_(pruned, 0)
        for p, grad in held.items():
            p.grad = grad
    for p in stepped:
        p.grad = None


def nm_topk_mask_reference(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` largest of every ``m`` consecutive scores along the last dim.

    Ties go to the lower index (a stable descending sort).

    Args:
        score: Tensor whose last dim is a multiple of ``m``.
        n: Elements kept per group, ``0 <= n <= m``.
        m: Group size.

    Returns:
        Bool mask of ``score``'s shape with exactly ``n`` True per group.

    Raises:
        ValueError: If the last dim is not a multiple of ``m`` or ``n`` is out of range.
    """
    if score.dim() == 0 or score.shape[-1] % m != 0 or not 0 <= n <= m:
        raise ValueError(
            f"need last dim % m == 0 and 0 <= n <= m (shape {tuple(score.shape)}, {n}:{m})"
        )
    groups = score.reshape(-1, m)
    order = torch.sort(groups, dim=1, descending=True, stable=True).indices[:, :n]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, order, True)
    return mask.reshape(score.shape)


def global_magnitude_threshold_reference(
    tensors: Sequence[torch.Tensor], kept: int
) -> torch.Tensor:
    """The ``kept``-th largest ``|w|`` over all tensors (full concatenation + kthvalue).

    Keeping ``|w| >= threshold`` keeps ``kept`` weights when there are no ties at the
    threshold.

    Args:
        tensors: Weight tensors (any shapes, one device).
        kept: Number of weights to keep, ``1 <= kept <= total``.

    Returns:
        0-d float32 tensor on the tensors' device.

    Raises:
        ValueError: If ``kept`` is out of range.
    """
    flat = torch.cat([t.detach().reshape(-1).float().abs() for t in tensors])
    if not 1 <= kept <= flat.numel():
        raise ValueError(f"kept={kept} out of range for {flat.numel()} weights")
    return flat.kthvalue(flat.numel() - kept + 1).values
