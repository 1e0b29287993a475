"""MNIST sparsity sweep: accuracy versus sparsity of LeNet-300-100, per pruning method.

One dense training run (cached in cache_dir and reused), then for every sparsity and every
method one `pl.Trainer` run with a `SparsityCallback`, evaluated on the MNIST test set:

    oneshot            magnitude-prune the trained dense net and evaluate (no training)
    oneshot+finetune   prune once, then fine-tune with the masks fixed (the ASP recipe)
    gmp                gradual magnitude pruning (Zhu & Gupta) while fine-tuning
    rigl               sparse from scratch, ERK layer sparsities, RigL drop and regrow

Run the default sweep (6 sparsities x 4 methods; about 6 minutes on 2 dedicated CPU cores,
see docs/results/mnist.md):

    python examples/mnist_sweep.py

Override any key of examples/configs/mnist.yaml on the command line (OmegaConf dot-list):

    python examples/mnist_sweep.py sparsities=[0.9] methods=[gmp] epochs=3 out_dir=outputs/try
    python examples/mnist_sweep.py data_dir=/path/to/mnist logger=none
    python examples/mnist_sweep.py config=my_sweep.yaml      # another YAML file as the base

Left in out_dir: results.csv and results.json (one row per sparsity x method), results.md (the
table beside the reference) and accuracy_vs_sparsity.png. Weights & Biases gets one run per
configuration and a "summary" run with the results table and an accuracy-versus-sparsity
chart. Without a W&B API key the runs are written offline under out_dir/wandb; `wandb sync`
uploads them later. `logger=none` turns W&B off.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from mnist_data import MNIST, load_mnist
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import TQDMProgressBar
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine

CONFIG = Path(__file__).resolve().parent / "configs" / "mnist.yaml"

# The reference table of the issue (a small FC net): sparsity -> (original, prune, finetune).
REFERENCE = {
    0.70: (0.9604, 0.9566, 0.9682),
    0.80: (0.9545, 0.9460, 0.9656),
    0.90: (0.9534, 0.8845, 0.9615),
    0.95: (0.9569, 0.4923, 0.9395),
    0.98: (0.9570, 0.2158, 0.8074),
    0.99: (0.9565, 0.0982, 0.3052),
}
# The goal for the best method of each row, on the full test set.
GOAL = {0.70: 0.98, 0.80: 0.98, 0.90: 0.98, 0.95: 0.98, 0.98: 0.975, 0.99: 0.96}


# -----------------------------------------------------------------------------------------------
# Config: the YAML file, then key=value overrides from the command line


class ConfigError(ValueError):
    """A setting that cannot work; raised before any training."""


def load_config(argv: list[str]) -> DictConfig:
    """Base YAML (CONFIG, or `config=PATH`) merged with dot-list overrides; unknown keys fail."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("config=")]
    overrides = [a for a in argv if not a.startswith("config=")]
    if bad := [a for a in overrides if "=" not in a]:
        raise ConfigError(f"arguments must be key=value overrides, got {bad}")
    cfg = OmegaConf.load(paths[-1] if paths else CONFIG)
    OmegaConf.set_struct(cfg, True)  # a misspelt key is an error, not a silent no-op
    OmegaConf.set_struct(cfg.method_specs, False)  # ...but new methods may be added
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as e:  # OmegaConf's errors name the key and the file
        raise ConfigError(str(e)) from e
    check_config(cfg)
    return cfg


def check_config(cfg: DictConfig) -> None:
    """Fail early, before any training, on settings that cannot work."""
    if not cfg.sparsities or not cfg.methods:
        raise ConfigError("sparsities and methods must each name at least one entry")
    if unknown := [m for m in cfg.methods if m not in cfg.method_specs]:
        raise ConfigError(f"unknown methods {unknown}; defined: {list(cfg.method_specs)}")
    if cfg.wandb_mode not in ("auto", "online", "offline", "disabled"):
        raise ConfigError(
            f"wandb_mode must be auto, online, offline or disabled, got {cfg.wandb_mode!r}"
        )
    if bad := [s for s in cfg.sparsities if not 0.0 <= float(s) < 1.0]:
        raise ConfigError(f"sparsities must lie in [0, 1), got {bad}")
    if cfg.logger not in ("wandb", "none"):
        raise ConfigError(f"logger must be wandb or none, got {cfg.logger!r}")
    for name in cfg.methods:
        spec = cfg.method_specs[name]
        if sorted(spec) != ["callback", "init", "train"]:
            raise ConfigError(
                f"method {name} must have exactly the keys init, train and "
                f"callback, got {sorted(spec)}"
            )
        if spec.init not in ("dense", "scratch"):
            raise ConfigError(f"method {name}: init must be dense or scratch, got {spec.init!r}")
        try:  # validate the callback arguments now rather than after the dense run
            SparsityConfig(**callback_kwargs(cfg, name, sparsity=float(cfg.sparsities[0])))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"method {name}: {e}") from e


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
        self.net = net
        self.lr, self.warmup = cfg.lr, cfg.warmup
        self.momentum, self.weight_decay = cfg.momentum, cfg.weight_decay
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
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.lr,
            momentum=self.momentum,
            nesterov=True,
            weight_decay=self.weight_decay,
        )
        # One-cycle: warm up, then anneal to ~0; the low-LR tail is where pruned nets recover.
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=self.lr,
            total_steps=int(self.trainer.estimated_stepping_batches),
            pct_start=self.warmup,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


