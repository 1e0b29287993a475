"""Patterns at the edges: kernels whose taps a tile would straddle, float64 weights ranked in
float64, hand-built ``Pattern`` objects refusing what no string gives, non-string patterns."""

from __future__ import annotations

import pytest
import torch

from sparse_training import SparsityConfig, pattern_mask
from sparse_training.pieces.patterns import Pattern, parse_pattern


@pytest.mark.parametrize("pattern", ["2:4:2d", "block:2x1+2:4"])
def test_a_tile_must_stay_inside_one_kernel_tap(pattern):
    """A (6, 8, 2, 2) kernel has 24 view rows, a multiple of 4, but 6 output channels per
    tap: a transposable tile (4 rows) would straddle two taps, a 2-row block would not."""
    weight = torch.randn(6, 8, 2, 2, dtype=torch.float64)
    if pattern == "2:4:2d":
        with pytest.raises(ValueError, match=r"weight of shape \(6, 8, 2, 2\) cannot take "
                           r"pattern '2:4:2d': 6 output channels are not a multiple of the 4 "
                           r"rows of a tile, which must stay inside one kernel tap"):
            pattern_mask(weight, pattern)
    else:  # 6 outputs hold three 2-row blocks per tap
        assert pattern_mask(weight, pattern).shape == weight.shape
    mask = pattern_mask(torch.randn(8, 8, 2, 2), "2:4:2d")  # 8 outputs: per tap, both ways
    for kh in range(2):
        for kw in range(2):
            tap = mask[:, :, kh, kw].reshape(2, 4, 2, 4)
            assert (tap.sum(1) == 2).all() and (tap.sum(3) == 2).all()


def test_float64_weights_are_ranked_in_float64():
    """1 + 1e-12 and 1 are one float32 number: ranked in float64 the larger wins, and 1e-46
    (0 in float32) outranks an exact 0."""
    for values, kept in (([1 + 1e-12, 1.0, 0.5, 0.25], 0), ([0.25, 0.5, 1.0, 1 + 1e-12], 3),
                         ([1.0, 1 + 1e-12, 0.5, 0.25], 1)):
        mask = pattern_mask(torch.tensor([values], dtype=torch.float64), "1:4")
        assert mask[0].nonzero().flatten().tolist() == [kept]
    tiny = torch.tensor([[1e-50, 1e-46, 0.0, 0.0]], dtype=torch.float64)
    assert pattern_mask(tiny, "unstructured", 0.75)[0].tolist() == [False, True, False, False]


@pytest.mark.parametrize("fields, match", [
    (dict(n=5, m=4), r"^pattern Pattern\(n=5, m=4\): N must satisfy 1 <= N <= M, got N=5, M=4$"),
    (dict(n=0, m=4, spec="0:4"), r"^pattern '0:4': N must satisfy 1 <= N <= M, got N=0, M=4$"),
    (dict(n=2), r"N must satisfy 1 <= N <= M, got N=2, M=None$"),
    (dict(n=2.0, m=4), r"N must satisfy 1 <= N <= M, got N=2.0, M=4$"),
    (dict(block_rows=0, block_cols=4, spec="block:0x4"),
     r"^pattern 'block:0x4': block dimensions must be >= 1, got 0x4$"),
    (dict(block_rows=True), r"block dimensions must be >= 1, got Truex1$"),
    (dict(n=2, m=8, transposable=True, spec="2:8:2d"),
     r"^pattern '2:8:2d': transposable N:M supports M <= 5 \(.*\), got M=8$"),
    (dict(transposable=True),
     r"^pattern Pattern\(transposable=True\): transposable needs an N:M pattern \(n and m\)"),
    (dict(unit="head", unit_size=0, spec="head:0"),
     r"^pattern 'head:0': the head size must be >= 1, got 0$"),
])
def test_a_hand_built_pattern_refuses_what_no_string_gives(fields, match):
    with pytest.raises(ValueError, match=match):
        Pattern(**fields)


def test_a_hand_built_pattern_must_be_what_its_spec_names():
    pattern = Pattern(1, 1, 2, 4, False, "unstructured")
    match = r"is not the pattern its spec 'unstructured' names .*build patterns with parse_pattern"
    with pytest.raises(ValueError, match=match):
        parse_pattern(pattern)
    with pytest.raises(ValueError, match=match):
        SparsityConfig(pattern=pattern)
    with pytest.raises(ValueError, match=r"is not a valid pattern: unknown pattern '2-4'"):
        parse_pattern(Pattern(1, 1, 2, 4, False, "2-4"))
    assert parse_pattern(Pattern(1, 1, 2, 4, True, "2:4:2d")) == parse_pattern("2:4:2d")


@pytest.mark.parametrize("settings, match", [
    (dict(pattern=2.4), r"pattern must be a string, got 2.4 of type float; valid forms: "
                        r"\"unstructured\", \"N:M\""),
    (dict(pattern=None), r"got None of type NoneType; valid forms: "),
    (dict(pattern=124), r"base-60 number 124; quote it: pattern: \"2:4\""),
    (dict(pattern="2:4", overrides={"fc": {"pattern": 124}}),
     r"overrides\['fc'\]: pattern must be a string, got the number 124: YAML reads an "
     r"unquoted 2:4"),
    (dict(pattern="2:4", overrides={"fc": {"pattern": ["2:4"]}}),
     r"overrides\['fc'\]: pattern must be a string, got \['2:4'\] of type list; valid forms"),
])
def test_a_pattern_that_is_not_a_string_names_the_valid_forms(settings, match):
    with pytest.raises(ValueError, match=match):
        SparsityConfig(**settings)
