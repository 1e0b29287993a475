"""The engine without Lightning: enforcement, optimizer state, hooks, state, export."""

import pytest
import torch
from conftest import assert_masks_hold
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine, make_permanent


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gmp_loop_keeps_zeros_and_state(name):
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.75, schedule="gmp",
                                                  start=2, end=12, frequency=2))
    engine.start(20)
    optimizer = OPTIMIZERS[name](model.parameters())
    engine.attach(optimizer)
    for step in range(20):
        updated = engine.on_step_start(step)
        x = torch.randn(8, 16)
        model(x).square().mean().backward()
        engine.mask_gradients()
        optimizer.step()
        optimizer.zero_grad()
        assert_masks_hold(engine, [optimizer])
        if updated:
            expected = engine.schedule.fraction(step) * 0.75
            for layer in engine.layers:
                kept = int(layer.mask.sum())
                assert kept == layer.weight.numel() - int(expected * layer.weight.numel() + 0.5)
    assert engine.last_update == 12
    assert engine.sparsity == pytest.approx(0.75, abs=1e-3)


def test_mask_update_zeroes_state_that_training_filled():
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine.attach(optimizer)
    for _ in range(3):  # dense steps fill exp_avg everywhere
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state[model[0].weight]
    assert state["exp_avg"].ne(0).all()
    engine.update_masks(1.0)
    assert_masks_hold(engine, [optimizer])
    assert (model[0].weight_mask.reshape(32, -1, 4).sum(-1) == 2).all()


def test_skipped_amp_step_changes_nothing():
    """GradScaler skips optimizer.step on inf gradients: the post-step hook never runs."""
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.attach(optimizer)
    engine.on_step_start(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 16)).sum() * float("inf")).backward()
    scaler.unscale_(optimizer)
    engine.mask_gradients(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert calls == []
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_only_the_optimizers_own_layers_are_touched():
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(1)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    engine.attach(first)
    engine.attach(second)
    assert [layer.plan.name for layer in engine._layers_of(first)] == ["0"]
    assert [layer.plan.name for layer in engine._layers_of(second)] == ["2"]
    engine.detach()
    assert engine._attached == {}


def test_state_dict_round_trip_and_mask_mismatch():
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(5)
    engine.on_step_start(0)
    saved = model.state_dict()
    other = mlp()
    SparsityEngine(other, SparsityConfig("2:4"))
    other.load_state_dict(saved)
    assert torch.equal(other[0].weight_mask, model[0].weight_mask)

    bad = dict(saved)
    bad["0.weight_mask"] = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"checkpoint mask '0.weight_mask' .* does not fit"):
        other.load_state_dict(bad)
    dense = {k: v for k, v in saved.items() if not k.endswith("_mask")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"0.weight_mask\""):
        other.load_state_dict(dense)
    other.load_state_dict(dense, strict=False)  # explicit partial loads stay possible


def test_make_permanent_folds_and_removes_masks():
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5))
    engine.start(1)
    engine.on_step_start(0)
    x = torch.randn(4, 16)
    expected = model(x)
    make_permanent(model)
    assert not any(name.endswith("_mask") for name in model.state_dict())
    assert torch.equal(model(x), expected)
    assert (model[0].weight == 0).float().mean() == 0.5
    plain = mlp()
    plain.load_state_dict(model.state_dict())  # a plain model takes the exported weights


def test_existing_foreign_mask_is_rejected():
    model = mlp()
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"layer '0' already has a 'weight_mask' \(torch.float32"):
        SparsityEngine(model, SparsityConfig("2:4"))


def test_compile_sees_no_hooks():
    model = mlp()
    SparsityEngine(model, SparsityConfig("2:4"))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
