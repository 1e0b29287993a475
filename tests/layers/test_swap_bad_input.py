"""Bad input to the swaps (sparsify, densify, make_permanent): rules that can make no
Linear sparse, weights on the meta device, arguments that are not a model. Each is a clear
error naming the value and the fix, raised before any layer is swapped; Linears a rule
cannot make sparse stay as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sparse_training import (
    BlockSparseLinear,
    SemiStructuredLinear,
    densify,
    make_permanent,
    sparsify,
)

SPARSIFY_RULES = [  # (Linear shapes (in, out), rules, message): a ValueError, nothing swapped
    ([(16, 32)], {".": {"pattern": "block:64x64", "sparsity": 0.9}},
     r"rule '\.' can make none of the Linears it matches sparse \(nothing was swapped\):\n  "
     r"0: block 64x64 covers the whole 32x16 weight: sparsity 0.9 keeps 1 of 1 blocks \("
     r"nothing pruned; use smaller blocks or a higher sparsity\)"),
    ([(32, 32)], {".": {"pattern": "block:16x16", "density": 0.9}},
     r"0: the 32x32 weight has 4 blocks of 16x16: density 0.9 keeps 4 of 4 blocks"),
    ([(16, 10)], {".": {"pattern": "2:4"}},
     r"rule '\.' can make none .*\n  0: 2:4: out_features must be a positive multiple of 4 "
     r"\(2:4 groups\), got 10"),
    ([(6, 8)], {".": {"pattern": "2:4:2d"}}, r"0: 2:4:2d: in_features must be a positive "
                                             r"multiple of 4 \(2:4 groups\), got 6"),
    ([(64, 64), (16, 32)], {"0": {"pattern": "block:16x16", "density": 0.5},
                            "1": {"pattern": "block:64x64", "sparsity": 0.5}},
     r"rule '1' can make none .*\n  1: block 64x64 covers the whole 32x16 weight: sparsity "
     r"0.5 keeps 1 of 1"),
]


def linears(shapes) -> nn.Module:
    return nn.ModuleList([nn.Linear(i, o) for i, o in shapes])


@pytest.mark.parametrize(("shapes", "rules", "message"), SPARSIFY_RULES,
                         ids=[f"{i}-{m[-28:]}" for i, (*_, m) in enumerate(SPARSIFY_RULES)])
def test_sparsify_rules_that_prune_nothing_raise_before_any_swap(shapes, rules, message):
    model = linears(shapes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        sparsify(model, rules, verbose=False)
    assert all(type(m) is nn.Linear for m in model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


SPARSIFY_HANDLED = [  # (shapes, rules, decisions): the Linears that cannot be sparse stay
    ([(16, 32), (32, 256)], {".": {"pattern": "block:64x64", "sparsity": 0.9}},
     ["skipped: block 64x64 covers the whole 32x16 weight: sparsity 0.9 keeps 1 of 1 blocks "
      "(nothing pruned; use smaller blocks or a higher sparsity)", "compressed"]),
    ([(16, 32), (32, 10)], {".": {"pattern": "2:4"}},
     ["compressed", "skipped: 2:4: out_features must be a positive multiple of 4 (2:4 "
                    "groups), got 10"]),
    ([(16, 32)], {".": {"pattern": "block:64x64", "density": 1.0}}, ["compressed"]),  # asked
]


@pytest.mark.parametrize(("shapes", "rules", "decisions"), SPARSIFY_HANDLED,
                         ids=[str(d)[:30] for *_, d in SPARSIFY_HANDLED])
def test_sparsify_skips_the_linears_a_rule_cannot_make_sparse(shapes, rules, decisions):
    model = linears(shapes)
    dense = copy.deepcopy(model)
    rows = sparsify(model, rules, verbose=False)
    assert [row["decision"] for row in rows] == decisions
    for row, layer, reference in zip(rows, model, dense, strict=True):
        if row["decision"] == "compressed":  # as sparse as its row says
            assert isinstance(layer, (BlockSparseLinear, SemiStructuredLinear))
            kept = layer.to_dense().weight.ne(0).double().mean()
            assert float(kept) == pytest.approx(row["density"])
        else:  # untouched
            x = torch.randn(layer.in_features, 5).T  # non-contiguous
            assert type(layer) is nn.Linear and torch.equal(layer(x), reference(x))


def test_sparsify_refuses_weights_on_the_meta_device_naming_them():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(72, 48))
    for rule in ({"pattern": "block:16x16", "density": 0.5}, {"pattern": "2:4"}):
        with pytest.raises(ValueError, match=r"sparsify: \['0'\] are on the meta device: .* "
                                             r"initialize the weights first .*nothing was "
                                             r"swapped"):
            sparsify(model, {"0": rule}, verbose=False)
        assert type(model[0]) is nn.Linear


BLOCK = {"pattern": "block:16x16", "sparsity": 0.5}
MISTAKES = [  # (rules, message) given to a model of a Linear and one compressed already
    (BLOCK, r"^rules map a regex of module names to a rule; got one rule, \{'pattern': "
            r"'block:16x16', 'sparsity': 0.5\}: name the Linears it is for, e.g. \{'\.': "
            r"\{'pattern': 'block:16x16', 'sparsity': 0.5\}\} for all of them$"),
    ({"0": {"pattern": "block:16x16", "sparsity": 90}},
     r"rule '0': sparsity must be a number in \[0, 1\), got 90 \(a percentage\? give the "
     r"fraction pruned, 0.9\)"),
    ({"1": BLOCK}, r"^rule regex '1' matches no nn.Linear; their names are: '0' \(regexes are "
                   r"searched in these names\); compressed already: '1' \(densify them "
                   r"first\)$"),
]


@pytest.mark.parametrize(("rules", "message"), MISTAKES, ids=[m[:30] for _, m in MISTAKES])
def test_sparsify_mistakes_name_the_fix_before_any_swap(rules, message):
    """A rule without its regex, a percentage, and a layer compressed by an earlier call."""
    model = linears([(32, 32), (32, 32)])
    sparsify(model, {"1": BLOCK}, verbose=False)
    with pytest.raises(ValueError, match=message):
        sparsify(model, rules, verbose=False)
    assert type(model[0]) is nn.Linear


NOT_A_MODEL = [  # (call, error, message)
    (lambda: sparsify("model", {".": {"pattern": "2:4"}}), ValueError,
     r"sparsify takes the model \(an nn.Module\) whose layers it swaps, got str"),
    (lambda: densify(None), ValueError,
     r"densify takes the model \(an nn.Module\) .* got NoneType"),
    (lambda: make_permanent("x"), TypeError, "make_permanent takes a torch.nn.Module, got str"),
]


@pytest.mark.parametrize(("call", "error", "message"), NOT_A_MODEL,
                         ids=[m[:30] for *_, m in NOT_A_MODEL])
def test_a_swap_given_something_other_than_a_model_names_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(SPARSIFY_RULES), len(SPARSIFY_HANDLED), len(MISTAKES), len(NOT_A_MODEL)) == (
        5, 3, 3, 3)
