"""Per-step cost of SparsityCallback at BERT scale, paired with the dense step.

    python3 benchmarks/bert_step.py                  # on the GPU: the table of docs/performance.md
    TRITON_INTERPRET=1 python3 benchmarks/bert_step.py --tiny --pairs 2 --block 4 --warmup 2
                                        # CPU: checks the script (fused steps: interpreter)

Side by side with an earlier version: export its package into an ignored folder, e.g.
``mkdir .bench_old && git archive b5ddb53 sparse_training | tar -x -C .bench_old``, and pass
``--before .bench_old --variants "2:4 one-shot, hooks @before" ...`` (carry the folder to
the device); rows named ``NAME @before`` import it.

HF ``BertForQuestionAnswering`` built from ``BertConfig()`` (bert-base: 12 layers, 768 wide,
random init), batch 32 x 384 tokens, ``precision="bf16-mixed"``, ``torch.optim.AdamW``
(torch's default foreach step), embeddings and the QA head denied: 72 masked weight
tensors, 85M of the 109M parameters.

Why paired blocks: the step is host-bound (the GPU is busy ~32 of ~45-53 ms) and the same
dense run varied by 8% between processes on the lent machine, more than the effect to
measure. So each variant runs in one process and alternates blocks of ``--block`` steps
with the callback off (its hooks bypassed and its optimizer hooks detached: exactly the
dense step, the user's AdamW on every parameter; zeros in the weights do not change a
matmul's cost) and on. Both kinds of block see the same process, GPU clocks and host state.
A block's first step (the switch) is not timed; nothing synchronizes inside a block except
around a mask-update step, which is timed on its own.

Columns: steady step with the callback on and off (median of block means), the median of
the adjacent off/on block ratios; the
extra time of a mask-update step over a steady step, and the cost at ``frequency`` 100
(steady ratio + update extra / 100 steps); the Python time in the callback's hooks and
optimizer hooks per on-step (the fused kernel's launch included, the closure's forward and
backward excluded); GPU busy per step from ``torch.profiler`` over one extra off and on
block. One run, one table; JSON with the GPU and versions under ``$OUT`` (or
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from _common import at_least, busy_ms, device_name, file_tag, write_json
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset
from transformers import BertConfig, BertForQuestionAnswering

import sparse_training.kernels
from sparse_training import SparsityCallback

DENY = ["embeddings", "qa_outputs"]
FREQUENCY = 100
VARIANTS: dict[str, dict] = {
    "2:4 one-shot, hooks": dict(pattern="2:4", fused=False),
    "2:4 one-shot, fused": dict(pattern="2:4", fused=True),
    "90% unstructured one-shot, hooks": dict(pattern="unstructured", sparsity=0.9, fused=False),
    "90% unstructured one-shot, fused": dict(pattern="unstructured", sparsity=0.9, fused=True),
    "GMP to 90%, hooks": dict(pattern="unstructured", sparsity=0.9, schedule="gmp", end=300,
                              frequency=FREQUENCY, fused=False),
    "GMP to 90%, fused": dict(pattern="unstructured", sparsity=0.9, schedule="gmp", end=300,
                              frequency=FREQUENCY, fused=True),
    "RigL 90%, hooks": dict(pattern="unstructured", sparsity=0.9, schedule="constant",
                            score="random", regrow="rigl", regrow_end=1.0,
                            frequency=FREQUENCY, fused=False),
    "RigL 90%, fused": dict(pattern="unstructured", sparsity=0.9, schedule="constant",
                            score="random", regrow="rigl", regrow_end=1.0,
                            frequency=FREQUENCY, fused=True),
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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PairedBlocks(Callback):
    """Alternates blocks of steps with the sparsity callback off and on (off first, after
    ``warmup`` steps on), times each block and each mask-update step, and adds up the host
    time spent in the sparsity callback. Put it before the sparsity callback."""

    def __init__(self, sparse: SparsityCallback, warmup: int, block: int, blocks: int) -> None:
        self.sparse, self.warmup, self.block, self.blocks = sparse, warmup, block, blocks
        self.on, self.host_seconds, self.host_steps = True, 0.0, 0
        self.host_block_seconds = 0.0  # host time inside the timed steps of on-blocks
        self.block_ms: dict[bool, list[float]] = {True: [], False: []}
        self.update_ms: list[float] = []
        self.profiles: dict[bool, float] = {}
        self.host_costs: dict[str, float] = {}
        self._timed_from: int | None = None
        for name in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
            setattr(sparse, name, self._gated(getattr(sparse, name)))
        original = sparse_training.kernels.fused_masked_step
        sparse_training.kernels.fused_masked_step = self._timed(original)

    def _timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host_seconds += time.perf_counter() - began
        return wrapper

    def _gated(self, fn):
        timed = self._timed(fn)
        return lambda *args, **kwargs: timed(*args, **kwargs) if self.on else None

    def _switch(self, trainer, on: bool) -> None:
        engine = self.sparse.engine
        if on:
            for optimizer in trainer.optimizers:
                engine.attach(optimizer)
                hooks = optimizer._optimizer_step_post_hooks
                for key, fn in list(hooks.items()):
                    hooks[key] = self._timed(fn)
        else:
            engine.detach()
        self.on = on

    def on_train_end(self, trainer, pl_module):
        # still on the GPU (teardown moves the model back to the CPU)
        self.host_costs = host_costs(self.sparse.engine, trainer.optimizers[0])

    def _block_of(self, step: int) -> int:
        return (step - self.warmup) // self.block

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if step < self.warmup:
            return
        index = self._block_of(step)
        if (step - self.warmup) % self.block == 0:  # a switch: off in even blocks
            on = index % 2 == 1
            if index >= self.blocks:  # the two profiled blocks after the timed ones
                on = index == self.blocks + 1
                if index > self.blocks:
                    self._stop_profile(not on)
                self._start_profile(on)
            if on != self.on:
                self._switch(trainer, on)
            self._timed_from = step + 1
            self._update_ms = 0.0
            self._updates = 0
        if step == self._timed_from:
            sync()
            self._began = time.perf_counter()
        if self.on and step > self.warmup and step % FREQUENCY == 0 and step != self._timed_from:
            sync()
            self._update_began = time.perf_counter()
        if step == self._timed_from:
            self._host_mark = self.host_seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the step that just ran
        if step < self.warmup or self._timed_from is None:
            return
        if self.on and step > self.warmup and step % FREQUENCY == 0 and step != self._timed_from:
            sync()
            elapsed = (time.perf_counter() - self._update_began) * 1e3
            self._update_ms += elapsed
            self._updates += 1
            self.update_ms.append(elapsed)
        index = self._block_of(step)
        if (step - self.warmup) % self.block == self.block - 1 and index < self.blocks:
            sync()
            total = (time.perf_counter() - self._began) * 1e3 - self._update_ms
            steps = self.block - 1 - self._updates
            self.block_ms[self.on].append(total / steps)
            if self.on:
                self.host_block_seconds += self.host_seconds - self._host_mark
                self.host_steps += self.block - 1
        if step == self.warmup + (self.blocks + 2) * self.block - 1:
            self._stop_profile(self.on)

    def _start_profile(self, on: bool) -> None:
        if not torch.cuda.is_available():
            return
        from torch.profiler import ProfilerActivity, profile

        sync()
        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self._profile.__enter__()

    def _stop_profile(self, on: bool) -> None:
        if not torch.cuda.is_available():
            return
        sync()
        self._profile.__exit__(None, None, None)
        self.profiles[on] = busy_ms(self._profile.events()) / self.block


def make_batch(config: BertConfig, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "token_type_ids": (torch.arange(seq) >= seq // 4).long().expand(batch, seq).clone(),
        "start_positions": torch.randint(0, seq, (batch,), generator=g),
        "end_positions": torch.randint(0, seq, (batch,), generator=g),
    }


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """One variant, in this process."""
    config = BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                        num_attention_heads=2) if args.tiny else BertConfig()
    torch.manual_seed(0)
    model = QuestionAnswering(config)
    sparse = SparsityCallback(deny=DENY, **VARIANTS[name])
    blocks = 2 * args.pairs
    paired = PairedBlocks(sparse, args.warmup, args.block, blocks)
    total = args.warmup + (blocks + 2) * args.block
    trainer = pl.Trainer(max_steps=total, accelerator="gpu" if torch.cuda.is_available()
                         else "cpu", devices=1, precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[paired, sparse])
    trainer.fit(model, DataLoader(RepeatedBatch(make_batch(config, args.batch, args.seq),
                                                total), batch_size=None))
    on, off = (statistics.median(paired.block_ms[k]) for k in (True, False))
    steady = statistics.median(a / b for a, b in zip(paired.block_ms[True],
                                                     paired.block_ms[False], strict=True))
    update = statistics.mean(paired.update_ms) - on if paired.update_ms else 0.0
    engine = sparse.engine
    slots = getattr(engine, "slots", None) or engine.layers  # (an older engine: layers)
    return {
        "variant": name, "on_ms": on, "off_ms": off, "steady_ratio": steady,
        "update_extra_ms": update, "ratio_at_frequency_100": steady + update / FREQUENCY / off,
        "callback_host_ms_per_step": paired.host_block_seconds * 1e3 / max(paired.host_steps, 1),
        "gpu_busy_off_ms": paired.profiles.get(False), "gpu_busy_on_ms": paired.profiles.get(True),
        "blocks_on_ms": paired.block_ms[True], "blocks_off_ms": paired.block_ms[False],
        "update_steps_ms": paired.update_ms, "masked_tensors": len(slots),
        "masked_weights": sum(s.plan.numel for s in slots), "sparsity": engine.sparsity,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                            if torch.cuda.is_available() else None),
        **paired.host_costs,
    }


def host_costs(engine, optimizer, calls: int = 50) -> dict:
    """Host microseconds per call of the per-step passes with an empty launch queue (the
    device synchronized before each batch of calls): what they add to a host-bound step."""
    if not hasattr(engine, "slots"):
        return {}  # (an older engine has no per-optimizer lists to time)
    engine.attach(optimizer)  # a no-op: the last block is an on-block
    attached = engine._attached[optimizer]
    grads = [torch.randn_like(p) for p in attached.params]

    def per_call(fn) -> float:
        fn()
        sync()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = (time.perf_counter() - began) / calls * 1e6
        sync()
        return elapsed

    def set_grads() -> None:
        for p, g in zip(attached.params, grads, strict=True):
            p.grad = g

    set_grads()
    costs = {"host_us_gradient_pass": per_call(attached.zero_pruned_gradients),
             "host_us_weight_pass": per_call(attached.zero_pruned_weights)}
    if optimizer in engine.fused_optimizers:
        masks = attached.masks_by_param
        costs["host_us_fused_step"] = per_call(
            lambda: (set_grads(), sparse_training.kernels.fused_masked_step(optimizer, masks))
        ) - per_call(set_grads)
    return costs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # defaults: the updates at steps 100, 200 and 300 fall inside on-blocks, not on a switch
    parser.add_argument("--warmup", type=at_least(0), default=25)
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--pairs", type=at_least(1), default=15, help="off/on block pairs")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--tiny", action="store_true", help="2-layer 64-wide BERT (CPU check)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS),
                        help="each in a fresh process")
    parser.add_argument("--before", type=Path, help="a folder holding an earlier "
                        "sparse_training package: variants named 'NAME @before' import it")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run this one variant, print it
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", Path(__file__).parent / "results")))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        print("ROW " + json.dumps(run_variant(args.child, args)), flush=True)
        return
    rows = []
    for name in args.variants:
        env = dict(os.environ)
        if name.endswith(" @before"):
            env["PYTHONPATH"] = os.pathsep.join([str(args.before), env.get("PYTHONPATH", "")])
        command = [sys.executable, __file__, "--child", name.removesuffix(" @before")]
        for key in ("warmup", "block", "pairs", "batch", "seq"):
            command += [f"--{key}", str(getattr(args, key))]
        command += ["--tiny"] if args.tiny else []
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not lines:
            raise RuntimeError(f"variant {name!r} failed:\n{done.stderr[-3000:]}")
        rows.append({**json.loads(lines[-1][4:]), "variant": name})
        print(json.dumps(rows[-1]), flush=True)
    report(args, rows)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    device = device_name()
    lines = [f"BERT-base QA step, batch {args.batch}x{args.seq}, bf16-mixed, AdamW, on {device},"
             f" torch {torch.__version__}; {args.pairs} off/on pairs of {args.block}-step blocks "
             f"per variant", "",
             "| variant | on ms | off (dense) ms | on/off | update step extra ms | on/off at "
             "frequency 100 | callback host ms/step | host µs per pass, queue empty (grad / "
             "weight / fused step) | GPU busy off / on ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        busy = (f"{r['gpu_busy_off_ms']:.2f} / {r['gpu_busy_on_ms']:.2f}"
                if r["gpu_busy_on_ms"] is not None else "-")
        update = f"{r['update_extra_ms']:.1f}" if r["update_steps_ms"] else "-"
        passes = " / ".join(f"{r[k]:.0f}" if k in r else "-" for k in (
            "host_us_gradient_pass", "host_us_weight_pass", "host_us_fused_step"))
        lines.append(f"| {r['variant']} | {r['on_ms']:.2f} | {r['off_ms']:.2f} | "
                     f"{r['steady_ratio']:.3f}x | {update} | {r['ratio_at_frequency_100']:.3f}x "
                     f"| {r['callback_host_ms_per_step']:.2f} | {passes} | {busy} |")
    table = "\n".join(lines)
    print(table)
    tag = "tiny" if args.tiny else file_tag(device)
    path = write_json(f"bert_step_{tag}.json", {
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "table": table},
        out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
