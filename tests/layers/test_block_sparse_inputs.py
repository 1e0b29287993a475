"""The block-sparse op takes any input: operands of any strides at every entry point (the
functional, the launchers, the custom ops and their fake implementations, eager and under
``torch.compile``), padded tails of ``values`` never used (NaN, inf), and NaN block scores
ranked below every number when blocks are chosen.

Each result is checked against the float64 reference of ``block_sparse_cases`` (dense weight
built by loops over the kept blocks) or, for compiled runs, against the eager run too.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle

import pytest
import torch
from block_sparse_cases import (
    assert_close,
    dense_weight,
    make_case,
    reference,
    strided,
    tail_mask,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparse_training import BlockSparseLinear, sparsify
from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_norms,
    block_sparse_linear,
    dense_to_values,
    forward_reference,
    input_grad_reference,
    top_blocks,
    values_to_dense,
    weight_grad_reference,
)
from sparse_training.kernels.block_sparse import kernels as bsk
from sparse_training.kernels.block_sparse.ops import BlockSparseLinearFunction
from sparse_training.kernels.block_sparse.topology import INDEX_FIELDS

OPS = torch.ops.sparse_training

# (operand, layout) pairs: each operand alone, then all of them at once
LAYOUTS = {
    "x transposed": {"x": "transposed"},
    "x rows of a wider buffer": {"x": "offset_rows"},
    "values transposed": {"values": "transposed"},
    "values every other block": {"values": "every_other"},
    "bias stride 2": {"bias": "every_other"},
    "grad transposed": {"grad": "transposed"},
    "all": {"x": "transposed", "values": "transposed", "bias": "every_other",
            "grad": "offset_rows"},
}


def strided_case(layout: dict[str, str], dtype=torch.float32, out_f=70, in_f=45, tokens=13,
                 block=(16, 32), kind="random"):
    """A 2-D case whose operands are laid out as ``layout`` says (values unchanged)."""
    c = make_case(out_f, in_f, tokens, block, kind, dtype, lead=())
    for name, how in layout.items():
        plain = getattr(c, name)
        setattr(c, name, strided(plain, how))
        assert not getattr(c, name).is_contiguous() and torch.equal(
            getattr(c, name).nan_to_num(), plain.nan_to_num())
    return c.leaves()


def run_functional(c):
    out = block_sparse_linear(c.x, c.values, c.topology, c.bias)
    out.backward(c.grad)
    return out, c.x.grad, c.values.grad, c.bias.grad


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_functional_takes_any_strides(layout):
    c = strided_case(layout)
    for got, want in zip(run_functional(c), c.want(), strict=True):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_functional_takes_any_strides_in_every_dtype(dtype):
    c = strided_case(LAYOUTS["all"], dtype, kind="empty_rows")
    for got, want in zip(run_functional(c), c.want(), strict=True):
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_expanded_grad_and_permuted_3d_input():
    """``out.sum().backward()`` hands the op a stride-0 gradient; a permuted 3-D input is
    flattened by a copy."""
    c = make_case(40, 33, 5, (16, 16), lead=(2,))
    c.x = c.x.transpose(0, 1).contiguous().transpose(0, 1)
    c.grad = torch.ones_like(c.grad)
    c.leaves()
    block_sparse_linear(c.x, c.values, c.topology, c.bias).sum().backward()
    for got, want in zip((c.x.grad, c.values.grad, c.bias.grad), c.want()[1:], strict=True):
        assert_close(got, want, torch.float32)


def test_a_transposed_view_of_the_values_gives_the_reference_output_and_input_gradient():
    """A transposed view of ``values`` (fp32, 128 tokens, 128 -> 128, block 64): the output
    and dX equal the float64 reference's."""
    c = strided_case({"values": "transposed"}, out_f=128, in_f=128, tokens=128, block=(64, 64))
    out, grad_x, _, _ = run_functional(c)
    want = c.want()
    assert_close(out, want[0], torch.float32)
    assert_close(grad_x, want[1], torch.float32)


