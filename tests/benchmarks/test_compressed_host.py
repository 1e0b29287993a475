"""benchmarks/compressed_host.py on the CPU, 2 encoder layers: every variant trains through
the Trainer, the compressed one with 12 BlockSparseLinear layers whose launches all hit the
tuned-launch cache after the warmup, and the table and JSON hold the host figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "compressed_host.py"


def test_cpu_run_gives_the_host_table_and_json(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--steps", "3",
                           "--warmup", "2", "--profile-steps", "2", "--rounds", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sparse_training functions per step" in done.stdout
    result = json.loads((tmp_path / "compressed_host_cpu.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["dense", "masked-dense", "compressed"]
    assert [rows[v]["compressed_layers"] for v in rows] == [0, 0, 12]
    for row in rows.values():
        assert len(row["step_ms"]) == 3 and len(row["round_ms"]) == 2 and row["ms"] > 0
        assert row["aten_ops"] > 0 and row["python_calls"] > 0 and row["sync_sites"] == []
    compressed = rows["compressed"]
    assert compressed["launch_misses"] == 0
    names = [f["function"] for f in compressed["functions"]]
    assert any("block_sparse/launch.py" in name for name in names)
    # 3 launches per layer and step (forward, dX, dV), the products stubbed: no reference
    launches = next(f for f in compressed["functions"] if f["function"].endswith("(__call__)")
                    and "block_sparse/launch.py" in f["function"])
    assert launches["calls"] == 3 * 12 and compressed["reference_ms"] == 0
    assert rows["dense"]["own_ms"] == 0 < rows["masked-dense"]["own_ms"]
    assert sorted(result["layer_host_us"]) == sorted(
        f"{layer} {mode}" for layer in ("nn.Linear", "BlockSparseLinear")
        for mode in ("float32", "autocast torch.bfloat16"))
    assert all(us > 0 for us in result["layer_host_us"].values())


def test_compiled_run_finds_the_layers_topologies_and_splits_host_time_by_package(tmp_path):
    """``--compile default`` (aot_eager here, for time): the compiled step's custom-op calls
    build no topology (they find the layers' own, and the launches kept for them) and the
    profile splits the host time by package, the custom ops' dispatch layers included."""
    env = dict(os.environ, OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--steps", "3",
                           "--warmup", "2", "--profile-steps", "2", "--rounds", "1",
                           "--variants", "compressed", "--compile", "default",
                           "--backend", "aot_eager", "--top", "40"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "compressed_host_cpu.json").read_text())
    (row,) = result["rows"]
    assert row["compressed_layers"] == 12 and row["launch_misses"] == 0
    assert row["packages"]["torch/_library"] > 0 and row["packages"]["sparse_training"] > 0
    names = [f["function"] for f in row["functions"]]
    assert any(name.endswith("(_topology)") for name in names)
    assert not any(name.endswith("(__post_init__)") for name in names)
    assert any("torch/_library" in f["function"] for f in row["top_functions"])
