"""A finished fit gives its GPU memory back though the callback keeps its engine (for
inspection, and for a later fit that continues it): Lightning moves the model and the
optimizers to the CPU when the fit ends, and the tensors the engine keeps beside the model
go with them: a training score's statistics (the movement score's are the weights' size,
the second-order score's 32 times it) and SR-STE's dense weights. Left on the GPU, a sweep
that keeps its trainers or callbacks held them fit after fit, and a model evaluated or
pruned on the CPU after the fit met statistics on another device."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, make_loader, make_trainer

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine

SETTINGS = {
    "movement": dict(pattern="unstructured", sparsity=0.8, schedule="gmp", frequency=4,
                     score="movement", end=1.0),
    "second-order": dict(pattern="unstructured", sparsity=0.5, schedule="gmp", frequency=4,
                         score={"name": "second-order", "block_size": 4}, end=1.0),
    "sr-ste": dict(pattern="2:4", regrow="sr-ste", schedule="gmp", frequency=4),
}


def kept_beside(engine: SparsityEngine) -> list[torch.Tensor]:
    """The tensors the engine's updater holds that are not the model's."""
    statistics = engine.updater.statistics
    held = [] if statistics is None else [
        t for stats in statistics.tensors.values() for t in stats.values()]
    return held + list(getattr(engine.updater, "dense", {}).values())


@pytest.mark.parametrize("name", list(SETTINGS))
def test_engine_to_moves_what_it_keeps_beside_the_model(name):
    model = TinyNet()
    engine = SparsityEngine(model, SparsityConfig(**SETTINGS[name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.start(8)
    engine.attach(optimizer)
    for step, (x, y) in zip(range(3), make_loader(), strict=False):
        engine.on_step_start(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        engine.on_step_end()
    assert kept_beside(engine), "nothing kept beside the model: the test proves nothing"
    assert engine.to("meta") is engine
    assert all(t.is_meta for t in kept_beside(engine))
    assert not any(p.is_meta for p in model.parameters())  # the model is the caller's to move


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_finished_fit_moves_them_to_the_cpu_with_the_model(name, monkeypatch):
    """On the CPU the move cannot be seen in the tensors: the engine's ``to`` is spied on,
    and must be called at the fit's end with the CPU."""
    calls = []
    real = getattr(SparsityEngine, "to", None)

    def spy(engine, device):
        calls.append((torch.device(device), [t.device for t in kept_beside(engine)]))
        return real(engine, device) if real is not None else engine

    monkeypatch.setattr(SparsityEngine, "to", spy, raising=False)
    sparse = SparsityCallback(**SETTINGS[name])
    make_trainer([sparse], max_steps=6).fit(TinyNet(), make_loader())
    assert calls and calls[-1][0] == torch.device("cpu")
    assert calls[-1][1], "nothing kept beside the model at the fit's end"
    assert all(t.device.type == "cpu" for t in kept_beside(sparse.engine))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_engine_to_takes_a_device_only(name):
    """``engine.to`` moves what the engine keeps beside the model, as ``model.to(device)``
    moves the model; a dtype (``engine.to(torch.float16)``, as a model is cast) is refused
    naming it: Tensor.to took it and cast the statistics and dense weights for good (they
    go back to the weights' device at the next step, never to their dtype), so a training
    score accumulated in half precision from then on."""
    model = TinyNet()
    engine = SparsityEngine(model, SparsityConfig(**SETTINGS[name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.start(8)
    engine.attach(optimizer)
    for step, (x, y) in zip(range(3), make_loader(), strict=False):
        engine.on_step_start(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        engine.on_step_end()
    dtypes = [t.dtype for t in kept_beside(engine)]
    for wrong in (torch.float16, torch.ones(1, dtype=torch.float16)):
        with pytest.raises(TypeError, match=r"SparsityEngine.to\(device\) takes a device"):
            engine.to(wrong)
    assert [t.dtype for t in kept_beside(engine)] == dtypes
    assert engine.to(torch.device("cpu")) is engine and engine.to("cpu") is engine


@pytest.mark.parametrize("name", ["movement", "soft-movement"])
def test_statistics_follow_their_weights_device_when_carried(name):
    """Statistics on another device than their weights (moved by :meth:`SparsityEngine.to`
    at a fit's end, or restored from a checkpoint) go to the weights' device at their next
    use, also where a mask update uses them without ranking them first (a tensor whose
    target is 0: a run-long score's statistics are carried with its mask): they were used
    where they lay, statistics on the CPU against a GPU's weights. Here the weights move to
    ``meta`` (shape-only tensors) after training on the CPU, and the statistics must follow
    them there. (The second-order score's weight update reads them the same way; its
    arithmetic has no meta form to test it so.)"""
    model = TinyNet()
    settings = SETTINGS["movement"] | {"score": name}
    engine = SparsityEngine(model, SparsityConfig(**settings))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.start(8)
    engine.attach(optimizer)
    for step, (x, y) in zip(range(3), make_loader(), strict=False):
        engine.on_step_start(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        engine.on_step_end()
    statistics = engine.updater.statistics
    assert statistics.tensors, "no statistics: the test proves nothing"
    model.to("meta")
    carried = statistics.carried(engine.masked)
    assert carried and all(t.is_meta for ts in carried.values() for t in ts)
    assert all(t.is_meta for stats in statistics.tensors.values() for t in stats.values())
