"""Bad input to the block-sparse kernels' entry points: the functional
block_sparse_linear, the launchers, the custom ops, BlockTopology and top_blocks, on one
small case: 32 <- 48 features, 16x16 blocks, all 6 kept, 3x5 tokens. Each is a clear error
naming the value and the valid forms, raised before any operand or gradient changes, or is
handled as docs/block_sparse.md says."""

from __future__ import annotations

import pytest
import torch
from block_sparse_cases import assert_close, make_case, strided

from sparse_training.kernels.block_sparse import BlockTopology, block_sparse_linear, top_blocks
from sparse_training.kernels.block_sparse import kernels as bsk

BS_OPS = torch.ops.sparse_training


def _bs_case():
    return make_case(32, 48, 5, (16, 16), "all").leaves()


def _flat(c):
    """(x, grad_out, values, bias) as the launchers take them: 2-D, detached."""
    return c.x.detach().reshape(-1, 48), c.grad.reshape(-1, 32), c.values.detach(), \
        c.bias.detach()


def _index(c):
    return c.topology.packed


def _topology_with(c, **fields):
    return BlockTopology(**{**{f.name: getattr(c.topology, f.name)
                               for f in c.topology.__dataclass_fields__.values() if f.init},
                            **fields})


def _linear(c, x=None, values=None, bias=None):
    return block_sparse_linear(c.x if x is None else x, c.values if values is None else values,
                               c.topology, c.bias if bias is None else bias)


