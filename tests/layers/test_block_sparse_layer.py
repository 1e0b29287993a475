"""BlockSparseLinear and the sparsify/densify patcher against masked dense nn.Linear.

Run both ways: the conftest's TRITON_INTERPRET=1 (Triton kernels in the interpreter) and
TRITON_INTERPRET=0 (the pure-torch reference ops).
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from sparse_training import BlockSparseLinear, densify, sparsify
from sparse_training.kernels.block_sparse import block_grid, block_norms, dense_to_values
from sparse_training.kernels.block_sparse.topology import values_to_dense
from sparse_training.layers.blocks import dense_state_dict
from sparse_training.pieces.masks import kept_count

OUT, IN, BLOCK = 40, 70, (16, 32)  # grid 3x3, both tails overhang (48x96 padded)
# fp32 layer vs float64 truth: every output, input-gradient and weight-gradient entry is
# a sum of at most 70 products of O(1) terms accumulated in fp32 (kernels: fp32
# accumulators, IEEE products on CPU; reference: torch's fp32 matmul), so the error is
# below 70 * 2**-24 * sum|terms| ~ 1e-5 for these magnitudes.
TOL = dict(rtol=1e-5, atol=1e-5)


def element_mask(layer: BlockSparseLinear) -> torch.Tensor:
    """The block mask expanded to the dense weight's shape."""
    r, c = layer.block
    mask = layer.block_mask.repeat_interleave(r, 0).repeat_interleave(c, 1)
    return mask[:layer.out_features, :layer.in_features]


def outside(layer: BlockSparseLinear) -> torch.Tensor:
    """Bool [nnz, R, C]: entries of the kept blocks that hang over the weight's edge."""
    ones = torch.ones(layer.out_features, layer.in_features, dtype=torch.float64)
    return dense_to_values(ones, layer.topology) == 0


def masks_for_cases() -> dict[str, torch.Tensor]:
    grid = block_grid(OUT, IN, BLOCK)
    random = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    empty_row = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    return {"random": random, "empty_block_row": empty_row,
            "all_kept": torch.ones(grid, dtype=torch.bool)}


@pytest.mark.parametrize("case", ["random", "empty_block_row", "all_kept"])
def test_forward_backward_match_masked_dense_float64(case):
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()[case])
    weight64 = (layer.to_dense().weight.detach().double() * element_mask(layer)).requires_grad_()
    bias64 = layer.bias.detach().double().requires_grad_()
    x = torch.randn(2, 3, IN, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    grad_out = torch.randn(2, 3, OUT)

    y = layer(x)
    y.backward(grad_out)
    y64 = nn.functional.linear(x64, weight64, bias64)
    y64.backward(grad_out.double())

    torch.testing.assert_close(y.double(), y64, **TOL)
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL)
    torch.testing.assert_close(layer.bias.grad.double(), bias64.grad, **TOL)
    torch.testing.assert_close(layer.values.grad.double(),
                               dense_to_values(weight64.grad, layer.topology), **TOL)
    assert not layer.values.grad[outside(layer)].any()  # padded tails get no gradient


def test_init_counts_bounds_and_zero_tails():
    layer = BlockSparseLinear(IN, OUT, BLOCK, density=0.5)
    n_blocks = math.prod(block_grid(OUT, IN, BLOCK))
    assert layer.nnz == kept_count(n_blocks, 0.5) == int(layer.block_mask.sum())
    assert layer.values.shape == (layer.nnz, *BLOCK)
    assert layer.block_mask.dtype == torch.bool and layer.block_mask.shape == (3, 3)
    assert layer.values.abs().max() <= 1 / math.sqrt(IN)
    assert layer.bias.abs().max() <= 1 / math.sqrt(IN)
    assert not layer.values[outside(layer)].any()
    assert layer.values[~outside(layer)].all()
    assert BlockSparseLinear(IN, OUT, BLOCK, density=1e-6).nnz == 1  # at least one block
    assert set(layer.state_dict()) == {"weight", "bias"}  # nn.Linear's (dense) form
    text = repr(layer)
    assert all(s in text for s in ("in_features=70", "out_features=40", "block=16x32",
                                   "density=0.4444", "nnz=4"))


