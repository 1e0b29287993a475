"""SemiStructuredLinear on CPU: masks, autograd against float64 references, the measured
sparse/dense decision rule, and what tells the packed copies to refresh. (cuSPARSELt itself
runs only on the GPU: benchmarks/semi_structured.py checks it there and records it.)"""

import pytest
import torch
from torch import nn

from sparse_training import semi_structured
from sparse_training.kernels.semi_structured import (
    forward_reference,
    input_grad_reference,
    weight_grad_reference,
)
from sparse_training.kernels.semi_structured.ops import SemiStructuredLinearFunction
from sparse_training.kernels.semi_structured.paths import decide
from sparse_training.masks import pattern_mask
from sparse_training.semi_structured import SemiStructuredLinear


def test_the_dense_path_matches_float64_references_and_masks_the_weight_gradient():
    torch.manual_seed(0)
    weight = torch.randn(12, 20, dtype=torch.float64)
    mask = pattern_mask(weight, "2:4")
    weight = (weight * mask).requires_grad_()
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 20, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(7, 12, dtype=torch.float64)
    y = SemiStructuredLinearFunction.apply(x, weight, mask, bias, None, None)
    y.backward(grad)
    torch.testing.assert_close(y, forward_reference(x, weight, mask, bias))
    torch.testing.assert_close(x.grad, input_grad_reference(grad, weight, mask))
    torch.testing.assert_close(weight.grad, weight_grad_reference(grad, x, mask))
    torch.testing.assert_close(bias.grad, grad.sum(0))
    assert not weight.grad[~mask].any()


@pytest.mark.parametrize("transposable", [False, True])
def test_from_dense_keeps_the_magnitude_mask_and_to_dense_gives_the_masked_weight(transposable):
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = SemiStructuredLinear.from_dense(linear, transposable=transposable)
    expected = pattern_mask(linear.weight, "2:4:2d" if transposable else "2:4")
    assert torch.equal(layer.mask, expected) and layer.sparsity == 0.5
    x = torch.randn(5, 3, 32)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, linear.weight * expected,
                                                              linear.bias))
    dense = layer.to_dense()
    assert type(dense) is nn.Linear and torch.equal(dense.weight, linear.weight * expected)
    assert layer.path_problem(x) == "cuSPARSELt runs on CUDA, not cpu"


def test_masks_that_are_not_2_to_4_are_refused_naming_the_group():
    rows_only = torch.tensor([True, True, False, False]).repeat(8, 4)  # 2:4 rows, 4:4 columns
    SemiStructuredLinear(16, 8, mask=rows_only)
    with pytest.raises(ValueError, match=r"not 2:4 along each column: column 0, entries 0:4 "
                                         r"keep 4"):
        SemiStructuredLinear(16, 8, transposable=True, mask=rows_only)
    bad = rows_only.clone()
    bad[3, 4:8] = True
    with pytest.raises(ValueError, match=r"row 3, entries 4:8 keep 4"):
        SemiStructuredLinear(16, 8, mask=bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        SemiStructuredLinear(18, 8)
    layer = SemiStructuredLinear(16, 8)
    state = layer.state_dict()
    state["mask"] = bad
    with pytest.raises(ValueError, match="row 3"):
        layer.load_state_dict(state)


def test_training_keeps_pruned_weights_zero_and_counts_optimizer_steps():
    torch.manual_seed(0)
    layer = SemiStructuredLinear(32, 16, transposable=True)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    steps = semi_structured._OPTIMIZER_STEPS[0]
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
    assert not layer.weight[~layer.mask].any() and layer.weight[layer.mask].all()
    # torch's fused AdamW leaves the version counter alone: the global step count moves
    assert semi_structured._OPTIMIZER_STEPS[0] == steps + 3


def times(**ms):
    base = dict(dense_forward=1.0, sparse_forward=0.7, refresh=0.1)
    return {**base, **ms}


@pytest.mark.parametrize("measured, forward, input_grad, reason", [
    (times(), True, False, "sparse forward: saves 0.200 ms"),
    (times(sparse_forward=1.2), False, False, "dense: cuBLAS was faster"),
    (times(refresh=0.4), False, False, "save 0.300 ms but repacking after each step costs 0.400"),
    (times(dense_input_grad=1.0, sparse_input_grad=0.6, refresh_transposed=0.1), True, True,
     "sparse forward and dX: saves 0.500 ms"),
    (times(sparse_forward=1.1, dense_input_grad=1.0, sparse_input_grad=0.6,
           refresh_transposed=0.1), False, True, "sparse dX: saves 0.300 ms"),
])
def test_a_product_goes_sparse_only_where_it_is_faster_net_of_repacking(
        measured, forward, input_grad, reason):
    choice = decide(measured)
    assert (choice.forward, choice.input_grad) == (forward, input_grad)
    assert reason in choice.reason


def test_compress_with_2_4_keeps_the_masks_masked_dense_training_keeps():
    import pytorch_lightning as pl
    from conftest import BlockNet, make_loader, make_trainer

    from sparse_training import SparsityCallback

    masks = {}
    for compress in (False, True):
        pl.seed_everything(0, verbose=False)
        model = BlockNet()
        sparse = SparsityCallback(pattern="2:4:2d", compress=compress)
        make_trainer([sparse], max_epochs=1).fit(model, make_loader())
        masks[compress] = [model.net[i].mask if compress else model.net[i].weight_mask
                           for i in (0, 2, 4)]
        assert sparse.engine.sparsity == 0.5
    assert all(isinstance(m, torch.Tensor) for m in masks[True])
    for compressed, masked in zip(masks[True], masks[False], strict=True):
        assert torch.equal(compressed, masked)


def test_compress_refuses_regrowth_and_other_n_m_patterns_with_2_4_layers():
    from sparse_training import SparsityCallback

    with pytest.raises(ValueError, match="regrow='rigl' moves 2:4 entries"):
        SparsityCallback(pattern="2:4", schedule="constant", regrow="rigl", compress=True)
    with pytest.raises(ValueError, match="only '2:4' and '2:4:2d' compress"):
        SparsityCallback(pattern="1:4", compress=True)
