"""SemiStructuredLinear on CPU: masks, autograd against float64 references, the measured
sparse/dense decision rule, and what tells the packed copies to refresh. (cuSPARSELt itself
runs only on the GPU: benchmarks/semi_structured.py checks it there and records it.)"""

import copy

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


def test_under_autocast_the_layer_is_nn_linear_with_a_masked_gradient_in_the_weights_dtype():
    """The dense route adds no weight pass of its own: same output and dX as ``nn.Linear``
    under bf16 autocast, dW the masked float32 gradient (the mask fused into the cast)."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = SemiStructuredLinear.from_dense(linear)
    linear.weight.data.copy_(layer.weight.detach())
    x = torch.randn(3, 5, 32)
    outputs = []
    for module in (linear, layer):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(xi)
        y.float().square().sum().backward()
        outputs.append((y, xi.grad, module.weight.grad))
    (y_ref, dx_ref, dw_ref), (y, dx, dw) = outputs
    assert y.dtype == torch.bfloat16 and dw.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    torch.testing.assert_close(dw, dw_ref * layer.mask, rtol=0, atol=0)


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


@pytest.mark.parametrize("fused", [True, False])
def test_under_the_engine_the_optimizer_step_masks_the_gradient_instead_of_the_layer(fused):
    """Attached to an engine, the layer leaves dW unmasked (its dense route is plain
    ``F.linear``) and the engine's step masks it: the same weights as the layer masking its
    own gradient under torch's AdamW, zeros held in weights and optimizer state."""
    from sparse_training import SparsityConfig, SparsityEngine

    torch.manual_seed(0)
    reference = nn.Sequential(SemiStructuredLinear(32, 16, transposable=True), nn.GELU(),
                              SemiStructuredLinear(16, 8))
    model = copy.deepcopy(reference)
    engine = SparsityEngine(model, SparsityConfig("2:4", fused=fused))
    engine.start(10)
    inputs = [torch.randn(6, 32) for _ in range(3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    engine.attach(optimizers[1])
    assert [m.masks_gradient for m in model if isinstance(m, SemiStructuredLinear)] == [False] * 2
    for step, x in enumerate(inputs):
        engine.on_step_start(step)
        for net, optimizer in zip((reference, model), optimizers, strict=True):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            if net is model:
                engine.before_optimizer_step(optimizer, step, clipping=False)
            optimizer.step()
        engine.on_step_end()
    for ours, theirs in zip(model, reference, strict=True):
        if isinstance(ours, SemiStructuredLinear):
            torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6)
            assert not ours.weight[~ours.mask].any()
            state = optimizers[1].state[ours.weight]
            assert not state["exp_avg"][~ours.mask].any()
    engine.detach()
    assert all(m.masks_gradient for m in model if isinstance(m, SemiStructuredLinear))


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
    # BERT-large 1024 -> 4096 at 6144 tokens, GPU times on an H100: a tie, kept dense
    (times(dense_forward=0.073, sparse_forward=0.058, refresh=0.0089, dense_input_grad=0.0736,
           sparse_input_grad=0.0601, refresh_transposed=0.0193), False, False,
     "save 0.000 ms net of repacking, within 5% of cuBLAS's 0.147 ms"),
    (times(refresh=0.26), False, False, "save 0.040 ms net of repacking, within 5%"),
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
        assert [isinstance(model.net[i], SemiStructuredLinear) for i in (0, 2, 4)] == (
            [compress] * 3)
        masks[compress] = [model.net[i].mask if compress else model.net[i].weight_mask
                           for i in (0, 2, 4)]
        assert sparse.engine.sparsity == 0.5
    for compressed, masked in zip(masks[True], masks[False], strict=True):
        assert torch.equal(compressed, masked)


def test_compress_refuses_regrowth_and_other_n_m_patterns_with_2_4_layers():
    from sparse_training import SparsityCallback

    with pytest.raises(ValueError, match="regrow='rigl' moves 2:4 entries"):
        SparsityCallback(pattern="2:4", schedule="constant", regrow="rigl", compress=True)
    with pytest.raises(ValueError, match="only '2:4' and '2:4:2d' compress"):
        SparsityCallback(pattern="1:4", compress=True)


def test_an_unknown_timing_is_refused_naming_the_valid_ones():
    layer = SemiStructuredLinear(32, 16)
    with pytest.raises(ValueError, match=r"timing must be one of \('eager', 'cuda_graph'\), "
                                         r"got 'graph'"):
        layer.timing = "graph"
    assert layer.timing == "eager"  # refused before anything changed
    layer.timing = "cuda_graph"
    assert layer.timing == "cuda_graph" and SemiStructuredLinear(32, 16).timing == "eager"


class CountingCopy:
    """Stands in for a PackedWeight (cuSPARSELt packs on CUDA only): counts refreshes."""

    def __init__(self):
        self.refreshes = 0

    def refresh(self, weight):
        self.refreshes += 1


def test_packed_copies_refresh_after_a_step_and_always_once_captured(monkeypatch):
    """Eager: a refresh only when an optimizer stepped or the weight was written since the
    last one. A layer captured in a CUDA graph refreshes at every call, the capture and the
    eager calls after it: replays take optimizer steps that no Python sees."""
    layer = SemiStructuredLinear(32, 16, transposable=True)
    copies = [CountingCopy(), CountingCopy()]
    marker = semi_structured._weights_changed_marker(layer.weight)
    layer._packs[torch.bfloat16] = [[copy, marker] for copy in copies]
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    route = semi_structured.PathChoice(True, False, "sparse forward", {})

    def refreshes():
        layer._refreshed(torch.bfloat16, route)
        return [c.refreshes for c in copies]

    assert refreshes() == [0, 0]  # nothing changed since packing
    with torch.no_grad():
        layer.weight.mul_(2)
    assert refreshes() == [1, 0]  # the weight was written; dX stays on cuBLAS
    assert refreshes() == [1, 0]
    capturing[0] = True
    assert refreshes() == [2, 0]  # captured: every replay refreshes
    capturing[0] = False
    assert refreshes() == [3, 0] and refreshes() == [4, 0]  # eager calls after replays too