def test_dtype_and_device_moves_rebuild_the_topology():
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()["random"])
    x = torch.randn(3, IN, dtype=torch.float64)
    expected = nn.functional.linear(x, layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(layer.double()(x), expected, **TOL)
    assert layer.to("meta").topology.col_indices.device.type == "meta"  # as cpu -> cuda


@pytest.mark.parametrize("change", ["device move", "load_state_dict"])
def test_first_compiled_call_after_a_move_or_load_is_one_graph(change):
    """A Trainer moves the model to its device (and a checkpoint loads into it) just before
    the first, compiled forward: the topology is rebuilt eagerly there, so that forward
    traces one graph (``fullgraph=True`` raises at a graph break) and matches eager."""
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()["random"])
    if change == "device move":
        layer.to("cpu")
    else:
        layer.load_state_dict(copy.deepcopy(layer.state_dict()))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, IN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x)
    got.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    assert layer.values.grad is not None and torch.isfinite(layer.values.grad).all()


def test_sparsity_is_the_structural_zero_fraction_of_the_dense_weight():
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()["random"])
    with torch.no_grad():
        layer.values.fill_(1.0).mul_(~outside(layer))
    dense = layer.to_dense().weight
    assert layer.sparsity == pytest.approx(float((dense == 0).double().mean()), abs=1e-12)
    torch.testing.assert_close(layer.weight, dense, rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(block=(48, 64)), r"one of 16, 32, 64, 128, got \(48, 64\)"),
    (dict(block=64), "got 64"),
    (dict(density=0.0), r"density must be a number in \(0, 1\], got 0.0"),
    (dict(density=1.5), "got 1.5"),
    (dict(block_mask=torch.ones(2, 3, dtype=torch.bool)), r"shape \(2, 3\) != block grid \(3, 3\)"),
    (dict(block_mask=torch.ones(3, 3)), "bool tensor .* got torch.float32"),
    (dict(block_mask=torch.zeros(3, 3, dtype=torch.bool)), "keeps no block"),
    (dict(in_features=0), "in_features must be a positive int, got 0"),
    (dict(out_features=4.0), "out_features must be a positive int, got 4.0"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    args = dict(in_features=IN, out_features=OUT, block=BLOCK) | kwargs
    with pytest.raises(ValueError, match=message):
        BlockSparseLinear(**args)


def test_from_dense_keeps_largest_blocks_and_round_trips_exactly():
    linear = nn.Linear(IN, OUT, dtype=torch.float64)
    linear.bias.requires_grad_(False)
    layer = BlockSparseLinear.from_dense(linear, BLOCK, density=0.5)
    assert layer.values.dtype == torch.float64 and layer.nnz == 4
    assert layer.values.requires_grad and not layer.bias.requires_grad
    norms = block_norms(linear.weight, BLOCK)
    assert norms[layer.block_mask].min() > norms[~layer.block_mask].max()

    dense = layer.to_dense()
    assert type(dense) is nn.Linear and dense.weight.dtype == torch.float64
    assert torch.equal(dense.weight, linear.weight.detach() * element_mask(layer))
    assert torch.equal(dense.bias, linear.bias) and not dense.bias.requires_grad
    for mask in (element_mask(layer), layer.block_mask):  # element or block-grid mask
        again = BlockSparseLinear.from_dense(dense, BLOCK, mask=mask)
        assert torch.equal(again.block_mask, layer.block_mask)
        assert torch.equal(again.values, layer.values)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(), "exactly one of density and mask"),
    (dict(density=0.5, mask=torch.ones(3, 3, dtype=torch.bool)), "exactly one"),
    (dict(mask=torch.ones(4, 4, dtype=torch.bool)), r"weight's shape \(40, 70\) or of the "
                                                    r"block grid's shape \(3, 3\), got "
                                                    r"torch.bool \(4, 4\)"),
    (dict(block=(16, 48), density=0.5), r"got \(16, 48\)"),
])
def test_from_dense_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockSparseLinear.from_dense(nn.Linear(IN, OUT), **({"block": BLOCK} | kwargs))


def test_from_dense_element_mask_must_be_constant_on_blocks():
    mask = torch.zeros(OUT, IN, dtype=torch.bool)
    mask[:16, :32] = True
    mask[20, 65] = True  # block (1, 2): rows 16:32, columns 64:70
    with pytest.raises(ValueError, match=r"block \(1, 2\) \(weight rows 16:32, columns "
                                         r"64:70\): 1 of 96 entries kept"):
        BlockSparseLinear.from_dense(nn.Linear(IN, OUT), BLOCK, mask=mask)


