"""Peer cases for distributions and schedules, checked against references written here:

- ERK against RigL's own algorithm (Evci et al. 2020, ``sparse_utils.get_sparsities`` with
  ``erk_power_scale=1``: density proportional to ``sum(shape) / prod(shape)``, the layer of
  the largest raw density made dense while eps would push it past 1, eps solved again);
- ERK and global through ``SparsityEngine.prune()``: the masks' kept counts meet the budget
  (ERK within one weight per layer, as docs/dynamic.md says; global exactly), and global's
  masks are one threshold over all layers (torch.nn.utils.prune.global_unstructured's rule);
- GMP (Zhu & Gupta 2017: s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n dt))^3, s_i = 0) at every
  step of a run, boundaries included, as pieces and as the masks the engine holds, with a
  span the frequency does not divide (the last update at ``end``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peer_references import rigl_erk, zhu_gupta
from torch import nn

from sparse_training import GMP, SparsityConfig, SparsityEngine
from sparse_training.pieces.distributions import ERK

SHAPES = st.lists(st.one_of(
    st.tuples(st.integers(1, 300), st.integers(1, 300)),
    st.tuples(st.integers(1, 64), st.integers(1, 64), st.integers(1, 5), st.integers(1, 5))),
    min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(shapes=SHAPES, sparsity=st.floats(0.0, 0.999))
def test_erk_matches_rigl(shapes, sparsity):
    ours = ERK()(shapes, sparsity)
    assert ours == pytest.approx(rigl_erk(shapes, sparsity), abs=1e-9)
    assert all(0.0 <= s < 1.0 + 1e-12 for s in ours)
    kept = sum((1 - s) * math.prod(shape) for s, shape in zip(ours, shapes, strict=True))
    assert kept == pytest.approx((1 - sparsity) * sum(math.prod(s) for s in shapes), rel=1e-9)


def test_erk_keeps_small_layers_denser_and_clamps_at_dense():
    shapes = [(300, 784), (100, 300), (10, 100)]
    targets = ERK()(shapes, 0.5)
    assert targets[2] == 0.0 and targets[1] == 0.0  # clamped: dense
    assert targets[0] == pytest.approx(1 - (0.5 * 266200 - 31000) / 235200)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 20, 3), nn.ReLU(), nn.Conv2d(20, 30, 3), nn.Flatten(),
                         nn.Linear(120, 50), nn.ReLU(), nn.Linear(50, 10), nn.Linear(10, 7))


def _masks(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.weight.detach(), m.weight_mask) for m in model.modules()
            if hasattr(m, "weight_mask")]


@pytest.mark.parametrize("sparsity", [0.5, 0.77, 0.9, 0.95, 0.99])
def test_erk_engine_masks_meet_the_budget_within_one_weight_per_layer(sparsity):
    model = _model()
    SparsityEngine(model, SparsityConfig(pattern="unstructured", sparsity=sparsity,
                                         distribution="erk")).prune()
    pairs = _masks(model)
    assert len(pairs) == 5
    shapes = [tuple(w.shape) for w, _ in pairs]
    total = sum(w.numel() for w, _ in pairs)
    kept = sum(int(m.sum()) for _, m in pairs)
    assert abs(kept - (1 - sparsity) * total) <= len(pairs)
    for (w, m), target in zip(pairs, rigl_erk(shapes, sparsity), strict=True):
        assert abs(int(m.sum()) - (1 - target) * w.numel()) <= 0.5 + 1e-9


@pytest.mark.parametrize("sparsity", [0.5, 0.77, 0.9, 0.99])
def test_global_engine_masks_are_one_threshold_with_the_exact_total(sparsity):
    model = _model()
    SparsityEngine(model, SparsityConfig(pattern="unstructured", sparsity=sparsity,
                                         distribution="global")).prune()
    pairs = _masks(model)
    flat = torch.cat([w.abs().reshape(-1).double() for w, _ in pairs])
    kept = flat.numel() - math.floor(sparsity * flat.numel() + 0.5)
    assert sum(int(m.sum()) for _, m in pairs) == kept
    threshold = flat.sort(descending=True).values[kept - 1]
    for w, m in pairs:
        assert torch.equal(m, w.abs().double() >= threshold)


@pytest.mark.parametrize(("start", "end", "frequency"), [(0, 10, 1), (0, 100, 10), (3, 13, 4),
                                                         (5, 6, 1), (0, 7, 100)])
def test_gmp_fraction_and_updates_at_every_step(start, end, frequency):
    gmp = GMP(start=start, end=end, frequency=frequency)
    updates = gmp.updates()
    assert updates[0] == start and updates[-1] == end
    assert updates == sorted(set(range(start, end, frequency)) | {end})
    for t in range(end + 5):
        assert gmp.fraction(t) == pytest.approx(zhu_gupta(t, 1.0, start, end), abs=1e-12)
        latest = gmp.latest_update_step(t)
        assert latest == (None if t < start else max(u for u in updates if u <= t))


def test_gmp_resolves_fractions_of_the_run():
    gmp = GMP(start=0.1, end=0.6, frequency=5).resolve(total_steps=200)
    assert (gmp.start, gmp.end) == (20, 120)
    assert gmp.fraction(70) == pytest.approx(1 - 0.5 ** 3)


def test_gmp_engine_masks_follow_the_cubic_at_each_update():
    """The masks held at step t are the ones of its latest update, s_f * ramp(p), counted
    as round-half-up over each tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 8))
    engine = SparsityEngine(model, SparsityConfig(
        pattern="unstructured", sparsity=0.9, schedule="gmp", start=3, end=13, frequency=4))
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    engine.start(20)
    updates = [3, 7, 11, 13]
    for t in range(20):
        engine.on_step_start(t)
        due = max((u for u in updates if u <= t), default=None)
        s_t = 0.0 if due is None else zhu_gupta(due, 0.9, 3, 13)
        for layer in (model[0], model[2]):
            n = layer.weight.numel()
            pruned = int((~layer.weight_mask).sum()) if hasattr(layer, "weight_mask") else 0
            assert pruned == math.floor(s_t * n + 0.5), (t, s_t)


@pytest.mark.parametrize(("start", "end"), [(5, 5), (6, 5), (0.5, 0.5)])
def test_gmp_start_not_before_end_is_refused(start, end):
    with pytest.raises(ValueError, match=rf"start must come before end, got start={start!r}"):
        GMP(start=start, end=end)