def test_a_stride_2_bias_view_gives_the_reference_output():
    """A stride-2 ``bias`` view: the output equals the float64 reference's."""
    c = strided_case({"bias": "every_other"}, out_f=128, in_f=128, tokens=128, block=(64, 64))
    assert_close(run_functional(c)[0], c.want()[0], torch.float32)


def test_all_operands_strided_in_fp16_give_the_reference_and_empty_rows_give_the_bias():
    """Non-contiguous ``x``, ``values`` and ``bias`` together (fp16, block 16): the output
    and dX equal the reference's, and block rows with no kept block output the bias."""
    c = strided_case({"x": "transposed", "values": "transposed", "bias": "every_other"},
                     torch.float16, out_f=64, in_f=48, tokens=24, block=(16, 16),
                     kind="empty_rows")
    out, grad_x, _, _ = run_functional(c)
    want = c.want()
    assert_close(out, want[0], torch.float16)
    assert_close(grad_x, want[1], torch.float16)
    assert not c.mask[0].any()  # block row 0 keeps nothing: its outputs are the bias
    assert torch.equal(out[:, :16], c.bias.detach()[:16].expand(24, 16))


@pytest.mark.interpreter
def test_launchers_take_any_strides_index_tensors_included():
    c = strided_case(LAYOUTS["all"])
    topology = dataclasses.replace(c.topology, **{
        name: strided(getattr(c.topology, name), "every_other") for name in INDEX_FIELDS})
    values, x, bias, grad = (t.detach() for t in (c.values, c.x, c.bias, c.grad))
    want = c.want()
    assert_close(bsk.launch_forward(x, values, topology, bias), want[0], torch.float32)
    assert_close(bsk.launch_input_grad(grad, values, topology), want[1], torch.float32)
    assert_close(bsk.launch_weight_grad(grad, x, topology, values.dtype), want[2],
                 torch.float32)


@pytest.mark.parametrize("op, args", [
    ("block_sparse_linear", lambda c, idx: (c.x, c.values, c.bias, 70, 45, idx)),
    ("block_sparse_linear_input_grad", lambda c, idx: (c.grad, c.values, 70, 45, idx)),
    ("block_sparse_linear_weight_grad", lambda c, idx: (c.grad, c.x, c.values, 70, 45, idx)),
])
def test_custom_ops_pass_opcheck_with_strided_inputs(op, args):
    """Schema, fake implementation (shape, dtype and strides of the real output),
    autograd registration and AOT dispatch, on strided operands and odd shapes."""
    c = strided_case(LAYOUTS["all"])
    if op != "block_sparse_linear":
        c.values, c.x = c.values.detach(), c.x.detach()
    torch.library.opcheck(getattr(OPS, op).default, args(c, c.topology.packed))
    real = getattr(OPS, op)(*args(c, c.topology.packed))
    assert real.is_contiguous() and not real.isnan().any()


def test_custom_op_calls_on_a_live_topologys_packed_indices_use_it(monkeypatch):
    """A compiled graph passes a layer's own packed indices at every call: the ops find its
    topology (the kernels keep their direct launches per topology) and build a new one for
    another tensor, or once the topology of this tensor is gone."""
    from sparse_training.kernels.block_sparse import ops

    c = strided_case(LAYOUTS["all"])
    built = []
    real = ops._forward
    monkeypatch.setattr(ops, "_forward", lambda x, v, t, *rest: built.append(t) or real(
        x, v, t, *rest))
    own = BlockTopology(70, 45, c.topology.block,  # new index tensors, held here only
                        *(getattr(c.topology, name).clone() for name in INDEX_FIELDS))
    packed = own.packed
    twin = BlockTopology.from_packed(70, 45, own.block, packed, own.nnz)  # its own copy
    assert twin.packed is not packed and torch.equal(twin.packed, packed)
    del twin
    gc.collect()
    with torch.no_grad():
        first = OPS.block_sparse_linear(c.x, c.values, c.bias, 70, 45, packed)
        again = OPS.block_sparse_linear(c.x, c.values, c.bias, 70, 45, packed)
        OPS.block_sparse_linear(c.x, c.values, c.bias, 70, 45, packed.clone())
    assert torch.equal(first, again)
    assert built[0] is own and built[1] is own and built[2] is not own
    del built[:], own
    gc.collect()  # gone: a call builds a new one from the same tensor
    with torch.no_grad():
        assert torch.equal(OPS.block_sparse_linear(c.x, c.values, c.bias, 70, 45, packed),
                           first)
    assert len(built) == 1 and torch.equal(built[0].packed, packed)


