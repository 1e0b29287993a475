"""Peer cases for the mask functions, checked against float64 references written here (no
code shared with the library), the kind a competing implementation's suite holds:

- N:M as NVIDIA ASP (apex.contrib.sparsity) defines it: the N largest ``|w|`` of every M
  consecutive weights along the input dimension, for Linear weights ``(out, in)`` and Conv
  weights ``(out, in, kh, kw)`` (ASP's ``(r, s, k, c)`` view: groups along input channels);
- transposable N:M (ASP's ``m4n2_2d_best``): both the matrix and its transpose are N:M, and
  the kept magnitude of every 4x4 tile equals a brute force over every 0/1 tile;
- block and vector masks: whole blocks, scored by the sum of ``|w|`` (docs/patterns.md), the
  overhanging edge blocks of a shape the block does not divide counting as one block each;
- unstructured counts ``total - round_half_up(s * total)`` at odd and tiny shapes, sparsity
  0, tiny and near 1, ties (all-equal weights, zeros), NaN (ranks lowest) and infinite
  weights (rank highest), float16/bfloat16/float64, non-contiguous and transposed weights,
  3-D and 5-D convolution weights;
- inputs no mask can be made of (unit patterns, which span several tensors; scores that are
  no real tensor; sparse layouts): a ValueError naming the value.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_training import global_masks, parse_pattern, pattern_mask

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


# -- float64 references ----------------------------------------------------------------------
def ref_rank(values: torch.Tensor) -> torch.Tensor:
    """|w| in float64 with NaN below everything (ASP and torch.ao rank NaN as nothing)."""
    a = values.detach().to(torch.float64).abs()
    return torch.where(torch.isnan(a), torch.full_like(a, -1.0), a)


def ref_view(w: torch.Tensor) -> torch.Tensor:
    """ASP's view of a weight: Linear as it is, Conv (out, in, *k) -> (*k, out, in) ->
    (prod(k) * out, in), input channels last."""
    if w.dim() == 2:
        return w
    dims = w.dim()
    return w.permute(*range(2, dims), 0, 1).reshape(-1, w.shape[1])


def pruned_half_up(total: int, sparsity: float) -> int:
    """round(sparsity * total), halves up, in exact arithmetic where possible."""
    return math.floor(sparsity * total + 0.5)


def check_top_n_groups(w: torch.Tensor, mask: torch.Tensor, n: int, m: int) -> None:
    """Every M consecutive entries of each row of the 2-D view keep exactly N, and no pruned
    one outranks a kept one."""
    rank = ref_rank(ref_view(w)).reshape(-1, m)
    kept = ref_view(mask).reshape(-1, m)
    assert (kept.sum(-1) == n).all()
    for r, k in zip(rank, kept, strict=True):
        if 0 < n < m:
            assert r[k].min() >= r[~k].max()


def brute_force_tile_best(tile: torch.Tensor, n: int) -> float:
    """The largest kept sum of a float64 MxM tile over every 0/1 tile with n ones in each row
    and column (2**16 candidates for M = 4)."""
    m = tile.shape[0]
    best = -math.inf
    rows = [c for c in itertools.product([0, 1], repeat=m) if sum(c) == n]
    for choice in itertools.product(rows, repeat=m):
        if all(sum(choice[i][j] for i in range(m)) == n for j in range(m)):
            best = max(best, sum(float(tile[i, j]) for i in range(m) for j in range(m)
                                 if choice[i][j]))
    return best


# -- N:M ----------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n_m=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (4, 8), (1, 1), (5, 5),
                            (3, 7), (16, 32)]),
       rows=st.integers(1, 9), groups=st.integers(1, 4), dtype=st.sampled_from(DTYPES),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_nm_keeps_the_n_largest_of_every_m_along_the_input_dim(n_m, rows, groups, dtype, ties,
                                                               seed):
    n, m = n_m
    g = torch.Generator().manual_seed(seed)
    w = (torch.randint(-1, 2, (rows, groups * m), generator=g).double() if ties
         else torch.randn(rows, groups * m, generator=g, dtype=torch.float64)).to(dtype)
    mask = pattern_mask(w, f"{n}:{m}")
    assert mask.dtype == torch.bool and mask.shape == w.shape
    check_top_n_groups(w, mask, n, m)


@pytest.mark.parametrize("shape", [(4, 8, 3, 3), (8, 4, 1, 1), (2, 16, 1, 5), (4, 8, 3),
                                   (4, 4, 2, 2, 2)])
def test_nm_on_conv_weights_runs_along_input_channels(shape):
    """ASP's Conv rule: for each output channel and kernel tap, M consecutive input channels
    keep N (the mask of w[:, :, tap] is the 2:4 mask of that (out, in) matrix)."""
    w = torch.randn(shape, dtype=torch.float64)
    mask = pattern_mask(w, "2:4")
    check_top_n_groups(w, mask, 2, 4)
    for tap in itertools.product(*(range(k) for k in shape[2:])):
        matrix = w[(slice(None), slice(None), *tap)]
        assert torch.equal(mask[(slice(None), slice(None), *tap)], pattern_mask(matrix, "2:4"))


def test_nm_input_first_weight_groups_along_dim_0():
    """HF Conv1D (in, out): groups of its stored first dimension (the input)."""
    w = torch.randn(8, 6, dtype=torch.float64)
    mask = pattern_mask(w, "2:4", input_dim=0)
    check_top_n_groups(w.T, mask.T, 2, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nm_on_non_contiguous_and_transposed_weights(dtype):
    base = torch.randn(16, 8, dtype=torch.float64).to(dtype)
    transposed = base.T  # (8, 16), not contiguous
    assert not transposed.is_contiguous()
    mask = pattern_mask(transposed, "2:4")
    assert torch.equal(mask, pattern_mask(transposed.contiguous(), "2:4"))
    check_top_n_groups(transposed, mask, 2, 4)
    strided = torch.randn(6, 32, dtype=torch.float64).to(dtype)[::2, ::2]  # (3, 16)
    check_top_n_groups(strided, pattern_mask(strided, "1:4"), 1, 4)


@pytest.mark.parametrize("spec", ["2:4", "1:4", "2:4:2d", "block:2x2+1:2"])
def test_nm_all_equal_and_all_zero_weights_keep_exactly_n(spec):
    p = parse_pattern(spec)
    for fill in (0.0, 1.0, -3.0):
        w = torch.full((8, 16), fill)
        mask = pattern_mask(w, spec)
        assert int(mask.sum()) == w.numel() * p.n // p.m


def test_nm_nan_ranks_lowest_and_inf_highest():
    w = torch.tensor([[float("nan"), 1.0, 2.0, 3.0, float("inf"), 0.0, -float("inf"), 0.5]])
    assert pattern_mask(w, "2:4").tolist() == [[False, False, True, True,
                                                True, False, True, False]]
    assert pattern_mask(w, "3:4").tolist() == [[False, True, True, True,
                                                True, False, True, True]]
    w = torch.full((1, 4), float("nan"))
    assert int(pattern_mask(w, "2:4").sum()) == 2  # still exactly N


# -- transposable N:M -------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from(DTYPES), ties=st.booleans())
def test_transposable_tile_keeps_the_brute_force_best_magnitude(seed, n, dtype, ties):
    """ASP's 2:4 transposable search is exhaustive over the 90 (2:4) tiles; so is this one:
    its kept magnitude equals the brute force's on every 4x4 tile of an 8x8 weight."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randint(-2, 3, (8, 8), generator=g).double() if ties
         else torch.randn(8, 8, generator=g, dtype=torch.float64)).to(dtype)
    mask = pattern_mask(w, f"{n}:4:2d")
    assert (mask.reshape(8, 2, 4).sum(-1) == n).all()  # rows N:4
    assert (mask.T.reshape(8, 2, 4).sum(-1) == n).all()  # and the transpose
    a = ref_rank(w)
    for i, j in itertools.product(range(2), range(2)):
        tile, kept = a[4 * i:4 * i + 4, 4 * j:4 * j + 4], mask[4 * i:4 * i + 4, 4 * j:4 * j + 4]
        best = brute_force_tile_best(tile, n)
        assert float(tile[kept].sum()) == pytest.approx(best, rel=1e-6 if dtype == torch.float64
                                                        else 1e-5)


