"""Peer cases for channel permutations (Pool & Yu 2021; NVIDIA ASP's permutation search),
checked against references written here:

- ``kept_magnitude`` against a float64 sum of the N largest ``|w|`` of every M consecutive
  input channels (Linear, and Conv in ASP's view: each output channel at each tap);
- ``search_permutation`` returns a permutation that keeps at least the identity's magnitude
  and, on weights small enough to search in one window, one no single swap of two channels
  of different groups improves (the fixed point of ASP's greedy ``Channel_Swap``);
- ``permute_channels`` leaves the dense function unchanged: a Linear-ReLU-Linear MLP with
  biases, a Conv-BatchNorm-ReLU-Conv net (eval and train mode), and a Hugging Face BERT layer
  (the MLP and the value -> output.dense site within each head), all in float64; and after
  it, 2:4 pruning of the consumer keeps at least the magnitude it kept before;
- patterns a permutation cannot serve (transposable, block, unstructured) are refused,
  naming the value.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparse_training import kept_magnitude, pattern_mask, permute_channels, search_permutation


def ref_kept(w: torch.Tensor, n: int, m: int) -> float:
    """Sum of the N largest |w| of every M consecutive input channels, in float64 loops."""
    a = w.detach().double().abs()
    if a.dim() > 2:  # (out, in, *k): one row per output channel and tap
        a = a.movedim(1, -1).reshape(-1, a.shape[1])
    total = 0.0
    for row in a:
        for g in range(0, row.numel(), m):
            total += sum(sorted(row[g:g + m].tolist(), reverse=True)[:n])
    return total


@settings(max_examples=30, deadline=None)
@given(n_m=st.sampled_from([(2, 4), (1, 4), (3, 4), (2, 8), (1, 2)]), rows=st.integers(1, 6),
       groups=st.integers(1, 4), conv=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_kept_magnitude_matches_the_reference_and_the_mask(n_m, rows, groups, conv, seed):
    n, m = n_m
    shape = (rows, groups * m, 2, 3) if conv else (rows, groups * m)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert kept_magnitude(w, n, m) == pytest.approx(ref_kept(w, n, m), rel=1e-12)
    assert kept_magnitude(w, n, m) == pytest.approx(
        float(w.abs()[pattern_mask(w, f"{n}:{m}")].sum()), rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(n_m=st.sampled_from([(2, 4), (1, 4), (1, 2), (2, 8)]), rows=st.integers(1, 8),
       groups=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_search_is_a_permutation_and_a_fixed_point_of_single_swaps(n_m, rows, groups, seed):
    n, m = n_m
    w = torch.randn(rows, groups * m, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    perm = search_permutation(w, n, m, max_seconds=None)
    assert perm.dtype == torch.long and sorted(perm.tolist()) == list(range(groups * m))
    kept = ref_kept(w[:, perm], n, m)
    assert kept >= ref_kept(w, n, m) - 1e-12
    for i, j in itertools.combinations(range(groups * m), 2):
        if i // m == j // m:
            continue
        swapped = perm.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert ref_kept(w[:, swapped], n, m) <= kept + 1e-9 * max(kept, 1.0)


def test_search_gains_on_a_weight_whose_large_entries_share_groups():
    """Columns 0-3 hold every large entry: under 2:4 half of them go; regrouped, none."""
    w = torch.full((4, 8), 0.01, dtype=torch.float64)
    w[:, :4] = 1.0
    perm = search_permutation(w, 2, 4)
    assert ref_kept(w[:, perm], 2, 4) == pytest.approx(16.0)  # 4 rows x 2 groups x 2 ones
    assert ref_kept(w, 2, 4) == pytest.approx(4 * (2.0 + 2 * 0.01))  # one group of ones
    assert kept_magnitude(w[:, perm], 2, 4) >= kept_magnitude(w, 2, 4)


def test_mlp_function_is_preserved_and_pruning_keeps_more():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 8)).double().eval()
    x = torch.randn(5, 12, dtype=torch.float64)
    before, kept_before = mlp(x), ref_kept(mlp[2].weight, 2, 4)
    rows = permute_channels(mlp, "2:4", max_seconds_per_site=None)
    torch.testing.assert_close(mlp(x), before, rtol=1e-12, atol=1e-12)
    assert [r["site"] for r in rows] == ["2"]
    assert rows[0]["kept_after"] == pytest.approx(ref_kept(mlp[2].weight, 2, 4))
    assert rows[0]["kept_before"] == pytest.approx(kept_before)
    assert rows[0]["kept_after"] >= kept_before


@pytest.mark.parametrize("train", [False, True])
def test_conv_batchnorm_function_is_preserved(train):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 8, 3)).double()
    with torch.no_grad():  # running stats that are not the identity
        net(torch.randn(4, 3, 9, 9, dtype=torch.float64) * 2 + 1)
    net.train(train)
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    before = net(x)
    rows = permute_channels(net, "2:4", max_seconds_per_site=None)
    assert [r["site"] for r in rows] == ["3"]
    torch.testing.assert_close(net(x), before, rtol=1e-10, atol=1e-12)
    assert rows[0]["kept_after"] >= rows[0]["kept_before"]


def test_bert_layer_function_is_preserved():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)).double().eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    before = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    values = [bert.encoder.layer[i].attention.self.value.weight.detach().clone()
              for i in range(2)]
    rows = permute_channels(bert, "2:4", max_seconds_per_site=None)
    assert {r["site"] for r in rows} == {f"encoder.layer.{i}.{s}" for i in range(2)
                                         for s in ("output.dense", "attention.output.dense")}
    torch.testing.assert_close(bert(input_ids=ids, attention_mask=mask).last_hidden_state,
                               before, rtol=1e-10, atol=1e-10)
    for i in range(2):  # each head's 8 value rows stay within that head
        new = bert.encoder.layer[i].attention.self.value.weight.detach()
        for h in range(4):
            old_rows = {tuple(r.tolist()) for r in values[i][8 * h:8 * h + 8]}
            assert {tuple(r.tolist()) for r in new[8 * h:8 * h + 8]} == old_rows
    assert all(r["kept_after"] >= r["kept_before"] for r in rows)


@pytest.mark.parametrize("pattern", ["2:4:2d", "block:4x4", "unstructured", "vector:2+2:4",
                                     "2/4"])
def test_patterns_a_permutation_cannot_serve_are_refused(pattern):
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    weight = mlp[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"need an 'N:M' pattern .*got " + re.escape(repr(pattern))):
        permute_channels(mlp, pattern)
    assert torch.equal(mlp[2].weight, weight)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_named_before_anything_moves(bad):
    """A NaN made every swap's gain NaN: the search silently returned the identity and the
    report said kept_before=nan, gain 0. A weight that is not finite is named instead."""
    w = torch.randn(8, 16)
    w[0, 3] = bad
    with pytest.raises(ValueError, match=r"weight of shape \(8, 16\) has 1 non-finite entry "
                                         r"\(NaN or inf\)"):
        search_permutation(w, 2, 4)
    mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        mlp[2].weight[0, 0] = bad
    first = mlp[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"site '2': .*non-finite"):
        permute_channels(mlp, "2:4")
    assert torch.equal(mlp[0].weight, first)