def test_topology_fields_are_views_of_its_packed_indices():
    """The six index tensors live in one int32 tensor, in INDEX_FIELDS order (what a
    compiled graph takes, one input per layer), whatever dtype and strides they came in."""
    c = strided_case(LAYOUTS["all"])
    given = {name: strided(getattr(c.topology, name).long(), "every_other")
             for name in INDEX_FIELDS}
    topology = BlockTopology(70, 45, c.topology.block, **given)
    assert topology.packed.dtype == torch.int32 and topology.packed.is_contiguous()
    assert torch.equal(topology.packed, torch.cat([given[name] for name in INDEX_FIELDS]).int())
    for name in INDEX_FIELDS:
        view = getattr(topology, name)
        assert view.untyped_storage().data_ptr() == topology.packed.untyped_storage().data_ptr()
        assert view.is_contiguous() and torch.equal(view, given[name].int())
    rows, cols = topology.grid
    assert topology.packed.numel() == 2 + rows + cols + 4 * topology.nnz


@pytest.mark.parametrize("copy_of", [copy.copy, copy.deepcopy,
                                     lambda t: pickle.loads(pickle.dumps(t))])
def test_copied_topologies_are_checked_and_found_as_built_ones(copy_of):
    """Copies, deep copies (an EMA model, a teacher) and unpickled topologies (torch.load)
    go through ``__init__``: their own packed indices, found by the ops."""
    c = strided_case(LAYOUTS["all"])
    copied = copy_of(c.topology)
    assert copied.packed is not c.topology.packed
    assert torch.equal(copied.packed, c.topology.packed)
    assert BlockTopology.live(copied.packed) is copied
    assert BlockTopology.live(c.topology.packed) is c.topology
    assert torch.equal(copied.block_mask(), c.topology.block_mask())


def test_block_sparse_layers_compile_and_export_on_meta():
    """A model built on the meta device (shapes only) traces: meta has no autocast to ask."""
    with torch.device("meta"):
        layer = BlockSparseLinear(64, 32, block=(16, 16), density=0.5)
        x = torch.randn(4, 64)
    assert torch.compile(layer, backend="eager", fullgraph=True)(x).shape == (4, 32)
    for strict in (True, False):
        graph = torch.export.export(layer, (x,), strict=strict)
        assert graph.module()(x).shape == (4, 32)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_references_and_conversions_never_use_padded_tails(poison):
    c = make_case(70, 45, 9, (16, 32), lead=(), tail=poison)
    values, x, bias, grad = c.values, c.x, c.bias, c.grad
    want = c.want()
    assert_close(forward_reference(x, values, c.topology, bias), want[0], torch.float32)
    assert_close(input_grad_reference(grad, values, c.topology), want[1], torch.float32)
    assert_close(weight_grad_reference(grad, x, c.topology), want[2], torch.float32)
    assert torch.equal(values_to_dense(values, c.topology), dense_weight(values, c.mask, 70, 45)
                       .float())
    back = dense_to_values(values_to_dense(values, c.topology), c.topology)
    assert torch.all(back[tail_mask(c.mask, 70, 45, (16, 32))] == 0)