def test_transposable_conv_is_nm_along_input_and_output_channels_at_every_tap():
    w = torch.randn(8, 8, 3, 3, dtype=torch.float64)
    mask = pattern_mask(w, "2:4:2d")
    for kh, kw in itertools.product(range(3), range(3)):
        tap = mask[:, :, kh, kw]  # (out, in)
        assert (tap.reshape(8, 2, 4).sum(-1) == 2).all()
        assert (tap.T.reshape(8, 2, 4).sum(-1) == 2).all()


@pytest.mark.parametrize(("spec", "sparsity", "n"), [("2:4:2d", 0.25, 3), ("1:4:2d", 0.5, 2),
                                                     ("2:5:2d", None, 2), ("1:2:2d", 0.9, 1)])
def test_transposable_stages_and_m5_keep_the_brute_force_best(spec, sparsity, n):
    """A gradual stage N' of a transposable pattern is the transposable N':M mask; M = 5
    (2040 tiles for 2:5) is exhaustive too."""
    m = parse_pattern(spec).m
    w = torch.randn(m, 2 * m, dtype=torch.float64)
    mask = pattern_mask(w, spec, sparsity)
    a = ref_rank(w)
    for j in range(2):
        tile, kept = a[:, m * j:m * j + m], mask[:, m * j:m * j + m]
        assert (kept.sum(0) == n).all() and (kept.sum(1) == n).all()
        assert float(tile[kept].sum()) == pytest.approx(brute_force_tile_best(tile, n), rel=1e-9)


