"""1 GPU vs 2 GPUs (Lightning DDP over NCCL): a BERT-base QA training step, dense and compressed.

    python3 benchmarks/distributed_scaling.py             # on 2 GPUs: the table and its JSON
    python3 benchmarks/distributed_scaling.py --tiny --accelerator cpu --warmup 2 --steps 3 \\
        --block 16x16 --out /tmp/scaling_check            # CPU check: 2 gloo processes

bert_step.py's model and batch: HF ``BertForQuestionAnswering(BertConfig())`` (random init),
``bf16-mixed``, ``torch.optim.AdamW``, embeddings and QA head denied. Weak scaling: each GPU
runs the same 32 x 384 batch, so the global batch doubles on 2 GPUs; scaling efficiency =
samples/s on 2 / (2 x samples/s on 1). Variants: dense; 2:4 masked-dense (the engine's fused
masked step, what ``compress="auto"`` trains at this size); 2:4 compressed and 90%
block-sparse compressed (``compress=True``). 2:4 compressed layers
(``SemiStructuredLinear``) keep a dense-shaped weight, so DDP all-reduces as much gradient
as dense; block-sparse ones
(``BlockSparseLinear``) hold only the kept blocks as parameters, so the all-reduce shrinks.
Block 64x64: in the op table behind docs/performance.md (``block_sparse_ops_..._tma_auto
.json``, H100) BERT-base's three shapes at ~10% density take 0.51 / 0.43 / 0.44 of dense GPU
time (forward + dX + dW) at 64x64, against 0.62 / 0.44 / 0.46 at 128x128 and 0.66-0.80 at
32x32 (768x768, 768->3072, 3072->768); docs/block_sparse.md advises 64x64 for BERT-base.

Each (variant, device count) runs in a fresh process of this script (``--child``), whose
command line Lightning's DDP relaunches for rank 1. After ``--warmup`` steps every rank times
``--steps`` steps (device synchronized at both ends): ms/step = window / steps, rank 0's in
the table, every rank's in the JSON. Gradient MB: the bytes of the trainable parameters (fp32
under bf16-mixed), what DDP all-reduces per step. The children inherit this environment: on
the lent NCCL machines NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 must stay set (set to those values where missing). JSON under
``$OUT`` (or ``benchmarks/results``); a failed run reads "failed" and the script exits 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl
import torch
from _common import (
    NO_MULTICAST,
    at_least,
    communication_ms,
    device_activity,
    device_name,
    file_tag,
    print_row,
    printed_rows,
    write_json,
)
from bert_step import DENY, QuestionAnswering, RepeatedBatch, make_batch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader
from transformers import BertConfig

from sparse_training import SparsityCallback

DEVICES = (1, 2)
COMPRESSED = dict(compress=True, fused=True, deny=DENY)  # schedule: "oneshot" at step 0
VARIANTS: dict[str, Callable[[str], dict | None]] = {  # block "RxC" -> callback settings
    "dense": lambda block: None,
    # what compress="auto" trains at BERT-base size (2:4 under its 32M-weight threshold)
    "2:4 masked-dense": lambda block: dict(pattern="2:4", fused=True, deny=DENY),
    "2:4 compressed": lambda block: dict(pattern="2:4", **COMPRESSED),
    "90% block-sparse compressed": lambda block: dict(pattern=f"block:{block}", sparsity=0.9,
                                                      **COMPRESSED),
}


class StepTimer(Callback):
    """Times steps ``warmup`` to ``warmup + steps - 1`` from batch start to batch start (so
    every hook of a step counts once; put it first), records what the row reports, then
    profiles the next ``profiled`` steps on the GPU (:func:`profile_row`)."""

    def __init__(self, warmup: int, steps: int, profiled: int) -> None:
        self.warmup, self.steps, self.profiled, self.row = warmup, steps, profiled, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        end, step = self.warmup + self.steps, trainer.global_step
        if step not in (self.warmup, end, end + self.profiled):
            return
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if step == self.warmup:
            self.began = now
        elif step == end:
            ms = (now - self.began) * 1e3 / self.steps
            ranks = trainer.strategy.all_gather(torch.tensor(ms, device=pl_module.device))
            self.row = {"ms_per_step": ms, "rank_ms_per_step": ranks.flatten().tolist(),
                        "gradient_bytes": sum(p.numel() * p.element_size()
                                              for p in pl_module.parameters() if p.requires_grad),
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30
                        if cuda else None}
            if cuda and self.profiled:
                self.profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA])
                self.profiler.__enter__()
                self.began = time.perf_counter()
        elif cuda and self.profiled:
            self.profiler.__exit__(None, None, None)
            self.row["profile"] = profile_row(self.profiler.events(), self.profiled,
                                              (now - self.began) * 1e3 / self.profiled)


def profile_row(events, steps: int, wall_ms: float) -> dict:
    """Per profiled step: wall ms (profiler on), the communication split
    (:func:`communication_ms`: GPU busy, compute, NCCL, exposed NCCL) and the 8 kernels with
    the most time."""
    kernels: dict[str, float] = {}
    for event in device_activity(events):
        kernels[event.name[:80]] = (kernels.get(event.name[:80], 0.0)
                                    + event.time_range.elapsed_us() / 1e3 / steps)
    return {"wall_ms": wall_ms, **communication_ms(events, steps),
            "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8]),
            "sparse_routes": sparse_routes()}


def sparse_routes() -> dict[str, int]:
    """How many timed 2:4 shapes went to cuSPARSELt (forward, dX) and how many stayed
    on cuBLAS, in this process."""
    from sparse_training.kernels.semi_structured import paths

    choices = paths.cached_choices().values()
    return {"forward sparse": sum(c.forward for c in choices),
            "dX sparse": sum(c.input_grad for c in choices), "shapes": len(choices)}


def run_child(args: argparse.Namespace) -> dict | None:
    """One variant on ``args.devices`` devices, in this process (and Lightning's rank 1);
    the row on global rank 0, None elsewhere."""
    config = BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                        num_attention_heads=2) if args.tiny else BertConfig()
    torch.manual_seed(0)
    settings = VARIANTS[args.child](args.block)
    sparse = SparsityCallback(**settings) if settings is not None else None
    timer = StepTimer(args.warmup, args.steps, args.profiled)
    total = args.warmup + args.steps + args.profiled + 1  # the last step closes a window
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto",
                         precision=args.precision, max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[timer] + ([sparse] if sparse else []))
    data = RepeatedBatch(make_batch(config, args.batch, args.seq), total)
    trainer.fit(QuestionAnswering(config), DataLoader(data, batch_size=None))
    if trainer.global_rank != 0:
        return None
    engine = sparse.engine if sparse else None
    return {"variant": args.child, "devices": args.devices, **timer.row,
            "sparsity": engine.sparsity if engine else None,
            "masked_tensors": len(engine.masked) if engine else 0,
            "compressed_layers": len(engine.compressed) if engine else 0}


def run(name: str, devices: int, args: argparse.Namespace) -> dict:
    """One (variant, devices) in a fresh process: its row, or its error (the other runs go
    on: a failed row reads "failed" in the table)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    if args.accelerator == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # else Lightning gives rank 0 one thread, rank 1 all
        env["TRITON_INTERPRET"] = "1"  # fused=True and the block kernels run interpreted
    else:
        env.update({k: v for k, v in NO_MULTICAST.items() if k not in env})
    command = [sys.executable, __file__, "--child", name, "--devices", str(devices)]
    for key in ("warmup", "steps", "profiled", "batch", "seq", "block", "accelerator",
                "precision"):
        command += [f"--{key}", str(getattr(args, key))]
    command += ["--tiny"] if args.tiny else []
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    rows = printed_rows(done.stdout)
    if done.returncode == 0 and len(rows) == 1:
        return rows[0]
    error = f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    print(f"{name!r} on {devices} device(s) failed, {error}", file=sys.stderr, flush=True)
    return {"variant": name, "devices": devices, "error": error}


def cell(value: float | None, spec: str) -> str:
    return "failed" if value is None else spec.format(value)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    """Print the table; write it and the rows as JSON."""
    gpu = args.accelerator == "gpu"
    device = device_name("cuda" if gpu else "cpu")
    at = {(r["variant"], r["devices"]): r for r in rows}
    lines = [f"{'tiny BERT' if args.tiny else 'BERT-base'} QA step on {device}, Lightning DDP "
             f"({'NCCL' if gpu else 'gloo'}); weak scaling: batch {args.batch}x{args.seq} per "
             f"device (the global batch doubles with 2), {args.precision}, AdamW; {args.steps} "
             f"steps timed after {args.warmup}; torch {torch.__version__}", "",
             "| variant | 1 GPU ms/step | 2 GPUs ms/step | samples/s 1 GPU | samples/s 2 GPUs | "
             "scaling efficiency | speed vs dense (1 GPU) | speed vs dense (2 GPUs) | "
             "gradient MB all-reduced per step | peak GiB (1 / 2 GPUs) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        ms = {d: at[name, d].get("ms_per_step") for d in DEVICES}
        dense = {d: at["dense", d].get("ms_per_step") for d in DEVICES}
        rate = {d: d * args.batch * 1e3 / ms[d] if ms[d] else None for d in DEVICES}
        speed = {d: dense[d] / ms[d] if ms[d] and dense[d] else None for d in DEVICES}
        efficiency = rate[2] / (2 * rate[1]) if rate[1] and rate[2] else None
        grad = next((at[name, d]["gradient_bytes"] / 1e6 for d in DEVICES
                     if "gradient_bytes" in at[name, d]), None)
        peak = " / ".join(cell(at[name, d].get("peak_memory_gib"), "{:.1f}") for d in DEVICES)
        lines.append(f"| {name} | {cell(ms[1], '{:.2f}')} | {cell(ms[2], '{:.2f}')} | "
                     f"{cell(rate[1], '{:.1f}')} | {cell(rate[2], '{:.1f}')} | "
                     f"{cell(efficiency, '{:.1%}')} | {cell(speed[1], '{:.2f}x')} | "
                     f"{cell(speed[2], '{:.2f}x')} | {cell(grad, '{:.1f}')} | "
                     f"{peak if gpu else '-'} |")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        lines += ["", f"Profiled ({args.profiled} steps after the timed ones, rank 0), ms per "
                  f"step: GPU busy, compute (busy without NCCL), NCCL kernels, NCCL not "
                  f"hidden behind compute", "",
                  "| variant | GPUs | wall | GPU busy | compute | NCCL | exposed NCCL | "
                  "2:4 shapes sparse (fwd / dX of timed) |", "|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            f, routes = r["profile"], r["profile"]["sparse_routes"]
            lines.append(f"| {r['variant']} | {r['devices']} | {f['wall_ms']:.2f} | "
                         f"{f['gpu_busy_ms']:.2f} | {f['compute_busy_ms']:.2f} | "
                         f"{f['nccl_ms']:.2f} | {f['exposed_nccl_ms']:.2f} | "
                         f"{routes['forward sparse']} / {routes['dX sparse']} of "
                         f"{routes['shapes']} |")
    table = "\n".join(lines)
    print(table)
    tag = file_tag(device) if gpu else "cpu_tiny"
    path = write_json(f"distributed_scaling_{tag}.json", {
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "devices")},
        "rows": rows, "table": table}, out=args.out, device=device if gpu else "cpu")
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=at_least(0), default=15, help="untimed steps first")
    parser.add_argument("--steps", type=at_least(1), default=40, help="timed steps")
    parser.add_argument("--batch", type=int, help="per device; default 32 (--tiny: 2)")
    parser.add_argument("--seq", type=int, help="default 384 (--tiny: 32)")
    parser.add_argument("--profiled", type=int, default=5,
                        help="steps profiled on the GPU after the timed ones (0: none)")
    parser.add_argument("--block", default="64x64", help="RxC of the block-sparse variant")
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--tiny", action="store_true", help="2-layer 64-wide BERT (CPU check)")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", Path(__file__).parent / "results")))
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 32)
    args.seq = args.seq or (32 if args.tiny else 384)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print_row(run_child(args))
        return
    if args.accelerator == "gpu" and (visible := torch.cuda.device_count()) < 2:
        raise RuntimeError(f"the 1 vs 2 GPU table needs 2 CUDA GPUs, {visible} visible; for "
                           f"the CPU check pass --accelerator cpu --tiny")
    rows = []
    for name in VARIANTS:
        for devices in DEVICES:
            rows.append(run(name, devices, args))
            if "error" not in rows[-1]:  # (printed by run)
                print_row(rows[-1])
    report(args, rows)
    if failed := [f"{r['variant']!r} on {r['devices']}" for r in rows if "error" in r]:
        raise SystemExit(f"failed: {', '.join(failed)} (errors above and in the JSON)")


if __name__ == "__main__":
    main()
