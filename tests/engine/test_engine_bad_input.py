"""SparsityEngine misused without Lightning: stepped before start() or without an attached
optimizer, models swapped while it trains, a bad prune fraction or state, wrong types. Each
is a clear error naming the value and the fix, raised before any weight or mask changes."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import refused_while_training
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine, densify, make_permanent, sparsify


def small_engine(model: nn.Module | None = None):
    model = model or nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(10)
    return model, engine, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _attached(engine, optimizer):
    engine.attach(optimizer)


def _attached_then_detached(engine, optimizer):
    engine.attach(optimizer)
    engine.detach()


def _sparsified(model):
    sparsify(model, {r"^2$": {"pattern": "block:16x16", "density": 0.5}}, verbose=False)
    return model


NO_ATTACH = r"no optimizer is attached to this SparsityEngine: call engine.attach\(optimizer\)"
ENGINE_STEPS = [  # (model, preparation, misuse, message): a RuntimeError, nothing changed
    (None, None, lambda m, e, o: e.on_step_start(0),
     NO_ATTACH + r" before the training loop .*; for masks without training, engine.prune\(\)$"),
    (None, _attached_then_detached, lambda m, e, o: e.on_step_start(0), NO_ATTACH),
    (None, _attached, lambda m, e, o: e.before_optimizer_step(
        torch.optim.AdamW(m.parameters()), 0),
     r"before_optimizer_step got a AdamW that is not attached to this SparsityEngine: call "
     r"engine.attach\(optimizer\) once before training"),
    (None, lambda e, o: make_permanent(e.model), lambda m, e, o: e.attach(o),
     r"masks or compressed layers are no longer in its model \(make_permanent, densify\): "
     r"build a new SparsityEngine"),
    (None, _attached, lambda m, e, o: make_permanent(m),
     refused_while_training("make_permanent", "Sequential")
     + r"trainer.fit returns .* or after engine.detach\(\)"),
    (None, _attached, lambda m, e, o: make_permanent(nn.ModuleList([m])),
     refused_while_training("make_permanent", "Sequential")),
    (None, _attached, lambda m, e, o: sparsify(m, {r"^0$": {"pattern": "2:4"}}),
     refused_while_training("sparsify", "Sequential")),
    (_sparsified, _attached, lambda m, e, o: densify(m),
     refused_while_training("densify", "Sequential")),
]


@pytest.mark.parametrize(("model", "prepare", "misuse", "message"), ENGINE_STEPS,
                         ids=[f"{i}-{m[:24]}" for i, (*_, m) in enumerate(ENGINE_STEPS)])
def test_engine_misuse_without_lightning_raises_before_any_change(model, prepare, misuse,
                                                                  message):
    model = None if model is None else model(nn.Sequential(nn.Linear(16, 8), nn.ReLU(),
                                                           nn.Linear(8, 32)))
    model, engine, optimizer = small_engine(model)
    if prepare is not None:
        prepare(engine, optimizer)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(RuntimeError, match=message):
        misuse(model, engine, optimizer)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert buffers.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(buffers[k], b) for k, b in model.named_buffers())



@pytest.mark.parametrize("fraction", [1.5, -1, "1", True, float("nan")])
def test_prune_refuses_fractions_outside_0_1_before_any_mask_changes(fraction):
    model, engine, _ = small_engine(nn.Sequential(nn.Linear(16, 8), nn.ReLU(),
                                                  nn.Linear(8, 32)))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(ValueError, match=r"prune\(fraction\) takes the share of each tensor's "
                                         r"final sparsity to reach, a number in \[0, 1\] .*got "
                                         + re.escape(repr(fraction))):
        engine.prune(fraction)
    assert all(torch.equal(buffers[n], b) for n, b in model.named_buffers())
    engine.prune(0.5)  # a valid fraction still prunes half the target
    assert engine.sparsity == pytest.approx(engine.final_sparsity / 2, abs=0.01)


def test_an_engine_before_start_or_with_a_bad_state_is_refused():
    model = nn.Sequential(nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig("2:4", schedule="gmp", end=0.5))
    with pytest.raises(RuntimeError, match=r"call SparsityEngine.start\(total_steps\) before"):
        engine.on_step_start(0)
    with pytest.raises(ValueError, match="not a sparse_training engine state of format 1"):
        engine.load_state_dict({"masks": {}})
    with pytest.raises(ValueError, match="is a fraction of training, but the training length"):
        engine.start(None)


WRONG_TYPES = [  # (call, error, message): wrong types given to the engine
    (lambda: SparsityEngine("x", SparsityConfig("2:4")), TypeError,
     r"SparsityEngine\(model, config\) takes a torch.nn.Module and a SparsityConfig .*got str "
     r"and SparsityConfig"),
    (lambda: SparsityEngine(nn.Linear(8, 8), {"pattern": "2:4"}), TypeError,
     r"got Linear and dict"),
    (lambda: small_engine()[1].start("10"), ValueError,
     r"start\(total_steps\) takes the run's optimizer steps, an int >= 0, or None .*got '10'"),
    (lambda: small_engine()[1].start(-5), ValueError, r"start\(total_steps\) .* got -5"),
]


@pytest.mark.parametrize(("call", "error", "message"), WRONG_TYPES,
                         ids=[m[:30] for *_, m in WRONG_TYPES])
def test_wrong_types_given_to_the_engine_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_an_empty_weight_is_listed_as_empty_not_selected():
    """A zero-size Linear (a config with 0 features) has nothing to prune: the table says so,
    and the other weights train sparse."""
    model = nn.Sequential(nn.Linear(0, 8), nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig(pattern="unstructured", sparsity=0.5))
    decisions = {plan.name: (plan.selected, plan.reason) for plan in engine.plans}
    assert decisions["0.weight"] == (False, "empty: no entries to prune")
    assert decisions["1.weight"][0] and [s.name for s in engine.slots] == ["1.weight"]
    engine.prune()
    assert (model[1].weight == 0).sum() == 32


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    assert (len(ENGINE_STEPS), len(WRONG_TYPES)) == (8, 4)
