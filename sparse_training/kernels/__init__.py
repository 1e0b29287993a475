"""Triton kernels: fused masked optimizer step and fast mask computation.

Public API:
    fused_masked_step, fused_unsupported_reason, masked_step_reference,
    zero_pruned_, zero_pruned_reference,
    nm_topk_mask, nm_topk_masks, nm_topk_mask_reference,
    global_magnitude_threshold, global_magnitude_threshold_reference,
    pack_mask, unpack_mask.

Without Triton the mask functions fall back to their pure-torch references, the step to
its pure-torch single-tensor form, and ``fused_unsupported_reason`` says that Triton is
missing.
"""

from ._step_plan import options_unsupported_reason
from ._triton import HAS_TRITON
from .bitpack import pack_mask, unpack_mask
from .reference import (
    global_magnitude_threshold_reference,
    masked_step_reference,
    nm_topk_mask_reference,
    zero_pruned_reference,
)

if HAS_TRITON:
    from .global_threshold import global_magnitude_threshold
    from .masked_step import fused_masked_step, fused_unsupported_reason
    from .masked_zero import zero_pruned_
    from .nm_mask import nm_topk_mask, nm_topk_masks
else:
    from ._step_plan import device_unsupported_reason
    from ._step_single_tensor import masked_step_single_tensor as fused_masked_step
    global_magnitude_threshold = global_magnitude_threshold_reference
    nm_topk_mask = nm_topk_mask_reference
    zero_pruned_ = zero_pruned_reference

    def nm_topk_masks(scores, n, m):
        """N:M masks of several tensors (reference fallback without Triton)."""
        return [nm_topk_mask_reference(s, n, m) for s in scores]

    def fused_unsupported_reason(optimizer):
        """Why the fused step cannot serve ``optimizer`` (here: Triton is missing)."""
        return options_unsupported_reason(optimizer) or device_unsupported_reason(optimizer)


__all__ = [
    "fused_masked_step",
    "fused_unsupported_reason",
    "global_magnitude_threshold",
    "global_magnitude_threshold_reference",
    "masked_step_reference",
    "nm_topk_mask",
    "nm_topk_mask_reference",
    "nm_topk_masks",
    "pack_mask",
    "unpack_mask",
    "zero_pruned_",
    "zero_pruned_reference",
]
