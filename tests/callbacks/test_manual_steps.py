"""The schedule's step under manual optimization: a training batch, whatever number of
optimizers steps in it, the unit fractions of training are resolved in; automatic runs
(with accumulation too) keep counting optimizer steps."""

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet, TwoOptimizerNet, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.loggers import Logger

from sparse_training import SparsityCallback


class ManualNet(TinyNet):
    """Manual optimization with one optimizer, stepped once per batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()
        optimizer.zero_grad()


class Batches(Callback):
    """After the SparsityCallback's hook: each batch's number in the fit and whether the
    weights it trains on are pruned; each regrowth's batch (``counting`` the callback)."""

    def __init__(self, counting=None):
        self.batch, self.pruned, self.regrown, self.counting = -1, [], [], counting

    def on_train_start(self, trainer, pl_module):
        if self.counting is None:
            return
        updater = self.counting.engine.updater
        inner = updater.regrow

        def counted(engine, slots, step, kept=None):
            self.regrown += [(self.batch, slot.name) for slot in slots]
            inner(engine, slots, step, kept)

        updater.regrow = counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch += 1
        self.pruned.append(bool((pl_module.net[0].weight == 0).any()))

    def first_pruned(self):
        return self.pruned.index(True)


RUNS = {  # model and Trainer settings: 16 batches (128 samples of 16, 2 epochs)
    "manual, two optimizers": (TwoOptimizerNet, {}),
    "manual, one optimizer": (ManualNet, {}),
    "automatic": (TinyNet, {}),
    "automatic, accumulating 2": (TinyNet, {"accumulate_grad_batches": 2}),
}


@pytest.mark.parametrize("run", RUNS)
def test_start_fraction_prunes_at_the_batch_it_names(run):
    net, trainer_settings = RUNS[run]
    sparse = SparsityCallback("2:4", start=0.5)
    batches = Batches()
    trainer = make_trainer([sparse, batches], max_epochs=2, **trainer_settings)
    trainer.fit(net(), make_loader())
    assert batches.batch == 15
    assert batches.first_pruned() == 8  # half of the 16 batches trained dense


def test_two_optimizers_regrow_until_the_fraction_of_batches():
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="constant", regrow="rigl",
                              frequency=3)  # regrow_end 0.75 of 16 batches: batch 12
    batches = Batches(counting=sparse)
    make_trainer([sparse, batches], max_epochs=2).fit(TwoOptimizerNet(), make_loader())
    assert sparse.engine.updater.regrowth.end == 12
    for name in ("net.0.weight", "net.2.weight", "net.4.weight"):  # each once per period
        assert [b for b, n in batches.regrown if n == name] == [0, 3, 6, 9]


def test_max_steps_of_two_optimizers_counts_both_steps_of_a_batch(lightning_log):
    """max_steps=16 stops two optimizers after 8 batches: fractions are of those 8."""
    sparse = SparsityCallback("2:4", start=0.5)
    batches = Batches()
    trainer = make_trainer([sparse, batches], max_epochs=-1, max_steps=16)
    trainer.fit(TwoOptimizerNet(), make_loader(n=512))
    assert batches.batch == 7 and trainer.global_step == 16
    assert batches.first_pruned() == 4
    assert sparse.engine.updater.resolved_for == 8
    assert "mask updates at steps 4 (one update)" in lightning_log.text


class Resumable(Callback):
    """Records the schedule's last update at each batch start."""

    def __init__(self, sparse):
        self.sparse, self.updates = sparse, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.updates.append(self.sparse.engine.updater.last_update)


def gmp():
    return dict(pattern="unstructured", sparsity=0.8, schedule="gmp", start=0.125, end=0.75,
                frequency=1)  # updates at every batch from 2 to 12 of 16


def test_two_optimizers_resume_mid_epoch_at_the_next_batch(tmp_path):
    """A checkpoint saved at the end of batch 4 (global step 10): the resumed fit's first
    batch is batch 5 of the schedule, and the end-of-epoch resume is bit exact."""
    pl.seed_everything(0)
    straight = TwoOptimizerNet()
    sparse = SparsityCallback(**gmp())
    seen = Resumable(sparse)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    at_epoch_end = ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1)
    make_trainer([sparse, seen, checkpoints, at_epoch_end], max_epochs=2,
                 enable_checkpointing=True).fit(straight, make_loader())
    assert seen.updates == [None, None, *range(2, 13), 12, 12, 12]

    sparse = SparsityCallback(**gmp())
    resumed = Resumable(sparse)
    make_trainer([sparse, resumed], max_epochs=2).fit(
        TwoOptimizerNet(), make_loader(), ckpt_path=tmp_path / "epoch=0-step=10.ckpt")
    assert resumed.updates[0] == 5

    model = TwoOptimizerNet()
    sparse = SparsityCallback(**gmp())
    resumed = Resumable(sparse)
    make_trainer([sparse, resumed], max_epochs=2).fit(
        model, make_loader(), ckpt_path=tmp_path / "epochs" / "epoch=0-step=16.ckpt")
    assert resumed.updates == seen.updates[8:]
    for (name, a), (_, b) in zip(straight.state_dict().items(), model.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


class EveryOtherBatch(ManualNet):
    """Manual optimization whose optimizer steps at even batches only (accumulating two)."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(TinyNet.training_step(self, batch, batch_idx))
        if batch_idx % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()


class Written(Logger):
    """The steps at which the loggers were given ``sparsity/global``."""

    def __init__(self):
        super().__init__()
        self.steps = []

    name, version = "written", 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if "sparsity/global" in metrics:
            self.steps.append(step)


def test_sparsity_is_logged_at_every_step_the_loggers_write():
    """log_every_n_steps=4 writes at the ends of batches 4, 8, 12 and 16 (steps 3, 7, 11,
    15), whatever ``global_step`` says (an optimizer
    stepping every other batch leaves it at half the batches); epoch ends too."""
    written = Written()
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", end=12,
                              frequency=1)
    make_trainer([sparse], logger=written, log_every_n_steps=4).fit(EveryOtherBatch(),
                                                                   make_loader())
    assert sorted(set(written.steps)) == [3, 7, 11, 15]
    assert written.steps.count(3) == 1 and written.steps.count(7) == 2  # batch, epoch end
