"""benchmarks/fsdp_at_scale.py: its parameter counts against HF's Llama models (built on
the meta device) and the library's kept-block count, its traffic formulas at their edges,
and its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparse_training.layers.blocks import blocks_kept

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "fsdp_at_scale.py"
sys.path.insert(0, str(SCRIPT.parent))
from fsdp_at_scale import MODELS, estimate, kept_values, parameters  # noqa: E402


@pytest.mark.parametrize("size", list(MODELS))
def test_parameter_counts_are_those_of_hf_llama(size):
    shape = MODELS[size]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            num_hidden_layers=shape.layers, vocab_size=shape.vocab))
    counted = parameters(shape, 0)
    assert counted["layers"] == sum(p.numel() for p in model.model.layers.parameters())
    assert counted["layers"] + counted["root"] == sum(p.numel() for p in model.parameters())
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(tuple(m.weight.shape) for m in linears) == sorted(
        shape.linear_shapes() * shape.layers)


@pytest.mark.parametrize("out, inp", [(4096, 4096), (1024, 8192), (11008, 4096), (300, 700)])
@pytest.mark.parametrize("sparsity", [0.9, 0.75, 0.5])
def test_kept_values_are_the_compressed_layers(out, inp, sparsity):
    values, blocks = kept_values(out, inp, sparsity)
    grid = (-(-out // 128), -(-inp // 128))
    assert blocks == grid[0] * grid[1]
    assert values == blocks_kept(grid, 1 - sparsity, (out, inp), (128, 128)) * 128 * 128


def test_traffic_vanishes_where_nothing_crosses():
    shape = MODELS["7B"]
    alone = estimate(shape, 0.9, 1, 1, 8192, False, 50.0, 400.0)
    assert alone["fsdp_all_gather_gb"] == alone["fsdp_reduce_scatter_gb"] == 0
    one_node = estimate(shape, 0.0, 8, 8, 8192, False, 50.0, 400.0)
    assert one_node["hsdp_inter_node_gb"] == 0 and one_node["fsdp_all_gather_gb"] > 0
    # compressing shrinks what travels and what is stored, not the activations
    dense, sparse = (estimate(shape, s, 64, 8, 8192, True, 50.0, 400.0) for s in (0.0, 0.9))
    assert sparse["fsdp_all_gather_gb"] < 0.2 * dense["fsdp_all_gather_gb"]
    assert sparse["checkpoint_gb"] < 0.2 * dense["checkpoint_gb"]
    assert sparse["activations_gb"] == dense["activations_gb"]


def test_command_line_prints_both_tables_and_refuses_partial_nodes(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "rows.json")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.count("| Llama-2-") == 4 + 8  # traffic rows, then memory rows
    assert (tmp_path / "rows.json").exists()
    refused = subprocess.run([sys.executable, str(SCRIPT), "--gpus", "60"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--gpus 60 is not a multiple of --gpus-per-node 8" in (
        refused.stderr)
