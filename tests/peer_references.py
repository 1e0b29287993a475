"""References the peer tests share, written from the papers, sharing no code with the
library: RigL's ERK loop (Evci et al. 2020) and Zhu & Gupta's GMP cubic (2017)."""

from __future__ import annotations

import math


def rigl_erk(shapes: list[tuple[int, ...]], sparsity: float) -> list[float]:
    """RigL's ERK sparsities, transcribed from its loop (float64 Python arithmetic)."""
    dense: set[int] = set()
    while True:
        divisor, rhs, raw = 0.0, 0.0, {}
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            if i in dense:
                rhs -= n * sparsity
            else:
                rhs += n * (1 - sparsity)
                raw[i] = sum(shape) / n
                divisor += raw[i] * n
        if not raw:  # every layer dense (sparsity 0 can get here; RigL divides by zero)
            return [0.0] * len(shapes)
        eps = rhs / divisor
        largest = max(raw.values())
        if largest * eps <= 1:
            return [0.0 if i in dense else 1 - eps * raw[i] for i in range(len(shapes))]
        dense |= {i for i, r in raw.items() if r == largest}


def zhu_gupta(t: int, s_f: float, t0: int, t1: int) -> float:
    """s_t of Zhu & Gupta 2017 with s_i = 0 and n dt = t1 - t0, held outside [t0, t1]."""
    if t < t0:
        return 0.0
    if t >= t1:
        return s_f
    return s_f + (0.0 - s_f) * (1 - (t - t0) / (t1 - t0)) ** 3
