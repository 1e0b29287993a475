"""Whole training steps of real models through ``pl.Trainer``, the way a user trains.

    python3 benchmarks/e2e_step.py --model bert-base            # GPU: one table, JSON in $OUT
    python3 benchmarks/e2e_step.py --model llama --layers 4
    python3 benchmarks/e2e_step.py --model tiny --steps 2 --warmup 1   # CPU: checks the script
    python3 benchmarks/e2e_step.py --model llama --layers 2 --profile --variants "dense fused" \
        "block B 90% compressed"                       # where the time goes, Amdahl limits
    python3 benchmarks/e2e_step.py --report benchmarks/results/e2e_step_*.json  # saved tables

Models: HF ``BertForQuestionAnswering(BertConfig())`` (bert-base, random init, 32 x 384
tokens) or a Llama-3-8B-shaped ``LlamaForCausalLM`` from a config (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocab 32000, ``--layers`` decoder layers, 4 x 2048
tokens; ``tiny-llama``: hidden 128, 2 x 32 tokens, for CPU checks); embeddings, the QA
head and the LM head denied. Every variant is a
``LightningModule`` around the HF model with the user's ``torch.optim.AdamW`` (``fused=True``,
the fastest AdamW a user would pick, dense or sparse; the ``dense`` variant keeps torch's
default, foreach), ``pl.Trainer(accelerator="gpu",
precision="bf16-mixed")`` and ``SparsityCallback`` with its public options; ``+compile``
variants compile the HF model in the module's ``__init__`` (``torch.compile(model, mode)``).

Each variant runs in its own process (its own peak memory; a crash costs one row). Columns:
median ms per step after ``--warmup`` steps (the GPU synchronized at each step end), the
ratio to the dense fused step, peak GiB (``max_memory_allocated``), the training paths the
callback chose (compressed / masked-dense tensors and the compressed layer types found in
the model after the fit), the first and last loss, and the error if the run failed.

``--profile`` (:mod:`_step_profile`) adds, from ``torch.profiler`` (CPU, and CUDA where
present) over 2 more steps after the timed ones: ms per step by kernel family (sparse
products, dense products, attention, optimizer, memory copies, elementwise/other; on a
CPU-only run the aten ops' self CPU time), the 5 largest "other" kernels, ``busy`` (GPU busy:
the union of the device activity) and ``host``, the *exposed host time*: the profiled step's
wall time minus its GPU busy time (the profiler's own overhead is in it; ``wall_ms`` vs
``profiled_wall_ms`` in the JSON shows how much); then 2 more steps under ``cProfile``: the
host's Python functions with the most own time per step and the caller of each
(``python_top``, printed under the families: what the exposed host time is made of); and
what ``torch.compile`` built: graphs, graph breaks, and per CUDA graph the inputs copied at
each replay (:func:`_step_profile.compile_census`). The dense fused row also measures the time
the sparse variants shrink, outside the step on its real shapes: forward, dX and dW of every
selected ``nn.Linear`` (all but the denied embeddings and heads) at the step's token count
in bf16 with cuBLAS (fp32 on the CPU), ``P``, and ``AdamW(fused=True)`` on their fp32
weights, ``O``. Each row's Amdahl limit at its density ``d`` (1 - reached sparsity) is the
speed-up over the dense step ``T`` when only those shrink::

    limit(d) = T / (T - (1 - d) * (P + O))

printed beside the measured speed-up with their ratio (``of lim``; the goal is >= 0.85).
No product can beat the time to read and write its token matrices, whatever the density:
``F_s`` per shape, ``3 T (in + out)`` elements at the copy bandwidth measured beside ``P``.
``floor`` is the limit with each shape's products shrunk to ``max(d P_s, F_s)``::

    floor(d) = T / (T - sum_s (P_s - max(d P_s, F_s)) - (1 - d) O)

and ``of fl`` the speed-up against it (at low density on BERT-sized layers the two differ).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from _common import at_least, device_name, write_json
from _e2e_report import PROFILED_STEPS, add_limits, report
from _step_callbacks import python_profiler, step_profiler, step_times
from _step_profile import compile_census, linear_shapes, shrinkable_ms

DENY = {"bert-base": ["embeddings", "qa_outputs"], "tiny": ["embeddings", "qa_outputs"],
        "llama": ["embed_tokens", "lm_head"], "tiny-llama": ["embed_tokens", "lm_head"]}
BLOCK = {"bert-base": 64, "llama": 128, "tiny": 16, "tiny-llama": 16}
# hidden, intermediate, heads, KV heads, vocabulary; (batch, sequence) per step
LLAMA_SHAPES = {"llama": ((4096, 14336, 32, 8, 32000), (4, 2048)),
                "tiny-llama": ((128, 256, 4, 2, 256), (2, 32))}
# name -> callback settings (None: dense); "+compile[:mode]" suffixes add torch.compile
BASE_VARIANTS: dict[str, dict | None] = {
    "dense fused": None,
    "dense": None,  # torch's default AdamW (foreach), every other variant AdamW(fused=True)
    "block B 90% auto": dict(pattern="block:BxB", sparsity=0.9, compress="auto"),
    "block B 75% auto": dict(pattern="block:BxB", sparsity=0.75, compress="auto"),
    "block B 50% auto": dict(pattern="block:BxB", sparsity=0.5, compress="auto"),
    "block B 90% compressed": dict(pattern="block:BxB", sparsity=0.9, compress=True),
    "block B 75% compressed": dict(pattern="block:BxB", sparsity=0.75, compress=True),
    "block B 50% compressed": dict(pattern="block:BxB", sparsity=0.5, compress=True),
    "block B 90% masked-dense": dict(pattern="block:BxB", sparsity=0.9, compress=False),
    "unstructured 90% masked-dense": dict(pattern="unstructured", sparsity=0.9, compress=False),
    # RigL: drop and regrow every 4 steps, so inside the timed window of any --warmup >= 2
    "rigl 90% masked-dense": dict(pattern="unstructured", sparsity=0.9, regrow="rigl",
                                  frequency=4, compress=False),
    "rigl block B 90% compressed": dict(pattern="block:BxB", sparsity=0.9, regrow="rigl",
                                        frequency=4, compress=True),
    "2:4 auto": dict(pattern="2:4", compress="auto"),
    "2:4 compressed": dict(pattern="2:4", compress=True),
    "2:4 masked-dense": dict(pattern="2:4", compress=False),
}
COMPILE_MODES = {"compile": "default", "compile:mat": "max-autotune-no-cudagraphs",
                 "compile:ro": "reduce-overhead"}


def settings_of(variant: str, model: str) -> tuple[dict | None, str | None, bool]:
    """(callback settings, compile mode, fused AdamW) of a variant name."""
    base, _, suffix = variant.partition(" +")
    if base not in BASE_VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; bases: {list(BASE_VARIANTS)}, "
                         f"suffixes: {[' +' + s for s in COMPILE_MODES]}")
    if suffix and suffix not in COMPILE_MODES:
        raise SystemExit(f"unknown suffix {suffix!r} of {variant!r}; valid: {list(COMPILE_MODES)}")
    settings = BASE_VARIANTS[base]
    if settings is not None:
        block = str(BLOCK[model])
        settings = {k: v.replace("BxB", f"{block}x{block}") if isinstance(v, str) else v
                    for k, v in settings.items()}
        settings["deny"] = DENY[model]
    return settings, COMPILE_MODES.get(suffix), base != "dense"


def user_adamw(parameters, fused: bool):
    """The user's ``torch.optim.AdamW(lr=1e-5)``: ``fused=True`` when ``fused``, else torch's
    default (foreach). ``fused=False`` would not mean the default: torch then takes its
    single-tensor loop, since it picks foreach only when both options are left unset."""
    import torch

    return torch.optim.AdamW(parameters, lr=1e-5, **({"fused": True} if fused else {}))


def build(model_name: str, layers: int, device: str = "cpu"):
    """(HF model on ``device``, one batch on the CPU), seeded."""
    import torch
    from transformers import (
        BertConfig,
        BertForQuestionAnswering,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if model_name in LLAMA_SHAPES:
        (hidden, intermediate, heads, kv_heads, vocab), (batch, seq) = LLAMA_SHAPES[model_name]
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                             num_hidden_layers=layers, vocab_size=vocab,
                             max_position_embeddings=4096)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        with torch.device(device):  # initialized where it trains: fast on a GPU
            return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}
    if model_name == "bert-base":
        config, (batch, seq) = BertConfig(), (32, 384)
    else:
        config, (batch, seq) = BertConfig(hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=128), (4, 32)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    with torch.device(device):
        model = BertForQuestionAnswering(config)
    return model, {
        "input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "start_positions": torch.randint(0, seq, (batch,), generator=g),
        "end_positions": torch.randint(0, seq, (batch,), generator=g)}


def run_child(args: argparse.Namespace) -> dict:
    """One variant in this process: fit ``warmup + steps`` steps, time the last ``steps``."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader

    from sparse_training import BlockSparseLinear, SemiStructuredLinear, SparsityCallback

    settings, compile_mode, fused = settings_of(args.child, args.model)
    gpu = torch.cuda.is_available()
    hf_model, batch = build(args.model, args.layers)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = (hf_model if compile_mode is None
                          else torch.compile(hf_model, mode=compile_mode))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead: a step per batch
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())  # a graph's output is overwritten
            return loss

        def configure_optimizers(self):
            return user_adamw(self.parameters(), fused and gpu)

    timed_total = args.warmup + args.steps  # the timer records global steps warmup+1..
    module, timer = Module(), step_times(args.warmup, timed_total, gpu)
    callbacks: list = [timer]
    if args.profile:  # the torch profiler's steps, then cProfile's
        callbacks.append(profiler := step_profiler(timed_total, PROFILED_STEPS, gpu))
        callbacks.append(python := python_profiler(timed_total + PROFILED_STEPS,
                                                   PROFILED_STEPS, gpu))
    sparse = None
    if settings is not None:
        sparse = SparsityCallback(**settings)
        callbacks.append(sparse)
    total = timed_total + 2 * PROFILED_STEPS * args.profile
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1,
                         precision="bf16-mixed", max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    loader = DataLoader([batch] * total, batch_size=None)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, loader)
    kinds: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, (BlockSparseLinear, SemiStructuredLinear)):
            kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    engine = sparse.engine if sparse is not None else None
    losses = [float(x) for x in module.losses]
    ms = statistics.median(timer.ms) if timer.ms else None
    profiled = {}
    if args.profile:  # exposed host time: the profiled step's wall minus its GPU busy
        row = profiler.row
        profiled = {"profile": {**row, "exposed_host_ms": row["profiled_wall_ms"] - row["busy_ms"],
                                **python.row, **compile_census()}}
    if args.profile and settings is None:
        profiled["linear_shapes"] = linear_shapes(hf_model, DENY[args.model])
    return {
        "variant": args.child, "ms": ms, **profiled,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "compressed_layers": kinds,
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "tokens": batch["input_ids"].numel(),
        "masked_dense_tensors": len(engine.masked) if engine is not None else 0,
        "sparsity": engine.sparsity if engine is not None else 0.0,
        "loss_first": losses[0], "loss_last": losses[-1],
        "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
        "step_ms": timer.ms,
    }


