"""SemiStructuredLinear on CPU: masks, autograd against float64 references, the measured
sparse/dense decision rule, and what tells the packed copies to refresh. (cuSPARSELt itself
runs only on the GPU: benchmarks/semi_structured.py checks it there and records it.)"""

import copy
import dataclasses
import shutil
import types

import pytest
import torch
from torch import nn

from sparse_training.kernels.semi_structured import (
    PackedWeight,
    PathChoice,
    forward_reference,
    input_grad_reference,
    weight_grad_reference,
)
from sparse_training.kernels.semi_structured.ops import SemiStructuredLinearFunction
from sparse_training.kernels.semi_structured.paths import decide
from sparse_training.layers import packed_copies, semi_structured
from sparse_training.layers.semi_structured import SemiStructuredLinear
from sparse_training.pieces.masks import pattern_mask


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
    steps = packed_copies._OPTIMIZER_STEPS[0]
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
    assert not layer.weight[~layer.mask].any() and layer.weight[layer.mask].all()
    # torch's fused AdamW leaves the version counter alone: the global step count moves
    assert packed_copies._OPTIMIZER_STEPS[0] == steps + 3


@pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.interpreter), False])
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
    # BERT-large 1024 -> 4096 at 6144 tokens, times of a data-center GPU: a tie, kept dense
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
    marker = packed_copies.weights_changed_marker(layer.weight)
    for transposed, counting in zip((False, True), copies, strict=True):
        layer._packed.copies[(torch.bfloat16, transposed)] = [counting, marker]
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    route = PathChoice(True, False, "sparse forward", {})

    def refreshes():
        layer._packed.refreshed(layer.weight, layer.mask, torch.bfloat16, route)
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


# == cuSPARSELt faked on the CPU: the routes, what each keeps, the envelope ==
#
# The fake packs a 2:4 (rows, cols) operand as cuSPARSELt 0.8 does as far as the layer
# relies on it: the kept values in row-major order, then metadata (here the kept positions,
# found by nonzero(): the old index construction, independent of kept_positions).


