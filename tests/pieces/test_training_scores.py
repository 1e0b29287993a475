"""Training scores against float64 references written out here, sharing no code with the
pieces: movement accumulated by hand, Adam on the soft-movement scores by hand, and the
optimal brain surgeon's saliency and update from the empirical Fisher inverted directly."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_training.pieces.score_registry import parse_training_score, score_setting
from sparse_training.pieces.second_order import SecondOrderScore, fisher_block
from sparse_training.pieces.training_scores import (
    MovementScore,
    SoftMovementScore,
    TrainingScore,
)


def steps(shape, count, seed=0, dtype=torch.float64):
    """``count`` (weight, gradient) pairs of fresh random values."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator, dtype=dtype),
             torch.randn(shape, generator=generator, dtype=dtype)) for _ in range(count)]


def observed(score: TrainingScore, pairs, like=None):
    statistics = score.statistics(pairs[0][0] if like is None else like)
    for count, (weight, gradient) in enumerate(pairs, 1):
        score.observe(statistics, weight, gradient, count)
    return statistics


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 2, 2), (11,)])
def test_movement_is_minus_the_sum_of_weight_times_gradient(shape):
    pairs = steps(shape, 6)
    statistics = observed(MovementScore(), pairs)
    expected = torch.zeros(shape, dtype=torch.float64)
    for weight, gradient in pairs:
        for index in range(expected.numel()):
            expected.view(-1)[index] -= weight.reshape(-1)[index] * gradient.reshape(-1)[index]
    ranks = MovementScore()(statistics, pairs[-1][0], len(pairs))
    assert ranks.dtype == torch.float64 and ranks.shape == shape
    torch.testing.assert_close(ranks, expected, rtol=0, atol=1e-12)


def test_movement_of_float32_weights_sums_in_float32_and_skips_overflowed_steps():
    pairs = steps((4, 6), 3, dtype=torch.float32)
    weight, gradient = pairs[1]
    gradient[0, 0], gradient[1, 1] = float("inf"), float("nan")  # an fp16 step that overflowed
    statistics = observed(MovementScore(), pairs)
    movement = statistics["movement"]
    assert movement.dtype == torch.float32 and torch.isfinite(movement).all()
    expected = -sum(w.double() * g.double() for w, g in (pairs[0], pairs[2]))
    assert float(movement[0, 0]) == pytest.approx(float(expected[0, 0]), rel=1e-5)


def test_soft_movement_is_adam_on_the_straight_through_gradient_plus_its_l1_pull():
    score = SoftMovementScore(lr=0.05, l1=3.0, betas=(0.8, 0.9), eps=1e-6)
    pairs = steps((3, 5), 5, seed=1)
    statistics = observed(score, pairs)
    scores = torch.zeros(3, 5, dtype=torch.float64)
    m = torch.zeros_like(scores)
    v = torch.zeros_like(scores)
    for t, (weight, gradient) in enumerate(pairs, 1):
        sigmoid = 1 / (1 + torch.exp(-scores))
        # d/dS of L + l1 * mean(sigmoid(S)), dL/dS = g * w through the straight-through mask
        grad = gradient * weight + 3.0 * sigmoid * (1 - sigmoid) / 15
        m = 0.8 * m + 0.2 * grad
        v = 0.9 * v + 0.1 * grad * grad
        scores = scores - 0.05 * (m / (1 - 0.8 ** t)) / ((v / (1 - 0.9 ** t)).sqrt() + 1e-6)
    torch.testing.assert_close(score(statistics, pairs[-1][0], 5), scores, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [dict(lr=0.0), dict(betas=(0.9, 1.0)),
                                     dict(lr="1e-2"),  # YAML reads 1e-2 as a string
                                     dict(betas=(0.9,)), dict(betas="0.9"), dict(l1=None),
                                     dict(eps=float("inf")), dict(lr=True)])
def test_soft_movement_options_are_checked(options):
    """Refused at construction, naming the value, not at the first training step."""
    with pytest.raises(ValueError, match=r"SoftMovementScore needs finite numbers lr > 0, "
                                         r"l1 >= 0, eps > 0 and two betas in \[0, 1\), got "
                                         r"SoftMovementScore\("):
        SoftMovementScore(**options)


def inverse_fisher(gradients, damp):
    """The damped empirical Fisher of one block, inverted directly."""
    fisher = sum(torch.outer(g, g) for g in gradients) / len(gradients)
    fisher = fisher + damp * fisher.diagonal().mean() * torch.eye(len(gradients[0]),
                                                                  dtype=torch.float64)
    return torch.linalg.inv(fisher)


