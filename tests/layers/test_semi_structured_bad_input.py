"""Bad input to SemiStructuredLinear (2:4): shapes, dtypes, masks, inputs and state dicts.
Each is a clear error naming the value and the valid forms, raised before the layer changes,
or is handled as docs/semi_structured.md says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import second_derivative
from torch import nn

from sparse_training.layers.semi_structured import SemiStructuredLinear

S = SemiStructuredLinear  # short, for the tables
V = ValueError


def _rows_only_mask():
    return torch.tensor([True, True, False, False]).repeat(8, 4)  # 2:4 rows, 4:4 columns


def _run_autocast(layer, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return layer(x)


SEMI_ERRORS = [  # (call, error, message)
    (lambda: S(18, 8), V, r"in_features must be a positive multiple of 4 \(2:4 "
                                  r"groups\), got 18"),
    (lambda: S(16, 0), V, "out_features must be a positive multiple of 4 .*got 0"),
    (lambda: S(16.0, 8), V, "in_features must be a positive multiple .*got 16.0"),
    (lambda: S(True, 8), V, "in_features must be a positive multiple .*got True"),
    (lambda: S(16, 8, transposable="yes"), V,
     "transposable must be True or False, got 'yes'"),
    (lambda: S(16, 8, dtype=torch.int32), V,
     "dtype must be a floating-point torch.dtype .*got torch.int32"),
    (lambda: S(16, 8, mask=torch.ones(8, 16)), V,
     r"SemiStructuredLinear\(16->8, 2:4\): mask must be a bool tensor of the weight's shape "
     r"\(8, 16\), got torch.float32 \(8, 16\)"),
    (lambda: S(16, 8, mask=torch.ones(16, 8, dtype=torch.bool)), V,
     r"shape \(8, 16\), got torch.bool \(16, 8\)"),
    (lambda: S(16, 8, mask=[[True] * 16] * 8), V, r"shape \(8, 16\), got list"),
    (lambda: S(16, 8, mask=torch.ones(8, 16, dtype=torch.bool)), V,
     r"mask is not 2:4 along each row: row 0, entries 0:4 keep 4 \(2 of every 4 must be "
     r"kept; pattern_mask\(weight, '2:4'\) makes one\)"),
    (lambda: S(16, 8, transposable=True, mask=_rows_only_mask()), V,
     r"\(16->8, 2:4:2d\): mask is not 2:4 along each column: column 0, entries 0:4 keep 4"),
    (lambda: S.from_dense(nn.Conv1d(16, 8, 1)), V,
     "from_dense takes an nn.Linear, got Conv1d; for HF GPT-2's Conv1D"),
    (lambda: S.from_dense(nn.Linear(10, 8)), V,
     "in_features must be a positive multiple of 4 .*got 10"),
    (lambda: S.from_dense(nn.Linear(16, 8), transposable=1), V,
     "transposable must be True or False, got 1"),
    (lambda: S.from_dense(nn.Linear(16, 8), mask=torch.ones(8, 16, dtype=torch.bool)),
     V, "row 0, entries 0:4 keep 4"),
    (lambda: S(16, 8)(torch.randn(5, 17)), V,
     r"\(16->8, 2:4\): the input's last dimension must be in_features = 16, got \(5, 17\)"),
    (lambda: S(16, 8)(torch.tensor(1.0)), V, r"in_features = 16, got \(\)"),
    (lambda: S(16, 8)("x"), V, "in_features = 16, got str"),
    (lambda: S(16, 8).path_problem(torch.randn(4, 12)), V,
     r"in_features = 16, got \(4, 12\)"),
    (lambda: S(16, 8)(torch.randn(5, 16, dtype=torch.float64)), V,
     r"input dtype torch.float64 is not the weight's torch.float32; cast the input "
     r"\(x.to\(torch.float32\)\) or the layer, or run under torch.autocast"),
    (lambda: S(16, 8)(torch.randint(0, 3, (5, 16))), V,
     "input dtype torch.int64 is not the weight's torch.float32"),
    (lambda: S(16, 8, dtype=torch.bfloat16)(torch.randn(5, 16)), V,
     "input dtype torch.float32 is not the weight's torch.bfloat16"),
    (lambda: _run_autocast(S(16, 8), torch.randn(5, 16, dtype=torch.float64)), V,
     "input dtype torch.float64: autocast casts only torch.float32, torch.bfloat16, "
     "torch.float16; cast the input"),
]


@pytest.mark.parametrize(("call", "error", "message"), SEMI_ERRORS,
                         ids=[f"{i}-{m[:28]}" for i, (_, _, m) in enumerate(SEMI_ERRORS)])
def test_semi_structured_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _legacy(layer, **changes):
    return {**layer.state_dict(), "mask": layer.mask.clone(), "weight": torch.randn(8, 16),
            **changes}


def _not_2_4(layer):
    mask = layer.mask.clone()
    mask[5, 8:12] = torch.tensor([True, True, True, False])
    return mask


def _set_timing(layer, value):
    layer.timing = value


SEMI_UNCHANGED = [  # (change to a SemiStructuredLinear(16, 8), message): refused, no change
    (lambda m: _set_timing(m, "graph"), r"timing must be one of \('eager', 'cuda_graph'\), "
                                        r"got 'graph'"),
    (lambda m: _set_timing(m, None), r"timing must be one of .*got None"),
    (lambda m: m.set_mask(torch.ones(8, 16, dtype=torch.bool)), "row 0, entries 0:4 keep 4"),
    (lambda m: m.set_mask(m.mask.float()), "must be a bool tensor .*got torch.float32"),
    (lambda m: m.set_mask(m.mask.T), r"got torch.bool \(16, 8\)"),
    (lambda m: m.load_state_dict(_legacy(m, mask=_not_2_4(m))), r"SemiStructuredLinear\(16->8, "
     r"2:4\), state dict key 'mask': mask is not 2:4 along each row: row 5, entries 8:12 keep 3"),
    (lambda m: m.load_state_dict(_legacy(m, mask=m.mask.float())),
     r"state dict key 'mask': mask must be a bool tensor of the weight's shape \(8, 16\), "
     r"got torch.float32"),
    (lambda m: m.load_state_dict(_legacy(m, mask=m.mask[:, :12])),
     r"state dict key 'mask': .*got torch.bool \(8, 12\)"),
    (lambda m: m.load_state_dict({"weight": torch.randn(8, 12), "bias": torch.randn(8)}),
     r"state dict key 'weight': shape \(8, 12\) is not the layer's \(8, 16\); load a state "
     r"dict saved from a layer of this shape"),
    (lambda m: m.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(4)}),
     r"state dict key 'bias': shape \(4,\) is not the layer's \(8,\)"),
    (lambda m: nn.Sequential(m).load_state_dict({"0.weight": torch.randn(8, 16),
                                                 "0.mask": torch.zeros(8, 16, dtype=bool)}),
     r"state dict key '0.mask': mask is not 2:4 along each row: row 0, entries 0:4 keep 0"),
]


@pytest.mark.parametrize(("change", "message"), SEMI_UNCHANGED,
                         ids=[f"{i}-{m[:28]}" for i, (_, m) in enumerate(SEMI_UNCHANGED)])
def test_semi_structured_refusals_change_nothing(change, message):
    layer = SemiStructuredLinear(16, 8)
    before = {**{k: v.clone() for k, v in layer.state_dict().items()},
              "mask": layer.mask.clone()}
    with pytest.raises(ValueError, match=message):
        change(layer)
    after = {**layer.state_dict(), "mask": layer.mask}
    assert all(torch.equal(before[k], after[k]) for k in before) and layer.timing == "eager"


def _envelope(monkeypatch, out_features, in_features, tokens, dtype=torch.bfloat16):
    """The reason a bf16 call takes cuBLAS, with cuSPARSELt pretended present, and the
    call's output (cuBLAS: any measuring or packing would fail on the CPU)."""
    from sparse_training.layers import semi_structured

    monkeypatch.setattr(semi_structured, "cusparselt_problem", lambda device: None)
    layer = semi_structured.SemiStructuredLinear(in_features, out_features, dtype=dtype)
    x = torch.randn(tokens, in_features, dtype=dtype)
    y = layer(x)
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight, layer.bias))
    return layer.path_problem(x)


