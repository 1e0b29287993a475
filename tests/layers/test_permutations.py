"""Channel permutations: the dense function is unchanged, kept magnitude never drops."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparse_training import find_sites, kept_magnitude, permute_channels, search_permutation
from sparse_training.permutations import Site
from sparse_training.permutations import search as search_module

# float64 models: a permutation only reorders sums, so outputs agree to rounding (~1e-15)
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def _bert(hidden=64, heads=4, intermediate=128):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=hidden, num_hidden_layers=2,
                                     num_attention_heads=heads, intermediate_size=intermediate,
                                     max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).double().eval()
    with torch.no_grad():  # HF's init (std 0.02, zero biases) leaves biases trivial
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32),
                         nn.ReLU(), nn.Linear(32, 8)).double().eval()


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
                          nn.MaxPool2d(2), nn.Conv2d(32, 8, 1)).double()
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.weight.uniform_(0.5, 2.0)
            bn.bias.normal_()
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 3.0)
    return model.eval()


def _check_rows(rows, names):
    assert [r["site"] for r in rows] == names
    for r in rows:
        assert r["kept_after"] >= r["kept_before"] > 0
        assert r["gain"] == pytest.approx(r["kept_after"] / r["kept_before"] - 1)
        assert r["seconds"] >= 0
    assert any(r["gain"] > 0 for r in rows)


def test_bert_computes_the_same():
    model = _bert()
    ids = torch.randint(0, 50, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 8:] = 0
    before = model(input_ids=ids, attention_mask=mask)
    consumers = [s.consumer[0].weight.clone() for s in find_sites(model)]
    rows = permute_channels(model, "2:4")
    _check_rows(rows, [f"encoder.layer.{i}.{part}output.dense"
                       for i in range(2) for part in ("", "attention.")])
    assert any(not torch.equal(w, s.consumer[0].weight)
               for w, s in zip(consumers, find_sites(model), strict=True))
    after = model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(after.last_hidden_state, before.last_hidden_state, **TIGHT)
    torch.testing.assert_close(after.pooler_output, before.pooler_output, **TIGHT)


def test_mlp_computes_the_same():
    model = _mlp()
    x = torch.randn(10, 16, dtype=torch.float64)
    before = model(x)
    _check_rows(permute_channels(model, "2:4"), ["3", "5"])
    torch.testing.assert_close(model(x), before, **TIGHT)
    fresh = torch.randn(7, 16, dtype=torch.float64)
    torch.testing.assert_close(model(fresh), _mlp()(fresh), **TIGHT)


def test_cnn_with_batchnorm_computes_the_same():
    model, reference = _cnn(), _cnn()
    rows = permute_channels(model, "2:4")
    _check_rows(rows, ["3", "7"])
    assert not torch.equal(model[1].running_mean, reference[1].running_mean)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x), **TIGHT)


def test_gain_on_a_gaussian_weight():
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    perm = search_permutation(w, 2, 4)
    assert kept_magnitude(w[:, perm], 2, 4) > 1.01 * kept_magnitude(w, 2, 4)
    assert torch.equal(perm, search_permutation(w, 2, 4))  # deterministic


def test_conv_weight_and_budget():
    torch.manual_seed(0)
    w = torch.randn(8, 16, 3, 3)
    perm = search_permutation(w, 2, 4)
    assert kept_magnitude(w[:, perm], 2, 4) > kept_magnitude(w, 2, 4)
    assert torch.equal(search_permutation(w, 2, 4, max_seconds=0.0), torch.arange(16))


def test_kept_magnitude_matches_pattern_mask():
    from sparse_training import pattern_mask

    w = torch.randn(12, 32, dtype=torch.float64)
    assert kept_magnitude(w, 2, 8) == pytest.approx((w.abs() * pattern_mask(w, "2:8")).sum().item())
    assert kept_magnitude(torch.tensor([[0.1, -3.0, 2.0, 0.5]]), 2, 4) == 5.0


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), groups=st.integers(1, 8),
       nm=st.sampled_from([(1, 4), (2, 4), (2, 8)]), ties=st.booleans(),
       seed=st.integers(0, 2**16))
def test_search_is_a_permutation_that_never_loses(rows, groups, nm, ties, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    w = (torch.randint(-2, 3, (rows, groups * m), generator=g).float() if ties
         else torch.randn(rows, groups * m, generator=g))
    perm = search_permutation(w, n, m, seed=seed)
    assert perm.dtype == torch.long
    assert torch.equal(perm.sort().values, torch.arange(groups * m))
    assert kept_magnitude(w[:, perm], n, m) >= kept_magnitude(w, n, m)


def test_windows_for_wide_weights(monkeypatch):
    monkeypatch.setattr(search_module, "WINDOW_WORK", 8 * 32**2)  # 8 rows: 32-column windows
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    perm = search_permutation(w, 2, 4, seed=1)
    assert torch.equal(perm.sort().values, torch.arange(128))
    assert kept_magnitude(w[:, perm], 2, 4) > 1.01 * kept_magnitude(w, 2, 4)
    assert torch.equal(perm, search_permutation(w, 2, 4, seed=1))


def test_attention_permutes_within_heads():
    model = _bert()
    attention = [s for s in find_sites(model) if s.heads > 1]
    assert [s.heads for s in attention] == [4, 4]
    value = model.encoder.layer[0].attention.self.value
    with torch.no_grad():
        value.bias.copy_(torch.arange(64, dtype=torch.float64))  # label each channel
    permute_channels(model, "2:4", sites=attention)
    assert not torch.equal(value.bias, torch.arange(64, dtype=torch.float64))
    for head in value.bias.view(4, 16):
        assert head.min() // 16 == head.max() // 16  # a head's channels stay in it


def test_optimizer_state_follows_the_weights():
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    models = [_mlp() for _ in range(3)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]

    def step(model, optimizer):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for model, optimizer in zip(models, optimizers, strict=True):
        step(model, optimizer)  # Adam has exp_avg, exp_avg_sq
    permute_channels(models[0], "2:4", optimizer=optimizers[0])
    permute_channels(models[1], "2:4")  # state left unpermuted
    for model, optimizer in zip(models, optimizers, strict=True):
        step(model, optimizer)
    fresh = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(models[0](fresh), models[2](fresh), **TIGHT)
    assert not torch.allclose(models[1](fresh), models[2](fresh), **TIGHT)


def test_find_sites_skips_what_mixes_channels():
    shared = nn.Linear(8, 8)
    assert find_sites(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))) == []
    assert find_sites(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))) == []
    assert find_sites(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=2))) == []
    assert find_sites(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 4))) == []
    assert find_sites(nn.Sequential(nn.Linear(4, 8), shared, nn.ReLU(), shared)) == []
    site, = find_sites(nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 4)))
    assert [attr for _, attr, _ in site.producer] == ["weight"]


@pytest.mark.parametrize("pattern", ["2:4:2d", "block:4x4", "unstructured", "vector:4+2:4",
                                     "2-4", 24])
def test_bad_pattern(pattern):
    model = _mlp()
    weights = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(f"need an 'N:M' pattern (e.g. '2:4'), "
                                                   f"got {pattern!r}")):
        permute_channels(model, pattern)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_bad_shapes_change_nothing():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    weights = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"site '4': 6 input channels are not a multiple of M = 4"):
        permute_channels(model, "2:4")
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"\(6, 6\): 6 input channels are not a multiple of M = 4"):
        search_permutation(torch.randn(6, 6), 2, 4)
    with pytest.raises(ValueError, match=r"N:M needs integers 1 <= N <= M, got N=3, M=2"):
        kept_magnitude(torch.randn(4, 4), 3, 2)
    with pytest.raises(ValueError, match=r"input dimension \(2-D or more\), got shape \(8,\)"):
        search_permutation(torch.randn(8), 2, 4)


@pytest.mark.parametrize("call", [lambda: permute_channels("x"), lambda: find_sites(3)])
def test_a_model_that_is_no_module_is_a_type_error(call):
    with pytest.raises(TypeError, match=r"^(permute_channels|find_sites) takes a model \(a "
                                        r"torch.nn.Module\), got ('x'|3) of type (str|int)$"):
        call()


@pytest.mark.parametrize("seconds", [-1, float("nan"), "10", True])
def test_a_bad_search_budget_is_refused_before_anything_changes(seconds):
    model = _mlp()
    weights = [p.clone() for p in model.parameters()]
    shown = re.escape(repr(seconds))
    with pytest.raises(ValueError, match=rf"^max_seconds_per_site must be a number of seconds "
                                         rf">= 0 or None \(search until converged\), got {shown}$"):
        permute_channels(model, max_seconds_per_site=seconds)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    with pytest.raises(ValueError, match=rf"^max_seconds must be a number of seconds >= 0 .* "
                                         rf"got {shown}$"):
        search_permutation(torch.randn(8, 16), 2, 4, max_seconds=seconds)


def test_bad_heads():
    model = _bert(hidden=24, heads=4, intermediate=32)  # 6 channels per head
    with pytest.raises(ValueError, match=r"site 'encoder.layer.0.attention.output.dense': "
                                         r"24 input channels \(6 per head\) are not a "
                                         r"multiple of M = 4"):
        permute_channels(model, "2:4")


def test_bad_sites():
    model = _mlp()
    wrong = Site([(model[0], "weight", 0)], (model[5], "weight"), "mismatch")
    with pytest.raises(ValueError, match=r"site 'mismatch': Linear.weight is not a tensor with 32 "
                                         r"entries along dim 0"):
        permute_channels(model, sites=[wrong])
    model[3].register_buffer("weight_mask", torch.ones_like(model[3].weight, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"site '3': Linear.weight already has a sparsity mask"):
        permute_channels(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model[5].weight]["factored"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"site '5': optimizer state 'factored' of Linear.weight "
                                         r"has shape \(8,\), not the parameter's \(8, 32\)"):
        permute_channels(model, sites=find_sites(model)[1:], optimizer=optimizer)
