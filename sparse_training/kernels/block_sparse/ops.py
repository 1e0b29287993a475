"""The block-sparse Linear as ``torch.library`` custom ops with autograd, and its functional.

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


@torch.library.custom_op("sparse_training::block_sparse_linear", mutates_args=())
def _linear_op(x: Tensor, values: Tensor, bias: Tensor | None, out_features: int,
               in_features: int, index_tensors: list[Tensor]) -> Tensor:
    topology = _topology(values, out_features, in_features, index_tensors)
    if _use_kernels(x):
        return kernels.launch_forward(x, values, topology, bias)
    return reference.forward_reference(x, values, topology, bias)


@_linear_op.register_fake
def _(x, values, bias, out_features, in_features, index_tensors):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("sparse_training::block_sparse_linear_input_grad", mutates_args=())
def _input_grad_op(grad_out: Tensor, values: Tensor, out_features: int, in_features: int,
                   index_tensors: list[Tensor]) -> Tensor:
    topology = _topology(values, out_features, in_features, index_tensors)
    if _use_kernels(grad_out):
        return kernels.launch_input_grad(grad_out, values, topology)
    return reference.input_grad_reference(grad_out, values, topology)


@_input_grad_op.register_fake
def _(grad_out, values, out_features, in_features, index_tensors):
    return grad_out.new_empty(grad_out.shape[0], in_features)


@torch.library.custom_op("sparse_training::block_sparse_linear_weight_grad", mutates_args=())
def _weight_grad_op(grad_out: Tensor, x: Tensor, values: Tensor, out_features: int,
                    in_features: int, index_tensors: list[Tensor]) -> Tensor:
    topology = _topology(values, out_features, in_features, index_tensors)
    if _use_kernels(x):
        return kernels.launch_weight_grad(grad_out, x, topology, values.dtype)
    return reference.weight_grad_reference(grad_out, x, topology).to(values.dtype)


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
    grad_out = grad_out.contiguous()
    grad_x = grad_values = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = _input_grad_op(grad_out, values, *ctx.features, index_tensors)
    if ctx.needs_input_grad[1]:
        grad_values = _weight_grad_op(grad_out, x, values, *ctx.features, index_tensors)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_out.sum(0)
    return grad_x, grad_values, grad_bias, None, None, [None] * len(index_tensors)


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_linear(x: Tensor, values: Tensor, topology: BlockTopology,
                        bias: Tensor | None = None) -> Tensor:
    """``x W^T + bias`` with ``W`` given by its kept blocks ``values[nnz, R, C]``.

    ``x`` has any leading dimensions and ``in_features`` last; under autocast ``x``,
    ``values`` and ``bias`` run in the autocast dtype, as ``F.linear`` does.

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
    index_tensors = [getattr(topology, name) for name in _TOPOLOGY_FIELDS]
    out = _linear_op(flat, values, bias, topology.out_features, topology.in_features,
                     index_tensors)
    return out.view(*x.shape[:-1], topology.out_features)