def _legacy_mask_wins():
    layer = SemiStructuredLinear(16, 8)
    other = SemiStructuredLinear(16, 8)
    state = {"weight": torch.randn(8, 16), "bias": torch.randn(8), "mask": other.mask}
    layer.load_state_dict(state)
    return (torch.equal(layer.mask, other.mask)
            and torch.equal(layer.weight, state["weight"] * other.mask))


def _nan_is_pruned():
    layer = SemiStructuredLinear(16, 8)
    weight = torch.randn(8, 16)
    weight[2, 5] = float("nan")
    layer.load_state_dict({"weight": weight, "bias": torch.randn(8)})
    return not layer.mask[2, 5] and bool(layer.weight.isfinite().all())


def _linear_like(x):
    """A strided input gives ``F.linear``'s output (up to float32 summation order)."""
    layer = SemiStructuredLinear(16, 8)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-6, atol=1e-6)
    return True


SEMI_HANDLED = [  # (check given monkeypatch, expected): handled as docs/semi_structured.md says
    (lambda mp: _envelope(mp, 1024, 1024, 1000), "1000 tokens, under 1024 (SPARSE_MIN_TOKENS"),
    (lambda mp: _envelope(mp, 1024, 1024, 1028), "1028 tokens are not a multiple of 8"),
    (lambda mp: _envelope(mp, 1024, 512, 1024), "in_features 512 under 1024"),
    (lambda mp: _envelope(mp, 1040, 1028, 1024), "in_features 1028 not a multiple of 16"),
    (lambda mp: _envelope(mp, 16, 16, 1024, torch.float32),
     "torch.float32: the sparse route takes bf16 (cuSPARSELt's search failed on fp16"),
    (lambda mp: _envelope(mp, 1024, 1024, 0), "0 tokens, under 1024"),
    (lambda mp: _envelope(mp, 1024, 1024, 2048, torch.float16),
     "torch.float16: the sparse route takes bf16"),
    (lambda mp: SemiStructuredLinear(16, 8)(torch.randn(0, 16)).shape, (0, 8)),
    (lambda mp: SemiStructuredLinear(16, 8)(torch.randn(16)).shape, (8,)),
    (lambda mp: _linear_like(torch.randn(16, 3, 5).permute(1, 2, 0)), True),
    (lambda mp: SemiStructuredLinear(np.int64(16), np.int64(8)).in_features, 16),
    (lambda mp: _legacy_mask_wins(), True),
    (lambda mp: _nan_is_pruned(), True),
]