# -- block and vector masks -------------------------------------------------------------------
def ref_block_scores(w: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """L1 of every r x c block of a 2-D float64 matrix, edge blocks clipped to the matrix."""
    a = ref_rank(w)
    rows, cols = -(-a.shape[0] // r), -(-a.shape[1] // c)
    return torch.tensor([[float(a[i * r:(i + 1) * r, j * c:(j + 1) * c].sum())
                          for j in range(cols)] for i in range(rows)], dtype=torch.float64)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 13), cols=st.integers(1, 13), r=st.integers(1, 5),
       c=st.integers(1, 5), sparsity=st.floats(0.0, 0.999), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from(DTYPES))
def test_block_masks_keep_whole_blocks_with_the_largest_l1(rows, cols, r, c, sparsity, seed,
                                                           dtype):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).to(dtype)
    mask = pattern_mask(w, f"block:{r}x{c}", sparsity)
    scores = ref_block_scores(w, r, c)
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for i, j in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        block = mask[i * r:(i + 1) * r, j * c:(j + 1) * c]
        assert block.all() or not block.any()  # whole, clipped blocks included
        kept[i, j] = bool(block.all())
    blocks = scores.numel()
    assert int(kept.sum()) == blocks - pruned_half_up(blocks, sparsity)
    if kept.any() and not kept.all():  # float32 sums: ties within rounding may go either way
        assert scores[kept].min() >= scores[~kept].max() * (1 - 1e-2)


def test_block_score_is_l1_not_l2():
    """A block of many small weights outranks one of a single larger weight when its L1 is
    larger, although its L2 is smaller."""
    w = torch.zeros(2, 8)
    w[:, :4] = 1.0  # L1 8, L2 2.83
    w[0, 4] = 7.0  # L1 7, L2 7
    mask = pattern_mask(w, "block:2x4", 0.5)
    assert mask[:, :4].all() and not mask[:, 4:].any()


@pytest.mark.parametrize("spec", ["block:2x2", "block:2x2+1:2", "global"])
def test_a_block_holding_a_nan_ranks_lowest_even_beside_infinite_weights(spec):
    """NaN ranks lowest (docs/patterns.md); a block's sum over a NaN is NaN, whatever else
    the block holds: two infinite weights beside it must not make it rank highest."""
    w = torch.rand(4, 8) + 1
    w[0, 0] = w[0, 1] = float("inf")
    w[1, 0] = float("nan")
    mask = (global_masks([w], "block:2x2", 0.75)[0] if spec == "global" else
            pattern_mask(w, spec, None if "+" in spec else 0.75))
    assert not mask[:2, :2].any()


