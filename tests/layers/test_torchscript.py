"""TorchScript and the compressed layers: ``torch.jit.trace`` of a BlockSparseLinear records
its custom op (the traced module runs, differentiates and saves like the layer), and
``torch.jit.script`` of any compressed layer is refused naming the layer and what works."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from sparse_training import BlockSparseLinear, SemiStructuredLinear, SlimLinear

# fp32 against the same layer's eager call: both run the same kernels (or references) on the
# same operands, so they agree to the last bit or two; bf16 rounds each output once
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=0, atol=0),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_traced_block_sparse_layer_runs_differentiates_and_saves(dtype):
    torch.manual_seed(0)
    layer = BlockSparseLinear.from_dense(nn.Linear(70, 40), (16, 32), density=0.5).to(dtype)
    traced = torch.jit.trace(layer, torch.randn(2, 3, 70, dtype=dtype))
    assert "sparse_training::block_sparse_linear" in {n.kind() for n in traced.graph.nodes()}
    x = torch.randn(5, 2, 70, dtype=dtype, requires_grad=True)  # other leading dimensions
    out, eager = traced(x), layer(x)
    torch.testing.assert_close(out, eager, **TOL[dtype])
    grad = torch.randn_like(out)
    traced_grads = torch.autograd.grad(out, (x, layer.values, layer.bias), grad)
    eager_grads = torch.autograd.grad(eager, (x, layer.values, layer.bias), grad)
    for traced_grad, eager_grad in zip(traced_grads, eager_grads, strict=True):
        torch.testing.assert_close(traced_grad, eager_grad, **TOL[dtype])
    saved = io.BytesIO()
    torch.jit.save(traced, saved)
    saved.seek(0)
    torch.testing.assert_close(torch.jit.load(saved)(x), eager, **TOL[dtype])


def test_a_traced_layer_checks_the_inputs_of_its_later_calls():
    layer = BlockSparseLinear.from_dense(nn.Linear(64, 32), (16, 16), density=0.5)
    traced = torch.jit.trace(layer, torch.randn(2, 64))
    # the ValueError, wrapped by TorchScript's interpreter: not launched on 48 unchecked
    with pytest.raises(RuntimeError, match="input has 48 features, the layer takes 64"):
        traced(torch.randn(2, 48))


@pytest.mark.parametrize("layer", [
    BlockSparseLinear(64, 32, (16, 16), density=0.5),
    SemiStructuredLinear(64, 32),
    SlimLinear.from_dense(nn.Linear(64, 32), axis=0, band=16,
                          band_mask=torch.tensor([True, False])),
], ids=lambda layer: type(layer).__name__)
def test_script_is_refused_naming_the_layer_and_what_works(layer):
    with pytest.raises(RuntimeError, match=rf"torch.jit.script cannot compile "
                                           rf"{type(layer).__name__}: .* use torch.compile, "
                                           rf"or script the dense model"):
        torch.jit.script(nn.Sequential(nn.ReLU(), layer))
