"""Block-sparse Linear kernels (Triton interpreter on CPU) against the float64 reference of
``block_sparse_cases``: the dense weight built by loops over the kept blocks, shared with
no code of the package. The padded tail entries of ``values`` hold NaN in every case here:
the op must never use them (their gradient is exactly 0).

Strides, poisoned tails in every load path, NaN ranking, ``torch.compile`` and the custom
ops' fake implementations: ``test_block_sparse_inputs.py``.
"""

import gc

import pytest
import torch
import triton
from block_sparse_cases import (
    assert_close,
    block_mask_of,
    dense_weight,
    make_case,
    strided,
    tail_mask,
)

from sparse_training.kernels.block_sparse import (
    BlockTopology,
    block_sparse_linear,
    launch,
)
from sparse_training.kernels.block_sparse import kernels as bsk

pytestmark = pytest.mark.interpreter


def case(out_f, in_f, tokens, block, kind, dtype, seed=0):
    """:func:`make_case` unpacked, with its float64 reference."""
    c = make_case(out_f, in_f, tokens, block, kind, dtype, seed)
    return c.topology, c.mask, c.values, c.x, c.bias, c.grad, c.want()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("out_f, in_f, block", [
    (70, 45, (16, 32)),      # tails on both sides
    (96, 64, (32, 16)),
    (130, 200, (64, 64)),
    (128, 256, (128, 128)),  # aligned: the TMA path under the interpreter
    (200, 136, (128, 128)),  # the TMA path with tails in both reductions
    (200, 136, (128, 64)),
])
@pytest.mark.parametrize("kind", ["random", "empty_rows", "all"])
def test_forward_and_gradients_match_float64(dtype, out_f, in_f, block, kind):
    c = make_case(out_f, in_f, 11, block, kind, dtype).leaves()
    out = block_sparse_linear(c.x, c.values, c.topology, c.bias)
    out.backward(c.grad)
    for got, expected in zip((out, c.x.grad, c.values.grad, c.bias.grad), c.want(),
                             strict=True):
        assert got.dtype == dtype
        assert_close(got, expected, dtype)
    assert torch.all(c.values.grad[tail_mask(c.mask, out_f, in_f, block)] == 0)


@pytest.mark.parametrize("use_tma", [True, False])
@pytest.mark.parametrize("out_f, in_f, block", [(64, 96, (32, 32)), (72, 44, (32, 16)),
                                                (200, 136, (128, 128))])
def test_both_load_paths_agree(use_tma, out_f, in_f, block):
    topology, mask, values, x, bias, grad, want = case(out_f, in_f, 40, block, "random",
                                                       torch.float32)
    x2, g2 = x.reshape(-1, in_f), grad.reshape(-1, out_f)
    assert_close(bsk.launch_forward(x2, values, topology, bias, use_tma),
                 want[0].view(-1, out_f), torch.float32)
    assert_close(bsk.launch_input_grad(g2, values, topology, use_tma), want[1].view(-1, in_f),
                 torch.float32)
    grad_values = bsk.launch_weight_grad(g2, x2, topology, values.dtype, use_tma)
    assert_close(grad_values, want[2], torch.float32)
    assert torch.all(grad_values[tail_mask(mask, out_f, in_f, block)] == 0)


def test_weight_gradient_split_over_token_chunks_is_deterministic_and_exact():
    # 1100 tokens and 2 kept blocks: the token sum is split into chunks (fp32 partials)
    topology, mask, values, x, bias, grad, want = case(32, 32, 1100, (16, 16), "random",
                                                       torch.float32)
    chunk, splits = bsk._token_splits(1100 * 3, topology.nnz, x.device)
    assert splits > 1
    x2, g2 = x.reshape(-1, 32), grad.reshape(-1, 32)
    first = bsk.launch_weight_grad(g2, x2, topology, torch.float32)
    assert torch.equal(first, bsk.launch_weight_grad(g2, x2, topology, torch.float32))
    assert_close(first, want[2], torch.float32)