BLOCK_SPARSE_OP_ERRORS = [  # (case, call on a fresh case, message)
    ("x with 47 features", lambda c: _linear(c, x=c.x[..., :47]),
     "input has 47 features, the layer takes 48"),
    ("x 0-d", lambda c: _linear(c, x=torch.tensor(1.0)),
     r"input must be a tensor of shape \(\.\.\., 48\), got shape \(\)"),
    ("x a list", lambda c: _linear(c, x=[[1.0] * 48]),
     r"input must be a tensor of shape \(\.\.\., 48\), got list"),
    ("x int64", lambda c: _linear(c, x=c.x.detach().long()),
     "input dtype torch.int64 is not a floating dtype: cast it with .to"),
    ("x bool", lambda c: _linear(c, x=c.x.detach() > 0),
     "input dtype torch.bool is not a floating dtype"),
    ("x complex", lambda c: _linear(c, x=c.x.detach().to(torch.complex64)),
     "input dtype torch.complex64 is not a floating dtype"),
    ("x fp16, values fp32", lambda c: _linear(c, x=c.x.detach().half()),
     r"values dtype torch.float32 != input dtype torch.float16: give the operands one dtype "
     r"\(cast with .to\(...\), or run under torch.autocast\)"),
    ("x on meta", lambda c: _linear(c, x=c.x.detach().to("meta")),
     "input is on meta, the topology's index tensors on cpu: move both to one device"),
    ("values on meta", lambda c: _linear(c, values=c.values.detach().to("meta")),
     "values is on meta, the topology's index tensors on cpu"),
    ("values missing blocks", lambda c: _linear(c, values=c.values[:5]),
     r"values shape \(5, 16, 16\) != \(nnz, R, C\) = \(6, 16, 16\) of the topology"),
    ("values 2-D", lambda c: _linear(c, values=c.values.flatten(1)),
     r"values shape \(6, 256\) != \(nnz, R, C\) = \(6, 16, 16\)"),
    ("values blocks of another size", lambda c: _linear(c, values=torch.randn(6, 16, 32)),
     r"values shape \(6, 16, 32\) != \(nnz, R, C\)"),
    ("values a numpy array", lambda c: _linear(c, values=c.values.detach().numpy()),
     r"values must be a tensor of shape \(nnz, R, C\), got ndarray"),
    ("values bf16, x fp32", lambda c: _linear(c, values=c.values.detach().bfloat16()),
     "values dtype torch.bfloat16 != input dtype torch.float32"),
    ("values int32", lambda c: _linear(c, values=c.values.detach().int()),
     "values dtype torch.int32 is not a floating dtype"),
    ("bias of 31", lambda c: _linear(c, bias=c.bias[:31]),
     r"bias shape \(31,\) != \(out_features,\) = \(32,\) of the topology"),
    ("bias 2-D", lambda c: _linear(c, bias=c.bias[None]),
     r"bias shape \(1, 32\) != \(out_features,\)"),
    ("bias a list", lambda c: _linear(c, bias=[0.0] * 32),
     r"bias must be a tensor of shape \(out_features,\), got list"),
    ("bias fp64", lambda c: _linear(c, bias=c.bias.detach().double()),
     "bias dtype torch.float64 != input dtype torch.float32"),
    ("bias on meta", lambda c: _linear(c, bias=c.bias.detach().to("meta")),
     "bias is on meta, the topology's index tensors on cpu"),
    ("launch_forward 3-D x", lambda c: bsk.launch_forward(c.x, c.values, c.topology, None),
     r"input must have shape \(tokens, 48\), got \(3, 5, 48\)"),
    ("launch_forward fp64", lambda c: bsk.launch_forward(
        _flat(c)[0].double(), _flat(c)[2].double(), c.topology, None),
     "input dtype torch.float64: the Triton kernels run float32, float16 and bfloat16"),
    ("launch_forward bias of 33", lambda c: bsk.launch_forward(
        _flat(c)[0], _flat(c)[2], c.topology, torch.randn(33)), r"bias shape \(33,\)"),
    ("launch_forward use_tma on an unaligned x", lambda c: bsk.launch_forward(
        strided(_flat(c)[0], "offset_rows"), _flat(c)[2], c.topology, None, use_tma=True),
     "use_tma=True needs 16-byte aligned operands .* leave use_tma=None"),
    ("launch_input_grad 31 features", lambda c: bsk.launch_input_grad(
        _flat(c)[1][:, :31], _flat(c)[2], c.topology),
     "grad_out has 31 features, the layer gives 32"),
    ("launch_input_grad 1-D grad", lambda c: bsk.launch_input_grad(
        _flat(c)[1][0], _flat(c)[2], c.topology),
     r"grad_out must have shape \(tokens, 32\), got \(32,\)"),
    ("launch_input_grad missing blocks", lambda c: bsk.launch_input_grad(
        _flat(c)[1], _flat(c)[2][1:], c.topology), r"values shape \(5, 16, 16\)"),
    ("launch_weight_grad rows differ", lambda c: bsk.launch_weight_grad(
        _flat(c)[1][:14], _flat(c)[0], c.topology, torch.float32),
     r"grad_out shape \(14, 32\) does not match input shape \(15, 48\): one row of grad_out "
     r"per row of the input"),
    ("launch_weight_grad int dtype", lambda c: bsk.launch_weight_grad(
        _flat(c)[1], _flat(c)[0], c.topology, torch.int32),
     r"dtype torch.int32 of the weight gradient is not one of .* pass values.dtype"),
    ("launch_weight_grad fp16 x, fp32 grad", lambda c: bsk.launch_weight_grad(
        _flat(c)[1], _flat(c)[0].half(), c.topology, torch.float32),
     "grad_out dtype torch.float32 != input dtype torch.float16"),
    ("op with packed indices cut short", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], c.values.detach(), None, 32, 48, _index(c)[:-1]),
     r"packed block indices must be a 1-D int32 \(or int64\) tensor of length 2 \+ 2 \+ 3 "
     r"\+ 4 \* 6 = 31 for a \(32, 48\) weight in \(16, 16\) blocks with 6 kept, got "
     r"torch.int32 \(30,\): pass a BlockTopology's .packed"),
    ("op with packed indices 2-D", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], c.values.detach(), None, 32, 48, _index(c)[None]),
     r"length 2 \+ 2 \+ 3 \+ 4 \* 6 = 31 .* got torch.int32 \(1, 31\)"),
    ("op with float packed indices", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], c.values.detach(), None, 32, 48, _index(c).float()),
     r"length 2 \+ 2 \+ 3 \+ 4 \* 6 = 31 .* got torch.float32 \(31,\)"),
    ("from_packed with a negative nnz", lambda c: BlockTopology.from_packed(
        32, 48, (16, 16), _index(c), -1), r"nnz must be an int in \[0, 6\] \(the kept blocks "
                                        r"of a 2x3 block grid\), got -1"),
    ("from_packed with a float nnz", lambda c: BlockTopology.from_packed(
        32, 48, (16, 16), _index(c), 6.0), r"nnz must be an int in \[0, 6\] .* got 6.0"),
    ("op with more blocks in values than the grid has", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], torch.zeros(7, 16, 16), None, 32, 48, _index(c).clone()),
     r"values holds 7 blocks; a \(32, 48\) weight in \(16, 16\) blocks has 6"),
    ("op with more blocks in values than the live topology", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], torch.zeros(7, 16, 16), None, 32, 48, _index(c)),
     r"values shape \(7, 16, 16\) != \(nnz, R, C\) = \(6, 16, 16\)"),
    ("op with 2-D values", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], c.values.detach().flatten(1), None, 32, 48, _index(c)),
     r"values shape \(6, 256\) is not \(nnz, R, C\)"),
    ("op with out_features of another grid", lambda c: BS_OPS.block_sparse_linear(
        c.x.detach()[0], c.values.detach(), None, 40, 48, _index(c)),
     r"packed block indices must be a 1-D int32 \(or int64\) tensor of length 2 \+ 3 \+ 3 "
     r"\+ 4 \* 6 = 32 for a \(40, 48\) weight in \(16, 16\) blocks with 6 kept, got "
     r"torch.int32 \(31,\)"),
    ("input_grad op, grad of 33", lambda c: BS_OPS.block_sparse_linear_input_grad(
        torch.randn(5, 33), c.values.detach(), 32, 48, _index(c)),
     "grad_out has 33 features, the layer gives 32"),
    ("weight_grad op, rows differ", lambda c: BS_OPS.block_sparse_linear_weight_grad(
        torch.randn(4, 32), c.x.detach()[0], c.values.detach(), 32, 48, _index(c)),
     r"grad_out shape \(4, 32\) does not match input shape \(5, 48\)"),
    ("topology block 0x16", lambda c: BlockTopology.from_block_mask(
        torch.ones(2, 3, dtype=torch.bool), 32, 48, (0, 16)),
     r"block must be \(R, C\) with R, C >= 1, got \(0, 16\)"),
    ("topology of 0 outputs", lambda c: BlockTopology.from_block_mask(
        torch.ones(0, 3, dtype=torch.bool), 0, 48, (16, 16)),
     r"needs out_features and in_features >= 1, got \(0, 48\)"),
    ("topology float row_indices", lambda c: _topology_with(
        c, row_indices=c.topology.row_indices.float()),
     r"BlockTopology.row_indices must be an int32 \(or int64\) tensor of shape \(6,\) .* got "
     r"torch.float32 \(6,\) on cpu"),
    ("topology t_block_ids too short", lambda c: _topology_with(
        c, t_block_ids=c.topology.t_block_ids[:5]),
     r"BlockTopology.t_block_ids must be .* shape \(6,\) .* got torch.int32 \(5,\)"),
    ("topology offsets on meta", lambda c: _topology_with(
        c, t_offsets=c.topology.t_offsets.to("meta")),
     r"BlockTopology.t_offsets must be .* on cpu .* got torch.int32 \(4,\) on meta"),
    ("topology offsets a list", lambda c: _topology_with(c, row_offsets=[0, 3, 6]),
     "BlockTopology.row_offsets must be .* got list"),
    ("top_blocks nnz above the grid", lambda c: top_blocks(torch.rand(2, 3), 7),
     r"nnz must be an int in \[0, 6\] \(the number of blocks of a \(2, 3\) block grid\), "
     r"got 7"),
    ("top_blocks nnz -1", lambda c: top_blocks(torch.rand(2, 3), -1),
     r"nnz must be an int in \[0, 6\] .* got -1"),
    ("top_blocks nnz 2.0", lambda c: top_blocks(torch.rand(2, 3), 2.0),
     r"nnz must be an int .* got 2.0"),
    ("top_blocks nnz True", lambda c: top_blocks(torch.rand(2, 3), True),
     r"nnz must be an int .* got True"),
    ("from_block_mask with nnz above the grid", lambda c: BlockTopology.from_block_mask(
        torch.ones(2, 3, dtype=torch.bool), 32, 48, (16, 16), nnz=8),
     r"nnz 8 is not a kept count of a 2x3 block grid \(0 to 6\)"),
    ("from_block_mask with nnz -1", lambda c: BlockTopology.from_block_mask(
        torch.ones(2, 3, dtype=torch.bool), 32, 48, (16, 16), nnz=-1),
     r"nnz -1 is not a kept count"),
]


