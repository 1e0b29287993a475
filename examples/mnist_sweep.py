"""MNIST sparsity sweep: accuracy versus sparsity of LeNet-300-100, per pruning method.

One dense training run (cached in cache_dir and reused), then for every sparsity and every
method one `pl.Trainer` run with a `SparsityCallback`, evaluated on the MNIST test set:

    oneshot            magnitude-prune the trained dense net and evaluate (no training)
    oneshot+finetune   prune once, then fine-tune with the masks fixed (the ASP recipe)
    gmp                gradual magnitude pruning (Zhu & Gupta) while fine-tuning
    rigl               sparse from scratch, ERK layer sparsities, RigL drop and regrow

Run the default sweep (6 x 4 runs, one torch thread: docs/results/mnist.md has its time); list
every key of configs/mnist.yaml with its default; override keys (OmegaConf dot-list) or the
whole YAML file:

    python examples/mnist_sweep.py
    python examples/mnist_sweep.py --help
    python examples/mnist_sweep.py sparsities=[0.9] methods=[gmp] epochs=3 out_dir=outputs/try
    python examples/mnist_sweep.py config=my_sweep.yaml data_dir=/path/to/mnist logger=none

Before each run a progress line ("run 3/24 · gmp @ 0.90 · 2m14s elapsed · ~9m left"), after it
a result line. Left in out_dir: results.csv, results.json, results.md (the table beside the
reference) and accuracy_vs_sparsity.png. W&B gets a run per configuration and a "summary" run
(table and chart), offline under out_dir/wandb without an API key: the sweep ends with the
`wandb sync` command that uploads them. Every key is checked before any training
(examples/sweep_config.py); progress, W&B and files: examples/reporting.py; the tables:
examples/mnist_report.py. Seeds, the data order and the thread count are fixed, so the same
machine and torch build give the same numbers to the last digit.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from mnist_data import MNIST, load_mnist
from mnist_report import accuracy_series, results_markdown
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import TQDMProgressBar
from reporting import (
    Progress,
    cached_training,
    environment,
    finish_logger,
    log_summary_run,
    make_logger,
    plot_vs_sparsity,
    quiet_lightning,
    set_threads,
    setup_wandb,
    sync_hint,
    write_results,
)
from sweep_config import (
    LOGGING_RULES,
    MAPPING,
    ConfigError,
    check_keys,
    integer,
    list_of,
    load_config,
    number,
    positive_number,
    prepare_dirs,
    text,
)
from torch import Tensor, nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine

CONFIG = Path(__file__).resolve().parent / "configs" / "mnist.yaml"
DESCRIPTION = __doc__.split("\n\nRun the default")[0]  # what --help says above the keys

# -----------------------------------------------------------------------------------------------
# Config: sweep_config.load_config reads the YAML and the overrides; this checks what they mean

RULES = {  # what every key of configs/mnist.yaml must be
    "data_dir": text(optional=True),
    "cache_dir": text(),
    "sparsities": list_of(number(0, 1, high_open=True), "[0.9, 0.99]", unique=True),
    "methods": list_of(text(), "[gmp, rigl]", unique=True),
    "train_size": integer(0),
    "test_size": integer(0),
    "batch_size": integer(1),
    "threads": integer(0),
    "seed": integer(0),
    "dense_epochs": integer(1),
    "epochs": integer(1),
    "lr": positive_number(),
    "warmup": number(0, 1, low_open=True, high_open=True),  # OneCycleLR's pct_start
    "momentum": number(0, 1, low_open=True, high_open=True),  # Nesterov needs some
    "weight_decay": number(0, 1),
    "method_specs": MAPPING,
    **LOGGING_RULES,
}


def check_config(cfg: DictConfig) -> None:
    """Fail early, before any training, on settings that cannot work: every key against its
    rule, then every method named against its definition."""
    check_keys(cfg, RULES)
    if unknown := [m for m in cfg.methods if m not in cfg.method_specs]:
        raise ConfigError(f"unknown methods {unknown}; defined: {list(cfg.method_specs)}")
    for name in cfg.methods:
        spec = cfg.method_specs[name]
        if not isinstance(spec, DictConfig) or sorted(spec) != ["callback", "init", "train"]:
            raise ConfigError(
                f"method {name} must have exactly the keys init, train and "
                f"callback, got {spec!r}"
            )
        if spec.init not in ("dense", "scratch"):
            raise ConfigError(f"method {name}: init must be dense or scratch, got {spec.init!r}")
        if not isinstance(spec.train, bool):
            raise ConfigError(f"method {name}: train must be true or false, got {spec.train!r}")
        # the callback's settings at every sparsity, on the model they will select from:
        # now rather than after the dense run
        for sparsity in cfg.sparsities:
            kwargs = callback_kwargs(cfg, name, sparsity=float(sparsity))
            try:
                SparsityEngine(LeNet300100(), SparsityConfig.from_settings(kwargs))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"method {name} at sparsity {sparsity}: {e}") from e


def callback_kwargs(cfg: DictConfig, method: str, sparsity: float) -> dict[str, Any]:
    """SparsityCallback arguments of `method` at `sparsity`."""
    kwargs = OmegaConf.to_container(cfg.method_specs[method].callback, resolve=True)
    return {**kwargs, "sparsity": sparsity}


# -----------------------------------------------------------------------------------------------
# Model and training


class LeNet300100(nn.Module):
    """LeNet-300-100 (LeCun et al. 1998): 784-300-100-10, ReLU; 266,200 weights, 410 biases."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 300)
        self.fc2 = nn.Linear(300, 100)
        self.fc3 = nn.Linear(100, 10)

    def forward(self, x: Tensor) -> Tensor:  # (B, 784) -> (B, 10) logits
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Classifier(pl.LightningModule):
    """Cross-entropy training with SGD + one-cycle LR; test accuracy through torchmetrics."""

    def __init__(self, net: nn.Module, cfg: DictConfig) -> None:
        super().__init__()
        self.net, self.cfg = net, cfg
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")  # plain accuracy

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self) -> dict[str, Any]:
        c = self.cfg
        optimizer = torch.optim.SGD(
            self.parameters(), c.lr, c.momentum, weight_decay=c.weight_decay, nesterov=True
        )
        # One-cycle: warm up, then anneal to ~0; the low-LR tail is where pruned nets recover.
        steps = int(self.trainer.estimated_stepping_batches)
        scheduler = OneCycleLR(optimizer, c.lr, total_steps=steps, pct_start=c.warmup)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