@pytest.mark.parametrize(("shape", "v"), [((7, 5), 4), ((1, 9), 2), ((9, 1), 4), ((3, 3), 8)])
def test_vector_masks_on_shapes_the_vector_does_not_divide(shape, v):
    w = torch.randn(shape, dtype=torch.float64)
    mask = pattern_mask(w, f"vector:{v}", 0.5)
    scores = ref_block_scores(w, v, 1)
    kept_blocks = 0
    for i, j in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        block = mask[i * v:(i + 1) * v, j]
        assert block.all() or not block.any()
        kept_blocks += int(block.all())
    assert kept_blocks == scores.numel() - pruned_half_up(scores.numel(), 0.5)


def test_vector_nm_keeps_n_whole_vectors_of_every_m():
    """Vector-wise N:M (V x 1 vectors, N of every M along the input dim): as the reference
    does it by hand on a 4 x 8 weight with V = 2."""
    w = torch.randn(4, 8, dtype=torch.float64)
    mask = pattern_mask(w, "vector:2+2:4")
    scores = ref_block_scores(w, 2, 1)  # (2, 8)
    for i in range(2):
        expected = torch.zeros(8, dtype=torch.bool)
        for group in range(2):
            cols = range(4 * group, 4 * group + 4)
            expected[sorted(cols, key=lambda j: -float(scores[i, j]))[:2]] = True
        assert torch.equal(mask[2 * i], expected) and torch.equal(mask[2 * i + 1], expected)


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 3), c=st.integers(1, 3),
       n_m=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4)]), row_blocks=st.integers(1, 3),
       groups=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_block_nm_keeps_the_n_largest_l1_blocks_of_every_m(r, c, n_m, row_blocks, groups,
                                                           seed):
    """nmSPARSE's block-wise N:M: in each block row, N of every M consecutive blocks along
    the input dimension, ranked by L1 (ties broken either way)."""
    n, m = n_m
    w = torch.randn(r * row_blocks, c * m * groups, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    mask = pattern_mask(w, f"block:{r}x{c}+{n}:{m}")
    scores = ref_block_scores(w, r, c)  # (row_blocks, m * groups)
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for i, j in itertools.product(range(scores.shape[0]), range(scores.shape[1])):
        block = mask[i * r:(i + 1) * r, j * c:(j + 1) * c]
        assert block.all() or not block.any()
        kept[i, j] = bool(block.all())
    assert (kept.reshape(row_blocks, groups, m).sum(-1) == n).all()
    for sc, k in zip(scores.reshape(-1, m), kept.reshape(-1, m), strict=True):
        if n < m:
            assert sc[k].min() >= sc[~k].max() * (1 - 1e-6)


# -- unstructured -----------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(shape=st.sampled_from([(1, 1), (1, 7), (7, 1), (3, 5), (13, 17), (2, 3, 3, 3), (5,),
                              (97, 3)]),
       sparsity=st.one_of(st.sampled_from([0.0, 1e-12, 0.5, 0.999999, 1 - 1e-12]),
                          st.floats(0.0, 1.0, exclude_max=True)),
       dtype=st.sampled_from(DTYPES), fill=st.sampled_from([None, 0.0, 2.0]),
       seed=st.integers(0, 2**31 - 1))
def test_unstructured_exact_count_at_odd_shapes_and_edge_sparsities(shape, sparsity, dtype,
                                                                    fill, seed):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
         if fill is None else torch.full(shape, fill, dtype=torch.float64)).to(dtype)
    mask = pattern_mask(w, "unstructured", sparsity)
    total = w.numel()
    assert int(mask.sum()) == total - pruned_half_up(total, sparsity)
    rank, kept = ref_rank(w).reshape(-1), mask.reshape(-1)
    if kept.any() and not kept.all():
        assert rank[kept].min() >= rank[~kept].max()