@pytest.mark.parametrize(("call", "message"), [row[1:] for row in BLOCK_SPARSE_OP_ERRORS],
                         ids=[row[0] for row in BLOCK_SPARSE_OP_ERRORS])
def test_block_sparse_op_errors_come_before_any_change(call, message):
    c = _bs_case()
    operands = (c.x, c.values, c.bias)
    before = [t.detach().clone() for t in operands]
    with pytest.raises(ValueError, match=message):
        call(c)
    assert all(t.grad is None for t in operands)
    assert all(torch.equal(t, b) for t, b in zip(operands, before, strict=True))


def _train(c, x=None, values=None, bias=None, grad=None):
    """Forward and backward of the functional; the output and the three gradients."""
    out = _linear(c, x, values, bias)
    out.backward(c.grad if grad is None else grad)
    return out


def _handled_float64(c):
    c.x, c.values, c.bias = (t.detach().double().requires_grad_() for t in (c.x, c.values,
                                                                           c.bias))
    out = _train(c)
    for got, want in zip((out, c.x.grad, c.values.grad, c.bias.grad), c.want(), strict=True):
        assert got.dtype == torch.float64
        assert_close(got, want, torch.float64)


def _handled_no_tokens(c):
    x = torch.randn(0, 48, requires_grad=True)
    out = _train(c, x=x, grad=torch.randn(0, 32))
    assert out.shape == (0, 32) and x.grad.shape == (0, 48)
    assert torch.equal(c.values.grad, torch.zeros(6, 16, 16))
    assert torch.equal(c.bias.grad, torch.zeros(32))