@pytest.mark.parametrize("tokens", [11, 400])  # x 3: one token chunk; two, fp32 partials summed
def test_autocast_gradients_of_values_and_bias_come_unrounded_from_the_fp32_sums(tokens):
    """Under bf16 autocast the eager op casts float32 values and bias inside its autograd
    Function: the graph holds no cast node for them, and their float32 gradients are the
    float64 reference of the bf16 operands to float32 accuracy (not rounded to bf16)."""
    c = make_case(70, 45, tokens, (16, 32), "random", torch.float32).leaves()
    _, splits = bsk._token_splits(3 * tokens, c.topology.nnz, c.x.device)
    assert (splits > 1) == (tokens > 11)
    with torch.autocast("cpu", torch.bfloat16):
        out = block_sparse_linear(c.x, c.values, c.topology, c.bias)
    function = out.grad_fn.next_functions[0][0]  # under the output's view
    edges = [type(node).__name__ for node, _ in function.next_functions]  # tensor inputs
    assert edges[1:] == ["AccumulateGrad", "AccumulateGrad"]  # values, bias: no cast node
    grad = c.grad.bfloat16()
    out.backward(grad)
    rounded = make_case(70, 45, tokens, (16, 32), "random", torch.float32)
    rounded.values, rounded.x, rounded.grad = (t.bfloat16().float() for t in (
        c.values.detach(), c.x.detach(), grad))
    rounded.bias = c.bias.detach().bfloat16().float()
    _, grad_x, grad_values, grad_bias = rounded.want()
    assert c.values.grad.dtype == c.bias.grad.dtype == c.x.grad.dtype == torch.float32
    assert_close(c.values.grad, grad_values, torch.float32)
    assert_close(c.bias.grad, grad_bias, torch.float32)
    assert_close(c.x.grad, grad_x, torch.bfloat16)  # dX: the kernel's bf16 output


class CompiledStandIn:
    """Plays the ``CompiledKernel`` that a GPU launch returns: its launcher gets every
    argument positionally (constexprs included) and runs the interpreted kernel."""

    def __init__(self, kernel):
        while isinstance(kernel, triton.runtime.Heuristics):
            kernel = kernel.fn
        self.kernel, self.function, self.packed_metadata, self.launches = kernel, None, None, 0

    def run(self, x, y, z, stream, function, packed, metadata, enter, exit, *args):
        self.launches += 1
        self.hooks = (metadata, enter, exit)
        self.kernel[(x, y, z)](*args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid)


class AutotunerStandIn:
    """The interpreter's autotuner, returning the compiled stand-in as the JIT would."""

    def __init__(self, autotuner):
        self.autotuner, self.arg_names, self.fn = autotuner, autotuner.arg_names, autotuner.fn
        self.compiled = CompiledStandIn(autotuner.fn)

    @property
    def best_config(self):
        return self.autotuner.best_config

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.autotuner[grid](*args, **kwargs)
            return self.compiled
        return run


@pytest.mark.parametrize("out_f, in_f, tokens, block, kind", [
    (70, 45, 11, (16, 32), "random"),      # masked tails (EVEN false)
    (64, 96, 32, (32, 32), "random"),      # EVEN true
    (128, 256, 32, (128, 128), "all"),     # tensor descriptors
    (128, 256, 32, (128, 128), "random"),  # one kept block: index views off 16 bytes
])
def test_direct_launch_of_the_tuned_kernel_matches_the_autotuner_path(
        monkeypatch, out_f, in_f, tokens, block, kind):
    """The GPU's fast path (launcher called with the cached grid and constexprs) run under
    the interpreter: the same results as ``kernel[grid]``, bit for bit."""
    tuned = {}
    for name in ("_DENSE_SPARSE", "_SAMPLED_DENSE_DENSE"):
        plain = getattr(bsk, name)
        tuned[name] = launch.TunedKernel(AutotunerStandIn(plain.kernel), plain.grid)
        monkeypatch.setattr(bsk, name, tuned[name])
    monkeypatch.setattr(launch, "current_stream", lambda device: 0)
    topology, mask, values, x, bias, grad, _ = case(out_f, in_f, tokens, block, kind,
                                                    torch.float32)
    x2, g2 = x.reshape(-1, in_f), grad.reshape(-1, out_f)

    def products(x2=x2, values=values, bias=bias, g2=g2):
        return (bsk.launch_forward(x2, values, topology, bias),
                bsk.launch_input_grad(g2, values, topology),
                bsk.launch_weight_grad(g2, x2, topology, values.dtype))
    want = products()
    for kernel in tuned.values():
        kernel.fast = True
    first, second = products(), products()  # the autotuner's path, then the direct one
    compiled = [k.kernel.compiled for k in tuned.values()]
    assert [c.launches for c in compiled] == [2, 1]
    assert compiled[1].hooks == (None, None, None)  # empty hook chains
    for got in (first, second):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    def hook(metadata):
        pass
    triton.knobs.runtime.launch_enter_hook.add(hook)  # a profiler: still direct, hooked
    try:
        bsk.launch_weight_grad(g2, x2, topology, values.dtype)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    metadata, enter, exit_ = compiled[1].hooks
    assert compiled[1].launches == 2 and metadata[0] == "metadata" and exit_ is None
    assert enter is triton.knobs.runtime.launch_enter_hook

    # strided operands: another row stride and alignment are other cache keys (tuned, then
    # direct); values and bias are copied contiguous: the same results, bit for bit
    operands = dict(x2=strided(x2, "offset_rows"), values=strided(values, "transposed"),
                    bias=strided(bias, "every_other"), g2=strided(g2, "transposed"))
    cached = [len(k._launches) for k in tuned.values()]
    for got in (products(**operands), products(**operands)):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    assert all(len(k._launches) > n for k, n in zip(tuned.values(), cached, strict=True))

    # the direct launches are kept per topology (3 products, more for the strided operands
    # where their keys differ), and go with it: a mask change makes a new topology
    assert sum(len(k._owned[topology]) for k in tuned.values()) > 3

    def owners_with_a_new_topology() -> int:
        new = BlockTopology.from_block_mask(mask, out_f, in_f, block, nnz=topology.nnz)
        bsk.launch_forward(x2, values, new, bias)
        return len(bsk._DENSE_SPARSE._owned)
    owners = owners_with_a_new_topology()
    gc.collect()
    assert len(bsk._DENSE_SPARSE._owned) == owners - 1


