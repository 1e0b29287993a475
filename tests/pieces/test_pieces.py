"""The typed pieces: every schedule, score, distribution and regrowth rule answers its kind's
one signature (stated in its module docstring), checked against closed forms."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

from sparse_training import SparsityConfig
from sparse_training.engine.dynamic import DropAndGrow, SparseRefinedSTE, make_updater
from sparse_training.engine.updaters import ScheduledMasks
from sparse_training.pieces import distributions, regrowth, schedules, scores
from sparse_training.pieces.distributions import DISTRIBUTIONS, ERK, Global, Uniform
from sparse_training.pieces.regrowth import Regrowth, SparseRefinement
from sparse_training.pieces.schedules import (
    GMP,
    SCHEDULES,
    Constant,
    Gradual,
    Linear,
    OneShot,
    parse_schedule,
)
from sparse_training.pieces.scores import (
    DenseWeight,
    GradientScore,
    MagnitudeScore,
    RandomScore,
)


@pytest.mark.parametrize("module, signature", [
    (schedules, "schedule.fraction(step) -> float"),
    (scores, "score(tensor: Scored, step: int, stream: int) -> Tensor | None"),
    (distributions, "distribution(shapes, sparsity) -> list[float | None]"),
    (regrowth, "regrowth.fraction(step) -> float"),
])
def test_each_kind_states_its_one_signature(module, signature):
    assert signature in module.__doc__


@pytest.mark.parametrize("cls", [OneShot, Constant, GMP, Linear])
def test_every_schedule_has_the_same_methods(cls):
    for method in ("fraction", "latest_update_step", "resolve", "updates", "as_list"):
        assert list(inspect.signature(getattr(cls, method)).parameters)[0] == "self"
    assert SCHEDULES[cls.name] is cls


@pytest.mark.parametrize("cls, ramp", [(GMP, lambda p: 1 - (1 - p) ** 3), (Linear, lambda p: p)])
def test_gradual_schedules_follow_their_formula(cls, ramp):
    start, end, frequency = 7, 61, 9  # odd steps
    schedule = cls(start=start, end=end, frequency=frequency)
    for step in range(0, 80):
        if step < start:
            expected, latest = 0.0, None
        elif step >= end:
            expected, latest = 1.0, end
        else:
            expected = ramp((step - start) / (end - start))
            latest = start + (step - start) // frequency * frequency
        assert schedule.fraction(step) == pytest.approx(expected, abs=1e-12)
        assert schedule.latest_update_step(step) == latest
    assert schedule.updates() == [7, 16, 25, 34, 43, 52, 61]


@pytest.mark.parametrize("cls", [OneShot, Constant])
def test_single_update_schedules_hold_from_start(cls):
    schedule = cls(start=0.25).resolve(total_steps=40)
    assert (schedule.start, schedule.end, schedule.updates()) == (10, None, [10])
    assert [schedule.fraction(s) for s in (9, 10, 39)] == [0.0, 1.0, 1.0]
    assert [schedule.latest_update_step(s) for s in (9, 10, 39)] == [None, 10, 10]


@pytest.mark.parametrize("schedule", [OneShot(3), Constant(0, 5), GMP(2, 4, 30),
                                      Linear(0.1, 1, 0.9)])
def test_a_schedule_round_trips_through_its_checkpoint_list(schedule):
    assert parse_schedule(*schedule.as_list()) == schedule


def test_update_steps_count_the_updates_in_words_for_one():
    assert GMP(0, 1, 5).update_steps(1) == "0 (one update)"  # fast_dev_run's one step
    assert GMP(0, 1, 5).update_steps(3) == "0, 1, 2 (3 updates)"
    assert OneShot(4).update_steps(10) == "4 (one update)"


def test_parse_schedule_names_the_bad_value_and_the_valid_forms():
    with pytest.raises(ValueError, match="unknown schedule 'cubic'; valid: oneshot, gmp, "
                                         "linear, constant"):
        parse_schedule("cubic")
    # (schedules that other tests and the docs' examples register follow the built-in ones)
    with pytest.raises(ValueError, match=r"end applies to gradual schedules \(gmp, linear"
                                         r"[^)]*\), not to 'constant'; got end=5"):
        parse_schedule("constant", end=5)
    assert isinstance(parse_schedule("gmp", end=5), Gradual)


def test_scores_share_one_signature_and_draw_by_seed_step_and_stream():
    weight = torch.randn(6, 10)
    gradient = torch.randn(6, 10)

    class Slot:  # what a score reads of a sparse tensor
        dense_shape, device, dense_gradient = weight.shape, weight.device, gradient

    for score in (MagnitudeScore(), RandomScore(3), GradientScore()):
        assert list(inspect.signature(score).parameters) == ["tensor", "step", "stream"]
    assert MagnitudeScore()(Slot(), 4, 1) is None
    assert GradientScore()(Slot(), 4, 1) is gradient
    draw = RandomScore(3)(Slot(), 4, 1)
    assert draw.shape == weight.shape and torch.equal(draw, RandomScore(3)(Slot(), 4, 1))
    for other in (RandomScore(4)(Slot(), 4, 1), RandomScore(3)(Slot(), 5, 1),
                  RandomScore(3)(Slot(), 4, 2)):
        assert not torch.equal(draw, other)
    assert torch.equal(RandomScore(3)(DenseWeight(weight), 4, 1), draw)
    assert DenseWeight(weight).dense_gradient is None


@pytest.mark.parametrize("distribution", [Uniform(), ERK(), Global()])
def test_distributions_share_one_signature(distribution):
    shapes = [(30, 17), (11, 30), (5, 11, 3, 3)]
    targets = distribution(shapes, 0.8)
    assert len(targets) == len(shapes) and DISTRIBUTIONS[distribution.name] == distribution
    if isinstance(distribution, Global):
        assert targets == [None] * 3  # one threshold at every update, no fixed value
        return
    kept = sum((1 - t) * math.prod(s) for t, s in zip(targets, shapes, strict=True))
    assert kept == pytest.approx(0.2 * sum(math.prod(s) for s in shapes))
    assert (len(set(targets)) == 1) == isinstance(distribution, Uniform)


def test_erk_follows_its_closed_form():
    """density_l = eps (sum of shape_l) / (prod of shape_l), eps solved for the total."""
    shapes = [(40, 23), (23, 40), (7, 40)]
    targets = ERK()(shapes, 0.7)
    raw = [sum(s) / math.prod(s) for s in shapes]
    eps = 0.3 * sum(math.prod(s) for s in shapes) / sum(
        r * math.prod(s) for r, s in zip(raw, shapes, strict=True))
    assert targets == pytest.approx([1 - eps * r for r in raw])


def test_regrowth_decays_by_its_cosine_and_rigl_is_set_with_another_score():
    rule = Regrowth("set", RandomScore(0), alpha=0.4, end=0.5).resolve(total_steps=90)
    assert rule.end == 45
    for step in (0, 13, 44, 45, 80):
        expected = 0.2 * (1 + math.cos(math.pi * step / 45)) if step < 45 else 0.0
        assert rule.fraction(step) == pytest.approx(expected)
    rigl, set_ = (SparsityConfig("unstructured", sparsity=0.5, regrow=r, seed=7).parsed_regrowth
                  for r in ("rigl", "set"))
    assert type(rigl) is type(set_) and (rigl.alpha, rigl.end) == (set_.alpha, set_.end)
    assert (rigl.grow, set_.grow) == (GradientScore(), RandomScore(7))


def test_sparse_refinement_adds_its_decay_where_pruned():
    grad, dense = torch.randn(8, 12, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
    mask = torch.rand(8, 12) < 0.5
    expected = [[g + (0.0 if m else 0.01 * w) for g, w, m in zip(gr, wr, mr, strict=True)]
                for gr, wr, mr in zip(grad.tolist(), dense.tolist(), mask.tolist(), strict=True)]
    SparseRefinement(0.01)(grad, dense, mask)
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("settings, length_free", [
    (dict(pattern="unstructured", sparsity=0.5, regrow="rigl"), False),  # regrow_end 0.75
    (dict(pattern="unstructured", sparsity=0.5, schedule="gmp", end=0.8), False),
    (dict(pattern="unstructured", sparsity=0.5, schedule="gmp", end=80), True),
    (dict(pattern="unstructured", sparsity=0.5, regrow="rigl", regrow_end=60), True),
])
def test_a_restored_schedule_resolved_for_another_run_length_warns(settings, length_free):
    """A schedule with fractions resolved for 100 steps, restored into a run of 200: its
    steps stay, with a warning naming both lengths; in steps, or the same length, none."""
    config = SparsityConfig(**settings)

    def updater():
        return make_updater(config.parsed_schedule, config.parsed_score,
                            config.parsed_regrowth, config.parsed_refinement)

    first = updater()
    first.start(100)
    saved = first.state_dict()
    for total, warns in ((100, False), (200, not length_free)):
        resumed = updater()
        resumed.load_state_dict(saved)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.start(total)
        messages = [str(w.message) for w in caught]
        assert bool(messages) == warns, messages
        if warns:
            assert messages[0].startswith("the schedule resumed (or continued) keeps its "
                                          "steps, resolved for a run of 100 optimizer steps; "
                                          "this run has 200")
        assert resumed.schedule == first.schedule
    legacy = updater()  # a state saved before resolved_for was kept: the length is unknown
    legacy.load_state_dict({k: v for k, v in saved.items() if k != "resolved_for"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        legacy.start(200)
    assert legacy.state_dict()["resolved_for"] == -1  # not taken for 200


@pytest.mark.parametrize("settings, updater", [
    (dict(pattern="2:4"), ScheduledMasks),
    (dict(pattern="unstructured", sparsity=0.5, regrow="rigl"), DropAndGrow),
    (dict(pattern="unstructured", sparsity=0.5, regrow="set"), DropAndGrow),
    (dict(pattern="2:4", regrow="sr-ste", sr_ste_decay=0.1), SparseRefinedSTE),
])
def test_the_config_parses_strings_once_and_the_updater_takes_pieces(settings, updater):
    config = SparsityConfig(**settings)
    built = make_updater(config.parsed_schedule, config.parsed_score, config.parsed_regrowth,
                         config.parsed_refinement)
    assert type(built) is updater
    assert not any(isinstance(v, SparsityConfig) for v in vars(built).values())
    if updater is SparseRefinedSTE:
        assert built.refinement == SparseRefinement(0.1) and config.parsed_regrowth is None
