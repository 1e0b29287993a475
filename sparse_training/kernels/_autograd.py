"""What the kernels' autograd Functions and the layers around them share."""

from __future__ import annotations

import torch

AUTOCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts


def refuse_create_graph(op: str) -> None:
    """Raise where a backward runs with ``create_graph=True`` (grad mode is on inside a
    backward only then): the kernels' gradients are not differentiable, and a graph through
    them would miss their terms silently (``once_differentiable`` raises only where the
    second derivative reaches one of its own inputs, not for a gradient penalty)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: second derivatives (backward with create_graph=True, a "
                           f"gradient penalty) are not supported through its kernels")
