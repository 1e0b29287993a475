"""A Llama-3-8B-shaped decoder trained compressed under FSDP2 on 1 and more GPUs, end to end.

    python3 benchmarks/e2e_distributed.py --gpus 1 2        # GPUs: the table, JSON under $OUT
    python3 benchmarks/e2e_distributed.py --model tiny --accelerator cpu --gpus 1 2 \\
        --warmup 1 --steps 2                                # CPU check: gloo processes

The model and the variants are e2e_step.py's (``build``, ``settings_of``): HF
``LlamaForCausalLM`` from a config (hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
vocabulary 32000) with ``--layers`` decoder layers (8 by default, a fixed model: 2.0 B
parameters, which trains dense with AdamW on one 80 GB GPU), 4 x 2048 tokens per GPU (weak
scaling: the global batch grows with the GPUs), ``precision="bf16-mixed"``; ``--model tiny``
is a 128-wide Llama with 2 x 32 tokens for CPU checks. The model is built on its GPU (a CPU
initialization of 2 B parameters takes minutes) in the module's ``__init__``;
``SparsityCallback`` swaps the compressed layers at ``setup``; ``configure_model`` shards it
with FSDP2 (``fully_shard``, through Lightning's ``ModelParallelStrategy``): each decoder layer
one unit, the root the embeddings, the final norm and the LM head; parameters gathered in
bf16 and gradients reduce-scattered in fp32 (``MixedPrecisionPolicy``, ``--gather-dtype``).
The optimizer is the user's ``torch.optim.AdamW(fused=True)`` in every variant.
Variants: dense; block 128x128 compressed (``compress=True``) at 90% and 75%; block 128x128
masked-dense at 90% (``compress=False``: dense weights, the engine's fused masked step);
embeddings and the LM head denied.

Each (variant, GPU count) runs in a fresh process of this script (``--child``; Lightning
relaunches its command line for the other ranks), killed with its ranks when it outlives
``--run-timeout`` or the ``--budget`` left; a failed run costs its row only. Each row is
printed as it finishes (``ROW {json}``) and the JSON (``e2e_distributed_llama<--tag>.json``
under ``$OUT``, or ``benchmarks/results``; ``..._tiny_cpu`` for the CPU check) is rewritten
after every row, so a run cut short keeps the finished rows. Columns:

- ms/step: rank 0's median over ``--steps`` steps after ``--warmup`` (each ranks' GPU
  synchronized at every step end); tokens/s per GPU = 4 x 2048 / step time;
- scaling efficiency: 1-GPU ms / N-GPU ms of the same variant (1.0: perfect weak scaling);
- speed vs dense: the dense step's ms / this variant's, at the same GPU count;
- peak GiB: the largest ``max_memory_allocated`` of any rank over the training steps;
- GB all-gathered and reduce-scattered per step, from the sharded parameters: each unit's
  parameters padded as FSDP2 pads them (dim 0 to a multiple of N), gathered twice per step
  (forward and backward; once for the root, which FSDP2 keeps unsharded between them) in the
  gather dtype, their gradients reduce-scattered once in fp32. These are the collectives'
  sizes; each GPU sends and receives (N - 1) / N of them;
- from a ``torch.profiler`` trace of ``--profiled`` steps after the timed ones (rank 0): NCCL
  kernel ms and exposed communication ms (time NCCL kernels run with no compute kernel);
  a second table splits them by collective (all-gather, reduce-scatter, ...): kernels per
  step, ms, and exposed ms, which says whether FSDP2's prefetch hides that kind; a third
  gives each rank's compute and NCCL ms of the profiled step (NCCL kernels wait for the
  slowest rank: one rank computing longer shows as the others' NCCL time) and whether the
  ranks' block-sparse kernels took the same tuned configurations (each rank autotunes on
  its own timings).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from _common import (
    NO_MULTICAST,
    at_least,
    communication_ms,
    device_name,
    print_row,
    printed_rows,
    write_json,
)
from _e2e_models import LLAMA_SHAPES
from _e2e_models import MODELS as E2E_MODELS
from e2e_step import build, settings_of, step_times, user_adamw
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

from sparse_training import BlockSparseLinear, SparsityCallback

MODELS = {"llama": "llama", "tiny": "tiny-llama"}  # --model -> e2e_step's model name
VARIANTS = ("dense fused", "block B 90% compressed", "block B 90% masked-dense",
            "block B 75% compressed")  # e2e_step's names, most wanted first
GATHER_DTYPES = ("bf16", "fp32")


def run_child(args: argparse.Namespace) -> dict | None:
    """One variant on ``args.devices`` devices in this process (and the ranks Lightning
    launches): the row on global rank 0, None elsewhere."""
    model_name = MODELS[args.model]
    settings, _, fused = settings_of(args.child, model_name)
    gpu = args.accelerator == "gpu"
    total = args.warmup + args.steps + (args.profiled if gpu else 0)
    timer = step_times(args.warmup, args.warmup + args.steps, gpu)
    probe = Probe(args.warmup + args.steps, args.profiled if gpu else 0, args.gather_dtype)
    sparse = SparsityCallback(**settings) if settings is not None else None
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        precision="bf16-mixed", max_steps=total, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, probe, *([sparse] if sparse else [])])
    device = f"cuda:{trainer.local_rank}" if gpu else "cpu"
    hf_model, batch = build(model_name, args.layers, device)
    if args.checkpointing:  # HF's own switch, as a user turns it on; recomputed per layer
        hf_model.gradient_checkpointing_enable({"use_reentrant": False})
    module = ShardedCausalLM(hf_model, fused=fused, gather_dtype=args.gather_dtype)
    trainer.fit(module, DataLoader([batch] * total, batch_size=None))
    if trainer.global_rank != 0:
        return None
    engine = sparse.engine if sparse else None
    losses = [float(loss) for loss in module.losses]
    ms = statistics.median(timer.ms[:args.steps])
    tokens = math.prod(LLAMA_SHAPES[model_name][2])
    return {"variant": args.child, "gpus": args.devices, "ms": ms,
            "device": device_name("cuda" if gpu else "cpu"),
            "tokens_per_s_per_gpu": tokens * 1e3 / ms, "step_ms": timer.ms[:args.steps],
            **probe.row,
            "compressed_layers": sum(isinstance(m, BlockSparseLinear) for m in module.modules()),
            "masked_dense_tensors": len(engine.masked) if engine else 0,
            "sparsity": engine.sparsity if engine else 0.0,
            "loss_first": losses[0], "loss_last": losses[-1]}


class ShardedCausalLM(pl.LightningModule):
    """An HF causal LM that ``configure_model`` shards with FSDP2: each decoder layer one
    unit, the rest (embeddings, final norm, LM head) the root; parameters gathered in
    ``gather_dtype``, gradients reduce-scattered in fp32."""

    def __init__(self, model: torch.nn.Module, fused: bool, gather_dtype: str) -> None:
        super().__init__()
        self.model, self.fused, self.gather_dtype = model, fused, gather_dtype
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if self.gather_dtype == "bf16" else None,
            reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)  # the root: its forward is called

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return user_adamw(self.parameters(), self.fused)


def collective_gb(module: torch.nn.Module, world: int, gather_bytes: int, reduce_bytes: int = 4) -> dict:
    """GB per step of the all-gathers and reduce-scatters of FSDP2 units ``module`` holds,
    from their sharded parameters (module doc): each parameter's dim 0 padded to a multiple
    of ``world``, gathered twice per step in a unit other than the root (forward, then
    backward) and once in the root, its gradient reduce-scattered once."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    owner: dict[int, bool] = {}  # parameter id -> whether its unit is the root
    for unit in reversed(units):  # nested units before the ones that hold them
        for param in unit.parameters():
            owner.setdefault(id(param), unit is units[0])
    gathered = scattered = 0
    for param in module.parameters():
        rows = param.shape[0] if param.dim() else 1
        padded = math.ceil(rows / world) * world * (param.numel() // max(rows, 1))
        gathered += padded * gather_bytes * (1 if owner.get(id(param), True) else 2)
        scattered += padded * reduce_bytes
    return {"all_gather_gb": gathered / 1e9, "reduce_scatter_gb": scattered / 1e9,
            "wire_gb_per_gpu": (gathered + scattered) * (world - 1) / world / 1e9,
            "fsdp_units": len(units)}


class Probe(Callback):
    """Collects a row's measurements besides the step times: the collectives' sizes at
    the start, every rank's peak memory of the training steps at the end, and a
    profile of steps ``first`` to ``first + profiled - 1`` on every rank's GPU (rank 0's
    in full, every rank's busy, compute and NCCL ms: a rank that computes longer makes
    the others' collectives wait), with whether every rank's block-sparse kernels took
    the same tuned configurations."""

    def __init__(self, first: int, profiled: int, gather_dtype: str) -> None:
        self.first, self.profiled, self.row = first, profiled, {}
        self.gather_bytes = 2 if gather_dtype == "bf16" else 4

    def on_train_start(self, trainer, pl_module) -> None:
        self.row["traffic"] = collective_gb(pl_module, trainer.world_size, self.gather_bytes)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.profiled and batch_idx == self.first:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.profiled and batch_idx == self.first + self.profiled - 1:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self.row["profile"] = communication_ms(self.profiler.events(), self.profiled)

    def on_train_end(self, trainer, pl_module) -> None:
        if pl_module.device.type != "cuda":
            return
        profile = self.row.get("profile", {})
        mine = [torch.cuda.max_memory_allocated() / 2**30] + [
            profile.get(key, math.nan) for key in RANK_COLUMNS[1:]]
        ranks = trainer.strategy.all_gather(torch.tensor(mine, device=pl_module.device))
        ranks = ranks.reshape(-1, len(mine)).tolist()  # every rank calls
        self.row.update(peak_gib=max(r[0] for r in ranks), rank_peak_gib=[r[0] for r in ranks],
                        ranks={key: [r[i] for r in ranks] for i, key in enumerate(RANK_COLUMNS)})
        tuned = [None] * trainer.world_size
        if trainer.world_size > 1:
            torch.distributed.all_gather_object(tuned, tuned_configs())
        self.row["tuned_configs_agree"] = all(t == tuned[0] for t in tuned)
        if not self.row["tuned_configs_agree"]:
            self.row["tuned_configs"] = tuned


RANK_COLUMNS = ("peak_gib", "gpu_busy_ms", "compute_busy_ms", "nccl_ms", "exposed_nccl_ms")


def tuned_configs() -> dict[str, str]:
    """The configuration Triton's autotuner chose for each key of the block-sparse kernels
    in this process (ranks tune apart, each on its own timings)."""
    from sparse_training.kernels.block_sparse import kernels

    return {f"{name} {key}": str(config)
            for name, tuned in (("forward/dX", kernels._DENSE_SPARSE),
                                ("dW", kernels._SAMPLED_DENSE_DENSE))
            for key, config in tuned.kernel.cache.items()}


def run(variant: str, devices: int, args: argparse.Namespace, timeout: float) -> dict:
    """One (variant, devices) in a fresh process group: its row, or its error."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    if args.accelerator == "cpu":
        env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="0")  # the layers' torch references
    else:
        env.update({k: v for k, v in NO_MULTICAST.items() if k not in env})
        env["TRITON_INTERPRET"] = "0"
    command = [sys.executable, __file__, "--child", variant, "--devices", str(devices)]
    for key in ("model", "layers", "warmup", "steps", "profiled", "accelerator", "gather_dtype"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    command += ["--checkpointing"] * args.checkpointing
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, start_new_session=True)  # its ranks share its group
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        return {"variant": variant, "gpus": devices, "wall_s": time.perf_counter() - start,
                "error": f"killed after {timeout:.0f} s: {stderr[-3000:]}"}
    rows = printed_rows(stdout)
    if child.returncode == 0 and len(rows) == 1:
        return {**rows[0], "wall_s": time.perf_counter() - start}
    return {"variant": variant, "gpus": devices, "wall_s": time.perf_counter() - start,
            "error": f"exit {child.returncode}: {stdout[-1000:]}\n{stderr[-5000:]}"}


def summary(error: str) -> str:
    """An error's last line (where a traceback names the exception), at most 160 chars."""
    lines = [line for line in error.splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:160]


def derived(rows: list[dict]) -> None:
    """Add each row's scaling efficiency (against the same variant on 1 GPU) and speed vs
    dense (at the same GPU count), where both rows ran."""
    ms = {(r["variant"], r["gpus"]): r.get("ms") for r in rows}
    for row in rows:
        one, dense = ms.get((row["variant"], 1)), ms.get(("dense fused", row["gpus"]))
        if row.get("ms"):
            row["scaling_efficiency"] = one / row["ms"] if one else None
            row["speed_vs_dense"] = dense / row["ms"] if dense else None


def shown_name(row: dict, block: int) -> str:
    """A row's variant as the tables show it, ``B`` read as the block size."""
    return row["variant"].replace("block B", f"block {block}x{block}")


def table(rows: list[dict], block: int) -> str:
    """The rows as a markdown table, ``B`` in the variants' names read as ``block`` (failed
    rows name their error's first line)."""
    def cell(value, spec: str) -> str:
        return "-" if value is None else spec.format(value)

    lines = ["| variant | GPUs | ms/step | tokens/s per GPU | scaling efficiency | speed vs "
             "dense | peak GiB | GB all-gathered / reduce-scattered per step | NCCL ms | "
             "exposed NCCL ms | loss first -> last |", "|---" * 11 + "|"]
    for r in rows:
        name = shown_name(r, block)
        if "error" in r:
            lines.append(f"| {name} | {r['gpus']} | failed: {summary(r['error'])} |" + " |" * 8)
            continue
        traffic, profile = r["traffic"], r.get("profile", {})
        lines.append(
            f"| {name} | {r['gpus']} | {r['ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{cell(r.get('scaling_efficiency'), '{:.1%}')} | "
            f"{cell(r.get('speed_vs_dense'), '{:.2f}x')} | {cell(r.get('peak_gib'), '{:.1f}')} | "
            f"{traffic['all_gather_gb']:.3g} / {traffic['reduce_scatter_gb']:.3g} | "
            f"{cell(profile.get('nccl_ms'), '{:.1f}')} | "
            f"{cell(profile.get('exposed_nccl_ms'), '{:.1f}')} | "
            f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return "\n".join(lines)


def collectives_table(rows: list[dict], block: int) -> str:
    """Per row and collective kind of its profile: kernels per step, their ms, and the ms no
    compute kernel overlaps (rows on one GPU issue none)."""
    lines = ["| variant | GPUs | collective | kernels per step | ms | exposed ms |",
             "|---" * 6 + "|"]
    for r in rows:
        name = shown_name(r, block)
        for kind, c in sorted(r.get("profile", {}).get("collectives", {}).items()):
            lines.append(f"| {name} | {r['gpus']} | {kind} | {c['count']:.1f} | "
                         f"{c['ms']:.1f} | {c['exposed_ms']:.1f} |")
    return "\n".join(lines)


def ranks_table(rows: list[dict], block: int) -> str:
    """Per row on several GPUs: each rank's compute and NCCL ms of the profiled step, and
    whether the ranks' kernels took the same tuned configurations."""
    lines = ["| variant | GPUs | compute ms per rank | NCCL ms per rank | same tuned configs |",
             "|---" * 5 + "|"]
    for r in rows:
        if r.get("gpus", 1) < 2 or "ranks" not in r:
            continue
        name = shown_name(r, block)
        compute, nccl = (" / ".join(f"{v:.1f}" for v in r["ranks"][key])
                         for key in ("compute_busy_ms", "nccl_ms"))
        lines.append(f"| {name} | {r['gpus']} | {compute} | {nccl} | "
                     f"{'yes' if r['tuned_configs_agree'] else 'no'} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=at_least(1), nargs="+", default=[1, 2],
                        help="device counts (those above the visible GPUs are skipped)")
    parser.add_argument("--model", choices=list(MODELS), default="llama")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; tiny: 2)")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps first")
    parser.add_argument("--steps", type=at_least(1), default=6, help="timed steps")
    parser.add_argument("--profiled", type=int, default=1,
                        help="GPU steps profiled after the timed ones (0: none)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help=f"e2e_step.py variant names (default: {', '.join(VARIANTS)})"
                        .replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--gather-dtype", choices=GATHER_DTYPES, default="bf16",
                        help="FSDP2's param_dtype: what the all-gathers carry")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing of every decoder layer (HF's "
                             "gradient_checkpointing_enable, non-reentrant)")
    parser.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--budget", type=float, default=520,
                        help="seconds for all runs; runs that do not fit are not started")
    parser.add_argument("--run-timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--tag", default="", help="appended to the JSON file's name")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", Path(__file__).parent / "results")))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layers = args.layers or (8 if args.model == "llama" else 2)
    for variant in args.variants:  # a bad name stops before any run
        settings_of(variant, MODELS[args.model])
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print_row(run_child(args))
        return
    visible = torch.cuda.device_count() if args.accelerator == "gpu" else max(args.gpus)
    counts = [n for n in args.gpus if n <= visible]
    if skipped := [n for n in args.gpus if n > visible]:
        print(f"skipped GPU counts {skipped}: {visible} visible", flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "devices", "out")}
    tag = (args.model if args.accelerator == "gpu" else f"{args.model}_cpu") + (
        "_ckpt" if args.checkpointing else "")
    path = args.out / f"e2e_distributed_{tag}{args.tag}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    block = E2E_MODELS[MODELS[args.model]].block
    start = time.perf_counter()
    for variant in args.variants:
        for devices in counts:
            left = args.budget - (time.perf_counter() - start)
            row = (run(variant, devices, args, min(args.run_timeout, left)) if left > 30 else
                   {"variant": variant, "gpus": devices, "error": "not run: budget spent"})
            rows.append(row)
            shown = {k: summary(v) if k == "error" else v for k, v in row.items()}
            print_row(shown)
            derived(rows)
            # the device's name comes from the ranks' rows: this process keeps off the GPUs
            device = next((r["device"] for r in rows if "device" in r), "no device: every run failed")
            write_json(path.name, {"args": settings, "rows": rows, "table": table(rows, block),
                                   "collectives": collectives_table(rows, block),
                                   "ranks": ranks_table(rows, block)},
                       out=args.out, device=device)
    recompute = ", activation checkpointing" if args.checkpointing else ""
    print(f"\n{args.model} ({args.layers} layers) under FSDP2 on {device}, "
          f"bf16-mixed, gathers in {args.gather_dtype}{recompute}; torch {torch.__version__}\n")
    print(table(rows, block))
    print("\nCollectives of the profiled step, rank 0:\n")
    print(collectives_table(rows, block))
    print("\nEach rank's profiled step:\n")
    print(ranks_table(rows, block))
    print(f"wrote {path}")
    if failed := [f"{r['variant']!r} on {r['gpus']}" for r in rows if "error" in r]:
        raise SystemExit(f"failed: {', '.join(failed)} (errors in the JSON)")


if __name__ == "__main__":
    main()
