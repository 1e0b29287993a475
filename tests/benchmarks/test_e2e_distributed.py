"""benchmarks/e2e_distributed.py in its CPU mode (``--model tiny --accelerator cpu``): a tiny
Llama trained dense and compressed under FSDP2 on 1 and 2 gloo processes, end to end through
the script, its rows checked against the model's own parameter counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import script_env, two_process_problem  # noqa: E402

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "e2e_distributed.py"
VARIANTS = ["dense fused", "block B 90% compressed"]


def tiny_llama_sizes() -> tuple[int, int]:
    """(parameters in the decoder layers, parameters outside them) of the CPU mode's
    tiny Llama (hidden 128, intermediate 256, 4 heads, 2 KV heads, vocabulary 256, 2
    layers), counted on a fresh HF model."""
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, vocab_size=256))
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return layers, sum(p.numel() for p in model.parameters()) - layers


def run_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    """The script in its CPU mode (1 warm-up step, 2 timed) with ``args``, checked to exit 0."""
    env = script_env()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--accelerator", "cpu", "--warmup", "1",
         "--steps", "2", "--out", str(out), *args],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Both variants on 1 and 2 ranks (each pair in a fresh process group, as the script
    runs it): its output and rows."""
    if problem := two_process_problem("cpu"):
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("e2e-distributed")
    done = run_script(out, "--gpus", "1", "2", "--variants", *VARIANTS)
    return done, json.loads((out / "e2e_distributed_tiny_cpu.json").read_text())["rows"]


@pytest.mark.slow
def test_cpu_mode_trains_dense_and_compressed_on_one_and_two_ranks(cpu_run):
    done, rows = cpu_run
    assert done.stdout.count("\nROW ") + done.stdout.startswith("ROW ") == 4  # streamed
    at = {(r["variant"], r["gpus"]): r for r in rows}
    assert sorted(at) == sorted((v, n) for v in VARIANTS for n in (1, 2))
    layers, rest = tiny_llama_sizes()  # every dim is even: 2 ranks pad nothing
    dense = at["dense fused", 2]["traffic"]
    # decoder layers gathered twice (forward, backward) in bf16, the root once; fp32 grads
    assert dense["all_gather_gb"] * 1e9 == pytest.approx((2 * layers + rest) * 2)
    assert dense["reduce_scatter_gb"] * 1e9 == pytest.approx((layers + rest) * 4)
    assert dense["wire_gb_per_gpu"] == pytest.approx(
        (dense["all_gather_gb"] + dense["reduce_scatter_gb"]) / 2)
    assert at["dense fused", 1]["traffic"]["wire_gb_per_gpu"] == 0
    compressed = at["block B 90% compressed", 2]
    assert compressed["compressed_layers"] == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert compressed["sparsity"] == pytest.approx(0.9, abs=0.01)
    # the layers' weights shrink to about a tenth: gathered bytes fall with them
    gathered = compressed["traffic"]["all_gather_gb"]
    assert rest * 2 < gathered * 1e9 < 0.5 * dense["all_gather_gb"] * 1e9
    for variant in VARIANTS:
        one, two = at[variant, 1], at[variant, 2]
        assert two["scaling_efficiency"] == pytest.approx(one["ms"] / two["ms"])
        assert two["speed_vs_dense"] == pytest.approx(at["dense fused", 2]["ms"] / two["ms"])
        # every rank trains the same batch, so the mean gradient and the losses are one
        # rank's, up to the rounding of the reduction
        assert one["loss_first"] == two["loss_first"]
        assert one["loss_last"] == pytest.approx(two["loss_last"], rel=1e-4)
        assert one["loss_last"] != one["loss_first"]  # the model trained


@pytest.mark.slow
def test_activation_checkpointing_recomputes_the_compressed_layers_to_the_same_losses(
        cpu_run, tmp_path):
    """``--checkpointing`` (HF's per-layer recompute, as a user turns it on) trains the
    compressed model under FSDP2 to the losses of the run without it (the 2-rank run of
    ``cpu_run``: the script runs each variant and rank count in a process of its own)."""
    variant = "block B 90% compressed"
    (plain,) = [r for r in cpu_run[1] if r["variant"] == variant and r["gpus"] == 2]
    run_script(tmp_path, "--gpus", "2", "--variants", variant, "--checkpointing")
    (recomputed,) = json.loads((tmp_path / "e2e_distributed_tiny_cpu_ckpt.json").read_text()
                               )["rows"]
    assert recomputed["compressed_layers"] == plain["compressed_layers"] == 14
    assert recomputed["loss_first"] == plain["loss_first"]
    assert recomputed["loss_last"] == pytest.approx(plain["loss_last"], rel=1e-5)
    assert recomputed["loss_last"] != recomputed["loss_first"]


def test_ranks_table_shows_each_ranks_profile_and_whether_their_tunings_agree():
    sys.path.insert(0, str(SCRIPT.parent))
    from e2e_distributed import ranks_table

    rows = [{"variant": "dense fused", "gpus": 1},
            {"variant": "block B 90% compressed", "gpus": 2, "tuned_configs_agree": False,
             "ranks": {"compute_busy_ms": [120.0, 131.5], "nccl_ms": [40.0, 9.25]}}]
    assert ranks_table(rows, block=128).splitlines()[2:] == [
        "| block 128x128 90% compressed | 2 | 120.0 / 131.5 | 40.0 / 9.2 | no |"]
