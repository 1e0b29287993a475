"""An end-to-end user run checked against references written here: a conv net trained with
``SparsityCallback(unstructured, ERK, GMP)`` through a Lightning Trainer holds, at the start
of every step, per layer exactly ``round_half_up(s_l * n_l)`` pruned weights, where s_l is
RigL's ERK target of the layer (Evci et al. 2020) times Zhu & Gupta's cubic at the latest
update step; the pruned weights are zero after every optimizer step, and N:M runs
(ASP's recipe: prune once, fine-tune) keep 2 of every 4 input channels at every step."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet
from peer_references import rigl_erk, zhu_gupta
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import SparsityCallback


class Recorder(Callback):
    """Pruned counts per masked layer at each step start (after the sparsity callback's
    update, which comes first), and whether pruned weights are zero after each step."""

    def __init__(self) -> None:
        self.pruned: list[list[int]] = []
        self.zeros_hold = True

    def _layers(self, module):
        return [m for m in module.net if hasattr(m, "weight_mask")]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pruned.append([int((~m.weight_mask).sum()) for m in self._layers(pl_module)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for m in self._layers(pl_module):
            self.zeros_hold &= not m.weight[~m.weight_mask].any()


def _fit(callback: SparsityCallback, steps: int) -> tuple[TinyNet, Recorder]:
    torch.manual_seed(0)
    net, recorder = TinyNet(conv=True), Recorder()
    data = TensorDataset(torch.randn(64, 4, 4, 4), torch.randint(0, 3, (64,)))
    pl.Trainer(max_steps=steps, callbacks=[callback, recorder], logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, accelerator="cpu").fit(
        net, DataLoader(data, batch_size=8))
    return net, recorder


def test_erk_gmp_run_holds_the_reference_counts_at_every_step():
    callback = SparsityCallback("unstructured", sparsity=0.9, distribution="erk",
                                schedule="gmp", start=0, end=8, frequency=2)
    net, recorder = _fit(callback, 12)
    layers = [m for m in net.net if hasattr(m, "weight_mask")]
    shapes = [tuple(m.weight.shape) for m in layers]
    targets = rigl_erk(shapes, 0.9)
    updates = [0, 2, 4, 6, 8]
    assert len(recorder.pruned) == 12 and recorder.zeros_hold
    for t, counts in enumerate(recorder.pruned):
        ramp = zhu_gupta(max(u for u in updates if u <= t), 1.0, 0, 8)
        expected = [math.floor(s * ramp * math.prod(shape) + 0.5)
                    for s, shape in zip(targets, shapes, strict=True)]
        assert counts == expected, t


@pytest.mark.parametrize("pattern", ["2:4", "2:4:2d"])
def test_oneshot_nm_run_keeps_two_of_every_four_input_channels(pattern):
    net, recorder = _fit(SparsityCallback(pattern), 6)
    assert recorder.zeros_hold
    for m in net.net:
        if not hasattr(m, "weight_mask"):
            continue
        mask = m.weight_mask
        by_input = mask.movedim(1, -1).reshape(-1, mask.shape[1] // 4, 4)  # taps x out rows
        assert (by_input.sum(-1) == 2).all()
        if pattern.endswith("2d") and mask.dim() == 4:  # each tap's transpose is 2:4 too
            by_output = mask.permute(2, 3, 1, 0).reshape(-1, mask.shape[0] // 4, 4)
            assert (by_output.sum(-1) == 2).all()