@pytest.mark.parametrize("shape, block_size", [((4, 6), 3), ((2, 12), 12), ((3, 10), 4),
                                              ((6,), 3)])
def test_second_order_saliency_is_w2_over_twice_the_inverse_fisher_diagonal(shape, block_size):
    score = SecondOrderScore(block_size=block_size, damp=0.05)
    pairs = steps(shape, 9, seed=2)
    weight = pairs[-1][0]
    statistics = observed(score, [(weight, g) for _, g in pairs])
    rows = shape[0] if len(shape) > 1 else 1
    length = math.prod(shape) // rows
    size = fisher_block(length, block_size)
    expected = torch.empty(rows, length, dtype=torch.float64)
    flat_w = weight.reshape(rows, length)
    for row in range(rows):
        for start in range(0, length, size):
            grads = [g.reshape(rows, length)[row, start:start + size] for _, g in pairs]
            inverse = inverse_fisher(grads, 0.05)
            for q in range(size):
                w = flat_w[row, start + q]
                expected[row, start + q] = w * w / (2 * inverse[q, q])
    torch.testing.assert_close(score(statistics, weight, len(pairs)),
                               expected.reshape(shape), rtol=1e-9, atol=1e-12)


def test_second_order_update_is_the_optimal_brain_surgeon_step_for_the_pruned_set():
    score = SecondOrderScore(block_size=6, damp=0.1)
    pairs = steps((2, 6), 10, seed=3)
    weight = pairs[0][0]
    statistics = observed(score, [(weight, g) for _, g in pairs])
    pruned = torch.zeros(2, 6, dtype=torch.bool)
    pruned[0, [1, 4]] = True  # two in the first row's block, none in the second's
    updated = score.compensate(statistics, weight, pruned, len(pairs))
    inverse = inverse_fisher([g[0] for _, g in pairs], 0.1)
    q = [1, 4]
    # dw = -F^-1 E_Q ([F^-1]_QQ)^-1 w_Q
    step = -inverse[:, q] @ torch.linalg.solve(inverse[q][:, q], weight[0, q])
    torch.testing.assert_close(updated[0], weight[0] + step, rtol=1e-9, atol=1e-12)
    assert (updated[0, q] == 0).all()  # the pruned weights reach zero exactly
    assert torch.equal(updated[1], weight[1])  # a block that prunes nothing stays


def test_second_order_removing_a_weight_costs_its_saliency_on_the_quadratic_model():
    """The OBS update minimises 1/2 dw^T F dw with w_q + dw_q = 0: its cost is rho_q, and
    no other dw with that constraint costs less."""
    score = SecondOrderScore(block_size=5, damp=0.2)
    pairs = steps((1, 5), 8, seed=4)
    weight = pairs[0][0]
    statistics = observed(score, [(weight, g) for _, g in pairs])
    grads = [g[0] for _, g in pairs]
    fisher = torch.linalg.inv(inverse_fisher(grads, 0.2))
    saliency = score(statistics, weight, len(pairs))[0]
    for q in range(5):
        pruned = torch.zeros(1, 5, dtype=torch.bool)
        pruned[0, q] = True
        dw = (score.compensate(statistics, weight, pruned, len(pairs)) - weight)[0]
        cost = 0.5 * dw @ fisher @ dw
        assert float(cost) == pytest.approx(float(saliency[q]), rel=1e-8)
        other = dw.clone()
        other[(q + 1) % 5] += 0.01  # any other step with the same constraint costs more
        assert float(0.5 * other @ fisher @ other) > float(cost)


def test_an_update_from_fewer_gradients_than_a_fisher_block_warns(recwarn):
    """Fewer gradients than a block's entries leave its Fisher rank-deficient (up to the
    damping): the OBS step may cost more than no step, which the user is told."""
    score = SecondOrderScore(block_size=6, damp=0.1)
    pairs = steps((2, 6), 6, seed=3)
    weight = pairs[0][0]
    pruned = torch.zeros(2, 6, dtype=torch.bool)
    pruned[0, 1] = True
    enough = observed(score, [(weight, g) for _, g in pairs])
    score.compensate(enough, weight, pruned, len(pairs))
    assert not [w for w in recwarn if "rank-deficient" in str(w.message)]
    few = observed(score, [(weight, g) for _, g in pairs[:5]])
    with pytest.warns(UserWarning, match=r"from 5 gradients, fewer than the 6 entries of a "
                                         r"Fisher block.*block_size <= 5 or update_weights"):
        score.compensate(few, weight, pruned, 5)