@pytest.mark.parametrize("form", ["dense", "compact"])
def test_state_dict_into_a_layer_with_another_mask(form):
    masks = masks_for_cases()
    source = nn.Sequential(BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks["random"]))
    target = nn.Sequential(BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks["random"].flip(0)))
    x = torch.randn(5, IN)
    target[0](x)  # builds the old topology, which loading must replace
    state = source.state_dict() if form == "dense" else {
        "0.values": source[0].values, "0.block_mask": source[0].block_mask,
        "0.bias": source[0].bias}
    target.load_state_dict(state)
    assert torch.equal(target[0].topology.block_mask(), masks["random"])
    assert torch.equal(target(x), source(x))

    bad = {"0.values": source[0].values, "0.block_mask": masks["all_kept"],
           "0.bias": source[0].bias}
    with pytest.raises(ValueError, match="0.block_mask keeps 9 blocks but values holds 5"):
        target.load_state_dict(bad)


def test_set_block_mask_keeps_shared_blocks_and_zeros_new_ones():
    old, new = masks_for_cases()["random"], masks_for_cases()["random"].roll(1, 1)
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=old)
    before, values = layer.to_dense().weight, layer.values
    layer.set_block_mask(new)
    assert layer.values is values and torch.equal(layer.block_mask, new)
    after = layer.to_dense().weight
    both = element_mask(layer) & (old & new).repeat_interleave(16, 0).repeat_interleave(
        32, 1)[:OUT, :IN]
    assert torch.equal(after[both], before[both])
    assert not after[~both].any()  # dropped blocks and newly kept ones are zero
    x = torch.randn(4, IN)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, after, layer.bias), **TOL)

    given = torch.randn(layer.nnz, *BLOCK)
    layer.set_block_mask(old, given)
    assert torch.equal(layer.values, given * ~outside(layer))
    with pytest.raises(ValueError, match="mask keeps 9 blocks, the layer has nnz = 5"):
        layer.set_block_mask(masks_for_cases()["all_kept"])
    with pytest.raises(ValueError, match=r"values shape \(5, 32, 16\) != \(nnz, R, C\)"):
        layer.set_block_mask(old, torch.randn(5, 32, 16))


def test_set_block_mask_rewrites_the_topology_in_place_for_compiled_graphs():
    """A compiled graph (a CUDA graph under reduce-overhead) reads the index tensors at the
    addresses it was built with: a new mask is written there, and the compiled layer, not
    recompiled, computes with it as the eager one does."""
    from torch._dynamo.testing import CompileCounter

    old, new = masks_for_cases()["random"], masks_for_cases()["random"].roll(1, 1)
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=old)
    topology, address = layer.topology, layer.topology.packed.data_ptr()
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter)
    x = torch.randn(5, IN)
    torch.testing.assert_close(compiled(x), layer(x), **TOL)
    layer.set_block_mask(new)
    assert layer.topology is topology and topology.packed.data_ptr() == address
    built = type(topology).from_block_mask(new, OUT, IN, BLOCK)
    assert torch.equal(topology.packed, built.packed)
    torch.testing.assert_close(compiled(x), nn.functional.linear(
        x, layer.to_dense().weight, layer.bias), **TOL)
    assert counter.frame_count == 1


def test_set_block_mask_before_a_backward_is_refused_not_silently_wrong():
    """A new mask between a forward and its backward (under autocast, where ``values`` is
    not saved as it is) raises autograd's in-place error: the old graph's gradients would
    be the new mask's."""
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()["random"])
    x = torch.randn(4, IN, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = layer(x)
    layer.set_block_mask(layer.block_mask.roll(1, 1))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_a_topology_built_under_inference_mode_trains_after_it():
    """A load_state_dict under ``torch.inference_mode`` (an evaluation script, a hook of
    Lightning's validation loop) builds the topology there: its indices are still normal
    tensors, so the next training step can save them for backward (as ``nn.Linear``
    trains after such a load) and ``set_block_mask`` rewrites them in place."""
    old = masks_for_cases()["random"]
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=old)
    with torch.inference_mode():
        layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()})
    built = layer.topology
    assert not built.packed.is_inference()
    x = torch.randn(3, IN, dtype=torch.float64)
    weight = layer.to_dense().weight.detach().double().requires_grad_()
    layer(x.float()).sum().backward()
    nn.functional.linear(x, weight).sum().backward()
    torch.testing.assert_close(layer.values.grad.double(),
                               dense_to_values(weight.grad, layer.topology), **TOL)
    layer.set_block_mask(old.roll(1, 1))
    assert layer.topology is built and torch.equal(built.block_mask(), old.roll(1, 1))