@dataclass(frozen=True)
class Loaders:
    """In-memory MNIST; num_workers=0 because the tensors are already in RAM."""

    train_set: TensorDataset
    test_set: TensorDataset
    batch_size: int
    seed: int

    def train(self) -> DataLoader:
        """A shuffling loader with its own seeded generator: every run sees the same order."""
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def test(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=1000)


def make_loaders(data: MNIST, cfg: DictConfig) -> Loaders:
    """The first train_size / test_size images (0: all of them)."""
    n_train = cfg.train_size or len(data.train_x)
    n_test = cfg.test_size or len(data.test_x)
    return Loaders(
        train_set=TensorDataset(data.train_x[:n_train], data.train_y[:n_train]),
        test_set=TensorDataset(data.test_x[:n_test], data.test_y[:n_test]),
        batch_size=cfg.batch_size,
        seed=cfg.seed,
    )


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
    per_layer: dict[str, float]  # sparsity of each masked layer's weight

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
        per_layer={
            name.removeprefix("net."): 1.0 - int(w.count_nonzero()) / w.numel()
            for name, w in masked.items()
        },
    )


# -----------------------------------------------------------------------------------------------
# Weights & Biases


def setup_wandb(cfg: DictConfig) -> None:
    """Quiet W&B and resolve wandb_mode=auto: online with an API key, else offline."""
    if cfg.logger == "none":
        return
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")  # the sweep prints its own one line per run
    if cfg.wandb_mode == "auto":
        cfg.wandb_mode = os.environ.get("WANDB_MODE") or (
            "online" if wandb.login(prompt=False) else "offline"
        )


def make_logger(cfg: DictConfig, group: str, name: str, config: dict[str, Any]) -> Any:
    """A WandbLogger for one run, or False (no logger) with logger=none."""
    if cfg.logger == "none":
        return False
    from pytorch_lightning.loggers import WandbLogger

    return WandbLogger(
        project=cfg.wandb_project,
        group=group,
        name=name,
        job_type=name.split("@")[0],
        save_dir=cfg.out_dir,
        config=config,
        mode=cfg.wandb_mode,
    )


def finish_logger(logger: Any, summary: dict[str, Any]) -> None:
    """Write the run's result into its W&B summary and close the run."""
    if logger:
        logger.experiment.summary.update(summary)
        logger.experiment.finish()