def _handled_1d_input(c):
    out = _linear(c, x=c.x[0, 0])
    assert out.shape == (32,)
    assert_close(out, c.want()[0][0, 0], torch.float32)


def _handled_autocast(c):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _train(c)
    assert out.dtype == torch.bfloat16 and c.values.grad.dtype == torch.float32
    assert_close(out, c.want()[0], torch.bfloat16)


def _handled_nan_scores_only(c):
    kept = top_blocks(torch.full((2, 3), float("nan")), 4)
    assert int(kept.sum()) == 4  # no block has a number: NaN blocks fill the count


def _handled_strided_everything(c):
    c.x = strided(c.x.detach()[0], "transposed").requires_grad_()
    c.values = strided(c.values.detach(), "transposed").requires_grad_()
    c.bias = strided(c.bias.detach(), "every_other").requires_grad_()
    c.grad = strided(c.grad[0], "transposed")
    out = _train(c)
    for got, want in zip((out, c.x.grad, c.values.grad, c.bias.grad), c.want(), strict=True):
        assert_close(got, want, torch.float32)


BLOCK_SPARSE_OP_HANDLED = [  # accepted as docs/block_sparse.md says
    ("float64 operands: the pure-torch reference", _handled_float64),
    ("no tokens: empty output, zero weight and bias gradients", _handled_no_tokens),
    ("a 1-D input, as F.linear", _handled_1d_input),
    ("fp32 operands under bf16 autocast", _handled_autocast),
    ("top_blocks over NaN scores only", _handled_nan_scores_only),
    ("every operand non-contiguous", _handled_strided_everything),
]


@pytest.mark.parametrize("check", [row[1] for row in BLOCK_SPARSE_OP_HANDLED],
                         ids=[row[0] for row in BLOCK_SPARSE_OP_HANDLED])
def test_block_sparse_op_handled_inputs(check):
    check(_bs_case())


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(BLOCK_SPARSE_OP_ERRORS), len(BLOCK_SPARSE_OP_HANDLED)) == (53, 6)