@dataclass(frozen=True)
class Loaders:
    """The first train_size / test_size images (0: all of them), in memory (num_workers=0)."""

    data: MNIST
    cfg: DictConfig

    def train(self) -> DataLoader:
        """Shuffled by its own seeded generator: every run sees the same order."""
        n = self.cfg.train_size or len(self.data.train_x)
        images = TensorDataset(self.data.train_x[:n], self.data.train_y[:n])
        order = torch.Generator().manual_seed(self.cfg.seed)
        return DataLoader(images, self.cfg.batch_size, shuffle=True, generator=order)

    def test(self) -> DataLoader:
        n = self.cfg.test_size or len(self.data.test_x)
        return DataLoader(TensorDataset(self.data.test_x[:n], self.data.test_y[:n]), 1000)


def make_trainer(
    cfg: DictConfig, epochs: int, logger: Any, callbacks: list[pl.Callback]
) -> pl.Trainer:
    steps_per_epoch = -(-(cfg.train_size or 60000) // cfg.batch_size)
    log_every = min(50, steps_per_epoch)  # small CI runs still log every epoch
    if cfg.progress_bar:  # redraw every 10 steps: a log file gets 47 lines per epoch, not 469
        callbacks = [*callbacks, TQDMProgressBar(refresh_rate=10)]
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=cfg.progress_bar,
        log_every_n_steps=log_every,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        # Not deterministic=True: on CPU it makes training ~10x slower, and seeded CPU runs
        # already repeat exactly with the same thread count.
    )


# -----------------------------------------------------------------------------------------------
# Measuring sparsity: over the pruned (masked) layers and over every parameter


