"""The block-sparse Linear's autograd: an ``autograd.Function`` for eager calls and
``torch.library`` custom ops for ``torch.compile`` and ``torch.jit.trace``, and the functional
over both.

``sparse_training::block_sparse_linear`` (forward), ``..._input_grad`` and
``..._weight_grad`` each run the Triton launcher where the kernels can run (CUDA, or CPU
under ``TRITON_INTERPRET=1``) and the pure-torch reference elsewhere. Being custom ops
with fake (meta) implementations, ``torch.compile`` traces through them without a
graph break, and the backward is registered on the forward op. Their last argument,
``checked``, says that the operands were checked already: the fake implementations check
them whenever a graph is traced, and the graphs pass True, so that a compiled step's
launches skip the checks; a direct call (False by default) checks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_training.kernels._autograd import AUTOCAST_DTYPES, refuse_create_graph
from sparse_training.kernels._triton import HAS_TRITON, kernels_run_on
from sparse_training.kernels.block_sparse import reference
from sparse_training.kernels.block_sparse.topology import (
    KERNEL_DTYPES,
    BlockTopology,
    block_grid,
    check_operands,
)

if HAS_TRITON:
    from sparse_training.kernels.block_sparse import kernels
else:  # the references serve every device
    kernels = None


def _topology(values: Tensor, out_features: int, in_features: int,
              packed: Tensor) -> BlockTopology:
    """The topology the custom ops' arguments describe (the block from ``values``): the
    live one on this very ``packed`` tensor (:meth:`BlockTopology.live`: a compiled graph
    passes a layer's own at every call, and the launches the kernels keep per topology
    serve it), else a new one.

    Raises:
        ValueError: ``values`` not 3-D, or ``packed`` not the indices of one block grid.
    """
    block = tuple(values.shape[1:])
    topology = BlockTopology.live(packed)  # first: the call a compiled step makes
    if topology is not None and (topology.out_features, topology.in_features,
                                 topology.block) == (out_features, in_features, block):
        return topology
    if values.dim() != 3:
        raise ValueError(f"values shape {tuple(values.shape)} is not (nnz, R, C)")
    nnz, (rows, cols) = values.shape[0], block_grid(out_features, in_features, block)
    if isinstance(nnz, int) and nnz > rows * cols:
        raise ValueError(f"values holds {nnz} blocks; a ({out_features}, {in_features}) "
                         f"weight in {block} blocks has {rows * cols}")
    return BlockTopology.from_packed(out_features, in_features, block, packed, nnz)


def _use_kernels(t: Tensor) -> bool:
    """The Triton kernels serve devices they run on in their dtypes; the references the
    rest (float64 included, exactly)."""
    return kernels is not None and t.dtype in KERNEL_DTYPES and kernels_run_on(t.device)


def _forward(x: Tensor, values: Tensor, topology: BlockTopology, bias: Tensor | None,
             checked: bool = False) -> Tensor:
    """``Y``, its operands checked unless ``checked`` (the kernels' launch only: the
    references always check, their products cost far more)."""
    if _use_kernels(x):
        launch = kernels.forward_product if checked else kernels.launch_forward
        return launch(x, values, topology, bias)
    return reference.forward_reference(x, values, topology, bias)


def _input_grad(grad_out: Tensor, values: Tensor, topology: BlockTopology,
                checked: bool = False) -> Tensor:
    """``dX``, its operands checked unless ``checked`` (as :func:`_forward`)."""
    if _use_kernels(grad_out):
        launch = kernels.input_grad_product if checked else kernels.launch_input_grad
        return launch(grad_out, values, topology)
    return reference.input_grad_reference(grad_out, values, topology)


def _weight_grad(grad_out: Tensor, x: Tensor, topology: BlockTopology,
                 dtype: torch.dtype, checked: bool = False) -> Tensor:
    """``dValues`` in ``dtype``, its operands checked unless ``checked`` (as
    :func:`_forward`)."""
    if _use_kernels(x):
        launch = kernels.weight_grad_product if checked else kernels.launch_weight_grad
        return launch(grad_out, x, topology, dtype)
    # summed in float32 at least, as the kernels do: half-precision operands (autocast) must
    # not round the gradient of float32 values to their own precision
    wide = torch.promote_types(x.dtype, torch.float32)
    return reference.weight_grad_reference(grad_out.to(wide), x.to(wide), topology).to(dtype)


def _gradients(needs: tuple[bool, ...], grad_out: Tensor, bias_dtype: torch.dtype | None,
               input_grad, weight_grad) -> tuple[Tensor | None, ...]:
    """(dX, dValues, dBias) of ``Y = X W^T + b``; the products through the given ops, the
    bias gradient summed into ``bias_dtype`` (None: no bias)."""
    return (input_grad(grad_out) if needs[0] else None,
            weight_grad(grad_out) if needs[1] else None,
            grad_out.sum(0, dtype=bias_dtype) if bias_dtype is not None and needs[2] else None)


def _autocast(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` as autocast casts ``F.linear``'s operands to ``dtype``: the 32- and 16-bit
    floats (others, int and float64, stay as they are and meet the checks)."""
    if dtype is None or not isinstance(t, Tensor) or t.dtype not in AUTOCAST_DTYPES:
        return t
    return t.to(dtype)