# the tails along the output dimension fill accumulator columns that are never stored
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("poison", [float("inf"), -float("inf")])
def test_kernels_never_use_infinite_tails(poison):
    c = make_case(72, 44, 9, (32, 16), dtype=torch.bfloat16, tail=poison).leaves()
    for got, want in zip(run_functional(c), c.want(), strict=True):
        assert_close(got, want, torch.bfloat16)
    assert torch.all(c.values.grad[tail_mask(c.mask, 72, 44, (32, 16))] == 0)


def test_a_layer_with_poisoned_tails_trains_finite():
    layer = BlockSparseLinear(45, 70, (16, 32), density=0.6)
    tails = tail_mask(layer.block_mask, 70, 45, (16, 32))
    with torch.no_grad():
        layer.values[tails] = float("nan")
    x = torch.randn(6, 45, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert torch.all(layer.values.grad[tails] == 0) and torch.isfinite(layer.weight).all()


# -- NaN ranking (the engine's rule: NaN scores sort below every number) ------------------

def test_top_blocks_ranks_nan_below_every_number():
    scores = torch.tensor([[float("nan"), 0.5, -float("inf")], [3.0, float("nan"), 1.0]])
    assert top_blocks(scores, 3).tolist() == [[False, True, False], [True, False, True]]
    assert top_blocks(scores, 4).tolist() == [[False, True, True], [True, False, True]]
    assert top_blocks(scores, 6).all() and not top_blocks(scores, 0).any()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), cols=st.integers(1, 5))
def test_top_blocks_keeps_the_exact_count_and_numbers_first(data, rows, cols):
    cells = rows * cols
    nan = data.draw(st.lists(st.booleans(), min_size=cells, max_size=cells))
    finite = data.draw(st.lists(st.floats(0, 1e6), min_size=cells, max_size=cells))
    nnz = data.draw(st.integers(0, cells))
    scores = torch.tensor(finite).view(rows, cols)
    scores[torch.tensor(nan).view(rows, cols)] = float("nan")
    kept = top_blocks(scores, nnz)
    numbers = int((~scores.isnan()).sum())
    assert int(kept.sum()) == nnz
    assert int((kept & ~scores.isnan()).sum()) == min(nnz, numbers)
    if (kept & ~scores.isnan()).any() and (~kept & ~scores.isnan()).any():
        assert scores[kept & ~scores.isnan()].min() >= scores[~kept & ~scores.isnan()].max()


def test_from_dense_and_sparsify_never_keep_a_nan_block():
    """A block full of NaN is never kept, though topk ranks NaN first, so the layer's
    output stays finite."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight[:16, :16] = float("nan")
    assert block_norms(linear.weight, (16, 16)).isnan()[0, 0]
    layer = BlockSparseLinear.from_dense(linear, (16, 16), density=0.5)
    assert not layer.block_mask[0, 0] and layer.nnz == 4
    assert torch.isfinite(layer(torch.randn(3, 64))).all()
    model = nn.Sequential(linear)
    sparsify(model, {"0": {"pattern": "block:16x16", "density": 0.5}}, verbose=False)
    assert not model[0].block_mask[0, 0] and torch.isfinite(model(torch.randn(3, 64))).all()


# -- torch.compile -------------------------------------------------------------------------

class StridedNet(nn.Module):
    """Two block-sparse products with tails in both dimensions: a ``BlockSparseLinear``
    read on a transposed input, then the functional on ``values`` stored transposed and a
    stride-2 bias (views the compiled graph passes into the custom ops as they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = BlockSparseLinear(45, 70, (16, 32), density=0.6)
        second = BlockSparseLinear(70, 33, (16, 16), density=0.5)
        self.topology = second.topology
        self.values_t = nn.Parameter(second.values.detach().transpose(1, 2).contiguous())
        self.bias_2 = nn.Parameter(torch.randn(66))

    def forward(self, x_t: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x_t.t()))
        return block_sparse_linear(hidden, self.values_t.transpose(1, 2), self.topology,
                                   self.bias_2[::2])


