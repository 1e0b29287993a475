"""Optional Triton import and the rule for when the kernels can run on a device."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as _err:  # the kernels are optional: pip install sparse_training[kernels]
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: str | None = f"triton is not importable ({_err})"
else:
    TRITON_IMPORT_ERROR = None

HAS_TRITON = TRITON_IMPORT_ERROR is None


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    CUDA devices always qualify when Triton is installed; CPU tensors qualify only
    under ``TRITON_INTERPRET=1``, which is how CI tests the kernels without a GPU.
    """
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())