def test_adamw_keeps_padded_tails_zero_and_state_compressed():
    layer = BlockSparseLinear(IN, OUT, BLOCK, block_mask=masks_for_cases()["random"])
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(3):
        layer(torch.randn(6, IN)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state[layer.values]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (layer.nnz, *BLOCK)
    for tensor in (layer.values, state["exp_avg"], state["exp_avg_sq"]):
        assert not tensor[outside(layer)].any()
    assert layer.values[~outside(layer)].all()


def assert_swapped_as_masked_dense(dense: nn.Module, model: nn.Module, rows: list[dict],
                                   run) -> None:
    """``model`` (sparsified from a copy of ``dense``) computes what ``dense`` computes with
    the dropped blocks zeroed; densify gives exactly that dense model back."""
    reference = copy.deepcopy(dense)
    for row in rows:
        if row["decision"] == "compressed":
            layer = model.get_submodule(row["name"])
            reference.get_submodule(row["name"]).weight.data.mul_(element_mask(layer))
    torch.testing.assert_close(run(model), run(reference), **TOL)
    compressed = sum(row["decision"] == "compressed" for row in rows)
    assert densify(model) == compressed
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_sparsify_transformer_encoder_skips_out_proj(capsys):
    layer = nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True)
    dense = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model = copy.deepcopy(dense)
    rows = sparsify(model, {r"linear": {"pattern": "block:16x32", "density": 0.5},
                            r"out_proj": {"pattern": "block:32x32", "sparsity": 0.5}})
    decisions = {row["name"]: row["decision"] for row in rows}
    assert decisions["layers.0.linear1"] == decisions["layers.1.linear2"] == "compressed"
    assert "MultiheadAttention reads out_proj.weight" in decisions["layers.1.self_attn.out_proj"]
    assert type(model.layers[0].self_attn.out_proj) is type(dense.layers[0].self_attn.out_proj)
    assert isinstance(model.layers[1].linear2, BlockSparseLinear)
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["module", "shape", "rule", "block", "density",
                                             "nnz", "decision"]
    assert re.search(r"\nlayers\.0\.linear1 +128x64 +'linear' +16x32 +0\.5000 +8 +compressed\n",
                     table)

    x = torch.randn(2, 5, 64)
    model(x).square().mean().backward()
    assert model.layers[0].linear1.values.grad is not None
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():  # eval + no grad: the fast path, which reads linear1.weight itself
        fast = model.eval()(x, src_key_padding_mask=padding)
    assert_swapped_as_masked_dense(dense, model.train(), rows, lambda m: m(x))
    with torch.no_grad():
        torch.testing.assert_close(fast, model.eval()(x, src_key_padding_mask=padding), **TOL)


def test_sparsify_tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    dense = transformers.BertModel(config).eval()
    model = copy.deepcopy(dense)
    rules = {r"intermediate\.dense": {"pattern": "block:32x32", "density": 0.5},
             r"output\.dense": {"pattern": "block:16x32", "sparsity": 0.25}}
    rows = sparsify(model, rules, verbose=False)
    compressed = {row["name"] for row in rows if row["decision"] == "compressed"}
    assert compressed == {f"encoder.layer.{i}.{n}" for i in range(2) for n in (
        "intermediate.dense", "output.dense", "attention.output.dense")}
    assert {row["decision"] for row in rows if row["name"] not in compressed} == {
        "matches no rule"}
    assert model.encoder.layer[1].output.dense.block == (16, 32)
    ids = torch.randint(0, 50, (2, 7))
    assert_swapped_as_masked_dense(dense, model, rows,
                                   lambda m: m(input_ids=ids).last_hidden_state)


def skips_model() -> nn.Module:
    model = nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32),
                           "c": nn.Linear(32, 32), "d": nn.Linear(32, 32)})
    model["b"].weight = model["a"].weight  # tied
    parametrize.register_parametrization(model["c"], "weight", nn.Identity())
    model["d"].register_forward_hook(lambda *args: None)
    return model


def test_tied_parametrized_and_hooked_linears_are_skipped():
    model = skips_model()
    rows = sparsify(model, {".": {"pattern": "block:16x16", "density": 0.5}}, verbose=False)
    decisions = {row["name"]: row["decision"] for row in rows}
    assert decisions == {"a": "skipped: weight tied to b.weight",
                         "b": "skipped: weight tied to a.weight",
                         "c": "skipped: parametrized weight (a swap would drop the "
                              "parametrization)",
                         "d": "skipped: has forward_hooks (a swap would drop them)"}
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())


