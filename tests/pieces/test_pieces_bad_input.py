"""Wrong input to the pieces' public functions (parse_pattern, pattern_mask, global_masks):
each is a clear error naming the value and the valid forms."""

from __future__ import annotations

import pytest
import torch

from sparse_training import global_masks, pattern_mask
from sparse_training.pieces.patterns import parse_pattern

WRONG_INPUTS = [  # (call, message): each a ValueError
    (lambda: parse_pattern("２:４"), r"unknown pattern '２:４'; valid forms"),
    (lambda: pattern_mask([[1.0, 2.0, 3.0, 4.0]], "2:4"),
     r"a mask needs a real weight tensor of at least one dimension and one entry, got a list"),
    (lambda: pattern_mask(torch.tensor(1.0), "2:4"), r"got a torch.float32 tensor of shape \(\)"),
    (lambda: pattern_mask(torch.empty(0, 4), "2:4"), r"of shape \(0, 4\)"),
    (lambda: pattern_mask(torch.randn(4, 4, dtype=torch.complex64), "2:4"),
     r"got a torch.complex64 tensor"),
    (lambda: global_masks([], "unstructured", 0.5),
     r"weights must be a non-empty list of weight tensors, got list"),
    (lambda: global_masks([torch.randn(4, 4)] * 2, "unstructured", 0.5, scores=[None]),
     r"scores must hold one entry per weight \(2\), got 1"),
]


@pytest.mark.parametrize(("call", "message"), WRONG_INPUTS,
                         ids=[m[:30] for _, m in WRONG_INPUTS])
def test_wrong_inputs_to_the_pieces_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_table_holds_every_case():
    """Guards against a row lost in an edit."""
    assert len(WRONG_INPUTS) == 7
