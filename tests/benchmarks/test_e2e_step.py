"""benchmarks/e2e_step.py with ``--profile`` in its CPU mode (``--model tiny``): the kernel
families, the dense row's Linear shapes and the Amdahl limits, end to end through the
script, checked against the tiny BERT's config."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import script_env
from transformers import BertConfig, BertForQuestionAnswering

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "e2e_step.py"
sys.path.insert(0, str(SCRIPT.parent))
from _step_profile import family_of, linear_shapes  # noqa: E402

# kernel names from H100 profiles (benchmarks/results/), one per family, and one unknown
KERNELS = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": "dense products",
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32": "dense products",
    "sm90_xmma_sparse_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "sparse products",
    "_dense_sparse_kernel": "sparse products",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>": "optimizer",
    "masked_step_kernel": "optimizer",
    "Memcpy DtoD (Device -> Device)": "memory copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>":
        "elementwise/other",
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_names_fall_in_their_family(name):
    assert family_of(name) == KERNELS[name]


def test_linear_shapes_count_gpt2_conv1d_input_first():
    """GPT-2's Linears are ``Conv1D`` (weight in x out): the dense row's shapes count them,
    so its limits exist (an empty list once failed the optimizer timing)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=24, n_layer=2, n_head=2, n_positions=16, vocab_size=50)
    shapes = linear_shapes(GPT2LMHeadModel(config), ["wte", "wpe", "lm_head"])
    h, n = config.n_embd, config.n_layer
    # c_attn (h -> 3h), attention c_proj (h -> h), c_fc (h -> 4h), mlp c_proj (4h -> h)
    assert sorted(map(tuple, shapes)) == sorted(
        [(h, 3 * h, 1, n), (h, h, 1, n), (h, 4 * h, 1, n), (4 * h, h, 1, n)])