def log_summary_run(
    cfg: DictConfig, group: str, rows: list[dict[str, Any]], dense: dict[str, Any], plot: Path
) -> Path:
    """The summary run: the results table, accuracy-versus-sparsity chart and the PNG."""
    import wandb

    run = wandb.init(
        project=cfg.wandb_project,
        group=group,
        name="summary",
        job_type="summary",
        dir=cfg.out_dir,
        mode=cfg.wandb_mode,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    columns = list(rows[0]) if rows else ["method", "sparsity", "accuracy"]
    results = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
    points = [[r["method"], r["sparsity"], r["accuracy"]] for r in rows]
    points += [["dense", s, dense["accuracy"]] for s in cfg.sparsities]
    points += [["reference finetune", s, ref[2]] for s, ref in REFERENCE.items()]
    curve = wandb.Table(columns=["method", "sparsity", "accuracy"], data=points)
    run.log(
        {
            "results": results,
            "accuracy_vs_sparsity": wandb.plot.line(
                curve,
                "sparsity",
                "accuracy",
                stroke="method",
                title="MNIST LeNet-300-100: accuracy vs sparsity",
            ),
            "accuracy_vs_sparsity_png": wandb.Image(str(plot)),
        }
    )
    run.summary["dense_accuracy"] = dense["accuracy"]
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


# -----------------------------------------------------------------------------------------------
# The dense run (cached) and one sparse run


def dense_key(cfg: DictConfig) -> str:
    """Hash of every setting the dense net depends on."""
    keys = (
        "train_size",
        "batch_size",
        "seed",
        "dense_epochs",
        "lr",
        "warmup",
        "momentum",
        "weight_decay",
    )
    settings = {k: cfg[k] for k in keys} | {"model": "lenet-300-100"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def dense_net(cfg: DictConfig, loaders: Loaders) -> tuple[dict[str, Tensor], float]:
    """The trained dense weights from the cache, or trained now and cached; and the seconds."""
    path = Path(cfg.cache_dir) / f"lenet300100-{dense_key(cfg)}.pt"
    if path.is_file():
        cached = torch.load(path)
        print(f"dense net: cached {path}")
        return cached["state_dict"], cached["seconds"]
    pl.seed_everything(cfg.seed, verbose=False)
    model = Classifier(LeNet300100(), cfg)
    start = time.perf_counter()
    make_trainer(cfg, cfg.dense_epochs, False, []).fit(model, loaders.train())
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.net.state_dict(), "seconds": seconds}, path)
    return model.net.state_dict(), seconds


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
    logger = make_logger(
        cfg,
        group,
        f"{method}@{sparsity:g}",
        {
            "method": method,
            "sparsity": sparsity,
            "callback": kwargs,
            "epochs": cfg.epochs if spec.train else 0,
            **{k: cfg[k] for k in ("lr", "batch_size")},
        },
    )
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
        "weights_kept": counts.weights_kept,
        "weights_total": counts.weights_total,
        "params_kept": counts.params_kept,
        "params_total": counts.params_total,
        # e.g. "fc1 99.5%, fc2 96.4%, fc3 51.1%": where the global threshold put the zeros
        "per_layer": ", ".join(f"{k} {v:.1%}" for k, v in counts.per_layer.items()),
        "seconds": round(seconds, 1),
    }
    finish_logger(logger, row)
    return row


# -----------------------------------------------------------------------------------------------
# Outputs: results.csv, results.json, results.md, accuracy_vs_sparsity.png


def write_results(
    out: Path, rows: list[dict[str, Any]], dense: dict[str, Any], cfg: DictConfig
) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(
        json.dumps(
            {"dense": dense, "rows": rows, "config": OmegaConf.to_container(cfg, resolve=True)},
            indent=2,
        )
        + "\n"
    )
    (out / "results.md").write_text(markdown_table(rows, dense, cfg))


def _best(rows: list[dict[str, Any]], sparsity: float, cfg: DictConfig) -> dict[str, Any] | None:
    """The most accurate fine-tuned row at `sparsity` (the goal is about fine-tuned nets)."""
    trained = [r for r in rows if r["sparsity"] == sparsity and cfg.method_specs[r["method"]].train]
    return max(trained or [None], key=lambda r: r["accuracy"] if r else 0.0)