def test_launches_kept_per_owner_belong_to_their_kernel_and_stay_few(monkeypatch):
    """``launch_by`` serves a kept launch only to the kernel that made it (a stand-in kernel,
    as the host benchmarks swap in, never leaks into the real one), and keeps at most
    ``OWNED_PER_OWNER`` per owner: the oldest go when token counts keep changing."""
    class Recorded:
        def __init__(self, maker):
            self.maker, self.direct = maker, 0

        def __call__(self, tensors):
            self.direct += 1

    made = []

    def through_the_autotuner(self, tensors, scalars, **meta):
        made.append(Recorded(self))
        return made[-1]

    monkeypatch.setattr(launch.TunedKernel, "__call__", through_the_autotuner)
    first, second = (launch.TunedKernel(bsk._DENSE_SPARSE.kernel, bsk._DENSE_SPARSE.grid)
                     for _ in range(2))

    class Owner:
        pass

    owner, arguments = Owner(), lambda: ((), {})
    first.launch_by(owner, ("key",), (), arguments)
    first.launch_by(owner, ("key",), (), arguments)
    second.launch_by(owner, ("key",), (), arguments)
    assert [m.maker for m in made] == [first, second] and made[0].direct == 1
    assert (first.owned_misses, second.owned_misses) == (1, 1)
    for tokens in range(2 * launch.OWNED_PER_OWNER):
        first.launch_by(owner, (tokens,), (), arguments)
    kept = first._owned[owner]
    assert list(kept) == [(t,) for t in range(launch.OWNED_PER_OWNER,
                                              2 * launch.OWNED_PER_OWNER)]
    del owner
    gc.collect()
    assert len(first._owned) == 0


def test_topology_views_describe_the_same_blocks():
    mask = block_mask_of(100, 150, (16, 32), "empty_rows", seed=3)
    topology = BlockTopology.from_block_mask(mask, 100, 150, (16, 32), nnz=int(mask.sum()))
    assert torch.equal(topology.block_mask(), mask)
    rows, cols = mask.nonzero(as_tuple=True)
    assert torch.equal(topology.row_indices.long(), rows)
    assert torch.equal(topology.col_indices.long(), cols)
    assert topology.row_offsets.tolist() == [0, *mask.sum(1).cumsum(0).tolist()]
    assert topology.t_offsets.tolist() == [0, *mask.sum(0).cumsum(0).tolist()]
    for j in range(mask.shape[1]):  # block column j lists its blocks by row, with positions
        lo, hi = topology.t_offsets[j], topology.t_offsets[j + 1]
        ids = topology.t_block_ids[lo:hi].long()
        assert torch.equal(topology.t_row_indices[lo:hi].long(), mask[:, j].nonzero()[:, 0])
        assert torch.equal(topology.col_indices[ids].long(), torch.full_like(ids, j))
    assert all(t.dtype == torch.int32 for t in (topology.row_offsets, topology.t_block_ids))


def test_topology_after_a_block_swap():
    """A RigL/SET move: one block dropped, one grown; the same count, new views."""
    mask = block_mask_of(64, 64, (16, 16), "random", seed=5)
    dropped, grown = mask.nonzero()[0], (~mask).nonzero()[-1]
    moved = mask.clone()
    moved[tuple(dropped)] = False
    moved[tuple(grown)] = True
    topology = BlockTopology.from_block_mask(moved, 64, 64, (16, 16), nnz=int(mask.sum()))
    assert torch.equal(topology.block_mask(), moved)
    x = torch.randn(7, 64)
    values = torch.randn(topology.nnz, 16, 16)
    assert_close(block_sparse_linear(x, values, topology),
                 x.double() @ dense_weight(values, moved, 64, 64).t(), torch.float32)


def test_a_mask_of_the_wrong_grid_is_refused():
    with pytest.raises(ValueError, match=r"block mask shape \(3, 3\) != block grid \(5, 5\)"):
        BlockTopology.from_block_mask(torch.ones(3, 3, dtype=torch.bool), 70, 70, (16, 16))