class BlockSparseLinearFunction(torch.autograd.Function):
    """Eager autograd of ``Y = X W^T + b`` (2-D ``x``): the launchers called directly,
    without the custom ops' Python dispatch layers (host time the layer step pays).

    ``dtype``: autocast's, or None. ``values`` and ``bias`` are cast to it here, where
    autograd records no cast: their gradients come back in their own dtypes straight from
    the fp32 sums (never rounded to ``dtype`` on the way), with no cast nodes or copies in
    the backward. The operands are checked once, by the forward, which also picks the
    kernels or the references for all three products: the backward's operands are
    autograd's (``grad_out`` has the output's shape, dtype and device) and the saved ones.
    """

    @staticmethod
    def forward(ctx, x: Tensor, values: Tensor, topology: BlockTopology,
                bias: Tensor | None, dtype: torch.dtype | None) -> Tensor:
        cast, ctx.kernels = _autocast(values, dtype), _use_kernels(x)
        product = kernels.launch_forward if ctx.kernels else reference.forward_reference
        out = product(x, cast, topology, _autocast(bias, dtype))
        # the packed indices too: a mask rewritten in place before the backward
        # (set_block_mask) is then autograd's "modified by an inplace operation" error
        ctx.save_for_backward(x, cast, topology.packed)
        ctx.topology, ctx.dtypes = topology, (values.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        refuse_create_graph("block_sparse_linear")
        x, values, _ = ctx.saved_tensors
        topology, (values_dtype, bias_dtype) = ctx.topology, ctx.dtypes
        needs = ctx.needs_input_grad  # (x, values, topology, bias, dtype)
        input_grad, weight_grad = ((kernels.input_grad_product, kernels.weight_grad_product)
                                   if ctx.kernels else (_input_grad, _weight_grad))
        grads = _gradients(
            (needs[0], needs[1], needs[3]), grad_out, bias_dtype,
            lambda g: input_grad(g, values, topology),
            lambda g: weight_grad(g, x, topology, values_dtype))
        return grads[0], grads[1], None, grads[2], None


# Defined with torch.library's low-level API, not ``custom_op``: the dispatcher then calls
# the implementations with no Python wrapper around them (``custom_op``'s checks its
# outputs' aliasing at every call: 5-20 us more a call on a CPU, three calls a layer and
# step in a compiled graph; ``benchmarks/op_dispatch.py``'s custom_op column).
_LIBRARY = torch.library.Library("sparse_training", "FRAGMENT")
_LIBRARY.define("block_sparse_linear(Tensor x, Tensor values, Tensor? bias, SymInt out_features, "
                "SymInt in_features, Tensor packed, bool checked=False) -> Tensor")
_LIBRARY.define("block_sparse_linear_input_grad(Tensor grad_out, Tensor values, "
                "SymInt out_features, SymInt in_features, Tensor packed, "
                "bool checked=False) -> Tensor")
_LIBRARY.define("block_sparse_linear_weight_grad(Tensor grad_out, Tensor x, Tensor values, "
                "SymInt out_features, SymInt in_features, Tensor packed, "
                "bool checked=False) -> Tensor")


def _linear_impl(x: Tensor, values: Tensor, bias: Tensor | None, out_features: int,
                 in_features: int, packed: Tensor, checked: bool = False) -> Tensor:
    return _forward(x, values, _topology(values, out_features, in_features, packed),
                    bias, checked)


def _linear_fake(x, values, bias, out_features, in_features, packed, checked=False):
    topology = _topology(values, out_features, in_features, packed)
    check_operands(topology, values=values, x=x, bias=bias)
    return x.new_empty(x.shape[0], out_features)  # contiguous, as the launcher's


def _input_grad_impl(grad_out: Tensor, values: Tensor, out_features: int, in_features: int,
                     packed: Tensor, checked: bool = False) -> Tensor:
    return _input_grad(grad_out, values,
                       _topology(values, out_features, in_features, packed), checked)


def _input_grad_fake(grad_out, values, out_features, in_features, packed, checked=False):
    topology = _topology(values, out_features, in_features, packed)
    check_operands(topology, values=values, grad_out=grad_out)
    return grad_out.new_empty(grad_out.shape[0], in_features)


def _weight_grad_impl(grad_out: Tensor, x: Tensor, values: Tensor, out_features: int,
                      in_features: int, packed: Tensor, checked: bool = False) -> Tensor:
    return _weight_grad(grad_out, x, _topology(values, out_features, in_features,
                                               packed), values.dtype, checked)


def _weight_grad_fake(grad_out, x, values, out_features, in_features, packed, checked=False):
    topology = _topology(values, out_features, in_features, packed)
    check_operands(topology, values=values, x=x, grad_out=grad_out)
    return values.new_empty(values.shape)  # contiguous whatever the strides of values


for _name, _impl, _fake in (("block_sparse_linear", _linear_impl, _linear_fake),
                            ("block_sparse_linear_input_grad", _input_grad_impl,
                             _input_grad_fake),
                            ("block_sparse_linear_weight_grad", _weight_grad_impl,
                             _weight_grad_fake)):
    _LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")  # every device
    torch.library.register_fake(f"sparse_training::{_name}", _fake, lib=_LIBRARY)
_linear_op = torch.ops.sparse_training.block_sparse_linear.default
_input_grad_op = torch.ops.sparse_training.block_sparse_linear_input_grad.default
_weight_grad_op = torch.ops.sparse_training.block_sparse_linear_weight_grad.default


def _setup_context(ctx, inputs, output) -> None:
    x, values, bias, out_features, in_features, packed, _ = inputs
    ctx.save_for_backward(x, values, packed)
    ctx.features = (out_features, in_features)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad_out):
    """The gradients' ops with ``checked``: the forward checked its operands, and autograd
    gives ``grad_out`` the output's shape, dtype and device."""
    x, values, packed = ctx.saved_tensors
    grads = _gradients(
        ctx.needs_input_grad, grad_out, ctx.bias_dtype,
        lambda g: _input_grad_op(g, values, *ctx.features, packed, checked=True),
        lambda g: _weight_grad_op(g, x, values, *ctx.features, packed, checked=True))
    # one per argument passed: the dispatcher drops ``checked`` where it is the default
    return (*grads, None, None, None, None)[:len(ctx.needs_input_grad)]