@pytest.mark.parametrize(("check", "expected"), SEMI_HANDLED,
                         ids=[f"{i}-{str(e)[:28]}" for i, (_, e) in enumerate(SEMI_HANDLED)])
def test_semi_structured_handled_inputs(monkeypatch, check, expected):
    result = check(monkeypatch)
    assert (expected in result if isinstance(expected, str) else result == expected), result


def test_a_gradient_penalty_through_the_layer_is_refused():
    """A second derivative through the layer is refused, not silently zero."""
    with pytest.raises((ValueError, RuntimeError), match=r"second derivatives \(backward with "
                                                         r"create_graph=True, a gradient "
                                                         r"penalty\)"):
        second_derivative(SemiStructuredLinear(32, 16), "weight")


def test_a_2to4_layer_builds_and_runs_on_the_meta_device():
    """Shapes only (deferred initialization, tracing): the mask's groups are not checked
    there, and the forward skips autocast, which meta does not have."""
    layer = SemiStructuredLinear(8, 16, device="meta")
    out = layer(torch.randn(3, 5, 8, device="meta"))
    assert out.shape == (3, 5, 16) and out.is_meta and layer.mask.is_meta


def test_an_input_on_another_device_is_named():
    layer = SemiStructuredLinear(8, 16)
    with pytest.raises(ValueError, match=r"input on meta, the layer's weight on cpu; move one "
                                         r"\(x.to\('cpu'\) or layer.to\('meta'\)\)"):
        layer(torch.randn(3, 8, device="meta"))


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(SEMI_ERRORS), len(SEMI_UNCHANGED), len(SEMI_HANDLED)) == (23, 11, 13)
