"""The multi-tensor zero-pruned kernel (Triton interpreter on CPU) against its reference."""

import pytest
import torch

from sparse_training.kernels import masked_zero, zero_pruned_, zero_pruned_reference

pytestmark = pytest.mark.interpreter


def tensors_and_masks(dtype, seed, sizes=((5, 7), (16_411,), (3, 4, 33), (1,), (0,))):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*s, generator=g).to(dtype) for s in sizes]
    tensors[0].view(-1)[0] = float("nan")  # pruned NaN and inf must become zeros too
    tensors[1].view(-1)[3] = float("inf")
    masks = [torch.rand(*s, generator=g) < 0.4 for s in sizes]
    masks[0].view(-1)[0] = masks[1].view(-1)[3] = False
    return tensors, masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_kernel_matches_the_reference(dtype):
    tensors, masks = tensors_and_masks(dtype, seed=0)
    expected = [t.clone() for t in tensors]
    zero_pruned_reference(expected, masks)
    masked_zero.launch_zero_pruned(tensors, masks)
    for got, want, mask in zip(tensors, expected, masks, strict=True):
        assert torch.equal(got, want)  # bit-exact: kept values untouched, pruned exactly 0
        assert not got[~mask].any() and not got[mask].isnan().any()


def test_a_plan_is_reused_for_new_values_and_rebuilt_for_new_addresses():
    masked_zero._PLANS.clear()
    tensors, masks = tensors_and_masks(torch.float32, seed=1)
    masked_zero.launch_zero_pruned(tensors, masks)
    for t in tensors:  # new values at the same addresses
        t.copy_(torch.randn(t.shape))
    masked_zero.launch_zero_pruned(tensors, masks)
    assert len(masked_zero._PLANS) == 1
    assert all(not t[~m].any() for t, m in zip(tensors, masks, strict=True))
    others, other_masks = tensors_and_masks(torch.float32, seed=2)
    masked_zero.launch_zero_pruned(others, other_masks)
    assert len(masked_zero._PLANS) == 2
    assert all(not t[~m].any() for t, m in zip(others, other_masks, strict=True))


def test_the_functional_entry_on_cpu_takes_the_reference():
    tensors, masks = tensors_and_masks(torch.float32, seed=3)
    kept = [t[m].clone() for t, m in zip(tensors, masks, strict=True)]
    zero_pruned_(tensors, masks)
    for t, m, k in zip(tensors, masks, kept, strict=True):
        assert not t[~m].any() and torch.equal(t[m], k)