def test_second_order_keeps_its_fisher_blocks_inside_rows():
    assert [fisher_block(n, 32) for n in (384, 1536, 30, 7, 1)] == [32, 32, 30, 7, 1]
    statistics = SecondOrderScore(block_size=50).statistics(torch.zeros(8, 768))
    assert statistics["fisher"].shape == (8, 16, 48, 48)  # 48 divides 768; 50 does not


def test_second_order_without_gradients_and_bad_options_are_refused():
    score = SecondOrderScore()
    with pytest.raises(ValueError, match="at least one observed gradient"):
        score(score.statistics(torch.zeros(2, 4)), torch.zeros(2, 4), 0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        SecondOrderScore(block_size=0)
    with pytest.raises(ValueError, match="damp must be a finite number > 0"):
        SecondOrderScore(damp=float("nan"))
    # a YAML string "false" is truthy: it would have updated the weights
    with pytest.raises(ValueError, match="update_weights must be True or False, got 'false'"):
        SecondOrderScore(update_weights="false")
    with pytest.raises(ValueError, match="joint must be True or False, got 1"):
        SecondOrderScore(joint=1)


def test_a_block_without_gradient_is_damped_by_the_tensors_mean_fisher():
    """A dead neuron's row gets no gradient: its Fisher block is zero, and its damping
    falls back to the tensor's mean diagonal (saliency w^2 damp mean / 2), not to 0."""
    score = SecondOrderScore(block_size=4, damp=0.5)
    weight = torch.randn(2, 4, dtype=torch.float64)
    gradient = torch.zeros(2, 4, dtype=torch.float64)
    gradient[1] = torch.tensor([1.0, 2.0, 0.0, 3.0])
    statistics = score.statistics(weight)
    score.observe(statistics, weight, gradient, 1)
    mean = float((gradient[1] ** 2).mean())
    torch.testing.assert_close(score(statistics, weight, 1)[0],
                               weight[0] ** 2 * 0.5 * mean / 2, rtol=1e-12, atol=0)
    pruned = torch.ones(2, 4, dtype=torch.bool)
    assert (score.compensate(statistics, weight, pruned, 1) == 0).all()
    empty = score.statistics(weight)
    score.observe(empty, weight, torch.zeros(2, 4, dtype=torch.float64), 1)
    torch.testing.assert_close(score(empty, weight, 1), weight ** 2 * 0.5 / 2)


def test_joint_second_order_sums_to_the_cost_of_removing_whole_fisher_blocks():
    score = SecondOrderScore(block_size=4, damp=0.3, joint=True)
    pairs = steps((3, 8), 7, seed=5)
    weight = pairs[0][0]
    statistics = observed(score, [(weight, g) for _, g in pairs])
    ranks = score(statistics, weight, len(pairs))
    for row in range(3):
        for start in (0, 4):
            grads = [g[row, start:start + 4] for _, g in pairs]
            fisher = torch.linalg.inv(inverse_fisher(grads, 0.3))
            w = weight[row, start:start + 4]
            cost = 0.5 * w @ fisher @ w
            assert float(ranks[row, start:start + 4].sum()) == pytest.approx(float(cost),
                                                                              rel=1e-9)


@pytest.mark.parametrize("setting, expected", [
    ("movement", MovementScore()), ("soft-movement", SoftMovementScore()),
    ("second-order", SecondOrderScore()), ("magnitude", None), ("random", None),
    ({"name": "second-order", "block_size": 50, "damp": 1e-3},
     SecondOrderScore(block_size=50, damp=1e-3)),
    ({"name": "soft-movement", "betas": [0.5, 0.6]}, SoftMovementScore(betas=(0.5, 0.6))),
    (SecondOrderScore(damp=0.5), SecondOrderScore(damp=0.5)),
])
def test_score_settings_parse_and_print_back(setting, expected):
    assert parse_training_score(setting) == expected
    if expected is not None:
        assert parse_training_score(score_setting(expected)) == expected
        assert score_setting(expected) == (expected.name if expected == type(expected)()
                                           else score_setting(expected))


@pytest.mark.parametrize("setting, message", [
    ({"block_size": 4}, "needs 'name' from 'movement', 'soft-movement', 'second-order'"),
    ({"name": "second-order", "blocks": 4}, r"takes the options \['block_size', 'damp', "
                                            r"'update_weights', 'joint'\], got \['blocks'\]"),
    ({"name": "second-order", "damp": -1}, "damp must be a finite number > 0"),
])
def test_bad_score_mappings_name_what_is_wrong(setting, message):
    with pytest.raises(ValueError, match=message):
        parse_training_score(setting)
