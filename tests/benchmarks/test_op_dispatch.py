"""benchmarks/op_dispatch.py on the CPU: one row per product, the dispatch column the
difference of the two it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "op_dispatch.py"


def test_rows_per_product_and_the_dispatch_difference(tmp_path):
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, str(SCRIPT), "--calls", "5", "--repeats", "1"],
                         capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "op_dispatch_cpu.json").read_text())["rows"]
    assert [r["product"] for r in rows] == ["forward", "input grad", "weight grad"]
    for row in rows:
        assert min(row["direct_us"], row["op_no_grad_us"], row["op_grad_us"]) > 0
        assert row["dispatch_us"] == pytest.approx(row["op_no_grad_us"] - row["direct_us"])
