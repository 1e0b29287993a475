"""benchmarks/_common.py's profile arithmetic on hand-made device events: busy time, the
NCCL time no compute kernel overlaps, per collective kind."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from _common import collective_kind, communication_ms  # noqa: E402


@dataclass
class Span:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    name: str
    time_range: Span
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA
    is_user_annotation: bool = False


def event(name: str, start: float, end: float) -> Event:
    return Event(name, Span(start, end))


def test_exposed_time_per_collective_is_what_no_compute_kernel_covers():
    events = [
        event("gemm", 0, 1000), event("gemm", 1500, 2000),
        # half hidden behind the first gemm, half alone: 300 us exposed of 600
        event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 700, 1300),
        # entirely in the gap after the second gemm: all exposed
        event("ncclKernel_ReduceScatter_RING_LL_Sum_float(...)", 2000, 2400),
        # fully hidden
        event("ncclDevKernel_AllGather_RING_LL(...)", 1600, 1900),
        event("Optimizer.step#AdamW.step", 0, 5000),  # a range, not device work
    ]
    profile = communication_ms(events, steps=2)
    assert profile["gpu_busy_ms"] == pytest.approx((1300 + 900) / 1e3 / 2)
    assert profile["compute_busy_ms"] == pytest.approx((1000 + 500) / 1e3 / 2)
    assert profile["exposed_nccl_ms"] == pytest.approx((300 + 400) / 1e3 / 2)
    assert profile["collectives"] == {
        "AllGather": {"count": 1.0, "ms": pytest.approx(0.45), "exposed_ms": pytest.approx(0.15)},
        "ReduceScatter": {"count": 0.5, "ms": pytest.approx(0.2),
                          "exposed_ms": pytest.approx(0.2)},
    }
    kinds = profile["collectives"].values()
    assert sum(k["exposed_ms"] for k in kinds) == pytest.approx(profile["exposed_nccl_ms"])


@pytest.mark.parametrize(("kernel", "kind"), [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "AllReduce"),
    ("ncclDevKernel_Reduce_Sum_f32(x)", "Reduce"),
    ("ncclDevKernel_SendRecv(x)", "SendRecv"),
    ("ncclDevKernel_Generic(x)", "ncclDevKernel_Generic"),
])
def test_collective_kind_reads_the_kernel_name(kernel, kind):
    assert collective_kind(kernel) == kind
