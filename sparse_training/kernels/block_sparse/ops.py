"""The block-sparse Linear's autograd: an ``autograd.Function`` for eager calls and
``torch.library`` custom ops for ``torch.compile``, and the functional over both.

``sparse_training::block_sparse_linear`` (forward), ``..._input_grad`` and
``..._weight_grad`` each run the Triton launcher where the kernels can run (CUDA, or CPU
under ``TRITON_INTERPRET=1``) and the pure-torch reference elsewhere. Being custom ops
with fake (meta) implementations, ``torch.compile`` traces through them without a
graph break, and the backward is registered on the forward op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_training.kernels._triton import HAS_TRITON, kernels_run_on
from sparse_training.kernels.block_sparse import reference
from sparse_training.kernels.block_sparse.topology import BlockTopology

if HAS_TRITON:
    from sparse_training.kernels.block_sparse import kernels
else:  # the references serve every device
    kernels = None

_TOPOLOGY_FIELDS = ("row_offsets", "row_indices", "col_indices", "t_offsets",
                    "t_row_indices", "t_block_ids")


def _topology(values: Tensor, out_features: int, in_features: int,
              index_tensors: list[Tensor]) -> BlockTopology:
    return BlockTopology(out_features, in_features, tuple(values.shape[1:]), *index_tensors)


def _use_kernels(t: Tensor) -> bool:
    return kernels is not None and kernels_run_on(t.device)


def _forward(x: Tensor, values: Tensor, topology: BlockTopology, bias: Tensor | None) -> Tensor:
    if _use_kernels(x):
        return kernels.launch_forward(x, values, topology, bias)
    return reference.forward_reference(x, values, topology, bias)


def _input_grad(grad_out: Tensor, values: Tensor, topology: BlockTopology) -> Tensor:
    if _use_kernels(grad_out):
        return kernels.launch_input_grad(grad_out, values, topology)
    return reference.input_grad_reference(grad_out, values, topology)


def _weight_grad(grad_out: Tensor, x: Tensor, values: Tensor, topology: BlockTopology
                 ) -> Tensor:
    if _use_kernels(x):
        return kernels.launch_weight_grad(grad_out, x, topology, values.dtype)
    return reference.weight_grad_reference(grad_out, x, topology).to(values.dtype)


def _gradients(needs: tuple[bool, ...], grad_out: Tensor, x: Tensor, values: Tensor,
               has_bias: bool, input_grad, weight_grad) -> tuple[Tensor | None, ...]:
    """(dX, dValues, dBias) of ``Y = X W^T + b``; the products through the given ops."""
    grad_out = grad_out.contiguous()
    return (input_grad(grad_out) if needs[0] else None,
            weight_grad(grad_out) if needs[1] else None,
            grad_out.sum(0) if has_bias and needs[2] else None)


class BlockSparseLinearFunction(torch.autograd.Function):
    """Eager autograd of ``Y = X W^T + b`` (2-D ``x``): the launchers called directly,
    without the custom ops' Python dispatch layers (host time the layer step pays)."""

    @staticmethod
    def forward(ctx, x: Tensor, values: Tensor, topology: BlockTopology,
                bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, values)
        ctx.topology, ctx.has_bias = topology, bias is not None
        return _forward(x, values, topology, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, values = ctx.saved_tensors
        topology = ctx.topology
        needs = ctx.needs_input_grad  # (x, values, topology, bias)
        grads = _gradients((needs[0], needs[1], needs[3]), grad_out, x, values, ctx.has_bias,
                           lambda g: _input_grad(g, values, topology),
                           lambda g: _weight_grad(g, x, values, topology))
        return grads[0], grads[1], None, grads[2]


@torch.library.custom_op("sparse_training::block_sparse_linear", mutates_args=())
def _linear_op(x: Tensor, values: Tensor, bias: Tensor | None, out_features: int,
               in_features: int, index_tensors: list[Tensor]) -> Tensor:
    return _forward(x, values, _topology(values, out_features, in_features, index_tensors),
                    bias)


@_linear_op.register_fake
def _(x, values, bias, out_features, in_features, index_tensors):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("sparse_training::block_sparse_linear_input_grad", mutates_args=())
def _input_grad_op(grad_out: Tensor, values: Tensor, out_features: int, in_features: int,
                   index_tensors: list[Tensor]) -> Tensor:
    return _input_grad(grad_out, values,
                       _topology(values, out_features, in_features, index_tensors))


@_input_grad_op.register_fake
def _(grad_out, values, out_features, in_features, index_tensors):
    return grad_out.new_empty(grad_out.shape[0], in_features)


@torch.library.custom_op("sparse_training::block_sparse_linear_weight_grad", mutates_args=())
def _weight_grad_op(grad_out: Tensor, x: Tensor, values: Tensor, out_features: int,
                    in_features: int, index_tensors: list[Tensor]) -> Tensor:
    return _weight_grad(grad_out, x, values,
                        _topology(values, out_features, in_features, index_tensors))


@_weight_grad_op.register_fake
def _(grad_out, x, values, out_features, in_features, index_tensors):
    return torch.empty_like(values)


def _setup_context(ctx, inputs, output) -> None:
    x, values, bias, out_features, in_features, index_tensors = inputs
    ctx.save_for_backward(x, values, *index_tensors)
    ctx.features = (out_features, in_features)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out):
    x, values, *index_tensors = ctx.saved_tensors
    grads = _gradients(
        ctx.needs_input_grad, grad_out, x, values, ctx.has_bias,
        lambda g: _input_grad_op(g, values, *ctx.features, index_tensors),
        lambda g: _weight_grad_op(g, x, values, *ctx.features, index_tensors))
    return (*grads, None, None, [None] * len(index_tensors))


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_linear(x: Tensor, values: Tensor, topology: BlockTopology,
                        bias: Tensor | None = None) -> Tensor:
    """``x W^T + bias`` with ``W`` given by its kept blocks ``values[nnz, R, C]``.

    ``x`` has any leading dimensions and ``in_features`` last; under autocast ``x``,
    ``values`` and ``bias`` run in the autocast dtype, as ``F.linear`` does. Eager calls
    go through :class:`BlockSparseLinearFunction`; under ``torch.compile`` through the
    custom ops, which the compiler traces without a graph break.

    Raises:
        ValueError: ``x``'s last dimension or ``values``' shape does not fit ``topology``.
    """
    if x.shape[-1] != topology.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes "
                         f"{topology.in_features}")
    if tuple(values.shape) != (topology.nnz, *topology.block):
        raise ValueError(f"values shape {tuple(values.shape)} != (nnz, R, C) = "
                         f"{(topology.nnz, *topology.block)} of the topology")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, values = x.to(dtype), values.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if torch.compiler.is_compiling():
        index_tensors = [getattr(topology, name) for name in _TOPOLOGY_FIELDS]
        out = _linear_op(flat, values, bias, topology.out_features, topology.in_features,
                         index_tensors)
    else:
        out = BlockSparseLinearFunction.apply(flat, values, topology, bias)
    return out.view(*x.shape[:-1], topology.out_features)