def eager_and_compiled(backend: str):
    torch.manual_seed(0)
    net = StridedNet()
    with torch.no_grad():  # poisoned tails: never read, in the compiled graph too
        net.first.values[tail_mask(net.first.block_mask, 70, 45, (16, 32))] = float("nan")
    x_t = torch.randn(45, 7)
    grad = torch.randn(7, 33)
    results = []
    for model in (net, torch.compile(net, backend=backend, fullgraph=True)):
        x = x_t.clone().requires_grad_()
        net.zero_grad(set_to_none=True)
        out = model(x)
        out.backward(grad)
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in net.parameters())])
    return net, results


def test_compiled_calls_use_the_layers_topology_and_skip_the_checks(monkeypatch):
    """Once traced (the fake implementations check the operands), a compiled step's
    custom-op calls launch on the layers' own topologies with ``checked`` set: no topology
    built, no operand checked again, the results those of the eager run."""
    from sparse_training.kernels.block_sparse import ops

    net, _ = eager_and_compiled("aot_eager")  # traced
    calls, checks = [], []

    def spy(real):
        def recorded(*args):
            calls.append((args[2], args[-1]))  # (topology, checked)
            return real(*args)
        return recorded

    for name in ("_forward", "_input_grad", "_weight_grad"):
        monkeypatch.setattr(ops, name, spy(getattr(ops, name)))
    real_check = bsk.check_operands
    monkeypatch.setattr(bsk, "check_operands", lambda *a, **k: checks.append(a) or real_check(
        *a, **k))
    model = torch.compile(net, backend="aot_eager", fullgraph=True)  # the cached graph
    net.zero_grad(set_to_none=True)
    x = torch.randn(45, 7, requires_grad=True)
    out = model(x)
    out.sum().backward()
    assert len(calls) == 6 and checks == []
    assert {id(t) for t, _ in calls} == {id(net.first.topology), id(net.topology)}
    assert all(checked is True for _, checked in calls)
    assert_close(out.detach(), net(x.detach()).detach().double(), torch.float32)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager_with_strided_inputs(backend):
    """``fullgraph=True``: no graph break in the op. The eager run is checked against the
    float64 reference, the compiled one against the eager one (outputs, every gradient)."""
    net, (eager, compiled) = eager_and_compiled(backend)
    for got, want in zip(compiled, eager, strict=True):
        assert_close(got, want.double(), torch.float32)
    hidden = torch.relu(net.first(torch.randn(7, 45)))
    assert_close(block_sparse_linear(hidden, net.values_t.transpose(1, 2), net.topology,
                                     net.bias_2[::2]),
                 reference(net.topology.block_mask(), net.values_t.detach().transpose(1, 2),
                           hidden.detach(), net.bias_2.detach()[::2],
                           torch.zeros(7, 33), 33)[0], torch.float32)


def test_compile_never_traces_into_the_launchers():
    """Where ``torch.compile`` meets the eager autograd path (a graph break before the op,
    or the ``autograd.Function`` called in a compiled function), Dynamo converts its frames
    down to the Triton launch; the launchers are kept out of it and run eagerly, with the
    eager results (torch 2.11 failed there with "Can't construct an AttrSource", the
    interpreter with a fake-tensor error)."""
    torch.manual_seed(0)
    layer = BlockSparseLinear(64, 40, (16, 16), density=0.5)
    x = torch.randn(9, 64)
    compiled = torch.compile(lambda x: BlockSparseLinearFunction.apply(
        x, layer.values, layer.topology, layer.bias, None))
    results = []
    for call in (compiled, layer):
        layer.zero_grad(set_to_none=True)
        x_grad = x.clone().requires_grad_()
        out = call(x_grad)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x_grad.grad, layer.values.grad, layer.bias.grad))
    for got, want in zip(*results, strict=True):
        assert_close(got, want.double(), torch.float32)
