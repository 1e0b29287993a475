"""A fit that fails before its first training batch leaves the model as it was: no mask
buffer, hook, swapped layer or optimizer hook of SparsityCallback stays behind, whichever
check failed (ours at the start, the engine's start on a resumed state, another callback's,
the sanity check), and a corrected fit of the same model then trains."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, assert_masks_hold, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback, EMAWeightAveraging
from torch import nn

from sparse_training import SparsityCallback

MOVEMENT = dict(pattern="unstructured", sparsity=0.5, schedule="gmp", score="movement",
                frequency=6, end=12)


class FailsAtFitStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        raise RuntimeError("another callback's check")


class FailsInValidation(TinyNet):
    def validation_step(self, batch, batch_idx):
        raise RuntimeError("a bad validation_step")


def snapshot(model: nn.Module) -> dict:
    """What a failed start must not change: state_dict keys, buffers, hooks, parameters and
    module types, by name."""
    return {
        "state_dict": list(model.state_dict()),
        "buffers": [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        "hooks": {n: (list(m._forward_hooks.values()), list(m._forward_pre_hooks.values()),
                      list(m._backward_hooks.values())) for n, m in model.named_modules()},
        "parameters": [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)],
        "modules": [(n, type(m)) for n, m in model.named_modules()],
    }


def fit_movement_checkpoint(path) -> str:
    """A checkpoint of a movement-score fit whose updates come every 6 steps."""
    trainer = make_trainer([SparsityCallback(**MOVEMENT)], max_epochs=2)
    trainer.fit(TinyNet(), make_loader())
    trainer.save_checkpoint(path / "movement.ckpt")
    return str(path / "movement.ckpt")


@pytest.mark.parametrize("case", ["frequency", "resumed frequency", "other callback",
                                  "sanity check", "compressed, sanity check",
                                  "compressed, weight averaging"])
def test_failed_start_leaves_the_model_as_it_was(case, tmp_path):
    model = FailsInValidation() if "sanity" in case else TinyNet()
    compress = dict(pattern="2:4", compress=True)
    callbacks, fit, message = {
        # refused before any change: a training score's updates longer than the run
        "frequency": ([SparsityCallback(**{**MOVEMENT, "frequency": 1000})], {},
                      "frequency=1000 is more than the run's 8 optimizer steps"),
        # a resumed schedule keeps its steps: the engine's start refuses them, masks made
        "resumed frequency": ([SparsityCallback(**MOVEMENT)],
                              dict(ckpt_path=fit_movement_checkpoint(tmp_path)),
                              "frequency=6 is more than the run's 4 optimizer steps"),
        "other callback": ([SparsityCallback(pattern="2:4"), FailsAtFitStart()], {},
                           "another callback's check"),
        "sanity check": ([SparsityCallback(pattern="2:4")],
                         dict(val_dataloaders=make_loader()), "a bad validation_step"),
        "compressed, sanity check": ([SparsityCallback(**compress)],
                                     dict(val_dataloaders=make_loader()),
                                     "a bad validation_step"),
        "compressed, weight averaging": ([SparsityCallback(**compress), EMAWeightAveraging()],
                                         {}, "compress=True trains compressed layers"),
    }[case]
    before = snapshot(model)
    trainer = make_trainer(callbacks, max_epochs=1,
                           **(dict(max_steps=4) if "resumed" in case else {}))
    with pytest.raises((ValueError, RuntimeError), match=message):
        trainer.fit(model, make_loader(), **fit)
    assert snapshot(model) == before
    assert not any(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                   for optimizer in trainer.optimizers)

    model.validation_step = lambda batch, batch_idx: None  # corrected
    sparse = SparsityCallback(pattern="2:4")
    again = make_trainer([sparse], max_epochs=1)
    again.fit(model, make_loader())
    assert sparse.engine.sparsity == pytest.approx(0.5)
    assert_masks_hold(sparse.engine, again.optimizers)


def test_a_failed_later_fit_keeps_the_masks_of_the_earlier_one():
    """Masks the model held before the failed fit (an earlier fit's) are not the start's
    to take back."""
    model = TinyNet()
    make_trainer([SparsityCallback(pattern="2:4")], max_epochs=1).fit(model, make_loader())
    masks = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(RuntimeError, match="another callback's check"):
        make_trainer([SparsityCallback(pattern="2:4"), FailsAtFitStart()],
                     max_epochs=1).fit(model, make_loader())
    assert masks.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(masks[n], b) for n, b in model.named_buffers())


def test_a_failed_later_fit_gives_back_the_schedules_progress():
    """A new Trainer's fit runs the schedule again from its start; failing before its first
    batch, it gives the earlier fit's progress back: the first Trainer then fits on where
    it stopped, as if the failed fit had not run."""
    def fit_on(failed: bool) -> tuple[list, dict]:
        torch.manual_seed(0)
        model = TinyNet()
        sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", end=24,
                                  frequency=2)
        first = make_trainer([sparse], max_epochs=1)
        first.fit(model, make_loader())
        before = sparse.engine.state_dict()["updater"]
        if failed:
            with pytest.raises(RuntimeError, match="another callback's check"):
                make_trainer([sparse, FailsAtFitStart()], max_epochs=1).fit(
                    model, make_loader())
        assert sparse.engine.state_dict()["updater"] == before
        first.fit_loop.max_epochs = 2
        first.fit(model, make_loader())
        return [p.detach() for p in model.parameters()], sparse.engine.state_dict()["updater"]

    (weights, progress), (straight, straight_progress) = fit_on(True), fit_on(False)
    assert progress == straight_progress
    assert all(torch.equal(a, b) for a, b in zip(weights, straight, strict=True))
