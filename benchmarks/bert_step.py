"""Per-step cost of SparsityCallback at BERT scale, against the same dense step (issue 8).

    python3 benchmarks/bert_step.py                  # on the GPU: the table of docs/performance.md
    python3 benchmarks/bert_step.py --tiny --steps 8 # a 2-layer model on the CPU: checks the script

HF ``BertForQuestionAnswering`` built from ``BertConfig()`` (bert-base: 12 layers, 768 wide,
random init), batch 32 x 384 tokens, ``precision="bf16-mixed"``, ``torch.optim.AdamW``
(torch's default foreach step), embeddings and the QA head denied: 72 masked Linear weights,
85M masked of 109M parameters. Each variant trains ``--warmup`` steps, then ``--steps``
timed steps (GMP and RigL at ``frequency=100``, so their mask updates fall in the timed
window). Mean step = wall time of the timed window between two device synchronizations
(nothing synchronizes inside it). Callback host ms = Python time spent in the callback's
hooks and the optimizer hooks per step (the fused kernel launch included; the forward and
backward that the fused pre-hook runs as Lightning's closure excluded). GPU busy = summed
kernel time per step from ``torch.profiler`` over a few extra steps. One run, one table;
JSON with the GPU and versions under ``$OUT`` (or ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset
from transformers import BertConfig, BertForQuestionAnswering

import sparse_training.kernels
from sparse_training import SparsityCallback

DENY = ["embeddings", "qa_outputs"]
VARIANTS: dict[str, dict | None] = {
    "dense": None,
    "2:4 one-shot, hooks": dict(pattern="2:4", fused=False),
    "2:4 one-shot, fused": dict(pattern="2:4", fused=True),
    "90% unstructured one-shot, hooks": dict(pattern="unstructured", sparsity=0.9, fused=False),
    "90% unstructured one-shot, fused": dict(pattern="unstructured", sparsity=0.9, fused=True),
    "GMP to 90%, freq 100, hooks": dict(pattern="unstructured", sparsity=0.9, schedule="gmp",
                                        end=0.9, frequency=100, fused=False),
    "GMP to 90%, freq 100, fused": dict(pattern="unstructured", sparsity=0.9, schedule="gmp",
                                        end=0.9, frequency=100, fused=True),
    "RigL 90%, freq 100, hooks": dict(pattern="unstructured", sparsity=0.9,
                                      schedule="constant", score="random", regrow="rigl",
                                      regrow_end=1.0, frequency=100, fused=False),
    "RigL 90%, freq 100, fused": dict(pattern="unstructured", sparsity=0.9,
                                      schedule="constant", score="random", regrow="rigl",
                                      regrow_end=1.0, frequency=100, fused=True),
}


class RepeatedBatch(IterableDataset):
    """The same random batch ``length`` times (no loading cost in the timed steps)."""

    def __init__(self, batch: dict[str, torch.Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __iter__(self):
        return iter([self.batch] * self.length)

    def __len__(self) -> int:
        return self.length


class QuestionAnswering(pl.LightningModule):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.model = BertForQuestionAnswering(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-5, weight_decay=0.01)


class WindowTimer(Callback):
    """Wall time of steps [warmup, warmup + steps), synchronized only at the two ends;
    host time inside the sparsity callback's hooks and the optimizer hooks."""

    def __init__(self, warmup: int, steps: int, sparse: SparsityCallback | None) -> None:
        self.warmup, self.steps, self.sparse = warmup, steps, sparse
        self.hook_seconds = 0.0
        self.window_ms: float | None = None
        if sparse is not None:
            for name in ("on_train_batch_start", "on_before_optimizer_step",
                         "on_train_batch_end"):
                setattr(sparse, name, self._timed(getattr(sparse, name)))

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.timing:
                    self.hook_seconds += time.perf_counter() - began
        return wrapper

    timing = False
    fused: bool | None = None

    def on_fit_start(self, trainer, pl_module):
        # after the sparsity callback's on_fit_start: its optimizer post-hooks exist now
        for optimizer in trainer.optimizers:
            hooks = optimizer._optimizer_step_post_hooks
            for key, fn in list(hooks.items()):
                hooks[key] = self._timed(fn)

    def on_train_end(self, trainer, pl_module):
        if self.sparse is not None:  # before the sparsity callback's teardown
            self.fused = bool(self.sparse.engine.fused_optimizers)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.began = time.perf_counter()
            self.timing = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.warmup + self.steps - 1:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.window_ms = (time.perf_counter() - self.began) * 1e3
            self.timing = False


def time_fused_kernel(timer: WindowTimer) -> None:
    """Count the fused kernel call's host time (it runs inside the pre-hook, after the
    closure) into ``timer``."""
    original = sparse_training.kernels.fused_masked_step

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if timer.timing:
                timer.hook_seconds += time.perf_counter() - began

    sparse_training.kernels.fused_masked_step = timed


