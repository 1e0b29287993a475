"""Per-step cost of SparsityCallback versus the same dense training step.

    python benchmarks/callback_overhead.py [--device cuda] [--out benchmarks/results]

One run, one table: the median time of one full Lightning training step (forward,
backward, optimizer) for a small MLP and a small conv net, dense and with the callback
(2:4 and unstructured 90%, through the fused Triton step and through the hook path), after
the masks exist (the per-step path: no mask update in the timed window), and the first
step, which computes the masks. Writes JSON with the device name and
torch version. Steps are timed with a synchronizing host clock around each batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from _common import at_least, cpu_name, file_tag, write_json
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import SparsityCallback


class StepTimer(Callback):
    """Wall time of every training batch, synchronized with the device."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self.began = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        self.times.append(time.perf_counter() - self.began)


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


MODELS = {
    "mlp 1024x4 (4.2M weights)": (lambda: nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16)), (1024,)),
    "convnet 3x64ch (0.1M weights)": (lambda: nn.Sequential(
        nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 16)), (16, 32, 32)),
}
VARIANTS = {  # fused="auto" takes the Triton step on CUDA; fused=False the hook path
    "dense": None,
    "2:4, fused": dict(pattern="2:4", start=0),
    "2:4, hooks": dict(pattern="2:4", start=0, fused=False),
    "unstructured 90%, fused": dict(pattern="unstructured", sparsity=0.9, start=0),
    "unstructured 90%, hooks": dict(pattern="unstructured", sparsity=0.9, start=0, fused=False),
}


def time_steps(model_name: str, variant: str, device: str, steps: int) -> dict:
    factory, input_shape = MODELS[model_name]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 64, *input_shape, generator=g),
                         torch.randint(0, 16, (steps * 64,), generator=g))
    timer = StepTimer()
    callbacks = [timer]
    if VARIANTS[variant] is not None:
        callbacks.insert(0, SparsityCallback(**VARIANTS[variant]))
    trainer = pl.Trainer(max_steps=steps, accelerator=device, devices=1, logger=False,
                         callbacks=callbacks, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(factory()), DataLoader(data, batch_size=64))
    steady = timer.times[10:]  # drop warm-up and the step that computes the masks
    return {"model": model_name, "variant": variant, "median_ms": 1e3 * statistics.median(steady),
            "first_step_ms": 1e3 * timer.times[0], "steps": len(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=at_least(1), default=200)
    parser.add_argument("--out", type=Path, help="default: $OUT, else benchmarks/results")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    rows = [time_steps(m, v, args.device, args.steps) for m in MODELS for v in VARIANTS]
    lines = [f"Callback overhead per training step on {device_name}, torch {torch.__version__}",
             "", "| model | variant | median step (ms) | vs dense | first step (ms) |",
             "|---|---|---|---|---|"]
    for row in rows:
        dense = next(r for r in rows if r["model"] == row["model"] and r["variant"] == "dense")
        row["ratio_vs_dense"] = row["median_ms"] / dense["median_ms"]
        lines.append(f"| {row['model']} | {row['variant']} | {row['median_ms']:.3f} | "
                     f"{row['ratio_vs_dense']:.3f}x | {row['first_step_ms']:.1f} |")
    table = "\n".join(lines)
    print(table)
    print("wrote", write_json(f"callback_overhead_{file_tag(device_name)}.json",
                              {"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                               "table": table}, out=args.out, device=args.device))


if __name__ == "__main__":
    main()
