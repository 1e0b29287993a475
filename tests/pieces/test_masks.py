"""Property tests: every mask has exactly its promised structure and count, ties included."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparse_training.layers.block_sparse import BlockSparseLinear
from sparse_training.pieces.masks import (
    as_matrix,
    from_matrix,
    global_masks,
    kept_count,
    pattern_mask,
    pattern_masks,
)
from sparse_training.pieces.patterns import parse_pattern

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
    (lambda: pattern_mask(torch.randn(8, 8), "2:4", input_dim=2),
     r"input_dim must be 0 \(weights stored \(in, out, ...\)\) or 1 .* got 2"),
    (lambda: pattern_mask(torch.randn(8, 8), "2:4", input_dim=True), "input_dim .* got True"),
    (lambda: pattern_masks([torch.randn(8, 8)] * 2, "2:4", input_dims=[0]),
     r"input_dims must give one entry per weight \(2\), got 1"),
    (lambda: pattern_mask(torch.randn(6, 8), "2:4", input_dim=0),
     r"weight of shape \(6, 8\) cannot take pattern '2:4': 6 input features"),
])
def test_mask_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("spec", ["unstructured", "2:4", "2:4:2d", "block:2x4", "vector:2+1:4"])
def test_same_shape_tensors_ranked_together_equal_one_by_one(spec):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(8, 16, generator=g) for _ in range(3)] + [
        torch.randn(4, 8, 2, 2, generator=g), torch.randn(16, 8, generator=g)]
    sparsity = None if ":" in spec and "block" not in spec and "vector" not in spec else 0.5
    together = pattern_masks(weights, spec, sparsity)
    for w, mask in zip(weights, together, strict=True):
        assert torch.equal(mask, pattern_mask(w, spec, sparsity))


def test_transposable_conv_tiles_are_nm_along_output_channels_at_every_tap():
    """ASP orders conv rows (r, s, k): at each tap, the (out, in) slice is 2:4 along inputs
    and, transposed, along outputs: no tile mixes taps with channels."""
    w = torch.randn(8, 8, 3, 3, generator=torch.Generator().manual_seed(0))
    mask = pattern_mask(w, "2:4:2d")
    for r in range(3):
        for s in range(3):
            tap = mask[:, :, r, s]  # (out, in)
            assert (tap.reshape(8, 2, 4).sum(-1) == 2).all()  # N:M along input channels
            assert (tap.T.reshape(8, 2, 4).sum(-1) == 2).all()  # and along output channels


@pytest.mark.parametrize("kernel", [(), (3,), (3, 2)])
def test_input_first_view_puts_inputs_last(kernel):
    """A weight stored (in, out, *kernel) (HF Conv1D, ConvTranspose) reads as (kernel taps x
    out, in): row (tap, o) holds the inputs of output o at that tap."""
    w = torch.randn(6, 5, *kernel, dtype=torch.float64)
    m = as_matrix(w, input_dim=0)
    taps = list(torch.ones(kernel).nonzero()) if kernel else [()]
    assert m.shape == (math.prod(kernel) * 5, 6)
    for t, tap in enumerate(taps):
        for o in range(5):
            assert torch.equal(m[t * 5 + o], w[(slice(None), o, *tap)])
    assert torch.equal(from_matrix(m, w.shape, input_dim=0), w)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), spec=st.sampled_from(["2:4", "1:4", "3:8", "2:4:2d"]))
def test_nm_input_first_groups_run_along_the_stored_first_dim(data, spec):
    """An (in, out) weight: N of every M consecutive inputs of each output, by magnitude."""
    p = parse_pattern(spec)
    stored = data.draw(weights(row_multiple=p.m, col_multiple=p.m, conv=False)).T  # strided
    mask = pattern_mask(stored, spec, input_dim=0)
    assert mask.shape == stored.shape
    groups = mask.movedim(0, -1).reshape(-1, p.m)  # (out x in / M, M)
    assert (groups.sum(-1) == p.n).all()
    if not p.transposable:
        scores = stored.double().abs().movedim(0, -1).reshape(-1, p.m)
        for row_scores, row_mask in zip(scores, groups, strict=True):
            _check_magnitude_order(row_scores, row_mask)


def test_same_shape_weights_of_both_layouts_ranked_apart():
    g = torch.Generator().manual_seed(3)
    square = [torch.randn(8, 8, generator=g) for _ in range(3)]
    together = pattern_masks(square, "2:4", input_dims=[1, 0, 1])
    for w, mask, dim in zip(square, together, [1, 0, 1], strict=True):
        assert torch.equal(mask, pattern_mask(w, "2:4", input_dim=dim))
    assert (together[1].T.reshape(8, 2, 4).sum(-1) == 2).all()


def _clipped_blocks(rows: int, cols: int, r: int, c: int) -> list[tuple[slice, slice]]:
    return [(slice(i, i + r), slice(j, j + c)) for i in range(0, rows, r)
            for j in range(0, cols, c)]


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), r=st.integers(1, 9),
       c=st.integers(1, 9), sparsity=st.floats(0.0, 0.99), seed=st.integers(0, 2**31 - 1),
       strided=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_block_masks_on_any_shape_keep_whole_clipped_blocks(rows, cols, r, c, sparsity, seed,
                                                            strided, dtype):
    """The last block row and column may overhang: each clipped block is kept or pruned
    whole, round(s B) of the B blocks go, the smallest sums of |w| over their entries."""
    full = torch.randn(rows, 2 * cols, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype)
    w = full[:, ::2] if strided else full[:, :cols].contiguous()
    mask = pattern_mask(w, f"block:{r}x{c}", sparsity)
    assert mask.shape == w.shape and mask.dtype == torch.bool
    blocks = _clipped_blocks(rows, cols, r, c)
    kept = [bool(mask[b].all()) for b in blocks]
    assert all(mask[b].all() or not mask[b].any() for b in blocks)
    assert sum(kept) == len(blocks) - math.floor(sparsity * len(blocks) + 0.5)
    scores = [float(w[b].double().abs().sum()) for b in blocks]
    kept_scores = [s for s, k in zip(scores, kept, strict=True) if k]
    pruned_scores = [s for s, k in zip(scores, kept, strict=True) if not k]
    if kept_scores and pruned_scores:  # ranked in float32: equal up to its rounding
        assert min(kept_scores) >= max(pruned_scores) * (1 - 1e-5) - 1e-6


@pytest.mark.parametrize(("shape", "sparsity"), [((3, 64), 0.5), ((3, 64), 0.75),
                                                 ((10, 30), 0.25), ((40, 70), 0.75),
                                                 ((33, 17), 0.5), ((16, 48), 0.5)])
def test_overhanging_block_mask_is_what_the_compressed_layer_keeps(shape, sparsity):
    """The masked-dense mask of a weight the blocks overhang is exactly the compressed
    layer's: BlockSparseLinear counts the same ceil-grid blocks and keeps the same ones."""
    out, inp = shape
    linear = nn.Linear(inp, out)
    mask = pattern_mask(linear.weight, "block:16x16", sparsity)
    layer = BlockSparseLinear.from_dense(linear, (16, 16), mask=mask)
    grid = math.ceil(out / 16) * math.ceil(inp / 16)
    assert layer.nnz == grid - math.floor(sparsity * grid + 0.5) == int(layer.block_mask.sum())
    assert torch.equal(layer.to_dense().weight != 0, mask)
    assert layer.sparsity == pytest.approx(1 - int(mask.sum()) / mask.numel(), abs=1e-12)


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_global_masks_count_overhanging_blocks(sparsity):
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(10, 30, generator=g), torch.randn(40, 70, generator=g).T,
          torch.randn(16, 16, generator=g)]
    masks = global_masks(ws, "block:16x16", sparsity)
    total, kept = 0, 0
    for w, mask in zip(ws, masks, strict=True):
        blocks = _clipped_blocks(*w.shape, 16, 16)
        assert all(mask[b].all() or not mask[b].any() for b in blocks)
        total += len(blocks)
        kept += sum(bool(mask[b].all()) for b in blocks)
    assert kept == total - math.floor(sparsity * total + 0.5)