def test_unstructured_nan_goes_first_and_inf_stays():
    w = torch.tensor([[float("nan"), 5.0, -float("inf"), 0.0, float("inf"), 1.0]])
    assert pattern_mask(w, "unstructured", 0.5).tolist() == [[False, True, True,
                                                              False, True, False]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_ranks_by_the_stored_values(dtype):
    """Values equal in half precision tie; values distinct in it never swap (ranked wider)."""
    w = torch.tensor([[1.0, 1.0 + 2 ** -7, 1.0 + 2 ** -6, 0.5]], dtype=dtype)
    mask = pattern_mask(w, "unstructured", 0.5)
    stored = w.double().abs()[0]
    assert stored[mask[0]].min() >= stored[~mask[0]].max()


def test_mask_does_not_touch_the_weight_or_its_grad():
    w = torch.randn(4, 8, requires_grad=True)
    before = w.detach().clone()
    mask = pattern_mask(w, "2:4")
    assert not mask.requires_grad and torch.equal(w.detach(), before) and w.grad is None


# -- global -----------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(sparsity=st.floats(0.0, 0.999), seed=st.integers(0, 2**31 - 1))
def test_global_threshold_matches_a_sorted_reference(sparsity, seed):
    """Han et al. 2015 / torch.nn.utils.prune.global_unstructured: one threshold over all
    the layers' |w|, exactly round(s * total) pruned."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(3, 5, generator=g, dtype=torch.float64),
          torch.randn(7, 2, 2, 2, generator=g, dtype=torch.float64) * 3,
          torch.randn(1, 9, generator=g, dtype=torch.float64) * 0.1]
    masks = global_masks(ws, "unstructured", sparsity)
    flat = torch.cat([w.abs().reshape(-1) for w in ws])
    kept = flat.numel() - pruned_half_up(flat.numel(), sparsity)
    assert sum(int(m.sum()) for m in masks) == kept
    if 0 < kept < flat.numel():  # Gaussian float64 weights: no ties, the set is unique
        threshold = flat.sort(descending=True).values[kept - 1]
        for w, m in zip(ws, masks, strict=True):
            assert torch.equal(m, w.abs() >= threshold)


# -- inputs no mask can be made of -------------------------------------------------------------
@pytest.mark.parametrize("spec", ["head", "head:16", "neuron"])
def test_unit_patterns_are_refused_by_the_single_tensor_functions(spec):
    """A head or a neuron spans several tensors: pattern_mask alone cannot know the unit, and
    must not silently prune single weights as if the pattern were unstructured."""
    with pytest.raises(ValueError, match=rf"pattern {spec!r} .*several tensors.*SparsityEngine"):
        pattern_mask(torch.randn(4, 16), spec, 0.5)
    with pytest.raises(ValueError, match=rf"pattern {spec!r} .*several tensors"):
        global_masks([torch.randn(4, 16)], spec, 0.5)


@pytest.mark.parametrize(("score", "message"), [
    ([[1.0] * 8] * 4, r"score must be a real tensor shaped like the weight, got a list"),
    (torch.randn(4, 8, dtype=torch.complex64), r"got a torch.complex64 tensor"),
])
def test_scores_that_are_no_real_tensor_are_named(score, message):
    with pytest.raises(ValueError, match=message):
        pattern_mask(torch.randn(4, 8), "2:4", score=score)
    with pytest.raises(ValueError, match=message):
        global_masks([torch.randn(4, 8)], "unstructured", 0.5, scores=[score])


def test_sparse_layout_weights_are_named():
    with pytest.raises(ValueError, match=r"dense \(strided\) weight tensor, got a torch.sparse_coo"):
        pattern_mask(torch.randn(4, 8).to_sparse(), "2:4")


def test_a_head_holding_a_nan_ranks_lowest_even_beside_infinite_weights():
    """The same rule for units (heads): a head whose query rows hold a NaN, and whose output
    columns two infinite weights, is the one pruned."""
    from sparse_training.pieces.units import COLUMNS, ROWS, UnitTie, unit_masks

    query, out = torch.rand(4, 8) + 1, torch.rand(8, 4) + 1  # 2 heads of size 2
    out[0, 0] = out[1, 0] = float("inf")
    query[1, 0] = float("nan")
    ties = [UnitTie("attn", "head", 2, ROWS, 2, (0, 1)),
            UnitTie("attn", "head", 2, COLUMNS, 2, (0, 1))]
    masks = unit_masks([query, out], ties, 0.5)
    assert not masks[0][:2].any() and masks[0][2:].all()
    assert not masks[1][:, :2].any() and masks[1][:, 2:].all()
