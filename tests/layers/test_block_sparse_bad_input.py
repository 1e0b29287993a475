"""Bad input to BlockSparseLinear: state dicts that do not fit the layer, densities that
would leave it dense, dtypes, values and inputs it cannot take. Each is a clear error naming
the value and the fix, raised before any copy into the layer, or is handled as
docs/block_sparse.md says."""

from __future__ import annotations

import pytest
import torch
from conftest import second_derivative
from torch import nn

from sparse_training import BlockSparseLinear

OUT, IN, GRID = 40, 70, (3, 3)  # BlockSparseLinear(70, 40, block 16x32): both tails hang over


def _layer() -> nn.Sequential:
    """One BlockSparseLinear keeping 5 of its 9 blocks, float64 values never zero."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return nn.Sequential(BlockSparseLinear(IN, OUT, (16, 32), block_mask=mask,
                                           dtype=torch.float64))


def _compact(layer, **changes):
    state = {"0.values": layer[0].values.detach().clone(),
             "0.block_mask": layer[0].block_mask.clone(), "0.bias": layer[0].bias.detach()}
    state.update({f"0.{k}": v for k, v in changes.items()})
    return state


def _dense(layer, weight=None):
    return {"0.weight": layer[0].to_dense().weight.detach() if weight is None else weight,
            "0.bias": layer[0].bias.detach()}


LOADS = [  # (state dict from the layer, message)
    (lambda layer: _compact(layer, block_mask=layer[0].block_mask.to(torch.uint8)),
     r"0.block_mask must be a bool tensor of the block grid's shape \(3, 3\), got torch.uint8"),
    (lambda layer: _compact(layer, block_mask=torch.ones(2, 3, dtype=torch.bool)),
     r"0.block_mask shape \(2, 3\) != block grid \(3, 3\)"),
    (lambda layer: _compact(layer, block_mask=torch.ones(GRID, dtype=torch.bool)),
     r"0.block_mask keeps 9 blocks but values holds 5: the state_dict is inconsistent"),
    (lambda layer: _compact(layer, values=torch.randn(5, 16, 16, dtype=torch.float64)),
     r"0.values has shape \(5, 16, 16\), the layer's \(nnz, R, C\) = \(5, 16, 32\)"),
    (lambda layer: {"0.block_mask": layer[0].block_mask.flip(1)},
     r"0.block_mask without 0.values: the compact form loads both"),
    (lambda layer: _dense(layer, torch.randn(OUT, IN, dtype=torch.float64)),
     r"0.weight has nonzeros in 9 of its 9 16x32 blocks, some outside the layer's block_mask,"
     r" and the layer keeps nnz = 5: load a weight that is zero outside 5 blocks"),
    (lambda layer: _dense(layer, torch.randn(OUT, 64, dtype=torch.float64)),
     r"0.weight has shape \(40, 64\), the layer's dense weight \(out_features, in_features\) "
     r"= \(40, 70\)"),
    (lambda layer: {**_dense(layer), "0.values": layer[0].values.detach()},
     r"0.weight and the compact 0.values/block_mask are both given; give one form"),
]


@pytest.mark.parametrize(("make_state", "message"), LOADS,
                         ids=[m[:30] for _, m in LOADS])
def test_block_sparse_state_dict_errors_come_before_any_copy(make_state, message):
    layer = _layer()
    state = make_state(_layer())
    with torch.no_grad():
        layer[0].values.mul_(-1)  # differs from every state above
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    mask = layer[0].block_mask.clone()
    with pytest.raises(ValueError, match=message):
        layer.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert torch.equal(layer[0].block_mask, mask)


def _zero_block(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its kept block (0, 0) (rows 0:16, columns 0:32) zeroed."""
    weight = weight.clone()
    weight[:16, :32] = 0
    return weight


def _elsewhere(layer) -> torch.Tensor:
    """A dense weight nonzero in exactly 5 blocks, the layer's mask flipped upside down."""
    mask = layer[0].block_mask.flip(0)
    keep = mask.repeat_interleave(16, 0).repeat_interleave(32, 1)[:OUT, :IN]
    return torch.where(keep, torch.randn(OUT, IN, dtype=torch.float64), 0)


LOADED = [  # (dense weight from the layer's own, the block mask kept after loading)
    # a kept block of zeros: the weight is zero outside the current mask, which stays
    (lambda layer: _zero_block(layer[0].to_dense().weight.detach()),
     lambda layer: layer[0].block_mask),
    # nonzeros in exactly nnz other blocks: those become the mask
    (_elsewhere, lambda layer: layer[0].block_mask.flip(0)),
]