@pytest.mark.parametrize(("rules", "message"), [
    ({"linear1": {"pattern": "4:8", "density": 0.5}}, "pattern '4:8' is neither a block"),
    ({"linear1": {"pattern": "2:4", "sparsity": 0.7}}, "2:4 keeps half the weights"),
    ({"linear1": {"pattern": "unstructured", "sparsity": 0.5}}, "'unstructured' is neither a"),
    ({"linear1": {"pattern": "vector:16", "sparsity": 0.5}}, "'vector:16' is neither a block"),
    ({"linear1": {"pattern": "block:16x16", "sparsty": 0.5}}, r"unknown key\(s\) \['sparsty'\]"),
    ({"linear1": {"pattern": "block:16x16", "sparsity": 0.5, "density": 0.5}},
     "exactly one of 'sparsity'"),
    ({"linear1": {"pattern": "block:16x16", "sparsity": 1.0}}, r"\[0, 1\), got 1.0"),
    ({"linear1": {"pattern": "block:48x16", "density": 0.5}}, r"got \(48, 16\)"),
    ({"linear1": {"pattern": "block:16x16", "density": 0.5},
      "nomatch": {"pattern": "block:16x16", "density": 0.5}},
     r"'nomatch' matches no nn.Linear; their names are: 'layers.0.self_attn.out_proj'"),
    ({"linear1": {"pattern": "block:16x16", "density": 0.5}, "(": {"pattern": "block:16x16",
                                                                   "density": 0.5}},
     "'\\(' is not a valid regex"),
])
def test_bad_rules_raise_before_any_swap(rules, message):
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64), 1,
                                  enable_nested_tensor=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        sparsify(model, rules, verbose=False)
    assert not any(isinstance(m, BlockSparseLinear) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dense_state_dict_loads_the_compact_form_into_the_plain_model():
    """The compact form sharded layers save, made dense for plain Linears: each kept block
    in place (a float64 reference that places them one by one), zeros elsewhere, the
    other entries untouched; a model that cannot take it is named."""
    torch.manual_seed(0)
    layer = BlockSparseLinear(100, 72, (16, 32), density=0.4, dtype=torch.float64)  # tails
    head = nn.Linear(72, 5, dtype=torch.float64)
    compact = {"0.values": layer.values.detach(), "0.block_mask": layer.block_mask,
               "0.bias": layer.bias.detach(), "2.weight": head.weight.detach(),
               "2.bias": head.bias.detach()}
    plain = nn.Sequential(nn.Linear(100, 72), nn.ReLU(), nn.Linear(72, 5)).double()
    plain.load_state_dict(dense_state_dict(compact, plain))  # strict: every key fits
    expected = torch.zeros(72, 100, dtype=torch.float64)
    for k, (i, j) in enumerate(layer.block_mask.nonzero().tolist()):
        rows, cols = expected[i * 16:(i + 1) * 16, j * 32:(j + 1) * 32].shape
        expected[i * 16:(i + 1) * 16, j * 32:(j + 1) * 32] = layer.values[k, :rows, :cols]
    assert torch.equal(plain[0].weight, expected) and torch.equal(plain[2].weight, head.weight)
    x = torch.randn(3, 100, dtype=torch.float64)
    torch.testing.assert_close(plain[0](x), layer(x))
    with pytest.raises(ValueError, match=r"'1' in the model is ReLU, not an nn.Linear"):
        dense_state_dict({"1.values": layer.values, "1.block_mask": layer.block_mask}, plain)
    with pytest.raises(ValueError, match=r"0.block_mask shape \(4, 4\) != block grid \(5, 4\)"):
        dense_state_dict({**compact, "0.block_mask": layer.block_mask[:4]}, plain)
    with pytest.raises(ValueError, match=r"0.block_mask keeps \d+ blocks, 0.values holds \d+"):
        dense_state_dict({**compact, "0.values": layer.values[1:]}, plain)


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "references"])
def test_autocast_values_gradient_is_the_float32_sum_on_both_paths(monkeypatch, interpret):
    """Under bf16 autocast the float32 values' gradient is dY^T X summed in float32 and
    kept in float32, whether the kernels (interpreter) or the references (plain CPU) run;
    the references summed in bf16 before (errors ~0.1 at |dW| ~50)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    torch.manual_seed(0)
    layer = BlockSparseLinear(64, 48, block=(16, 16), density=0.5, bias=True)
    x = torch.randn(2, 128, 64)
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected = grad.reshape(-1, 48).double().t() @ x.reshape(-1, 64).bfloat16().double()
    got = values_to_dense(layer.values.grad, layer.topology).double()
    kept = values_to_dense(torch.ones_like(layer.values), layer.topology).bool()
    assert layer.values.grad.dtype == torch.float32
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(layer.bias.grad.double(), grad.double().sum((0, 1)),
                               rtol=1e-5, atol=1e-3)