def make_batch(config: BertConfig, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "token_type_ids": (torch.arange(seq) >= seq // 4).long().expand(batch, seq).clone(),
        "start_positions": torch.randint(0, seq, (batch,), generator=g),
        "end_positions": torch.randint(0, seq, (batch,), generator=g),
    }


class StepProfiler(Callback):
    """``torch.profiler`` over ``steps`` steps starting at batch ``first``: kernel time
    (GPU busy) and wall time per step, and the top operations by host and device time."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.profile = None
        self.result: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.first and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profile.__enter__()
            self.began = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.profile is None or batch_idx != self.first + self.steps - 1:
            return
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self.began) * 1e3 / self.steps
        self.profile.__exit__(None, None, None)
        averages = self.profile.key_averages()
        self.result = {
            "profiled_wall_ms_per_step": wall_ms,
            "gpu_busy_ms_per_step": busy_ms(self.profile.events()) / self.steps,
            "top_by_device": averages.table(sort_by="self_device_time_total", row_limit=18),
            "top_by_host": averages.table(sort_by="self_cpu_time_total", row_limit=18)}
        self.profile = None


def busy_ms(events) -> float:
    """Union of the device activity intervals (kernels, copies, memsets; user annotations,
    which span idle time too, left out), in ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.is_user_annotation and not e.name.startswith("Optimizer."))
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def gpu_clocks() -> str | None:
    """SM clock, temperature and power now (nvidia-smi), to see drift between variants."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def run_variant(name: str, args, config: BertConfig, batch) -> dict:
    settings = VARIANTS[name]
    torch.manual_seed(0)
    model = QuestionAnswering(config)
    sparse = None if settings is None else SparsityCallback(deny=DENY, **settings)
    timer = WindowTimer(args.warmup, args.steps, sparse)
    time_fused_kernel(timer)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    precision = "bf16-mixed"
    total = args.warmup + args.steps + args.profile_steps
    profiler = StepProfiler(args.warmup + args.steps, args.profile_steps)
    callbacks = [c for c in (sparse, timer, profiler) if c is not None]
    trainer = pl.Trainer(max_steps=total, accelerator=accelerator, devices=1,
                         precision=precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, num_sanity_val_steps=0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, DataLoader(RepeatedBatch(batch, total), batch_size=None))
    row = {"variant": name, "mean_step_ms": timer.window_ms / args.steps,
           "callback_host_ms_per_step": timer.hook_seconds * 1e3 / args.steps,
           "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                               if torch.cuda.is_available() else None)}
    if sparse is not None:
        engine = sparse.engine
        slots = getattr(engine, "slots", None) or engine.layers  # (an older engine: layers)
        row["masked_weights"] = sum(slot.plan.numel for slot in slots)
        row["masked_tensors"] = len(slots)
        row["sparsity"] = engine.sparsity
        row["fused"] = timer.fused

    row.update({k: v for k, v in profiler.result.items() if not k.startswith("top_")})
    row["profile_tables"] = {k: v for k, v in profiler.result.items() if k.startswith("top_")}
    row["gpu_clocks_after"] = gpu_clocks()
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile-steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--tiny", action="store_true", help="2-layer 64-wide BERT (CPU check)")
    parser.add_argument("--variants", nargs="*", default=["dense", *VARIANTS, "dense"],
                        help="in this order, each in a fresh process; dense again at the end "
                             "shows drift")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run this one variant, print it
    parser.add_argument("--before", type=Path, help="a folder holding an earlier "
                        "sparse_training package: variants named 'NAME @before' import it")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", Path(__file__).parent / "results")))
    return parser.parse_args()


def bert_config(tiny: bool) -> BertConfig:
    return BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=2) if tiny else BertConfig()


def child(args: argparse.Namespace) -> None:
    """One variant in this process; its row as one JSON line."""
    config = bert_config(args.tiny)
    row = run_variant(args.child, args, config, make_batch(config, args.batch, args.seq))
    print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for index, name in enumerate(args.variants):
        env = dict(os.environ)
        if name.endswith(" @before"):
            env["PYTHONPATH"] = os.pathsep.join([str(args.before), env.get("PYTHONPATH", "")])
        command = [sys.executable, __file__, "--child", name.removesuffix(" @before"),
                   "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--profile-steps", str(args.profile_steps),
                   "--batch", str(args.batch), "--seq", str(args.seq)] + (
                       ["--tiny"] if args.tiny else [])
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not lines:
            raise RuntimeError(f"variant {name!r} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][4:]))
        rows[-1]["variant"] = name
        if name in args.variants[:index]:
            rows[-1]["variant"] = f"{name} (again, drift check)"
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile_tables"}),
              flush=True)
    report(args, rows)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    dense = next((r for r in rows if r["variant"] == "dense"), None)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine()
    lines = [f"BERT-base QA step, batch {args.batch}x{args.seq}, bf16-mixed, AdamW, on "
             f"{device}, torch {torch.__version__}; {args.steps} timed steps per variant", "",
             "| variant | mean step ms | vs dense | callback host ms/step | profiled step ms "
             "| GPU busy ms/step | peak GiB |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = row["mean_step_ms"] / dense["mean_step_ms"] if dense else float("nan")
        row["vs_dense"] = ratio
        busy = row.get("gpu_busy_ms_per_step")
        wall = row.get("profiled_wall_ms_per_step")
        peak = row["peak_memory_gib"]
        lines.append(f"| {row['variant']} | {row['mean_step_ms']:.2f} | {ratio:.3f}x | "
                     f"{row['callback_host_ms_per_step']:.2f} | "
                     f"{'-' if wall is None else f'{wall:.2f}'} | "
                     f"{'-' if busy is None else f'{busy:.2f}'} | "
                     f"{'-' if peak is None else f'{peak:.1f}'} |")
    table = "\n".join(lines)
    print(table)
    environment = {"device": device, "torch": torch.__version__, "lightning": pl.__version__,
                   "python": platform.python_version()}
    try:
        import transformers
        import triton

        environment.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "tiny" if args.tiny else device.replace(" ", "_")
    with open(args.out / f"bert_step_{tag}_profiles.txt", "w") as file:
        for row in rows:
            for key, text in row.pop("profile_tables", {}).items():
                file.write(f"== {row['variant']}: {key}\n{text}\n")
    path = args.out / f"bert_step_{tag}.json"
    path.write_text(json.dumps({**environment, "args": {k: str(v) for k, v in
                                                        vars(args).items()},
                                "rows": rows, "table": table}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