def fake_compress(operand):
    rows, cols = operand.shape
    positions = (operand.reshape(rows, cols // 4, 4) != 0).nonzero()[:, 2]
    values = operand[operand != 0]
    assert values.numel() == rows * cols // 2, "the fake packs exactly 2 nonzeros per group"
    return torch.cat([values, positions.to(operand.dtype)])


def fake_unpack(packed, cols):
    rows = packed.numel() // cols
    half = rows * cols // 2
    values = packed[:half].view(rows, cols // 4, 2).double()
    positions = packed[half:].view(rows, cols // 4, 2).long()
    return torch.zeros(rows, cols // 4, 4, dtype=torch.float64).scatter_(
        -1, positions, values).view(rows, cols)


def fake_sparse_mm(packed, dense_t, bias=None, transpose_result=True, **plan):
    assert transpose_result
    out = (fake_unpack(packed, dense_t.shape[0]) @ dense_t.double()).T
    return (out if bias is None else out + bias.double()).to(dense_t.dtype)


class ScriptedTimer:
    """Stands in for paths.wall_ms: runs each timed call once and returns the next time."""

    def __init__(self, times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn, calls=10):
        fn()
        self.calls += 1
        return self.times.pop(0)


# ms of: dense forward, sparse forward, refresh; dense dX, sparse dX, refresh of W^T
SPARSE_WINS = [1.0, 0.5, 0.1, 1.0, 0.5, 0.1]
DENSE_WINS = [1.0, 2.0, 0.1, 1.0, 2.0, 0.1]


@pytest.fixture
def fake_cusparselt(monkeypatch):
    """cuSPARSELt's ops faked on the CPU, an envelope of 32 features and 16 tokens, and
    a timer that returns ``fake_cusparselt.timer``'s scripted times."""
    from sparse_training.kernels.semi_structured import cusparselt, paths

    monkeypatch.setattr(torch, "_cslt_compress", fake_compress, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", fake_sparse_mm, raising=False)
    monkeypatch.setattr(torch, "_cslt_sparse_mm_search", lambda *a, **k: 0, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(semi_structured, "cusparselt_problem", lambda device: None)
    monkeypatch.setattr(cusparselt, "SPARSE_MIN_FEATURES", 32)
    monkeypatch.setattr(cusparselt, "SPARSE_MIN_TOKENS", 16)
    monkeypatch.setattr(paths, "_CHOICES", {})
    state = types.SimpleNamespace(timer=ScriptedTimer(SPARSE_WINS))
    monkeypatch.setattr(paths, "wall_ms", lambda fn, calls=10: state.timer(fn, calls))
    return state


def held_bytes(layer):
    """Bytes of the tensors the layer holds besides its parameters and buffers: packed
    copies, positions, anything cached (found through its attributes, dataclasses too)."""
    own = {id(t) for t in [*layer.parameters(), *layer.buffers()]}
    held = {}

    def walk(value):
        if isinstance(value, torch.Tensor) and id(value) not in own:
            held[id(value)] = value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))

    walk({k: v for k, v in vars(layer).items()
          if k not in ("_parameters", "_buffers", "_modules")})
    return sum(held.values())


def test_a_dense_route_keeps_no_packed_copy_and_a_sparse_one_only_what_it_uses(
        fake_cusparselt):
    """Memory: measured dense, the layer holds weight and mask only (what masked-dense
    holds); measured sparse, the packed copies the route uses and their uint8 positions,
    0.5 B per weight entry each."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    dense = SemiStructuredLinear(64, 32, transposable=True, dtype=torch.bfloat16)
    fake_cusparselt.timer = ScriptedTimer(DENSE_WINS)
    dense(x)
    route = dense.paths(x)
    assert fake_cusparselt.timer.calls == 6 and not (route.forward or route.input_grad)
    assert dense._packed.copies == {} and held_bytes(dense) == 0
    fake_cusparselt.timer = ScriptedTimer([1.0, 0.5, 0.1, 1.0, 2.0, 0.1])  # the forward only
    layer = SemiStructuredLinear(64, 48, transposable=True, dtype=torch.bfloat16)
    layer(x)
    assert fake_cusparselt.timer.calls == 6
    assert list(layer._packed.copies) == [(torch.bfloat16, False)]
    packed = layer._packed.copies[(torch.bfloat16, False)][0]
    assert packed.positions.dtype == torch.uint8 and packed.positions.numel() == 48 * 64 // 2
    assert held_bytes(layer) == 48 * 64 * 2 + 48 * 64 // 2  # the fake's packed size + 0.5 B


@pytest.mark.parametrize("mixed", [False, True])
def test_the_sparse_routes_match_float64_references_across_optimizer_steps(
        fake_cusparselt, mixed):
    """Forward and dX on the (fake) packed copies, refreshed after each AdamW step; bf16
    weights, or float32 ones under bf16 autocast; a non-contiguous input."""
    torch.manual_seed(0)
    dtype = torch.float32 if mixed else torch.bfloat16
    layer = SemiStructuredLinear(96, 64, transposable=True, dtype=dtype)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(96, 24, dtype=dtype).T.requires_grad_()  # 24 tokens, strided
        grad = torch.randn(24, 64, dtype=torch.bfloat16)
        weight, bias = layer.weight.detach().double(), layer.bias.detach().double()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            y = layer(x)
        y.backward(grad)
        route = layer.paths(x, torch.bfloat16)
        assert route.forward and route.input_grad
        x64, mask = x.detach().bfloat16().double(), layer.mask
        torch.testing.assert_close(y.double(), forward_reference(x64, weight.bfloat16().double(),
                                                                 mask, bias.bfloat16().double()),
                                   rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(x.grad.double(), input_grad_reference(
            grad.double(), weight.bfloat16().double(), mask), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(layer.weight.grad.double(), weight_grad_reference(
            grad.double(), x64, mask), rtol=2e-2, atol=2e-2)
        optimizer.step()
        optimizer.zero_grad()
    assert not layer.weight[~layer.mask].any()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_refresh_writes_the_values_the_old_int64_gather_wrote(monkeypatch, transposed,
                                                              weight_dtype):
    """The uint8 positions, gathered by row chunks (5 rows here, and a tail of 3), write the
    values the former whole-weight int64 ``nonzero()`` index wrote, into a fake packed
    buffer (no cuSPARSELt needed), and leave the metadata after the values alone."""
    from sparse_training.kernels.semi_structured import cusparselt

    torch.manual_seed(0)
    out_features, in_features = 28, 20  # transposed operand: 20 rows of 28
    weight = torch.randn(out_features, in_features, dtype=weight_dtype)
    mask = pattern_mask(weight, "2:4:2d")
    rows, cols = (in_features, out_features) if transposed else (out_features, in_features)
    monkeypatch.setattr(cusparselt, "CHUNK_ENTRIES", 5 * cols)
    metadata = torch.randn(37, dtype=torch.bfloat16)
    buffer = torch.cat([torch.full((rows * cols // 2,), float("nan"), dtype=torch.bfloat16),
                        metadata])
    positions = cusparselt.kept_positions(mask, transposed)
    packed = cusparselt.PackedWeight(buffer, positions, mask, transposed, fast=True)
    packed.refresh(weight)
    source = (weight.t() if transposed else weight).reshape(rows, cols // 4, 4)
    operand_mask = (mask.t() if transposed else mask).reshape(rows, cols // 4, 4)
    old_index = operand_mask.nonzero()[:, 2].view(rows, cols // 4, 2)  # int64, 12 B per entry
    expected = source.gather(-1, old_index).to(torch.bfloat16).reshape(-1)
    assert positions.dtype == torch.uint8 and torch.equal(positions.long(), old_index)
    assert torch.equal(buffer[: rows * cols // 2], expected)
    assert torch.equal(buffer[rows * cols // 2:], metadata)


def test_a_layout_that_the_values_only_refresh_does_not_write_falls_back_with_a_warning(
        fake_cusparselt, monkeypatch):
    def reversed_compress(operand):  # the values in another order than the refresh writes
        packed = fake_compress(operand)
        half = operand.numel() // 2
        return torch.cat([packed[:half].flip(0), packed[half:]])

    monkeypatch.setattr(torch, "_cslt_compress", reversed_compress)
    layer = SemiStructuredLinear(64, 32, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="every optimizer step repacks in full"):
        packed = PackedWeight.pack(layer.weight, layer.mask, torch.bfloat16)
    assert not packed.fast and packed.positions is None


def test_small_and_odd_token_counts_take_cublas_before_any_packing_or_timing(
        fake_cusparselt, monkeypatch):
    """The envelope (here 32 features, 16 tokens) and the token multiple are checked per
    call, before cuSPARSELt is touched: such calls run cuBLAS and give nn.Linear's output."""
    def no_packing(*args, **kwargs):
        raise AssertionError("packed outside the envelope")

    monkeypatch.setattr(PackedWeight, "pack", no_packing)
    torch.manual_seed(0)
    layer = SemiStructuredLinear(64, 32, dtype=torch.bfloat16)
    small = SemiStructuredLinear(32, 16, dtype=torch.bfloat16)
    cases = [(layer, torch.randn(8, 64), "8 tokens, under 16 (SPARSE_MIN_TOKENS"),
             (layer, torch.randn(0, 64), "0 tokens, under 16"),
             (layer, torch.randn(3, 7, 64), "21 tokens are not a multiple of 8"),
             (small, torch.randn(64, 32), "out_features 16 under 32 (SPARSE_MIN_FEATURES")]
    for module, x, reason in cases:
        x = x.bfloat16()
        assert reason in module.path_problem(x)
        expected = nn.functional.linear(x.double(), module.weight.double(), module.bias.double())
        torch.testing.assert_close(module(x).double(), expected, rtol=1e-2, atol=1e-2)
    assert fake_cusparselt.timer.calls == 0


COMPILED = [("aot_eager", None, False), ("aot_eager", None, True)] + (
    [("inductor", mode, False) for mode in (None, "max-autotune-no-cudagraphs", "reduce-overhead")]
    if shutil.which("g++") else [])


@pytest.mark.parametrize("backend, mode, mixed", COMPILED)
def test_torch_compile_traces_one_graph_and_trains_as_eager(backend, mode, mixed):
    """Under torch.compile (fullgraph: no graph break) the layers take the dense route:
    outputs, every gradient and 3 AdamW steps equal eager's (float32, or bf16 autocast), on
    non-contiguous inputs; a layer masking its gradient keeps pruned weights zero, one
    under an engine (``masks_gradient`` False) leaves that to the step."""
    torch.manual_seed(0)
    eager = nn.Sequential(SemiStructuredLinear(20, 12, transposable=True), nn.GELU(),
                          SemiStructuredLinear(12, 8))
    eager[2].masks_gradient = False
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, mode=mode, fullgraph=True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    exact = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=1e-5, atol=1e-5)
    for _ in range(3):
        x = torch.randn(20, 3, 5).permute(1, 2, 0)  # (3, 5, 20), strided
        grad = torch.randn(3, 5, 8)
        results = []
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                y = net(xi)
            y.backward(grad.to(y.dtype))
            results.append([y, xi.grad, *(p.grad.clone() for p in net.parameters())])
            optimizer.step()
            optimizer.zero_grad()
        for ours, theirs in zip(*results, strict=True):
            torch.testing.assert_close(ours, theirs, **exact)
    for ours, theirs in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, **exact)
    assert not model[0].weight[~model[0].mask].any() and model[2].weight[~model[2].mask].any()


@pytest.mark.parametrize("transposable", [False, True])
def test_the_state_dict_is_an_nn_linear_one_and_loads_strictly_both_ways(transposable):
    """``weight`` (zeros where pruned) and ``bias`` only. Into a layer with another mask, a
    saved layer's weights bring its mask (its 2:4 nonzeros); a dense Linear's weights are
    pruned to their magnitude mask; weights zero outside the current mask keep it."""
    torch.manual_seed(0)
    saved = SemiStructuredLinear(24, 16, transposable=transposable)
    state = saved.state_dict()
    assert list(state) == ["weight", "bias"]
    assert not state["weight"][~saved.mask].any() and state["weight"][saved.mask].all()
    linear = nn.Linear(24, 16)
    linear.load_state_dict(state, strict=True)
    x = torch.randn(5, 24).T.contiguous().T  # column-major
    torch.testing.assert_close(linear(x), saved(x), rtol=1e-6, atol=1e-6)
    other = SemiStructuredLinear(24, 16, transposable=transposable)
    assert not torch.equal(other.mask, saved.mask)
    other.load_state_dict(linear.state_dict(), strict=True)
    assert torch.equal(other.mask, saved.mask) and torch.equal(other.weight, saved.weight)
    torch.testing.assert_close(other(x), saved(x), rtol=0, atol=0)
    kept = other.mask.clone()
    sub_pruned = other.state_dict()
    sub_pruned["weight"] = sub_pruned["weight"] * (torch.rand(16, 24) < 0.5)  # fewer kept
    other.load_state_dict(sub_pruned, strict=True)
    assert torch.equal(other.mask, kept) and torch.equal(other.weight, sub_pruned["weight"])
    dense = nn.Linear(24, 16)
    other.load_state_dict(dense.state_dict(), strict=True)
    expected = pattern_mask(dense.weight, "2:4:2d" if transposable else "2:4")
    assert torch.equal(other.mask, expected)
    assert torch.equal(other.weight, dense.weight.detach() * expected)
    assert torch.equal(other.bias, dense.bias.detach())


def test_a_legacy_state_dict_with_a_mask_installs_it_and_a_bad_one_changes_nothing():
    torch.manual_seed(0)
    saved = SemiStructuredLinear(16, 8)
    legacy = {**saved.state_dict(), "mask": saved.mask.clone()}
    layer = SemiStructuredLinear(16, 8)
    layer.load_state_dict(legacy, strict=True)
    assert torch.equal(layer.mask, saved.mask) and torch.equal(layer.weight, saved.weight)
    before = {k: v.clone() for k, v in [*layer.state_dict().items(), ("mask", layer.mask)]}
    bad = {**legacy, "weight": torch.randn(8, 16), "mask": legacy["mask"].clone()}
    bad["mask"][5, 8:12] = True
    with pytest.raises(ValueError, match=r"SemiStructuredLinear\(16->8, 2:4\), state dict key "
                                         r"'mask': mask is not 2:4 along each row: row 5, "
                                         r"entries 8:12 keep [34]"):
        layer.load_state_dict(bad)
    after = {**layer.state_dict(), "mask": layer.mask}
    assert all(torch.equal(before[k], after[k]) for k in before)