@pytest.mark.parametrize(("make_weight", "expected_mask"), LOADED, ids=["zero-block", "moved"])
def test_dense_weights_load_as_documented(make_weight, expected_mask):
    """A dense weight zero outside the layer's mask keeps it; one nonzero in exactly nnz
    other blocks sets the mask to those blocks; the dense form then reads back exactly."""
    source, target = _layer(), _layer()
    weight = make_weight(source)
    target.load_state_dict(_dense(source, weight))
    assert torch.equal(target[0].block_mask, expected_mask(source))
    assert torch.equal(target.state_dict()["0.weight"], weight)
    x = torch.randn(3, 5, IN, dtype=torch.float64).transpose(0, 1)  # non-contiguous
    # float64 products accumulated in fp32 by the kernels (IN = 70 terms of O(1))
    torch.testing.assert_close(target(x), x @ weight.T + source[0].bias, rtol=1e-5, atol=1e-5)


def test_a_compressed_state_dict_loads_strictly_into_nn_linear_and_back():
    layer = _layer()
    plain = nn.Sequential(nn.Linear(IN, OUT, dtype=torch.float64))
    plain.load_state_dict(layer.state_dict())  # strict
    expected = layer[0].block_mask.repeat_interleave(16, 0).repeat_interleave(32, 1)[:OUT, :IN]
    assert torch.equal(plain[0].weight != 0, expected)
    back = _layer()
    with torch.no_grad():
        back[0].values.zero_()
    back.load_state_dict(plain.state_dict())
    assert torch.equal(back[0].values, layer[0].values)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.weight"'):
        back.load_state_dict({"0.bias": layer[0].bias})


DENSE_AS_SPARSE = [  # (call, message): a density that keeps every block of a small grid
    (lambda: BlockSparseLinear.from_dense(nn.Linear(16, 32), (64, 64), density=0.1),
     r"density 0.1 keeps 1 of 1 blocks of 64x64 in the 32x16 weight: nothing would be sparse; "
     r"use smaller blocks or a lower density"),
    (lambda: BlockSparseLinear(16, 32, (16, 16), density=0.8),
     r"density 0.8 keeps 2 of 2 blocks of 16x16 in the 32x16 weight"),
]


@pytest.mark.parametrize(("call", "message"), DENSE_AS_SPARSE,
                         ids=[m[:30] for _, m in DENSE_AS_SPARSE])
def test_layers_that_would_be_dense_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _set_block_mask_values(values):
    layer = BlockSparseLinear(32, 48, (16, 16))
    layer.set_block_mask(layer.block_mask.clone(), values=values)


def _autocast_int_input():
    """An integer input under autocast stays an integer (autocast casts floats only) and is
    refused, as nn.Linear refuses it."""
    layer = BlockSparseLinear(32, 48, (16, 16), density=0.5)
    with torch.autocast("cpu", torch.bfloat16):
        return layer(torch.ones(3, 32, dtype=torch.int64))


REFUSED = [  # (call, message): each a ValueError or a clear refusal
    (lambda: BlockSparseLinear(32, 48, (16, 16), dtype=torch.int32),
     r"dtype must be a floating-point torch.dtype \(the layer trains its values\), got "
     r"torch.int32"),
    (lambda: _set_block_mask_values([1.0]),
     r"values must be a tensor \[nnz, R, C\] = \(1, 16, 16\), got list"),
    (lambda: second_derivative(BlockSparseLinear(32, 48, (16, 16), density=0.5), "values"),
     r"second derivatives \(backward with create_graph=True, a gradient penalty\)"),
    (lambda: _autocast_int_input(), r"dtype"),
]


@pytest.mark.parametrize(("call", "message"), REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_dtypes_values_and_second_derivatives_the_layer_cannot_take_are_refused(call, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        call()


def test_float64_under_autocast_stays_float64():
    """As F.linear under autocast: float64 operands are not cast to the autocast dtype."""
    layer = BlockSparseLinear(32, 48, (16, 16), density=0.5, dtype=torch.float64)
    x = torch.randn(3, 32, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ layer.to_dense().weight.T + layer.bias)


def test_a_block_sparse_input_autocast_does_not_cast_is_named():
    layer = BlockSparseLinear(32, 32, block=(16, 16), density=0.5)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(
            ValueError, match=r"input dtype torch.float64 is not the layer's torch.float32, and "
                              r"autocast casts only torch.float32"):
        layer(torch.randn(4, 32, dtype=torch.float64))


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(LOADS), len(LOADED), len(DENSE_AS_SPARSE), len(REFUSED)) == (8, 2, 2, 4)