def variants_for(args: argparse.Namespace) -> list[str]:
    if args.variants:
        return args.variants
    return list(BASE_VARIANTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["bert-base", "llama", "tiny", "tiny-llama"],
                        default="bert-base")
    parser.add_argument("--layers", type=int, default=4, help="Llama decoder layers")
    parser.add_argument("--steps", type=at_least(1), default=20)
    parser.add_argument("--warmup", type=at_least(0), default=8)
    parser.add_argument("--variants", nargs="*", help="names (default: every base variant)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile {PROFILED_STEPS} more steps; Amdahl limits")
    parser.add_argument("--tag", default="")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print the tables of saved runs (their limits added) and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        for path in args.report:
            try:
                payload = json.loads(Path(path).read_text())
                # one run as the script writes it, or benchmarks/results/'s runs of it
                runs = [(run.get("command"), *saved_run(run))
                        for run in payload.get("runs", [payload])]
            except (OSError, ValueError, KeyError, TypeError) as error:
                parser.error(f"--report {path}: not a JSON file e2e_step saved ({error!r})")
            for command, saved, rows, device in runs:
                if command:
                    print(f"\n$ {command}")
                report(saved, rows, device)
        return
    if args.child:
        try:
            row = run_child(args)
            if "linear_shapes" in row:
                row["shrinkable"] = shrinkable_ms(row["linear_shapes"], row["tokens"])
        except Exception as err:  # noqa: BLE001 - a failed run is a row of the table
            row = {"variant": args.child, "error": f"{type(err).__name__}: {err}"[:400],
                   "traceback": traceback.format_exc()[-3000:]}
        Path(args.result).write_text(json.dumps(row))
        return
    for variant in variants_for(args):
        settings_of(variant, args.model)  # a bad name stops before any run
    rows = []
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = None
    for variant in variants_for(args):
        result = out / "_row.json"
        result.unlink(missing_ok=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", variant, "--result",
                               str(result), "--model", args.model, "--layers", str(args.layers),
                               "--steps", str(args.steps), "--warmup", str(args.warmup),
                               *["--profile"] * args.profile],
                              capture_output=True, text=True)
        row = (json.loads(result.read_text()) if result.exists() else
               {"variant": variant, "error": f"process died ({proc.returncode}): "
                                             f"{proc.stderr.strip()[-400:]}"})
        row["wall_s"] = time.perf_counter() - start
        rows.append(row)
        path = save(args, rows, out)
        print(f"{variant}: {row.get('ms') or row.get('error')}", flush=True)
    result.unlink(missing_ok=True)
    report(args, rows, device_name())
    print(f"wrote {path}")
    if failed := [r["variant"] for r in rows if "error" in r or not r.get("ms")]:
        sys.exit(f"e2e_step: {len(failed)} of {len(rows)} variants failed: {failed}")


def saved_run(payload: dict) -> tuple[argparse.Namespace, list[dict], str]:
    """The settings, rows and "device, torch version" of one saved run (its metadata in
    ``environment``, or at the top level as older runs kept it)."""
    env = payload.get("environment", payload)
    saved = argparse.Namespace(**{k: payload[k] for k in ("model", "layers")})
    return saved, payload["rows"], f"{env['device']}, torch {env['torch']}"


def save(args: argparse.Namespace, rows: list[dict], out: Path) -> Path:
    """The rows so far as ``e2e_step_<model><tag>.json`` in ``out`` (written after every
    run, so a sweep cut short by a time limit keeps the rows it finished)."""
    add_limits(rows)
    payload = {"model": args.model, "layers": args.layers, "steps": args.steps,
               "warmup": args.warmup, "rows": rows}
    return write_json(f"e2e_step_{args.model}{args.tag}.json", payload, out=out,
                      device=device_name())


if __name__ == "__main__":
    main()
