"""Mask computation kernels vs their torch references (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the kernels are optional")

from sparse_training.kernels import (  # noqa: E402
    global_magnitude_threshold,
    global_magnitude_threshold_reference,
    global_threshold,  # noqa: E402
    nm_topk_mask,
    nm_topk_mask_reference,
    nm_topk_masks,
    pack_mask,
    unpack_mask,
)

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 6), (0, 4), (4, 4)])
def test_nm_matches_reference_with_ties(n, m):
    gen = torch.Generator().manual_seed(n * 10 + m)
    scores = [
        torch.randn(9, 4 * m, generator=gen),
        torch.randint(0, 3, (5, 2 * m), generator=gen).float(),  # many ties: lower index wins
        torch.randn(3, 2, m, generator=gen).bfloat16().float(),
    ]
    for out, s in zip(nm_topk_masks(scores, n, m), scores, strict=True):
        assert out.dtype == torch.bool and out.shape == s.shape
        assert torch.equal(out, nm_topk_mask_reference(s, n, m))
        assert (out.reshape(-1, m).sum(1) == n).all()


def test_nm_single_and_errors():
    s = torch.randn(6, 8)
    assert torch.equal(nm_topk_mask(s, 2, 4), nm_topk_mask_reference(s, 2, 4))
    with pytest.raises(ValueError):
        nm_topk_mask(torch.randn(3, 6), 2, 4)


def test_nm_repeated_calls_independent_and_cache_invalidates():
    from sparse_training.kernels import nm_mask as nmk

    nmk.clear_nm_plan_cache()
    gen = torch.Generator().manual_seed(7)
    shapes = [(8, 16), (8, 16), (5, 12), (8, 16), (3, 2, 4), (7, 4)]  # shared + padded shapes
    scores = [torch.randn(s, generator=gen) for s in shapes]

    def check(outs, scores):
        assert len(outs) == len(scores)
        for out, s in zip(outs, scores, strict=True):
            assert out.shape == s.shape and out.is_contiguous()
            assert torch.equal(out, nm_topk_mask_reference(s, 2, 4))

    builds = nmk.plan_builds
    first = nm_topk_masks(scores, 2, 4)
    kept = [f.clone() for f in first]
    check(first, scores)
    for s in scores:  # same tensors, new values: the cached plan is reused
        s.copy_(torch.randn(s.shape, generator=gen))
    second = nm_topk_masks(scores, 2, 4)
    check(second, scores)
    assert nmk.plan_builds == builds + 1
    # The first call's masks were not overwritten by the second call.
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=True))
    assert first[0].data_ptr() != second[0].data_ptr()

    # A score tensor replaced by another object (new address): new plan, right masks.
    scores[2] = torch.randn(5, 12, generator=gen)
    check(nm_topk_masks(scores, 2, 4), scores)
    assert nmk.plan_builds == builds + 2
    # Same object, new data and shape: new plan.
    scores[5].data = torch.randn(2, 8, generator=gen)
    check(nm_topk_masks(scores, 2, 4), scores)
    assert nmk.plan_builds == builds + 3
    shared = scores[0].data
    scores[0].data = shared.view(16, 8)  # same object and address, new shape
    check(nm_topk_masks(scores, 2, 4), scores)
    assert nmk.plan_builds == builds + 4
    scores[0].data = shared.t()  # same address and shape as a cached plan, not contiguous
    check(nm_topk_masks(scores, 2, 4), scores)
    # Back to an earlier list layout: that plan is still cached.
    scores[0].data = shared
    before = nmk.plan_builds
    check(nm_topk_masks(scores, 2, 4), scores)
    assert nmk.plan_builds == before
    # A different group size with the same tensors gets its own plan.
    check_48 = nm_topk_masks(scores[:2], 4, 8)
    assert all(
        torch.equal(a, nm_topk_mask_reference(s, 4, 8))
        for a, s in zip(check_48, scores[:2], strict=True)
    )
    with pytest.raises(ValueError):
        nm_topk_masks(scores, 5, 4)


@pytest.mark.parametrize("kept", [1, 7, 500, 1999, 2373])
def test_global_threshold_matches_kthvalue(kept):
    gen = torch.Generator().manual_seed(kept)
    tensors = [
        torch.randn(40, 33, generator=gen),
        torch.randint(-3, 4, (11, 7), generator=gen).float(),  # ties and zeros
        torch.randn(1000, generator=gen) * 1e-4,
    ]
    fast = global_threshold._launch_radix_select(tensors, kept, chunk=1024, block=512)
    assert fast.dtype == torch.float32 and fast.dim() == 0
    assert fast.item() == global_magnitude_threshold_reference(tensors, kept).item()


def test_global_threshold_public_and_errors():
    tensors = [torch.randn(300), torch.randn(20, 5)]
    assert global_magnitude_threshold(tensors, 42) == global_magnitude_threshold_reference(
        tensors, 42
    )
    with pytest.raises(ValueError):
        global_magnitude_threshold(tensors, 0)


@pytest.mark.parametrize("shape", [(13,), (4, 6), (2, 3, 5)])
def test_pack_roundtrip(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (mask.numel() + 7) // 8
    assert torch.equal(unpack_mask(packed, shape), mask)
