"""Compressed layers built on the meta device, as large models are: ``to_empty()`` gives the
mask uninitialized memory, so the layer refuses to run until ``reset_parameters()``,
``load_state_dict`` or a mask set by hand writes a valid one; ``from_dense`` of a meta
``nn.Linear`` builds a meta layer; ``load_state_dict(..., assign=True)`` gives a meta layer
the loaded tensors, as it does an ``nn.Linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparse_training import BlockSparseLinear, SemiStructuredLinear, SlimLinear, sparsify

BLOCK = (16, 16)


def unset_block_layer() -> BlockSparseLinear:
    layer = BlockSparseLinear(64, 48, BLOCK, density=0.25, device="meta")
    layer.to_empty(device="cpu")
    layer.block_mask.fill_(True)  # what uninitialized memory may hold: 12 blocks, nnz 3
    return layer


def test_a_block_layer_from_the_meta_device_runs_only_once_its_mask_is_set():
    layer = unset_block_layer()
    assert layer.mask_unset and layer.nnz == 3
    for use in (lambda: layer(torch.randn(2, 64)), lambda: layer.weight, layer.state_dict):
        with pytest.raises(RuntimeError, match=r"BlockSparseLinear\(in_features=64, .*nnz=3.*\): "
                                               r"its block_mask is uninitialized memory .* call "
                                               r"reset_parameters\(\) or load_state_dict\(\)"):
            use()
    layer.reset_parameters()  # draws nnz blocks, then initializes them
    assert not layer.mask_unset and int(layer.block_mask.sum()) == layer.nnz == 3
    dense = layer.to_dense()
    assert torch.allclose(layer(torch.ones(2, 64)), dense(torch.ones(2, 64)))
    r, c = BLOCK
    kept = layer.block_mask.repeat_interleave(r, 0).repeat_interleave(c, 1)[:48, :64]
    assert not dense.weight[~kept].any() and dense.weight[kept].all()


def test_a_block_layer_from_the_meta_device_takes_a_loaded_or_given_mask():
    source = BlockSparseLinear(64, 48, BLOCK, density=0.25)
    for form in ("dense", "compact"):
        layer = unset_block_layer()
        state = source.state_dict()
        if form == "compact":
            weight = state.pop("weight")
            state["values"], state["block_mask"] = source.values.detach(), source.block_mask
            assert torch.equal(weight, source.to_dense().weight)
        layer.load_state_dict(state)
        assert not layer.mask_unset and torch.equal(layer.block_mask, source.block_mask)
        assert torch.equal(layer.to_dense().weight, source.to_dense().weight)
    layer = unset_block_layer()
    layer.set_block_mask(source.block_mask)  # no block was kept before: all start at zero
    assert not layer.mask_unset and not layer.values.any()
    with pytest.raises(ValueError, match=r"weight has nonzeros in 12 of its 12 16x16 blocks, "
                                         r"the layer's block_mask unset \(to_empty of a meta "
                                         r"layer\), and the layer keeps nnz = 3"):
        unset_block_layer().load_state_dict({"weight": torch.ones(48, 64),
                                             "bias": torch.zeros(48)})


def test_a_2to4_layer_from_the_meta_device_runs_only_once_its_mask_is_set():
    layer = SemiStructuredLinear(16, 8, device="meta")
    layer.to_empty(device="cpu")
    layer.mask.fill_(True)  # uninitialized memory: 4 of 4 in a group
    with pytest.raises(RuntimeError, match=r"SemiStructuredLinear\(.*pattern=2:4.*\): its mask is "
                                           r"uninitialized memory"):
        layer(torch.randn(2, 16))
    layer.reset_parameters()  # the drawn weight's magnitude 2:4 mask
    assert not layer.mask_unset
    assert (layer.mask.view(8, 4, 4).sum(-1) == 2).all()
    assert not layer.weight[~layer.mask].any() and layer.weight[layer.mask].all()
    layer(torch.randn(2, 16))
    loaded = SemiStructuredLinear(16, 8, device="meta", transposable=True)
    loaded.to_empty(device="cpu")
    source = SemiStructuredLinear(16, 8, transposable=True)
    loaded.load_state_dict(source.state_dict())
    assert not loaded.mask_unset and torch.equal(loaded.mask, source.mask)


def test_reset_parameters_of_a_2to4_layer_keeps_its_mask_and_zeroes_what_it_prunes():
    layer = SemiStructuredLinear(16, 8)
    mask = layer.mask.clone()
    layer.reset_parameters()
    assert torch.equal(layer.mask, mask) and not layer.weight[~mask].any()


def test_from_dense_of_a_meta_linear_builds_a_meta_layer():
    with torch.device("meta"):
        linear = nn.Linear(64, 48)
    linear.weight.requires_grad_(False)
    block = BlockSparseLinear.from_dense(linear, BLOCK, density=0.25)
    semi = SemiStructuredLinear.from_dense(linear)
    for layer in (block, semi):
        assert all(t.is_meta for t in [*layer.parameters(), *layer.buffers()])
        assert not layer.weight.requires_grad if layer is semi else not layer.values.requires_grad
        layer.to_empty(device="cpu")
        layer.reset_parameters()
        assert not layer.mask_unset
    assert block.nnz == 3 and int(block.block_mask.sum()) == 3
    assert (semi.mask.view(48, 16, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match=r"from_dense of an nn.Linear on the meta device takes "
                                         r"density, not mask"):
        BlockSparseLinear.from_dense(linear, BLOCK, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"on the meta device takes no mask"):
        SemiStructuredLinear.from_dense(linear, mask=torch.ones(48, 64, dtype=torch.bool))


def test_a_2to4_layer_on_the_meta_device_refuses_a_mask_it_could_not_keep():
    mask = torch.tensor([[True, True, False, False]] * 4)
    with pytest.raises(ValueError, match="on the meta device takes no mask: to_empty"):
        SemiStructuredLinear(4, 4, device="meta", mask=mask)
    with torch.device("meta"), pytest.raises(ValueError, match="takes no mask"):
        SemiStructuredLinear(4, 4, mask=mask)


def test_a_meta_model_of_compressed_layers_loads_with_assign():
    """torch's meta-device loading idiom: the state dict of a compressed model (nn.Linear's
    keys) into the same model built on the meta device, with ``assign=True``. Each layer
    takes its mask from the loaded weight (a meta mask holds none to keep) on the weight's
    device, and trains like the model saved."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Linear(64, 32))
    saved[4] = SlimLinear.from_dense(saved[4], axis=0, band=16,
                                     band_mask=torch.tensor([False, True]))
    sparsify(saved, {r"^0$": {"pattern": "block:16x16", "sparsity": 0.5},
                     r"^2$": {"pattern": "2:4"}}, verbose=False)
    bands = torch.tensor([True, False])  # (a meta mask would not say how many are kept)
    with torch.device("meta"):
        model = nn.Sequential(BlockSparseLinear(64, 64, BLOCK, density=0.5), nn.ReLU(),
                              SemiStructuredLinear(64, 32), nn.ReLU(),
                              SlimLinear(64, 32, 0, 16, bands))
    model.load_state_dict({k: v.clone() for k, v in saved.state_dict().items()}, assign=True)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model[0].block_mask, saved[0].block_mask)
    assert torch.equal(model[2].mask, saved[2].mask)
    assert torch.equal(model[4].band_mask, saved[4].band_mask)
    x = torch.randn(3, 64)
    block_and_2to4 = nn.Sequential(*model[:4]), nn.Sequential(*saved[:4])
    torch.testing.assert_close(block_and_2to4[0](x), block_and_2to4[1](x), rtol=0, atol=0)
    torch.testing.assert_close(model[4](x), saved[4](x), rtol=0, atol=0)
    for net in (model, saved):
        (net[:4](x).sum() + net[4](x).sum()).backward()
    for (name, param), other in zip(model.named_parameters(), saved.parameters(), strict=True):
        torch.testing.assert_close(param.grad, other.grad, rtol=0, atol=0, msg=name)
