"""Lightning's weight averaging (EMAWeightAveraging, WeightAveraging,
StochasticWeightAveraging) with SparsityCallback: the averaged model that validation sees,
checkpoints hold and the fit ends with is sparse with the fit's masks (the weights averaged
where the masks keep them), and buffers are averaged with their own, masks or not."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, assert_reported_is_pruned, make_loader, make_trainer
from pytorch_lightning.callbacks import (
    Callback,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from sparse_training import SparsityCallback

GMP = dict(pattern="unstructured", sparsity=0.8, schedule="gmp", end=0.5, frequency=4)
RIGL = dict(pattern="unstructured", sparsity=0.8, schedule="constant", regrow="rigl",
            frequency=3, regrow_end=0.75)
DECAY = 0.9


def masked(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "weight_mask")]


class Checked(TinyNet):
    """Validation runs on the averaged weights (swapped in): they hold the masks."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.validated = 0
        if norm:
            self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 4))

    def validation_step(self, batch, batch_idx):
        for module in masked(self):
            assert not module.weight[~module.weight_mask].any()
        self.validated += 1


class Recorder(Callback):
    """The trained (not averaged) weights, buffers and masks after every step."""

    def __init__(self) -> None:
        self.weights, self.buffers, self.masks = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append([m.weight.detach().clone() for m in masked(pl_module)])
        self.buffers.append([m.running_mean.clone() for m in pl_module.modules()
                             if isinstance(m, nn.BatchNorm1d)])
        self.masks = [m.weight_mask.clone() for m in masked(pl_module)]


def ema(values: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """EMAWeightAveraging's average of ``values`` (one list per step)."""
    average = [v.clone() for v in values[0]]
    for step in values[1:]:
        average = [DECAY * a + (1 - DECAY) * v for a, v in zip(average, step, strict=True)]
    return average


def fit(averaging: Callback, settings: dict, tmp_path, norm: bool = False,
        averaging_first: bool = False):
    model, recorder = Checked(norm), Recorder()
    sparse = SparsityCallback(**settings)
    first = [averaging, sparse] if averaging_first else [sparse, averaging]
    trainer = make_trainer([*first, recorder, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                           max_epochs=4, enable_checkpointing=True)
    trainer.fit(model, make_loader(), val_dataloaders=make_loader(n=32))
    return model, sparse, recorder


@pytest.mark.parametrize("averaging_first", [False, True], ids=["sparse-first", "averaging-first"])
@pytest.mark.parametrize("settings", [GMP, RIGL], ids=["gmp", "rigl"])
@pytest.mark.parametrize("averaging", [
    lambda: EMAWeightAveraging(decay=DECAY), lambda: EMAWeightAveraging(use_buffers=False),
    lambda: WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(DECAY)), WeightAveraging,
    lambda: StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)],
    ids=["ema", "ema-no-buffers", "ema-multi-tensor", "swa", "stochastic"])
def test_the_averaged_model_is_sparse_with_the_fits_masks(averaging, settings, averaging_first,
                                                          tmp_path):
    model, sparse, recorder = fit(averaging(), settings, tmp_path, averaging_first=averaging_first)
    assert model.validated > 0
    for module, mask in zip(masked(model), recorder.masks, strict=True):
        assert torch.equal(module.weight_mask, mask)
    assert sparse.engine.sparsity == pytest.approx(0.8, abs=0.01)
    assert_reported_is_pruned(sparse.engine)  # the summary's figure is the model's
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    for name, module in model.named_modules():
        if hasattr(module, "weight_mask"):
            assert not saved[f"{name}.weight"][~module.weight_mask].any(), name


def test_kept_weights_are_the_exponential_average(tmp_path):
    """Where GMP keeps a weight it was never pruned: the model ends with its plain EMA."""
    model, _, recorder = fit(EMAWeightAveraging(decay=DECAY), GMP, tmp_path)
    expected = ema(recorder.weights)
    for module, mask, average, trained in zip(masked(model), recorder.masks, expected,
                                              recorder.weights[-1], strict=True):
        torch.testing.assert_close(module.weight[mask], average[mask])
        assert not torch.equal(module.weight, trained)  # the average, not the last step


@pytest.mark.parametrize("averaging", [
    lambda: EMAWeightAveraging(decay=DECAY), lambda: EMAWeightAveraging(use_buffers=False),
    WeightAveraging], ids=["ema", "ema-no-buffers", "swa"])
def test_batch_norm_buffers_meet_their_own_average(averaging, tmp_path):
    """The masks, registered after the averaged copy was made, do not shift the buffers
    WeightAveraging pairs by position: BatchNorm's statistics are averaged with theirs."""
    callback = averaging()
    model, sparse, recorder = fit(callback, GMP, tmp_path, norm=True)
    for module, mask in zip(masked(model), recorder.masks, strict=True):
        assert torch.equal(module.weight_mask, mask)
        assert not module.weight[~mask].any()
    assert sparse.engine.sparsity == pytest.approx(0.8, abs=0.01)
    if isinstance(callback, EMAWeightAveraging) and callback._use_buffers:
        means = [m.running_mean for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
        for mean, expected in zip(means, ema(recorder.buffers), strict=True):
            torch.testing.assert_close(mean, expected)


class BuiltInSetup(TinyNet):
    """A head built in the LightningModule's setup, after the callbacks' (the averaged copy
    is made without it)."""

    def setup(self, stage):
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.net(x))


def test_a_copy_made_without_a_selected_tensor_is_refused_before_any_mask():
    model = BuiltInSetup()
    with pytest.raises(ValueError, match="the averaged copy of EMAWeightAveraging has no tensor "
                                         "'head.weight' of shape \\(4, 4\\)"):
        make_trainer([SparsityCallback(pattern="unstructured", sparsity=0.5),
                      EMAWeightAveraging()], max_epochs=1).fit(model, make_loader())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
