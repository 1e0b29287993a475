"""A one-minute tour of SparsityCallback on CPU: dense, 2:4 one-shot and 90% GMP side by side.

    python examples/demo.py            # about a minute on 2 CPU cores

A small MLP learns a synthetic 10-class problem; each run is a plain ``pl.Trainer`` with a
``SparsityCallback``. The table at the end gives the sparsity reached and the accuracy.
"""

from __future__ import annotations

import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import SparsityCallback


class MLP(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def make_data(n: int, seed: int) -> TensorDataset:
    """Points labelled by a fixed random teacher network: learnable, not separable by a line."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 64, generator=g)
    return TensorDataset(x, (torch.tanh(x) @ teacher).argmax(dim=1))


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


RUNS = {  # name -> SparsityCallback kwargs (None: dense baseline)
    "dense": None,
    "2:4 one-shot": dict(pattern="2:4", schedule="oneshot"),
    "unstructured 90% GMP": dict(pattern="unstructured", sparsity=0.9, schedule="gmp",
                                 frequency=20, end=0.6),
    "block:4x4 80% GMP": dict(pattern="block:4x4", sparsity=0.8, schedule="gmp",
                              frequency=20, end=0.6),
}


def main(epochs: int = 8) -> list[tuple[str, float, float, float]]:
    train, test = make_data(8192, seed=0), make_data(2048, seed=1)
    rows = []
    for name, settings in RUNS.items():
        pl.seed_everything(0, verbose=False)
        model = MLP()
        callbacks = [SparsityCallback(**settings)] if settings else []
        trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False,
                             enable_checkpointing=False, enable_model_summary=False,
                             accelerator="cpu")
        began = time.perf_counter()
        trainer.fit(model, DataLoader(train, batch_size=128, shuffle=True))
        seconds = time.perf_counter() - began
        sparsity = callbacks[0].engine.sparsity if callbacks else 0.0
        rows.append((name, sparsity, accuracy(model, test), seconds))
        print(f"finished {name}: sparsity {sparsity:.3f}, accuracy {rows[-1][2]:.4f}")
    print("\n| run | sparsity | test accuracy | seconds |\n|---|---|---|---|")
    for name, sparsity, acc, seconds in rows:
        print(f"| {name} | {sparsity:.3f} | {acc:.4f} | {seconds:.1f} |")
    return rows


if __name__ == "__main__":
    main()
