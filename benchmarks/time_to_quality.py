"""Held-out loss against wall-clock time: does sparse training reach dense's quality sooner?

    python3 benchmarks/time_to_quality.py --budget-s 40 --warm-up-s 3    # GPU, every variant
    python3 benchmarks/time_to_quality.py --variants dense "block 90% static" --seeds 0 1 2 \
        --same-process                          # one process: no start-up per run
    python3 benchmarks/time_to_quality.py --variants "block 90% rigl" --lr 3e-4 1e-3  # recipes
    python3 benchmarks/time_to_quality.py --size tiny --budget-s 5 --folder DIR   # CPU check
    python3 benchmarks/time_to_quality.py --plot benchmarks/results/time_to_quality/*.json
    python3 benchmarks/time_to_quality.py --saved benchmarks/results/time_to_quality/*.json \
        --wandb offline                                                  # W&B runs from JSON

Each (variant, seed) trains in its own process (all in this one with ``--same-process``)
through the user's path: a ``LightningModule`` around HF ``LlamaForCausalLM`` from a config
(``--size base``: hidden 2048, 16 heads, intermediate 5632; ``large``: Llama-3-8B's layer
shapes, hidden 4096, 32 heads, 8 key-value heads, intermediate 14336; ``--layers`` layers;
``tiny``: hidden 64 for CPU checks), ``pl.Trainer(precision="bf16-mixed",
max_time=budget)``, the user's ``AdamW`` (fused on a GPU; linear warm-up over
``--warmup-steps``, then constant ``--lr``) and
``SparsityCallback``. Several ``--lr`` and ``--warmup-steps`` values try every combination
with every variant and seed (the recipe search): every tried configuration keeps its
JSON. The corpus is :mod:`_corpus`'s (the standard library's Python files by default, BPE
tokens). Every
``--eval-every`` steps the held-out loss over ``--eval-batches`` fixed windows is recorded
with the wall-clock seconds since training started (evaluation and mask updates included)
and the tokens seen. Variants (block ``B`` = 128 at base size, 16 tiny):

=============================  ==============================================================
``dense``                      no callback
``block S% static``            ``B x B`` blocks at sparsity S, random from initialization,
                               compressed (``schedule="constant", score="random"``)
``block S% rigl`` / ``set``    (75% and 90% RigL, 90% SET) the same with RigL / SET
                               regrowth every ``--regrow-every`` steps (``--regrow-fraction``
                               of the kept blocks) until ``--schedule-steps``, compressed
``block 90% gradual``          GMP from dense to 90% over the first half of ``--schedule-steps``,
                               masked-dense (the kept count moves)
``block 90% gradual, then      the same until GMP ends, then a second ``fit`` (same process,
compressed``                   same clock) trains the kept blocks compressed: a new callback
                               with ``schedule="oneshot", score="magnitude", compress=True``
                               keeps the nonzero blocks; the optimizer state and its warm-up
                               start again
``block S% wide``              a sparse wider model (Sparse-IFT): hidden and intermediate
                               widened by ``1/sqrt(1 - S)`` so its Linear layers cost what
                               dense's do per step, static and compressed
=============================  ==============================================================

The kernels' first calls compile and autotune them inside the budget (and
``torch.compile`` its graphs); every run goes with Triton's autotuning cache on disk
(``TRITON_CACHE_AUTOTUNING=1``), and ``--warm-up-s S`` first trains each variant that
compiles kernels (the sparse ones; every one with ``--compile``) for S seconds, unrecorded,
so that the timed runs meet Triton's and Inductor's disk caches as warm as on any machine
that ran them before.

One JSON per run under ``$OUT/time_to_quality`` (``$OUT`` default ``benchmarks/results``),
named by budget and configuration: the settings, the corpus's token counts, the curve,
tokens/s, peak memory and parameters kept. ``--wandb offline|online|auto`` logs each
finished run's curve as a W&B run (from its JSON, after its training: the logging costs no
training time; ``--saved JSON...`` logs saved runs instead of training). ``--plot`` draws
the held-out loss against wall-clock time, a panel per (budget, model), one line per
configuration (mean over seeds); ``docs/results/time_to_quality.md`` is generated
from the committed JSON (``examples/results_pages.py``, tables from :mod:`_quality_report`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import at_least, device_name, fraction_in, results_dir, write_json
from _corpus import load_corpus
from _quality_report import model_of, plot_runs, read_run
from _shapes import DECODER_SHAPES

SIZES = {"base": dict(**DECODER_SHAPES["hidden-2048"], block=128, seq=1024, batch=8),
         "large": dict(**DECODER_SHAPES["llama-3-8b"], block=128, seq=1024, batch=8),
         "tiny": dict(hidden=64, intermediate=128, heads=4, kv_heads=4, block=16, seq=32,
                      batch=4)}
STATIC = dict(schedule="constant", score="random", compress=True)
VARIANTS: dict[str, dict | None] = {
    "dense": None,
    "block 75% static": dict(sparsity=0.75, **STATIC),
    "block 90% static": dict(sparsity=0.9, **STATIC),
    "block 75% rigl": dict(sparsity=0.75, regrow="rigl", **STATIC),
    "block 90% rigl": dict(sparsity=0.9, regrow="rigl", **STATIC),
    "block 90% set": dict(sparsity=0.9, regrow="set", **STATIC),
    "block 90% gradual": dict(sparsity=0.9, schedule="gmp", compress=False),
    "block 90% gradual, then compressed": dict(sparsity=0.9, schedule="gmp", compress=False),
    "block 75% wide": dict(sparsity=0.75, **STATIC),
    "block 90% wide": dict(sparsity=0.9, **STATIC),
}
# once the gradual schedule has pruned to its sparsity, a second fit trains the blocks it
# kept (the nonzero ones: the largest) as compressed layers
THEN_COMPRESSED = {"block 90% gradual, then compressed": dict(schedule="oneshot",
                                                              score="magnitude",
                                                              compress=True)}


def widths(size: dict, variant: str) -> tuple[int, int]:
    """(hidden, intermediate) of ``variant``: a wide variant's grow by ``1/sqrt(density)``
    (Linear FLOPs ~ density x width^2 stay dense's), rounded to whole blocks and heads."""
    settings = VARIANTS[variant]
    if not variant.endswith("wide"):
        return size["hidden"], size["intermediate"]
    grow = 1 / math.sqrt(1 - settings["sparsity"])
    step = math.lcm(size["block"], size["heads"])
    return tuple(max(step, round(size[k] * grow / step) * step)
                 for k in ("hidden", "intermediate"))


def sparsity_settings(args: argparse.Namespace) -> dict | None:
    """The ``SparsityCallback`` settings of ``args.child`` (None: dense): the gradual
    variant prunes over the first half of ``--schedule-steps``, regrowth stops after them."""
    settings = VARIANTS[args.child]
    if settings is None:
        return None
    if settings.get("schedule") == "gmp":
        return {**settings, "end": args.schedule_steps // 2,
                "frequency": max(1, args.schedule_steps // 40)}
    if "regrow" in settings:
        fraction = {} if args.regrow_fraction is None else {"regrow_fraction":
                                                            args.regrow_fraction}
        return {**settings, "frequency": args.regrow_every, "regrow_end": args.schedule_steps,
                **fraction}
    return dict(settings)


def configuration(variant: str, lr: float, warmup_steps: int, args: argparse.Namespace) -> str:
    """A configuration's name: the variant and its recipe (what the seeds repeat)."""
    name = f"{variant}, lr {lr:g}, warm-up {warmup_steps}"
    if "regrow" in (VARIANTS[variant] or {}):
        fraction = "" if args.regrow_fraction is None else f" x {args.regrow_fraction:g}"
        name += f", regrow every {args.regrow_every}{fraction}"
    mode = "" if args.compile in (None, "default") else f" ({args.compile})"
    return name + (f", compiled{mode}" if args.compile else "")


def run_child(args: argparse.Namespace) -> dict:
    """One (variant, seed) in this process."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse_training import SparsityCallback

    size, gpu = SIZES[args.size], torch.cuda.is_available()
    seq, batch = args.seq or size["seq"], args.batch or size["batch"]
    corpus = load_corpus(args.folder, args.glob, args.vocab, args.held_out)
    hidden, intermediate = widths(size, args.child)
    pl.seed_everything(args.seed, verbose=False)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                         num_hidden_layers=args.layers, vocab_size=corpus.vocab,
                         max_position_embeddings=seq)
    g = torch.Generator().manual_seed(1234)  # the same held-out windows for every run
    starts = torch.randint(0, corpus.held_out.numel() - seq - 1, (args.eval_batches, batch),
                           generator=g)
    held_out = [torch.stack([corpus.held_out[s:s + seq + 1].long() for s in row])
                for row in starts]

    class Windows(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(args.seed)
            while True:
                s = torch.randint(0, corpus.train.numel() - seq - 1, (batch,), generator=g)
                yield torch.stack([corpus.train[i:i + seq + 1].long() for i in s])

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            with torch.device("cuda" if gpu else "cpu"):
                self.model = LlamaForCausalLM(config)

        def training_step(self, ids, batch_idx):
            if args.compile == "reduce-overhead":  # CUDA graphs: a step per batch
                torch.compiler.cudagraph_mark_step_begin()
            # HF shifts the labels itself: a window's first seq tokens, seq - 1 predictions
            # (its last token is unused, and kept so the recorded runs' windows reproduce)
            return self.model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.1,
                                          **({"fused": True} if gpu else {}))
            warm = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
            return [optimizer], [{"scheduler": warm, "interval": "step"}]

    class Curve(pl.Callback):
        """Held-out loss every ``--eval-every`` steps, with wall seconds and tokens."""

        def __init__(self):
            self.points: list[dict] = []
            self.offset = 0  # the steps of earlier fits (a second fit counts on)

        def on_train_start(self, trainer, module):
            if self.points:
                self.offset = self.points[-1]["step"]
                return
            self.start = time.perf_counter()
            self.evaluate(trainer, module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.step(trainer) % args.eval_every == 0:
                self.evaluate(trainer, module)

        def on_train_end(self, trainer, module):
            if not self.points or self.points[-1]["step"] != self.step(trainer):
                self.evaluate(trainer, module)

        def step(self, trainer) -> int:
            return self.offset + trainer.global_step

        @torch.no_grad()
        def evaluate(self, trainer, module):
            module.eval()
            with torch.autocast("cuda" if gpu else "cpu", dtype=torch.bfloat16):
                losses = [float(module.model(input_ids=ids[:, :-1].to(module.device),
                                             labels=ids[:, :-1].to(module.device)).loss)
                          for ids in held_out]
            module.train()
            if gpu:
                torch.cuda.synchronize()
            point = {"step": self.step(trainer), "wall_s": time.perf_counter() - self.start,
                     "tokens": self.step(trainer) * batch * seq,
                     "held_out_loss": statistics.fmean(losses)}
            self.points.append(point)
            print(json.dumps(point), flush=True)

    settings, curve = sparsity_settings(args), Curve()
    phases = [settings] + ([{"sparsity": settings["sparsity"], **THEN_COMPRESSED[args.child]}]
                           if args.child in THEN_COMPRESSED else [])

    def fit(phase: dict | None, seconds: float, steps: int = -1) -> None:
        """One ``fit`` of ``module`` for ``seconds`` (or ``steps``), the curve counting on."""
        callbacks: list = [curve]
        if phase is not None:
            callbacks.append(SparsityCallback(
                pattern=f"block:{size['block']}x{size['block']}", seed=args.seed,
                deny=["embed_tokens", "lm_head"], **phase))
        pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1, precision="bf16-mixed",
                   max_time={"seconds": seconds}, max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
                   ).fit(module, DataLoader(Windows(), batch_size=None))

    module = LM()
    if args.compile:
        module.model = torch.compile(module.model, mode=args.compile)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    fit(phases[0], args.budget_s, settings["end"] if len(phases) > 1 else -1)
    if len(phases) > 1 and (left := args.budget_s - (time.perf_counter() - curve.start)) > 1:
        fit(phases[1], left)
    train_s, steps = curve.points[-1]["wall_s"], curve.points[-1]["step"]
    return {"name": configuration(args.child, args.lr, args.warmup_steps, args),
            "variant": args.child, "seed": args.seed,
            "settings": settings if len(phases) == 1 else phases,
            "size": args.size, "hidden": hidden, "intermediate": intermediate,
            "layers": args.layers,
            "seq": seq, "batch": batch, "lr": args.lr, "warmup_steps": args.warmup_steps,
            "compile": args.compile, "budget_s": args.budget_s, "corpus": corpus.describe(),
            "curve": curve.points, "steps": steps,
            "tokens_per_s": steps * batch * seq / train_s if train_s else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            "parameters": sum(p.numel() for p in module.parameters()),
            "nonzero_parameters": sum(int(p.count_nonzero()) for p in module.parameters()),
            "final_held_out_loss": curve.points[-1]["held_out_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--size", choices=list(SIZES), default="base")
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--seq", type=at_least(2), default=None)
    parser.add_argument("--batch", type=at_least(1), default=None)
    parser.add_argument("--budget-s", type=at_least(1), default=300,
                        help="wall-clock seconds of training per run (Lightning's max_time)")
    parser.add_argument("--eval-every", type=at_least(1), default=50)
    parser.add_argument("--eval-batches", type=at_least(1), default=8)
    parser.add_argument("--lr", type=fraction_in(0, 1), nargs="+", default=[3e-4])
    parser.add_argument("--warmup-steps", type=at_least(1), nargs="+", default=[100])
    parser.add_argument("--regrow-every", type=at_least(1), default=100,
                        help="steps between regrowth updates (rigl, set)")
    parser.add_argument("--regrow-fraction", type=fraction_in(0, 1, closed_high=True),
                        default=None,
                        help="share of the kept blocks regrowth swaps first (default: the "
                             "callback's)")
    parser.add_argument("--schedule-steps", type=at_least(2), default=2000,
                        help="the gradual variant prunes over the first half of these steps; "
                             "regrowth stops after them (max_time leaves the length unknown)")
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                        help="torch.compile the model, in this mode (default: the default "
                             "mode; reduce-overhead: CUDA graphs, for steps the host bounds)")
    parser.add_argument("--warm-up-s", type=at_least(0), default=0,
                        help="train each variant that compiles kernels this long first, "
                             "unrecorded: Triton's and Inductor's disk caches warm")
    parser.add_argument("--folder", type=Path, default=None,
                        help="corpus folder (default: the standard library)")
    parser.add_argument("--glob", default="**/*.py")
    parser.add_argument("--vocab", type=at_least(0), default=8192, help="BPE size; 0: bytes")
    parser.add_argument("--held-out", type=fraction_in(0, 1), default=0.05,
                        help="share of the files held out (by a hash of their path)")
    parser.add_argument("--wandb", choices=["off", "offline", "online", "auto"], default="off",
                        help="log each run's curve to W&B (auto: online with an API key)")
    parser.add_argument("--wandb-project", default="sparse-training-time-to-quality")
    parser.add_argument("--saved", nargs="+", metavar="JSON",
                        help="log saved runs to W&B (--wandb) instead of training")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot saved runs and exit")
    parser.add_argument("--same-process", action="store_true",
                        help="train every run in this process (no start-up per run; no "
                             "timeout): the default is a fresh process per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = results_dir()
    os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # before Triton loads, here and in children
    if args.plot:
        png = plot_runs([read_run(path) for path in args.plot], out / "time_to_quality.png")
        print(f"wrote {png}")
        return
    if args.saved:
        for path in args.saved:
            log_wandb(read_run(path), args, out)
        return
    if args.child:  # one configuration: one value of each list
        args.lr, args.warmup_steps = args.lr[0], args.warmup_steps[0]
        Path(args.result).write_text(json.dumps(run_child(args)))
        return
    corpus = load_corpus(args.folder, args.glob, args.vocab, args.held_out)  # cached once
    print(f"corpus: {corpus.describe()}", flush=True)
    folder = out / "time_to_quality"
    folder.mkdir(parents=True, exist_ok=True)
    shared = _without(sys.argv[1:], ("--variants", "--seeds", "--lr", "--warmup-steps",
                                      "--budget-s"))
    warmed = {}  # variant -> seconds of unrecorded training that ran first
    compiling = [v for v in args.variants if VARIANTS[v] or args.compile]
    for variant in compiling if args.warm_up_s else []:
        if (run := _child(shared, variant, args.lr[0], args.warmup_steps[0], args.seeds[0],
                          args.warm_up_s, args)) is not None:
            warmed[variant] = args.warm_up_s
            print(f"warmed up {variant}: {run['steps']} steps in {args.warm_up_s} s", flush=True)
    for variant, lr, warmup, seed in itertools.product(args.variants, args.lr,
                                                       args.warmup_steps, args.seeds):
        name = f"{configuration(variant, lr, warmup, args)}, seed {seed}"
        run = _child(shared, variant, lr, warmup, seed, args.budget_s, args)
        if run is None:
            continue
        slug = re.sub(r"[^a-z0-9.]+", "_", f"{args.budget_s}s {args.size} {args.layers} layers "
                                           f"{name}".lower()).strip("_")
        write_json(f"{slug}.json", {"command": " ".join(sys.argv), "run": run,
                                    "warmed_up_s": warmed.get(variant, 0),
                                    "same_process": args.same_process},
                   out=folder, device=device_name())
        print(f"{name}: {run['steps']} steps, final held-out loss "
              f"{run['final_held_out_loss']:.4f}, {run['tokens_per_s']:,.0f} tokens/s",
              flush=True)
        if args.wandb != "off":
            log_wandb(run, args, out)


def _child(shared: list[str], variant: str, lr: float, warmup: int, seed: int,
           budget_s: int, args: argparse.Namespace) -> dict | None:
    """One configuration trained in a fresh process, given ``budget_s`` and
    :data:`CHILD_MARGIN_S` more to start and finish (or in this one, ``--same-process``);
    its run, or None where it failed or overran (said, with the end of its error)."""
    train = _in_this_process if args.same_process else _in_a_process
    run, error = train(shared, variant, lr, warmup, seed, budget_s, args)
    if run is None:
        print(f"{configuration(variant, lr, warmup, args)}, seed {seed}: FAILED {error}",
              flush=True)
    return run


def _in_a_process(shared: list[str], variant: str, lr: float, warmup: int, seed: int,
                  budget_s: int, args: argparse.Namespace) -> tuple[dict | None, str]:
    """(its run or None, what went wrong) of one configuration in a fresh process."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "run.json"
        command = [sys.executable, __file__, *shared, "--child", variant, "--lr", str(lr),
                   "--warmup-steps", str(warmup), "--seed", str(seed), "--budget-s",
                   str(budget_s), "--result", str(result)]
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=budget_s + CHILD_MARGIN_S)
            error = f"({proc.returncode}) {proc.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            error = f"(still running {budget_s + CHILD_MARGIN_S} s after its start: stopped)"
        return (json.loads(result.read_text()) if result.exists() else None), error


def _in_this_process(shared: list[str], variant: str, lr: float, warmup: int, seed: int,
                     budget_s: int, args: argparse.Namespace) -> tuple[dict | None, str]:
    """(its run or None, what went wrong) of one configuration in this process: no
    start-up per run (imports, CUDA), no timeout; its memory freed after."""
    import gc

    import torch

    settings = {**vars(args), "child": variant, "lr": lr, "warmup_steps": warmup, "seed": seed,
                "budget_s": budget_s}
    try:
        return run_child(argparse.Namespace(**settings)), ""
    except Exception as error:  # noqa: BLE001 (said; the sweep goes on, as with a process)
        return None, f"{type(error).__name__}: {error}"
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


CHILD_MARGIN_S = 300
"""Seconds a run may take beyond its budget: imports, the corpus, the model, the first and
last evaluations and a compiled model's warm-up."""


def log_wandb(run: dict, args: argparse.Namespace, out: Path) -> None:
    """One W&B run (files under ``out/wandb``) with ``run``'s held-out curve against wall
    seconds, tokens and steps, its settings as the config and its totals as the summary;
    ``--wandb auto`` is online where W&B has an API key, else offline."""
    import wandb

    mode = args.wandb
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False)
                                                else "offline")
    config = {k: v for k, v in run.items() if k != "curve"}
    group = f"{run['name']}, {model_of(run)}, {run['budget_s']} s"  # at one budget
    with wandb.init(project=args.wandb_project, group=group, mode=mode,
                    name=f"{group}, seed {run['seed']}", config=config,
                    dir=str(out), reinit="create_new") as logged:
        logged.define_metric("held_out_loss", step_metric="wall_s")
        for point in run["curve"]:
            logged.log(point)
        logged.summary.update({k: run[k] for k in ("final_held_out_loss", "tokens_per_s",
                                                   "peak_gib", "steps")})


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and the values that follow each."""
    kept, skipping = [], False
    for arg in argv:
        if arg.startswith("--"):
            skipping = arg in options
        if not skipping:
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