def markdown_table(rows: list[dict[str, Any]], dense: dict[str, Any], cfg: DictConfig) -> str:
    """The reference table with our columns beside it, then every run in detail."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    n_test = cfg.test_size or 10000
    lines = [
        "# MNIST sparsity sweep: LeNet-300-100",
        "",
        f"Accuracy on {n_test:,} test images. original = the dense net (dense_epochs="
        f"{cfg.dense_epochs}); each method's column is its accuracy at that sparsity "
        f"(fine-tuning runs: epochs={cfg.epochs}). ref = the issue's reference table (a small FC net). Goal: "
        "the best method of each row reaches the goal.",
        "",
        "| sparsity | original | "
        + " | ".join(methods)
        + " | ref original | ref prune | ref finetune | best fine-tuned vs goal |",
        "|---" * (len(methods) + 6) + "|",
    ]
    for s in cfg.sparsities:
        acc = {r["method"]: f"{r['accuracy']:.4f}" for r in rows if r["sparsity"] == s}
        ref = [f"{v:.4f}" for v in REFERENCE[s]] if s in REFERENCE else ["", "", ""]
        best = _best(rows, s, cfg)
        met = ""
        if best and s in GOAL:
            verdict = "meets" if best["accuracy"] >= GOAL[s] else "MISSES"
            met = f"{best['method']} {best['accuracy']:.4f} {verdict} {GOAL[s]}"
        lines.append(
            f"| {s:.0%} | {dense['accuracy']:.4f} | "
            + " | ".join(acc.get(m, "") for m in methods)
            + f" | {' | '.join(ref)} | {met} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "sparsity (pruned layers) = zeros among the weights the callback masks; sparsity (all) "
        "= zeros among every parameter, biases included.",
        "",
        "| method | target | sparsity (pruned layers) | sparsity (all) | weights kept | "
        "params kept | per layer | accuracy | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['sparsity']:.0%} | {r['sparsity_layers']:.4%} | "
            f"{r['sparsity_all']:.4%} | {r['weights_kept']:,} / {r['weights_total']:,} | "
            f"{r['params_kept']:,} / {r['params_total']:,} | {r['per_layer']} | "
            f"{r['accuracy']:.4f} | "
            f"{r['seconds']:.1f} |"
        )
    lines += [
        "",
        f"Dense run: {dense['seconds']:.1f} s; sweep total {dense['sweep_seconds']:.0f} s "
        "(wall time, including the dense run unless it came from the cache).",
        "",
    ]
    return "\n".join(lines)


def plot(out: Path, rows: list[dict[str, Any]], dense: dict[str, Any]) -> Path:
    """accuracy_vs_sparsity.png: one line per method, the reference finetune column dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, ylim in zip(axes, [(0.0, 1.0), (0.9, 1.0)], strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["sparsity"], r["accuracy"]) for r in rows if r["method"] == method)
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
        ref = sorted((s, v[2]) for s, v in REFERENCE.items())
        ax.plot(*zip(*ref, strict=True), "k--", marker="x", label="reference finetune")
        ax.axhline(dense["accuracy"], color="grey", lw=0.8, label="dense")
        ax.set_xscale("logit")  # spreads 0.9 .. 0.99, where the methods differ
        ticks = sorted({r["sparsity"] for r in rows} | set(REFERENCE))
        ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(*ylim)
        ax.set_xlabel("sparsity")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[0].set_title("MNIST LeNet-300-100")
    axes[1].set_title("zoom: 0.9 - 1.0")
    axes[1].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path = out / "accuracy_vs_sparsity.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -----------------------------------------------------------------------------------------------


def quiet_lightning() -> None:
    """Drop per-Trainer banners and the num_workers hint (the data is already in memory)."""
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 asks torch's pytree something torch 2.13 deprecates; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    sweep_start = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    quiet_lightning()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup_wandb(cfg)
    group = f"mnist-{time.strftime('%Y%m%d-%H%M%S')}"

    loaders = make_loaders(load_mnist(cfg.data_dir), cfg)
    dense_state, dense_seconds = dense_net(cfg, loaders)
    dense_model = Classifier(LeNet300100(), cfg)
    dense_model.net.load_state_dict(dense_state)
    logger = make_logger(cfg, group, "dense", {"method": "dense", "epochs": cfg.dense_epochs})
    dense_acc = evaluate(cfg, dense_model, loaders, logger)
    dense = {
        "accuracy": round(dense_acc, 6),
        "seconds": round(dense_seconds, 1),
        "params_total": count(dense_model.net).params_total,
    }
    finish_logger(logger, dense)
    print(
        f"dense LeNet-300-100: accuracy {dense_acc:.4f} ({dense_seconds:.0f}s to train)", flush=True
    )

    rows = []
    configs = [(s, m) for s in cfg.sparsities for m in cfg.methods]
    for i, (sparsity, method) in enumerate(configs, 1):
        row = run_method(cfg, method, float(sparsity), dense_state, loaders, group)
        rows.append(row)
        print(
            f"[{i}/{len(configs)}] {method:<16} sparsity {sparsity:<4}: accuracy "
            f"{row['accuracy']:.4f}, {row['params_kept']:,}/{row['params_total']:,} params "
            f"kept ({row['sparsity_all']:.2%} zeros overall), {row['seconds']:.0f}s",
            flush=True,
        )

    dense["sweep_seconds"] = round(time.perf_counter() - sweep_start, 1)
    write_results(out, rows, dense, cfg)
    png = plot(out, rows, dense)
    print(f"results: {out / 'results.md'}, {out / 'results.csv'}, {out / 'results.json'}, {png}")
    if cfg.logger == "wandb":
        run_dir = log_summary_run(cfg, group, rows, dense, png)
        if cfg.wandb_mode == "offline":
            print(
                f"W&B runs written offline under {run_dir.parent} (no API key); upload them "
                f"with: wandb sync {run_dir.parent}/offline-run-*"
            )
        else:
            print(f"W&B: project {cfg.wandb_project}, group {group}")
    print(f"sweep took {dense['sweep_seconds']:.0f}s")
    return {"dense": dense, "rows": rows}


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        sys.exit(f"mnist_sweep: {e}")