@dataclass(frozen=True)
class Counts:
    weights_kept: int  # nonzero weights of the layers the callback masks
    weights_total: int
    params_kept: int  # nonzero parameters of the whole net, biases included
    params_total: int
    per_layer: str  # e.g. "fc1 99.5%, fc2 96.4%, fc3 51.1%": where the global threshold put zeros

    @property
    def sparsity_layers(self) -> float:
        return 1.0 - self.weights_kept / max(self.weights_total, 1)

    @property
    def sparsity_all(self) -> float:
        return 1.0 - self.params_kept / self.params_total


def count(net: nn.Module) -> Counts:
    """Nonzero counts of `net`; a layer counts as pruned if it carries a `weight_mask` buffer."""
    masked = {name: m.weight for name, m in net.named_modules() if "weight_mask" in m._buffers}
    params = list(net.parameters())
    return Counts(
        weights_kept=sum(int(w.count_nonzero()) for w in masked.values()),
        weights_total=sum(w.numel() for w in masked.values()),
        params_kept=sum(int(p.count_nonzero()) for p in params),
        params_total=sum(p.numel() for p in params),
        per_layer=", ".join(
            f"{name.removeprefix('net.')} {1.0 - int(w.count_nonzero()) / w.numel():.1%}"
            for name, w in masked.items()
        ),
    )


# -----------------------------------------------------------------------------------------------
# The dense run (cached) and one sparse run


def dense_net(cfg: DictConfig, loaders: Loaders) -> tuple[dict[str, Tensor], float]:
    """The trained dense weights (cached, keyed by every setting they depend on) and the
    seconds it took to train them."""
    keys = ("train_size", "batch_size", "seed", "dense_epochs", "lr", "warmup", "momentum",
            "weight_decay")

    def train() -> dict[str, Tensor]:
        pl.seed_everything(cfg.seed, verbose=False)
        model = Classifier(LeNet300100(), cfg)
        make_trainer(cfg, cfg.dense_epochs, False, []).fit(model, loaders.train())
        return model.net.state_dict()

    # the thread count, torch build and CPU change the float sums, so the weights too
    settings = {k: cfg[k] for k in keys} | {"model": "lenet-300-100", **environment()}
    return cached_training(cfg.cache_dir, "lenet300100", settings, train)


def evaluate(cfg: DictConfig, model: Classifier, loaders: Loaders, logger: Any) -> float:
    """Test-set accuracy through a Trainer (so it lands in the run's logger too)."""
    trainer = make_trainer(cfg, 0, logger, [])
    return trainer.test(model, loaders.test(), verbose=False)[0]["test/acc"]


def run_method(
    cfg: DictConfig,
    method: str,
    sparsity: float,
    dense: dict[str, Tensor],
    loaders: Loaders,
    group: str,
) -> dict[str, Any]:
    """Prune (and train) one configuration; returns its results row."""
    spec = cfg.method_specs[method]
    kwargs = callback_kwargs(cfg, method, sparsity)
    pl.seed_everything(cfg.seed, verbose=False)
    net = LeNet300100()
    if spec.init == "dense":
        net.load_state_dict(dense)
    model = Classifier(net, cfg)
    config = {"method": method, "sparsity": sparsity, "callback": kwargs, "lr": cfg.lr}
    config |= {"epochs": cfg.epochs if spec.train else 0, "batch_size": cfg.batch_size}
    logger = make_logger(cfg, group, f"{method}@{sparsity:g}", config)
    start = time.perf_counter()
    if spec.train:
        trainer = make_trainer(cfg, cfg.epochs, logger, [SparsityCallback(**kwargs)])
        trainer.fit(model, loaders.train())
    else:
        # No training: the engine behind SparsityCallback applies the final masks directly,
        # selecting layers by the same module names the callback would see.
        SparsityEngine(model, SparsityConfig(**kwargs)).prune()
    accuracy = evaluate(cfg, model, loaders, logger)
    seconds = time.perf_counter() - start
    counts = count(net)
    row = {
        "method": method,
        "sparsity": sparsity,
        "sparsity_layers": round(counts.sparsity_layers, 6),
        "sparsity_all": round(counts.sparsity_all, 6),
        "accuracy": round(accuracy, 6),
        **asdict(counts),  # weights_kept, weights_total, params_kept, params_total, per_layer
        "seconds": round(seconds, 1),
    }
    finish_logger(logger, row)
    return row


