"""Shared helpers: small models and data made on the fly (never zeros)."""

from __future__ import annotations

import os

# Triton kernels run in its interpreter on CPU; Lightning imports triton, so set it first.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyNet(pl.LightningModule):
    """A small MLP (or conv net) classifier with a configurable optimizer."""

    def __init__(self, optimizer: str = "adamw", conv: bool = False, lr: float = 1e-2) -> None:
        super().__init__()
        self.optimizer_name, self.lr = optimizer, lr
        if conv:
            self.net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
        else:
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                     nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TwoOptimizerNet(TinyNet):
    """Manual optimization with two optimizers (Adam for the first block, SGD for the rest):
    ``global_step`` grows once per ``opt.step()``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self(x), y))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.net[:2].parameters(), lr=1e-2),
                torch.optim.SGD(self.net[2:].parameters(), lr=1e-2, momentum=0.9))


def assert_masks_hold(engine, optimizers) -> None:
    """Pruned weights, and every weight-shaped optimizer-state tensor there, are exactly 0."""
    for layer in engine.layers:
        assert not layer.weight[~layer.mask].any()
        for optimizer in optimizers:
            for value in optimizer.state.get(layer.weight, {}).values():
                if torch.is_tensor(value) and value.shape == layer.weight.shape:
                    assert not value[~layer.mask].any()


def make_loader(n: int = 128, conv: bool = False, batch_size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 4, 4, generator=g) if conv else torch.randn(n, 16, generator=g)
    y = torch.randint(0, 4 if not conv else 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def make_trainer(callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(max_epochs=2, enable_checkpointing=False, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                    deterministic=True)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


@pytest.fixture(autouse=True)
def _seed():
    pl.seed_everything(0, verbose=False)
