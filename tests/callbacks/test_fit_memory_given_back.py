"""A finished fit gives its GPU memory back though the callback keeps its engine (for
inspection, and for a later fit that continues it): Lightning moves the model and the
optimizers to the CPU when the fit ends, and the tensors the engine keeps beside the model
go with them: a training score's statistics (the movement score's are the weights' size,
the second-order score's 32 times it) and SR-STE's dense weights. Left on the GPU, a sweep
that keeps its trainers or callbacks held them fit after fit, and a model evaluated or
pruned on the CPU after the fit met statistics on another device."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
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


def trained_engine(model: torch.nn.Module, settings: dict) -> SparsityEngine:
    """An engine of ``settings`` on ``model`` after 3 steps of an 8-step plain loop."""
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
    return engine


@pytest.mark.parametrize("name", list(SETTINGS))
def test_engine_to_moves_what_it_keeps_beside_the_model(name):
    model = TinyNet()
    engine = trained_engine(model, SETTINGS[name])
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
    engine = trained_engine(model, SETTINGS[name])
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
    engine = trained_engine(model, SETTINGS["movement"] | {"score": name})
    statistics = engine.updater.statistics
    assert statistics.tensors, "no statistics: the test proves nothing"
    model.to("meta")
    carried = statistics.carried(engine.masked)
    assert carried and all(t.is_meta for ts in carried.values() for t in ts)
    assert all(t.is_meta for stats in statistics.tensors.values() for t in stats.values())


class StatisticsDevices(pl.Callback):
    """The devices of the statistics an engine holds at each training batch's end."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.devices = sparse, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.devices.append({t.device.type for t in kept_beside(self.sparse.engine)})


def continued_fit(name: str, accelerator: str) -> tuple[SparsityCallback, StatisticsDevices]:
    """One epoch of ``name``'s gradual schedule, then the same Trainer fit again for a
    second epoch: the callback and the probe of the second fit."""
    sparse = SparsityCallback(**SETTINGS[name])
    model = TinyNet()
    trainer = make_trainer([sparse], max_epochs=1, accelerator=accelerator,
                           deterministic=False)
    trainer.fit(model, make_loader())
    assert kept_beside(sparse.engine), "nothing kept at the fit's end: the test proves nothing"
    assert {t.device.type for t in kept_beside(sparse.engine)} == {"cpu"}
    probe = StatisticsDevices(sparse)
    trainer.callbacks.append(probe)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, make_loader())
    return sparse, probe


def test_a_later_fit_starts_its_statistics_again():
    """A new fit is a new run of the schedule: the statistics the last fit left (on the
    CPU) are dropped and observed again from the fit's first step."""
    sparse, probe = continued_fit("movement", "cpu")
    assert len(probe.devices) == 8  # the second epoch's batches
    assert set(sparse.engine.updater.statistics.counts.values()) == {8}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["movement", "second-order", "sr-ste"])
def test_a_continued_gpu_fit_takes_them_back_to_the_gpu(name):
    """A GPU fit's end leaves the statistics (SR-STE's dense weights) on the CPU with the
    model; the same Trainer's next fit trains on the GPU with its statistics there, through
    its mask updates, without a device mismatch."""
    _, probe = continued_fit(name, "gpu")
    assert probe.devices and all(d == {"cuda"} for d in probe.devices if d)