@pytest.mark.slow
def test_cpu_profile_gives_families_shapes_and_limits(tmp_path):
    variants = ["dense fused", "block B 90% compressed"]
    env = script_env(OUT=str(tmp_path))
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "2",
                           "--warmup", "1", "--profile", "--variants", *variants],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ms per step by kernel family" in done.stdout
    rows = {r["variant"]: r for r in
            json.loads((tmp_path / "e2e_step_tiny.json").read_text())["rows"]}
    assert sorted(rows) == sorted(variants) and not any("error" in r for r in rows.values())
    dense, sparse = rows["dense fused"], rows["block B 90% compressed"]
    for row in rows.values():
        assert len(row["step_ms"]) == 2  # --steps, no more
        profile = row["profile"]
        assert sum(profile["family_ms"].values()) == pytest.approx(profile["busy_ms"])
        assert profile["exposed_host_ms"] == pytest.approx(
            profile["profiled_wall_ms"] - profile["busy_ms"])
        assert 0 < profile["busy_ms"] <= profile["profiled_wall_ms"]
        assert len(profile["top_other"]) == 5
        # cProfile's steps: the functions with the most own time, the step's loop among them
        assert profile["python_ms"] > 0 and len(profile["python_top"]) == 12
        owns = [own for _, own, _, _, _ in profile["python_top"]]
        assert owns == sorted(owns, reverse=True) and sum(owns) <= profile["python_ms"]
    assert dense["profile"]["family_ms"]["sparse products"] == 0
    assert dense["profile"]["family_ms"]["dense products"] > 0
    assert sparse["profile"]["family_ms"]["sparse products"] > 0
    # the selected Linears: q, k, v, attention output, intermediate, output per layer
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128)
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    assert sorted(map(tuple, dense["linear_shapes"])) == sorted(
        [(h, h, 1, 4 * n), (h, i, 1, n), (i, h, 1, n)])
    assert dense["tokens"] == sparse["tokens"] == 4 * 32
    # trainable parameters: the model's, less each selected weight's dropped 16x16 blocks
    total = sum(p.numel() for p in BertForQuestionAnswering(config).parameters())
    dropped = sum(count * 256 * math.floor(0.9 * (inp // 16) * (out // 16) + 0.5)
                  for inp, out, _, count in dense["linear_shapes"])
    assert dense["trainable_parameters"] == total
    assert sparse["trainable_parameters"] == total - dropped
    shrinkable = dense["shrinkable"]["products_ms"] + dense["shrinkable"]["optimizer_ms"]
    assert 0 < shrinkable < dense["ms"]
    kept = 1 - sparse["sparsity"]
    assert sparse["amdahl_limit"] == pytest.approx(
        dense["ms"] / (dense["ms"] - (1 - kept) * shrinkable))
    assert sparse["of_limit"] == pytest.approx(dense["ms"] / sparse["ms"] / sparse["amdahl_limit"])
    assert dense["amdahl_limit"] == pytest.approx(1.0)
    # the bandwidth floor: 3 T (in + out) fp32 elements per Linear at the measured bandwidth
    measured = dense["shrinkable"]
    assert measured["bandwidth_gbs"] > 0
    assert sum(measured["products_by_shape_ms"]) == pytest.approx(measured["products_ms"])
    for (fan_in, fan_out, _, count), floor in zip(dense["linear_shapes"],
                                                  measured["floor_by_shape_ms"], strict=True):
        bytes_moved = count * 3 * dense["tokens"] * (fan_in + fan_out) * 4
        assert floor == pytest.approx(bytes_moved / (measured["bandwidth_gbs"] * 1e9) * 1e3)
    assert 1.0 <= sparse["floor_limit"] <= sparse["amdahl_limit"]
    assert sparse["of_floor_limit"] == pytest.approx(dense["ms"] / sparse["ms"]
                                                     / sparse["floor_limit"])
    # --report prints the saved run's table again, limits included, from the JSON alone
    shown = subprocess.run([sys.executable, str(SCRIPT), "--report",
                            str(tmp_path / "e2e_step_tiny.json")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    line = next(line for line in shown.stdout.splitlines()
                if line.startswith("block B 90% compressed "))
    assert f"{sparse['ms']:.1f}" in line and f"{sparse['of_limit']:.2f}" in line
    assert f"cpu, torch {torch.__version__}" in shown.stdout
    assert "block B 90% compressed: host Python" in shown.stdout


def test_floor_limit_shrinks_each_shape_no_further_than_its_bandwidth_floor():
    """Hand-computed: shape a (P 6, floor 1) shrinks to max(0.1 * 6, 1) = 1, shape b (P 4,
    floor 0.1) to 0.4, the optimizer (2) to 0.2; the rest of the 20 ms step stays."""
    from _step_profile import amdahl_limit, floor_limit

    shrinkable = {"products_ms": 10.0, "optimizer_ms": 2.0, "products_by_shape_ms": [6.0, 4.0],
                  "floor_by_shape_ms": [1.0, 0.1]}
    assert floor_limit(20.0, shrinkable, 0.1) == pytest.approx(20 / (20 - 5 - 3.6 - 1.8))
    assert floor_limit(20.0, shrinkable, 0.1) < amdahl_limit(20.0, 12.0, 0.1)
    # dense: nothing shrinks; floors under d P_s: the Amdahl limit itself
    assert floor_limit(20.0, shrinkable, 1.0) == pytest.approx(1.0)
    assert floor_limit(20.0, shrinkable | {"floor_by_shape_ms": [0.0, 0.0]}, 0.5) == \
        pytest.approx(amdahl_limit(20.0, 12.0, 0.5))
    # a floor above its shape's measured products (the bandwidth measured low): P_s at most
    assert floor_limit(20.0, shrinkable | {"floor_by_shape_ms": [9.0, 0.1]}, 1.0) == \
        pytest.approx(1.0)
    assert floor_limit(20.0, {"products_ms": 10.0, "optimizer_ms": 2.0}, 0.1) is None
    assert floor_limit(5.0, shrinkable, 0.1) is None  # measured apart, longer than the step


def test_compiled_rows_are_measured_against_dense_compiled_alike():
    """``speedup`` is against eager dense fused for every row; a compiled row's limit and
    ``of_limit`` come from the dense fused row of its own compile mode, and a row whose
    baseline did not run (or failed) gets no limit."""
    from e2e_step import add_limits

    shrink = {"products_ms": 6.0, "optimizer_ms": 2.0}
    rows = [
        {"variant": "dense fused", "ms": 30.0, "sparsity": 0.0, "shrinkable": shrink},
        {"variant": "dense fused +compile:ro", "ms": 24.0, "sparsity": 0.0, "shrinkable": shrink},
        {"variant": "block B 90% compressed", "ms": 25.0, "sparsity": 0.9},
        {"variant": "block B 90% compressed +compile:ro", "ms": 20.0, "sparsity": 0.9},
        {"variant": "block B 90% compressed +compile", "ms": 40.0, "sparsity": 0.9},
        {"variant": "dense fused +compile:mat", "error": "died"},
        {"variant": "block B 50% compressed +compile:mat", "ms": 22.0, "sparsity": 0.5},
    ]
    add_limits(rows)
    by = {r["variant"]: r for r in rows}
    eager, ro = by["block B 90% compressed"], by["block B 90% compressed +compile:ro"]
    assert eager["speedup"] == pytest.approx(30 / 25) and "speedup_same_mode" not in eager
    assert eager["amdahl_limit"] == pytest.approx(30 / (30 - 0.9 * 8))
    assert eager["of_limit"] == pytest.approx(30 / 25 / eager["amdahl_limit"])
    assert ro["speedup"] == pytest.approx(30 / 20)
    assert ro["speedup_same_mode"] == pytest.approx(24 / 20)
    assert ro["amdahl_limit"] == pytest.approx(24 / (24 - 0.9 * 8))
    assert ro["of_limit"] == pytest.approx(24 / 20 / ro["amdahl_limit"])
    for name in ("block B 90% compressed +compile", "block B 50% compressed +compile:mat"):
        assert by[name]["speedup"] == pytest.approx(30 / by[name]["ms"])
        assert not {"speedup_same_mode", "amdahl_limit", "of_limit"} & set(by[name])
    assert "speedup" not in by["dense fused +compile:mat"]


def test_report_prints_runs_saved_before_columns_existed_and_failed_rows(tmp_path):
    """``--report`` on a JSON whose rows lack the later columns (tokens, floors, the Python
    profile), with a failed row and one that timed no step: dashes and FAILED, no crash."""
    rows = [{"variant": "dense fused", "ms": 30.0, "sparsity": 0.0, "peak_gib": 6.5,
             "compressed_layers": {}, "masked_dense_tensors": 0, "loss_first": 6.0,
             "loss_last": 3.0, "shrinkable": {"products_ms": 6.0, "optimizer_ms": 2.0}},
            {"variant": "block B 90% compressed", "ms": 25.0, "sparsity": 0.9},
            {"variant": "2:4 compressed", "error": "RuntimeError: died"},
            {"variant": "2:4 masked-dense", "ms": None, "sparsity": 0.5}]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"model": "bert-base", "layers": 4, "torch": "2.11.0",
                                "device": "NVIDIA H100", "rows": rows}))
    shown = subprocess.run([sys.executable, str(SCRIPT), "--report", str(path)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    lines = {line.split("  ")[0]: line for line in shown.stdout.splitlines()}
    assert "1.20x" in lines["block B 90% compressed"]  # 30 / 25
    assert f"{30 / (30 - 0.9 * 8):.2f}x" in lines["block B 90% compressed"]
    assert "FAILED: RuntimeError: died" in lines["2:4 compressed"]
    assert "FAILED: no step timed" in lines["2:4 masked-dense"]
    assert "NVIDIA H100, torch 2.11.0" in shown.stdout


def test_hotspots_count_every_call_of_a_recursive_function():
    """cProfile keeps primitive and total calls apart: a function recursing 50 times below
    its first call counts 51 calls per profiled step, its own time once, and a caller."""
    import cProfile

    from _step_callbacks import hotspots

    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + depth(n - 1)

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2):
        depth(50)
    profile.disable()
    found = {name.rsplit("(", 1)[-1]: row for name, *row in hotspots(profile, steps=2, top=50)}
    own, cumulative, calls, caller = found["depth)"]
    assert calls == 51 and 0 < own <= cumulative
    assert caller.endswith(("(depth)", "(test_hotspots_count_every_call_of_a_recursive_function)"))


E2E_STEP_REFUSALS = [  # (argv after --model tiny, message)
    (["--variants", "dense", "dense fused typo"], "unknown variant 'dense fused typo'"),
    (["--steps", "0"], r"argument --steps: must be an int >= 1, got 0"),
    (["--warmup", "-1"], r"argument --warmup: must be an int >= 0, got -1"),
    (["--report", "/nonexistent.json"], r"--report /nonexistent.json: not a JSON file e2e_step "
                                        r"saved"),
]
SCRIPT_REFUSALS = [  # (script, argv, message)
    ("bert_step.py", ["--pairs", "0"], "argument --pairs: must be an int >= 1, got 0"),
    ("compressed_host.py", ["--steps", "0"], "argument --steps: must be an int >= 1, got 0"),
    ("fsdp_at_scale.py", ["--gpus", "-8"], "argument --gpus: must be an int >= 1, got -8"),
    ("e2e_distributed.py", ["--gpus", "0"], "argument --gpus: must be an int >= 1, got 0"),
    ("mask_compute.py", ["--bogus"], r"unknown arguments \['--bogus'\]"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, dict]:
    """Every case of the two tables below, each script run as ``python SCRIPT ARGS`` would
    in a fork of one process (tests/refused_arguments.py): one interpreter start for all.
    Per case: its exit status, output, and what its own OUT folder holds afterwards."""
    folder = tmp_path_factory.mktemp("refusals")
    cases, outs = {}, {}
    for i, (argv, _) in enumerate(E2E_STEP_REFUSALS):
        outs[f"e2e_step {i}"] = out = folder / f"out{i}"
        out.mkdir()
        cases[f"e2e_step {i}"] = {"script": str(SCRIPT), "argv": ["--model", "tiny", *argv],
                                  "env": {"OUT": str(out)}}
    for script, argv, _ in SCRIPT_REFUSALS:
        cases[script] = {"script": str(SCRIPT.parent / script), "argv": argv}
    (folder / "cases.json").write_text(json.dumps(list(cases.values())))
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "refused_arguments.py"),
                           str(folder / "cases.json"), str(folder / "results.json")],
                          env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(zip(cases, json.loads((folder / "results.json").read_text()), strict=True))
    for name, out in outs.items():
        results[name]["written"] = sorted(p.name for p in out.iterdir())
    return results


@pytest.mark.parametrize(("case", "message"), [(i, m) for i, (_, m) in
                                               enumerate(E2E_STEP_REFUSALS)],
                         ids=[str(argv) for argv, _ in E2E_STEP_REFUSALS])
def test_bad_arguments_stop_before_any_run(refusals, case, message):
    done = refusals[f"e2e_step {case}"]
    assert done["returncode"] != 0 and re.search(message, done["stderr"] + done["stdout"])
    assert done["written"] == []  # nothing ran, nothing written


@pytest.mark.parametrize(("script", "message"), [(s, m) for s, _, m in SCRIPT_REFUSALS],
                         ids=[f"{s}-{a}" for s, a, _ in SCRIPT_REFUSALS])
def test_the_benchmarks_refuse_bad_arguments_before_running(refusals, script, message):
    done = refusals[script]
    assert done["returncode"] != 0 and re.search(message, done["stderr"]), done["stderr"][-2000:]


@pytest.mark.slow
def test_several_families_with_slim_rows_and_a_budget(tmp_path):
    """``--model`` takes several families (one JSON each); the heads+neurons row trains
    SlimLinear layers (T5: its FFNs; its heads, which share one relative position bias, stay
    masked-dense); the ratio against the best dense row is there; ``--budget-s 0`` starts
    none and says so."""
    env = script_env(OUT=str(tmp_path))
    variants = ["dense fused", "heads+neurons 50% compressed"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-vit", "tiny-llama",
                           "tiny-t5", "--steps", "2", "--warmup", "1", "--variants", *variants],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for model, tokens in (("tiny-vit", 4 * 17), ("tiny-llama", 2 * 32)):
        rows = {r["variant"]: r for r in
                json.loads((tmp_path / f"e2e_step_{model}.json").read_text())["rows"]}
        slim = rows["heads+neurons 50% compressed"]
        assert slim["compressed_layers"] == {"SlimLinear": 12 if model == "tiny-vit" else 4 * 7}
        assert slim["masked_dense_tensors"] == 0 and slim["tokens"] == tokens
        assert slim["speedup_best"] == pytest.approx(rows["dense fused"]["ms"] / slim["ms"])
    t5 = {r["variant"]: r for r in
          json.loads((tmp_path / "e2e_step_tiny-t5.json").read_text())["rows"]}
    slim = t5["heads+neurons 50% compressed"]
    # 2 encoder and 2 decoder FFNs (wi, wo) shrink; q/k/v/o of 6 attention modules stay
    assert slim["compressed_layers"] == {"SlimLinear": 8} and slim["masked_dense_tensors"] == 24
    assert "vs best" in done.stdout
    out = tmp_path / "budget"
    skipped = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny-vit", "--steps", "1",
                              "--warmup", "0", "--budget-s", "0", "--variants", *variants],
                             env=script_env(OUT=str(out)), capture_output=True, text=True,
                             timeout=300)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert ("skipped (past --budget-s 0): ['tiny-vit: dense fused', 'tiny-vit: heads+neurons "
            "50% compressed']") in skipped.stdout
    assert not list(out.glob("*.json"))


def test_a_bad_model_name_stops_before_any_run(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "bert-huge"],
                          env=script_env(OUT=str(tmp_path)), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "invalid choice: 'bert-huge'" in done.stderr
    assert not list(tmp_path.iterdir())