torch.library.register_autograd("sparse_training::block_sparse_linear", _backward,
                                setup_context=_setup_context, lib=_LIBRARY)


def block_sparse_linear(x: Tensor, values: Tensor, topology: BlockTopology,
                        bias: Tensor | None = None) -> Tensor:
    """``x W^T + bias`` with ``W`` given by its kept blocks ``values[nnz, R, C]``.

    ``x`` has any leading dimensions and ``in_features`` last; every operand may have any
    strides. Under autocast ``x``, ``values`` and ``bias`` run in the autocast dtype, as
    ``F.linear`` does (eager calls return the gradients of ``values`` and ``bias`` in their
    own dtypes from the fp32 sums: :class:`BlockSparseLinearFunction`); otherwise they
    share one dtype: float32, float16 or bfloat16 run
    the Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``), float64 and other
    devices the pure-torch references. Eager calls go through
    :class:`BlockSparseLinearFunction`; under ``torch.compile`` through the custom ops,
    which the compiler traces without a graph break, and under ``torch.jit.trace`` too,
    which records them (the traced module runs, differentiates and saves; its calls
    check their operands).

    Raises:
        ValueError: an operand that does not fit ``topology``
            (:func:`~.topology.check_operands`: features, shapes, dtypes, devices),
            checked by the launchers, the references and the fake implementations, each
            before it computes anything.
    """
    if not isinstance(x, Tensor) or x.dim() == 0:
        what = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"input must be a tensor of shape (..., {topology.in_features}), "
                         f"got {what}")
    device_type, dtype = x.device.type, None
    # meta has no autocast; while compiling, the other devices are taken to have it:
    # torch 2.11's compiler breaks the graph on is_autocast_available (and then runs a
    # model's loop over its layers eagerly)
    available = device_type != "meta" and (torch.compiler.is_compiling()
                                           or torch.amp.is_autocast_available(device_type))
    if available and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype not in AUTOCAST_DTYPES and x.dtype != values.dtype:  # float64 stays
            raise ValueError(f"input dtype {x.dtype} is not the layer's {values.dtype}, and "
                             f"autocast casts only {', '.join(map(str, AUTOCAST_DTYPES))} "
                             f"(F.linear's rule); cast the input")
        x = _autocast(x, dtype)
    flat = x.reshape(-1, x.shape[-1])
    compiling = torch.compiler.is_compiling()
    if compiling or torch.jit.is_tracing():  # a graph's op: torch.jit.trace records it too
        out = _linear_op(flat, _autocast(values, dtype), _autocast(bias, dtype),
                         topology.out_features, topology.in_features, topology.packed,
                         checked=compiling)  # compiled: the fake implementation checked
    else:  # values and bias cast inside (BlockSparseLinearFunction)
        out = BlockSparseLinearFunction.apply(flat, values, topology, bias, dtype)
    return out.view(*x.shape[:-1], topology.out_features)
