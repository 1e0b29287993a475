"""Held-out loss against wall-clock time: does sparse training reach dense's quality sooner?

    python3 benchmarks/time_to_quality.py --budget-s 300                 # GPU, every variant
    python3 benchmarks/time_to_quality.py --variants dense "block 90% static" --seeds 0 1 2
    python3 benchmarks/time_to_quality.py --size tiny --budget-s 5 --folder DIR   # CPU check
    python3 benchmarks/time_to_quality.py --plot benchmarks/results/time_to_quality_*.json

Each (variant, seed) trains in its own process through the user's path: a
``LightningModule`` around HF ``LlamaForCausalLM`` from a config (``--size base``: hidden
2048, 16 heads, intermediate 5632, ``--layers`` layers; ``tiny``: hidden 64 for CPU checks),
``pl.Trainer(precision="bf16-mixed", max_time=budget)``, the user's ``AdamW`` (fused on a
GPU; linear warm-up, then constant) and ``SparsityCallback``. The corpus is
:mod:`_corpus`'s (the standard library's Python files by default, BPE tokens). Every
``--eval-every`` steps the held-out loss over ``--eval-batches`` fixed windows is recorded
with the wall-clock seconds since training started (evaluation and mask updates included)
and the tokens seen. Variants (block ``B`` = 128 at base size, 16 tiny):

=============================  ==============================================================
``dense``                      no callback
``block S% static``            ``B x B`` blocks at sparsity S, random from initialization,
                               compressed (``schedule="constant", score="random"``)
``block S% rigl`` / ``set``    the same with RigL / SET regrowth every 100 steps until
                               ``--schedule-steps``, compressed
``block 90% gradual``          GMP from dense to 90% over the first half of ``--schedule-steps``,
                               masked-dense (the kept count moves)
``block S% wide``              a sparse wider model (Sparse-IFT): hidden and intermediate
                               widened by ``1/sqrt(1 - S)`` so its Linear layers cost what
                               dense's do per step, static and compressed
=============================  ==============================================================

One JSON per run under ``$OUT`` (default ``benchmarks/results``): the settings, the corpus's
token counts, the curve, tokens/s, peak memory and parameters kept; ``--plot`` draws the
held-out loss against wall-clock time, one line per variant (mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import at_least, device_name, write_json
from _corpus import load_corpus

SIZES = {"base": dict(hidden=2048, intermediate=5632, heads=16, kv_heads=16, block=128,
                      seq=1024, batch=8),
         "tiny": dict(hidden=64, intermediate=128, heads=4, kv_heads=4, block=16, seq=32,
                      batch=4)}
STATIC = dict(schedule="constant", score="random", compress=True)
VARIANTS: dict[str, dict | None] = {
    "dense": None,
    "block 75% static": dict(sparsity=0.75, **STATIC),
    "block 90% static": dict(sparsity=0.9, **STATIC),
    "block 90% rigl": dict(sparsity=0.9, regrow="rigl", frequency=100, **STATIC),
    "block 90% set": dict(sparsity=0.9, regrow="set", frequency=100, **STATIC),
    "block 90% gradual": dict(sparsity=0.9, schedule="gmp", compress=False),
    "block 75% wide": dict(sparsity=0.75, **STATIC),
    "block 90% wide": dict(sparsity=0.9, **STATIC),
}


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

        def on_train_start(self, trainer, module):
            self.start = time.perf_counter()
            self.evaluate(trainer, module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step % args.eval_every == 0:
                self.evaluate(trainer, module)

        def on_train_end(self, trainer, module):
            if not self.points or self.points[-1]["step"] != trainer.global_step:
                self.evaluate(trainer, module)

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
            point = {"step": trainer.global_step, "wall_s": time.perf_counter() - self.start,
                     "tokens": trainer.global_step * batch * seq,
                     "held_out_loss": statistics.fmean(losses)}
            self.points.append(point)
            print(json.dumps(point), flush=True)

    settings = VARIANTS[args.child]
    callbacks: list = [curve := Curve()]
    if settings is not None:
        extra = (dict(end=args.schedule_steps // 2, frequency=max(1, args.schedule_steps // 40))
                 if settings.get("schedule") == "gmp" else
                 dict(regrow_end=args.schedule_steps) if "regrow" in settings else {})
        callbacks.append(SparsityCallback(pattern=f"block:{size['block']}x{size['block']}",
                                          deny=["embed_tokens", "lm_head"], seed=args.seed,
                                          **settings, **extra))
    module = LM()
    if args.compile:
        module.model = torch.compile(module.model)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1,
                         precision="bf16-mixed", max_time={"seconds": args.budget_s},
                         max_steps=-1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, num_sanity_val_steps=0)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(Windows(), batch_size=None))
    train_s = curve.points[-1]["wall_s"]
    return {"variant": args.child, "seed": args.seed, "settings": settings,
            "hidden": hidden, "intermediate": intermediate, "layers": args.layers,
            "seq": seq, "batch": batch, "lr": args.lr, "warmup_steps": args.warmup_steps,
            "compile": args.compile, "budget_s": args.budget_s, "corpus": corpus.describe(),
            "curve": curve.points, "steps": trainer.global_step,
            "tokens_per_s": trainer.global_step * batch * seq / train_s if train_s else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
            "parameters": sum(p.numel() for p in module.parameters()),
            "final_held_out_loss": curve.points[-1]["held_out_loss"]}


def plot(paths: list[str], out: Path) -> Path:
    """Held-out loss against wall-clock seconds, one line per variant (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict]] = {}
    for path in paths:
        row = json.loads(Path(path).read_text())["run"]
        runs.setdefault(row["variant"], []).append(row)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for variant, rows in sorted(runs.items()):
        points = min(len(r["curve"]) for r in rows)
        wall = [statistics.fmean(r["curve"][i]["wall_s"] for r in rows) for i in range(points)]
        loss = [statistics.fmean(r["curve"][i]["held_out_loss"] for r in rows)
                for i in range(points)]
        axes.plot(wall, loss, label=f"{variant} ({len(rows)} seed{'s' * (len(rows) > 1)})")
    axes.set(xlabel="wall-clock seconds of training", ylabel="held-out loss",
             title="Time to quality")
    axes.legend()
    figure.savefig(path := out / "time_to_quality.png", dpi=120, bbox_inches="tight")
    return path


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
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=at_least(1), default=100)
    parser.add_argument("--schedule-steps", type=at_least(2), default=2000,
                        help="the gradual variant prunes over the first half of these steps; "
                             "regrowth stops after them (max_time leaves the length unknown)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--folder", type=Path, default=None,
                        help="corpus folder (default: the standard library)")
    parser.add_argument("--glob", default="**/*.py")
    parser.add_argument("--vocab", type=at_least(0), default=8192, help="BPE size; 0: bytes")
    parser.add_argument("--held-out", type=float, default=0.05)
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot saved runs and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    if args.plot:
        print(f"wrote {plot(args.plot, out)}")
        return
    if args.child:
        Path(args.result).write_text(json.dumps(run_child(args)))
        return
    corpus = load_corpus(args.folder, args.glob, args.vocab, args.held_out)  # cached once
    print(f"corpus: {corpus.describe()}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    shared = _without(sys.argv[1:], ("--variants", "--seeds"))
    for variant in args.variants:
        for seed in args.seeds:
            result = out / "_run.json"
            result.unlink(missing_ok=True)
            proc = subprocess.run([sys.executable, __file__, *shared, "--child", variant,
                                   "--seed", str(seed), "--result", str(result)],
                                  capture_output=True, text=True)
            if not result.exists():
                print(f"{variant} seed {seed}: FAILED ({proc.returncode}) "
                      f"{proc.stderr.strip()[-600:]}", flush=True)
                continue
            run = json.loads(result.read_text())
            result.unlink()
            name = f"time_to_quality_{variant.replace(' ', '_').replace('%', '')}_{seed}.json"
            write_json(name, {"command": " ".join(sys.argv), "run": run}, out=out,
                       device=device_name())
            print(f"{variant} seed {seed}: {run['steps']} steps, final held-out loss "
                  f"{run['final_held_out_loss']:.4f}, {run['tokens_per_s']:,.0f} tokens/s",
                  flush=True)


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