# -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = load_config(sys.argv[1:] if argv is None else argv, CONFIG, DESCRIPTION)
    check_config(cfg)
    configs = [(float(s), m) for s in cfg.sparsities for m in cfg.methods]
    progress = Progress(len(configs))  # its clock starts now: elapsed includes the dense run
    set_threads(cfg.threads)
    quiet_lightning()
    try:  # the data before anything is written
        data = load_mnist(cfg.data_dir)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"data_dir: {error}") from error
    prepare_dirs(cfg, ("cache_dir", "out_dir"))  # W&B writes under out_dir
    out = Path(cfg.out_dir)
    setup_wandb(cfg)
    group = f"mnist-{time.strftime('%Y%m%d-%H%M%S')}"

    # The dense net: trained (or taken from the cache), then evaluated like every other run.
    loaders = Loaders(data, cfg)
    dense_state, dense_seconds = dense_net(cfg, loaders)
    dense_model = Classifier(LeNet300100(), cfg)
    dense_model.net.load_state_dict(dense_state)
    logger = make_logger(cfg, group, "dense", {"method": "dense", "epochs": cfg.dense_epochs})
    accuracy = evaluate(cfg, dense_model, loaders, logger)
    dense = {"accuracy": round(accuracy, 6), "seconds": round(dense_seconds, 1)}
    dense["params_total"] = count(dense_model.net).params_total
    finish_logger(logger, dense)
    print(f"dense LeNet-300-100: accuracy {accuracy:.4f} ({dense_seconds:.0f}s to train)")

    # Every sparsity x method, one line before and one after each run.
    rows = []
    for sparsity, method in configs:
        progress.start(f"{method} @ {sparsity:.2f}")
        row = run_method(cfg, method, sparsity, dense_state, loaders, group)
        rows.append(row)
        progress.finish(
            f"accuracy {row['accuracy']:.4f}, {row['params_kept']:,}/{row['params_total']:,} "
            f"params kept ({row['sparsity_all']:.2%} zeros overall)"
        )
    dense["sweep_seconds"] = round(progress.elapsed, 1)

    # Outputs: files in out_dir, then the W&B summary run.
    config = OmegaConf.to_container(cfg, resolve=True)
    content = {"dense": dense, "config": config, "environment": environment()}
    files = write_results(out, rows, meta=content)
    files.append(out / "results.md")
    files[-1].write_text(results_markdown({**content, "rows": rows}))
    series = accuracy_series(rows)
    png = plot_vs_sparsity(
        out / "accuracy_vs_sparsity.png",
        series,
        metric="test accuracy",
        title="MNIST LeNet-300-100",
        dense=dense["accuracy"],
        ylim=(0.0, 1.0),
        zoom=(0.9, 1.0),  # where the methods differ
        dashed=["reference finetune"],
    )
    print(f"results: {', '.join(map(str, files))}, {png}")
    if cfg.logger == "wandb":
        curve = [[name, x, y] for name, points in series.items() for x, y in points]
        curve += [["dense", float(s), dense["accuracy"]] for s in cfg.sparsities]
        title = "MNIST LeNet-300-100: accuracy vs sparsity"
        summary = {"dense_accuracy": dense["accuracy"]}
        log_summary_run(
            cfg, group, rows, metric="accuracy", curve=curve, title=title, plot=png, summary=summary
        )
        print(f"W&B: project {cfg.wandb_project}, group {group}")
        if hint := sync_hint(cfg):
            print(f"W&B runs written offline (no API key); upload them with: {hint}")
    print(f"sweep took {dense['sweep_seconds']:.0f}s")
    return {"dense": dense, "rows": rows}


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        sys.exit(f"mnist_sweep: {e}")
