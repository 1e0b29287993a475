"""Unit masks (heads, neurons) against a loop reference in float64 sharing no code with
``unit_masks``, hypothesis on shapes and ties, and the unit patterns' grammar."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_training.pieces.patterns import parse_pattern
from sparse_training.pieces.units import COLUMNS, ROWS, UnitTie, unit_masks


def reference(weights, ties, sparsity, scores=None):
    """Unit scores summed entry by entry, the top ``units - round(s units)`` kept (ties by
    lower index; the tests use continuous random values), each member's bands expanded."""
    totals = {}
    for i, (w, tie) in enumerate(zip(weights, ties, strict=True)):
        score = (w.abs() if scores is None else scores[i]).to(torch.float64)
        total = totals.setdefault(tie.group, [0.0] * tie.units)
        for r in range(score.shape[0]):
            for c in range(score.shape[1]):
                band = (r if tie.axis == ROWS else c) // tie.size
                total[tie.of_block[band]] += float(score[r, c])
    kept = {}
    for group, total in totals.items():
        count = len(total) - int(sparsity * len(total) + 0.5)
        order = sorted(range(len(total)), key=lambda u: -total[u])
        kept[group] = set(order[:count])
    masks = []
    for w, tie in zip(weights, ties, strict=True):
        mask = torch.zeros(w.shape, dtype=torch.bool)
        for r in range(w.shape[0]):
            for c in range(w.shape[1]):
                band = (r if tie.axis == ROWS else c) // tie.size
                mask[r, c] = tie.of_block[band] in kept[tie.group]
        masks.append(mask)
    return masks


def attention(heads: int, size: int, width: int, fused: bool, generator, group="attn"):
    """Random query/key/value (fused or not) and output weights with their ties."""
    qkv = [torch.randn(heads * size * (3 if fused else 1), width, generator=generator,
                       dtype=torch.float64) for _ in range(1 if fused else 3)]
    out = torch.randn(width, heads * size, generator=generator, dtype=torch.float64)
    units = tuple(range(heads))
    ties = [UnitTie(group, "head", heads, ROWS, size, units * (3 if fused else 1))
            for _ in qkv] + [UnitTie(group, "head", heads, COLUMNS, size, units)]
    return [*qkv, out], ties


@given(heads=st.integers(1, 6), size=st.integers(1, 4), width=st.integers(1, 7),
       fused=st.booleans(), sparsity=st.floats(0.0, 0.99), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_unit_masks_keep_exact_counts_agree_across_members_and_match_the_reference(
        heads, size, width, fused, sparsity, seed):
    generator = torch.Generator().manual_seed(seed)
    weights, ties = attention(heads, size, width, fused, generator)
    masks = unit_masks(weights, ties, sparsity)
    expected = reference(weights, ties, sparsity)
    assert all(torch.equal(m, e) for m, e in zip(masks, expected, strict=True))
    kept = heads - int(sparsity * heads + 0.5)
    out_mask = masks[-1]
    kept_units = out_mask.reshape(width, heads, size)[0, :, 0]
    assert int(kept_units.sum()) == kept
    for mask, tie in zip(masks, ties, strict=True):  # every band whole, every member agrees
        bands = (mask.reshape(len(tie.of_block), tie.size, -1) if tie.axis == ROWS else
                 mask.reshape(mask.shape[0], len(tie.of_block), tie.size).transpose(0, 1))
        per_band = bands.flatten(1)
        assert (per_band.all(1) | ~per_band.any(1)).all()
        assert torch.equal(per_band[:, 0], kept_units[list(tie.of_block)])


def test_groups_rank_apart_and_scores_replace_magnitude():
    generator = torch.Generator().manual_seed(0)
    first, first_ties = attention(4, 2, 5, False, generator, "a")
    second, second_ties = attention(6, 1, 5, True, generator, "b")
    weights, ties = [*first, *second], [*first_ties, *second_ties]
    scores = [torch.rand(w.shape, generator=generator, dtype=torch.float64) for w in weights]
    masks = unit_masks(weights, ties, 0.5, scores)
    assert all(torch.equal(m, e) for m, e in zip(
        masks, reference(weights, ties, 0.5, scores), strict=True))


def test_nan_scores_rank_their_unit_lowest_and_input_first_tensors_read_transposed():
    w = torch.ones(2, 4, dtype=torch.float64)  # (in, out) storage: 4 outputs in 2 heads
    scores = torch.ones(2, 4, dtype=torch.float64)
    scores[0, 1] = float("nan")  # output 1: head 0
    tie = UnitTie("g", "head", 2, ROWS, 2, (0, 1))
    (mask,) = unit_masks([w], [tie], 0.5, [scores], input_dims=[0])
    assert mask.shape == (2, 4)
    assert mask[:, 2:].all() and not mask[:, :2].any()


@pytest.mark.parametrize("weights, ties, message", [
    ([torch.ones(4, 3)], [UnitTie("g", "head", 2, ROWS, 1, (0, 1))],
     r"does not tile a tensor whose 2-D view is \(4, 3\)"),
    ([torch.ones(2, 3), torch.ones(2, 3)],
     [UnitTie("g", "head", 2, ROWS, 1, (0, 1)), UnitTie("g", "head", 3, COLUMNS, 1, (0, 1, 2))],
     "the ties of group 'g' disagree on its units: 2 and 3"),
    ([torch.ones(2, 3)], [], "one tie, input dim .* per weight; got 1 weights, 0 ties"),
])
def test_ties_that_do_not_fit_are_refused(weights, ties, message):
    with pytest.raises(ValueError, match=message):
        unit_masks(weights, ties, 0.5)


def test_a_bad_tie_or_sparsity_is_refused():
    with pytest.raises(ValueError, match="not a unit tie"):
        UnitTie("g", "head", 2, 2, 1, (0, 1))
    with pytest.raises(ValueError, match="not a unit tie"):
        UnitTie("g", "head", 2, ROWS, 1, (0, 2))
    with pytest.raises(ValueError, match=r"sparsity must be a number in \[0, 1\)"):
        unit_masks([torch.ones(2, 2)], [UnitTie("g", "head", 2, ROWS, 1, (0, 1))], 1.0)


@pytest.mark.parametrize("spec, unit, size", [("head", "head", None), ("head:64", "head", 64),
                                              (" Neuron ", "neuron", None)])
def test_unit_patterns_parse(spec, unit, size):
    pattern = parse_pattern(spec)
    assert (pattern.unit, pattern.unit_size, pattern.is_unit, pattern.is_nm) == (
        unit, size, True, False)
    assert pattern.compression_problem is None  # SlimLinear takes heads and neurons


def test_a_head_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="the head size must be >= 1, got 0"):
        parse_pattern("head:0")
