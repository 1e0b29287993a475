"""Property tests: every mask has exactly its promised structure and count, ties included."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_training.masks import as_matrix, from_matrix, global_masks, kept_count, pattern_mask
from sparse_training.patterns import parse_pattern

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@st.composite
def weights(draw, row_multiple: int = 1, col_multiple: int = 1, conv: bool | None = None):
    """A random Linear or Conv weight whose 2-D view fits the multiples; few distinct
    values (ties) half the time."""
    dtype = draw(st.sampled_from(DTYPES))
    conv = draw(st.booleans()) if conv is None else conv
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 2))) if conv else ()
    out = row_multiple * draw(st.integers(1, 4))
    inp = col_multiple * draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    shape = (out, inp, *kernel)
    if draw(st.booleans()):
        w = torch.randint(-2, 3, shape, generator=g).to(torch.float64)  # many ties
    else:
        w = torch.randn(shape, generator=g, dtype=torch.float64)
    return w.to(dtype)


def _check_magnitude_order(scores, mask):
    """Every kept score >= every pruned score within the compared set."""
    if mask.all() or not mask.any():
        return
    assert scores[mask].min() >= scores[~mask].max()


def test_matrix_view_round_trip():
    w = torch.randn(6, 8, 3, 2)
    m = as_matrix(w)
    assert m.shape == (6 * 3 * 2, 8)
    assert torch.equal(m[0], w[0, :, 0, 0])  # input channels along the last dim (ASP layout)
    assert torch.equal(from_matrix(m, w.shape), w)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), m=st.integers(1, 32))
def test_nm_exact_structure(data, m):
    n = data.draw(st.integers(1, m))
    w = data.draw(weights(col_multiple=m, conv=False))
    mask = pattern_mask(w, f"{n}:{m}")
    assert mask.dtype == torch.bool and mask.shape == w.shape
    groups = mask.reshape(w.shape[0], -1, m)
    assert (groups.sum(-1) == n).all()
    scores = w.double().abs().reshape(w.shape[0], -1, m)
    for row_scores, row_mask in zip(scores.reshape(-1, m), groups.reshape(-1, m), strict=True):
        _check_magnitude_order(row_scores, row_mask)


@settings(max_examples=30, deadline=None)
@given(w=weights(col_multiple=4, conv=True))
def test_nm_conv_groups_along_input_channels(w):
    mask = as_matrix(pattern_mask(w, "2:4"))
    assert (mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), spec=st.sampled_from(["2:4", "1:4", "3:4", "2:5", "1:3"]))
def test_nm_gradual_stages(data, spec):
    pattern = parse_pattern(spec)
    w = data.draw(weights(col_multiple=pattern.m, conv=False))
    sparsity = data.draw(st.floats(0.0, 0.99))
    mask = pattern_mask(w, pattern, sparsity)
    kept = pattern.kept_per_group(sparsity)
    assert (mask.reshape(w.shape[0], -1, pattern.m).sum(-1) == kept).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), spec=st.sampled_from(["2:4:2d", "1:4:2d", "3:4:2d", "2:5:2d", "1:2:2d"]))
def test_transposable_rows_and_columns(data, spec):
    p = parse_pattern(spec)
    w = data.draw(weights(row_multiple=p.m, col_multiple=p.m, conv=False))
    mask = pattern_mask(w, spec)
    tiles = mask.reshape(w.shape[0] // p.m, p.m, w.shape[1] // p.m, p.m).permute(0, 2, 1, 3)
    assert (tiles.sum(-1) == p.n).all() and (tiles.sum(-2) == p.n).all()
    # the transposed weight is N:M too
    assert (mask.T.reshape(w.shape[1], -1, p.m).sum(-1) == p.n).all()


def test_transposable_is_optimal_on_a_tile():
    """Brute force over all 0/1 4x4 tiles with 2 per row and column: the chosen one scores best."""
    import itertools

    torch.manual_seed(1)
    w = torch.randn(4, 4, dtype=torch.float64)
    best = max((sum(w[i, j].abs() for i in range(4) for j in range(4) if t[i * 4 + j])
                for t in itertools.product([0, 1], repeat=16)
                if all(sum(t[i * 4:(i + 1) * 4]) == 2 for i in range(4))
                and all(sum(t[j::4]) == 2 for j in range(4))), default=None)
    mask = pattern_mask(w, "2:4:2d")
    assert torch.isclose(w.abs()[mask].sum(), torch.as_tensor(best))


@settings(max_examples=60, deadline=None)
@given(w=weights(), sparsity=st.floats(0.0, 0.999))
def test_unstructured_exact_count(w, sparsity):
    mask = pattern_mask(w, "unstructured", sparsity)
    assert int(mask.sum()) == kept_count(w.numel(), sparsity)
    _check_magnitude_order(w.double().abs().reshape(-1), mask.reshape(-1))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), cols=st.integers(1, 4),
       sparsity=st.floats(0.0, 0.99))
def test_block_exact_structure(data, rows, cols, sparsity):
    w = data.draw(weights(row_multiple=rows, col_multiple=cols, conv=False))
    mask = pattern_mask(w, f"block:{rows}x{cols}", sparsity)
    blocks = mask.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
    per_block = blocks.sum(dim=(1, 3))
    assert ((per_block == 0) | (per_block == rows * cols)).all()  # whole blocks only
    assert int((per_block > 0).sum()) == kept_count(per_block.numel(), sparsity)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), v=st.integers(1, 4), spec=st.sampled_from(["1:4", "2:4", "1:2"]))
def test_vector_nm(data, v, spec):
    p = parse_pattern(spec)
    w = data.draw(weights(row_multiple=v, col_multiple=p.m, conv=False))
    mask = pattern_mask(w, f"vector:{v}+{spec}")
    vectors = mask.reshape(w.shape[0] // v, v, w.shape[1])
    assert (vectors.all(1) | ~vectors.any(1)).all()  # V rows of one column move together
    assert (vectors[:, 0].reshape(vectors.shape[0], -1, p.m).sum(-1) == p.n).all()


def test_block_nm():
    w = torch.randn(4, 16)
    mask = pattern_mask(w, "block:2x2+1:2")
    blocks = mask.reshape(2, 2, 8, 2).sum(dim=(1, 3))  # (2, 8) block counts
    assert ((blocks == 0) | (blocks == 4)).all()
    assert ((blocks > 0).reshape(2, 4, 2).sum(-1) == 1).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_overrides_magnitude_and_nan_is_pruned(dtype):
    w = torch.randn(2, 8).to(dtype)
    score = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    mask = pattern_mask(w, "2:4", score=score)
    expected = torch.tensor([[0, 0, 1, 1] * 2] * 2, dtype=torch.bool)
    assert torch.equal(mask, expected)
    w = torch.randn(1, 4).to(dtype)
    w[0, 0] = float("nan")
    assert not pattern_mask(w, "3:4")[0, 0]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), sparsity=st.floats(0.0, 0.99))
def test_global_exact_total_and_threshold(data, sparsity):
    ws = [data.draw(weights(conv=False)).float() for _ in range(3)]
    masks = global_masks(ws, "unstructured", sparsity)
    total = sum(w.numel() for w in ws)
    assert sum(int(m.sum()) for m in masks) == kept_count(total, sparsity)
    scores = torch.cat([w.abs().reshape(-1) for w in ws])
    _check_magnitude_order(scores, torch.cat([m.reshape(-1) for m in masks]))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: pattern_mask(torch.randn(4, 6), "2:4"),
     r"weight of shape \(4, 6\) cannot take pattern '2:4': 6 input features"),
    (lambda: pattern_mask(torch.randn(4, 8), "unstructured"), "needs a sparsity"),
    (lambda: pattern_mask(torch.randn(4, 8), "unstructured", 1.0),
     r"sparsity must be a number in \[0, 1\), got 1.0"),
    (lambda: global_masks([torch.randn(4, 8)], "2:4", 0.5),
     "global distribution needs an unstructured or block pattern"),
])
def test_mask_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("spec", ["unstructured", "2:4", "2:4:2d", "block:2x4", "vector:2+1:4"])
def test_same_shape_tensors_ranked_together_equal_one_by_one(spec):
    from sparse_training.masks import pattern_masks

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(8, 16, generator=g) for _ in range(3)] + [
        torch.randn(4, 8, 2, 2, generator=g), torch.randn(16, 8, generator=g)]
    sparsity = None if ":" in spec and "block" not in spec and "vector" not in spec else 0.5
    together = pattern_masks(weights, spec, sparsity)
    for w, mask in zip(weights, together, strict=True):
        assert torch.equal(mask, pattern_mask(w, spec, sparsity))


def test_transposable_conv_tiles_are_nm_along_output_channels_at_every_tap():
    """ASP orders conv rows (r, s, k): at each tap, the (out, in) slice is 2:4 along inputs
    and, transposed, along outputs (issue 8: tiles used to mix taps and channels)."""
    w = torch.randn(8, 8, 3, 3, generator=torch.Generator().manual_seed(0))
    mask = pattern_mask(w, "2:4:2d")
    for r in range(3):
        for s in range(3):
            tap = mask[:, :, r, s]  # (out, in)
            assert (tap.reshape(8, 2, 4).sum(-1) == 2).all()  # N:M along input channels
            assert (tap.T.reshape(8, 2, 4).sum(-1) == 2).all()  # and along output channels
