"""The engine without Lightning: enforcement, optimizer state, hooks, state, export."""

import pytest
import torch
from conftest import assert_masks_hold, assert_reported_is_pruned
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
    "lbfgs-like noise": lambda p: NoisySGD(p, lr=1e-2),
}


class NoisySGD(torch.optim.SGD):
    """An optimizer that moves every weight, zeros included: the re-mask must catch it."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn_like(p), alpha=1e-3)
        return loss


def zhu_gupta_sparsity(t: int, s_f: float, t0: int, n: int, dt: int, s_i: float = 0.0) -> float:
    """Gradual magnitude pruning's target at step t (Zhu & Gupta 2017, "To prune, or not to
    prune", eq. 1): s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n dt))^3, updated at t0, t0 + dt,
    ..., t0 + n dt and held in between; s_i before t0, s_f after t0 + n dt."""
    if t < t0:
        return s_i
    t = t0 + min(n, (t - t0) // dt) * dt  # the last update at or before t
    return s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gmp_loop_keeps_zeros_and_state(name):
    """At every step each tensor prunes the cubic's share of its weights (rounded to a whole
    weight), and pruned weights and optimizer state stay zero under every optimizer."""
    torch.manual_seed(0)
    model = mlp()
    s_f, t0, n, dt = 0.8, 3, 4, 3
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=s_f, schedule="gmp",
                                                  start=t0, end=t0 + n * dt, frequency=dt))
    engine.start(20)
    optimizer = OPTIMIZERS[name](model.parameters())
    engine.attach(optimizer)
    for step in range(20):
        engine.on_step_start(step)
        model(torch.randn(8, 16)).square().mean().backward()
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        assert_masks_hold(engine, [optimizer])
        assert_reported_is_pruned(engine)
        target = zhu_gupta_sparsity(step, s_f, t0, n, dt)
        for slot in engine.slots:
            pruned = int((~slot.mask).sum())
            assert abs(pruned - target * slot.param.numel()) <= 0.5, (step, slot.name)
    assert engine.updater.last_update == t0 + n * dt
    assert engine.sparsity == pytest.approx(s_f, abs=1e-3)


def test_mask_update_zeroes_state_that_training_filled():
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4", start=3))
    engine.start(10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine.attach(optimizer)
    for step in range(3):  # dense steps fill exp_avg everywhere
        assert not engine.on_step_start(step)
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state[model[0].weight]
    assert state["exp_avg"].ne(0).all()
    assert engine.on_step_start(3)
    assert_masks_hold(engine, [optimizer])
    assert (model[0].weight_mask.reshape(32, -1, 4).sum(-1) == 2).all()


def test_reported_sparsity_is_the_pruned_share_not_the_zero_fraction():
    """A layer initialized to zero: the masks prune 80% of it, its forward weights are all
    zero, and the reported sparsity is the share pruned (its kept zeros count as kept)."""
    model = mlp()
    nn.init.zeros_(model[2].weight)
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.8))
    engine.prune()
    assert engine.tensor_sparsity["2.weight"] == pytest.approx(0.8, abs=0.01)
    assert not model[2].weight.any()
    assert engine.sparsity == pytest.approx(0.8, abs=1e-3)
    assert_reported_is_pruned(engine)


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
    engine.before_optimizer_step(optimizer, 0)
    scaler.step(optimizer)
    scaler.update()
    assert calls == []
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_only_the_optimizers_own_tensors_are_touched():
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(1)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    engine.attach(first)
    engine.attach(second)
    assert [slot.name for slot in engine.slots_of(first)] == ["0.weight"]
    assert [slot.name for slot in engine.slots_of(second)] == ["2.weight"]
    engine.detach()
    assert engine._attached == {}


def test_state_dict_round_trip_and_plain_model_state():
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(5)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.on_step_start(0)
    assert set(model.state_dict()) == set(mlp().state_dict())  # masks stay out of it
    saved, weights = engine.state_dict(), model.state_dict()
    engine.detach()
    other = mlp()
    other.load_state_dict(weights)  # strict: the sparse weights load into a plain model
    restored = SparsityEngine(other, SparsityConfig("2:4"), state=saved)
    assert torch.equal(other[0].weight_mask, model[0].weight_mask)
    assert restored.updater.last_update == 0


def test_a_state_that_does_not_fit_changes_nothing():
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(5)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.on_step_start(0)
    saved = engine.state_dict()
    saved["masks"]["2.weight"]["shape"] = [3, 3]
    engine.detach()
    other = mlp()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"mask '2.weight' has shape \[3, 3\], the tensor"):
        SparsityEngine(other, SparsityConfig("2:4"), state=saved)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in other.named_buffers())


def test_make_permanent_folds_and_removes_masks():
    torch.manual_seed(0)
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5))
    engine.start(1)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.on_step_start(0)
    x = torch.randn(4, 16)
    expected = model(x)
    with pytest.raises(RuntimeError, match="make_permanent would swap modules of a Sequential "
                                           "that a SparsityEngine is training"):
        make_permanent(model)  # mid-training: the optimizer hooks read the masks
    assert model[0].weight_mask.dtype == torch.bool
    engine.detach()
    make_permanent(model)
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    assert not engine.installed
    assert torch.equal(model(x), expected)
    assert (model[0].weight == 0).float().mean() == 0.5


def test_torch_prune_old_weight_norm_and_foreign_mask_attributes_are_refused():
    model = mlp()
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"'0.weight_orig' .* torch.nn.utils.prune"):
        SparsityEngine(model, SparsityConfig("2:4"))
    old_style = mlp()
    torch.nn.utils.weight_norm(old_style[0])  # weight_g, weight_v; weight set by a pre-hook
    before = {k: v.clone() for k, v in old_style.state_dict().items()}
    with pytest.raises(ValueError, match=r"'0.weight_g' \(Linear\) belongs to the old-style "
                       r"torch.nn.utils.weight_norm of layer '0': .* call torch.nn.utils."
                       r"remove_weight_norm on the layer first"):
        SparsityEngine(old_style, SparsityConfig("unstructured", sparsity=0.5))
    assert not any(name.endswith("_mask") for name, _ in old_style.named_buffers())
    assert all(torch.equal(v, before[k]) for k, v in old_style.state_dict().items())
    other = mlp()
    other[2].register_buffer("weight_mask", torch.ones(3))
    with pytest.raises(ValueError, match=r"'weight_mask' \(torch.float32, \(3,\)\) is not a bool"):
        SparsityEngine(other, SparsityConfig("2:4"))


def test_two_engines_on_one_tensor_are_refused_until_detached():
    model = mlp()
    first = SparsityEngine(model, SparsityConfig("2:4", allow=[r"^0\."]))
    second = SparsityEngine(model, SparsityConfig("2:4", allow=[r"^2\."]))  # disjoint: fine
    with pytest.raises(ValueError, match=r"'0.weight' .* already masked by another"):
        SparsityEngine(model, SparsityConfig("1:4", allow=[r"^0\."]))
    first.detach()
    SparsityEngine(model, SparsityConfig("2:4", allow=[r"^0\."]))
    second.detach()



def test_an_engine_attached_again_after_detach_holds_its_tensors_again():
    """detach() gives the tensors up so another engine may take them; attaching the engine
    again (the training loop goes on with it) must take them back: a second engine on them
    is refused while it trains, and an engine whose tensors another engine took meanwhile
    is refused at attach, before any hook, instead of two engines masking one tensor each
    by its own masks."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = SparsityEngine(model, SparsityConfig("2:4", allow=[r"^0\."]))
    first.attach(optimizer)
    first.detach()
    first.attach(optimizer)
    with pytest.raises(ValueError, match=r"'0.weight' .* already masked by another"):
        SparsityEngine(model, SparsityConfig("1:4", allow=[r"^0\."]))
    first.detach()
    second = SparsityEngine(model, SparsityConfig("1:4", allow=[r"^0\."]))
    with pytest.raises(ValueError, match=r"'0.weight' .* already masked by another"):
        first.attach(optimizer)
    assert first.attached_optimizers == [] and not optimizer._optimizer_step_pre_hooks
    second.detach()
    first.attach(optimizer)  # free again
    assert first.attached_optimizers == [optimizer]

def test_meta_weights_are_refused():
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(ValueError, match="on the meta device: materialize the model"):
        SparsityEngine(model, SparsityConfig("2:4"))
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    assert all(slot.mask.all() for slot in engine.slots)  # real masks, not leftover bytes


def test_compile_sees_no_hooks():
    model = mlp()
    SparsityEngine(model, SparsityConfig("2:4"))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
