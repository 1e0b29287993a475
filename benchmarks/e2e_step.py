"""Whole training steps of real models through ``pl.Trainer``, the way a user trains.

    python3 benchmarks/e2e_step.py --model bert-base            # GPU: one table, JSON in $OUT
    python3 benchmarks/e2e_step.py --model llama --layers 4
    python3 benchmarks/e2e_step.py --model tiny --steps 2 --warmup 1   # CPU: checks the script
    python3 benchmarks/e2e_step.py --model bert-base vit-base gpt2 --budget-s 540
    python3 benchmarks/e2e_step.py --model llama --layers 2 --profile --variants "dense fused" \
        "block B 90% compressed"                       # where the time goes, Amdahl limits
    python3 benchmarks/e2e_step.py --report benchmarks/results/e2e_step_*.json  # saved tables

Models (:mod:`_e2e_models`, HF models from their configs, random init): ``bert-base`` (QA,
32 x 384 tokens), ``vit-base`` (64 images), ``gpt2`` (8 x 1024), ``opt-350m`` (8 x 1024),
``decoder-1.5b`` (Qwen2-1.5B-shaped Llama, ``--layers``, 4 x 2048), ``decoder-2048``
(``time_to_quality.py``'s base model, ``--layers``, 8 x 1024) and ``llama``
(Llama-3-8B-shaped, ``--layers``, 4 x 2048), with ``tiny``/``tiny-*`` twins for CPU checks;
``--model`` takes several, run in turn, one JSON each. Embeddings and task heads are denied.
Every variant is a
``LightningModule`` around the HF model with the user's ``torch.optim.AdamW`` (``fused=True``,
the fastest AdamW a user would pick, dense or sparse; the ``dense`` variant keeps torch's
default, foreach), ``pl.Trainer(accelerator="gpu",
precision="bf16-mixed")`` and ``SparsityCallback`` with its public options; ``+compile``
variants compile the HF model in the module's ``__init__`` (``torch.compile(model, mode)``).
``heads+neurons 50%`` removes half the heads of every attention module and half the neurons
of every FFN (``SlimLinear``) or masks them. ``vs best`` is the speed-up against the faster of
the eager and compiled ``dense fused`` rows the command ran. ``--budget-s`` starts no variant
past that many seconds, ``--child-timeout`` ends a variant that takes longer (an error row).

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
from _e2e_models import ATTENTION, MODELS
from _e2e_report import PROFILED_STEPS, add_limits, report
from _step_callbacks import python_profiler, step_profiler, step_times
from _step_profile import compile_census, linear_shapes, shrinkable_ms

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
    # half the heads of every attention module and half the neurons of every FFN, removed
    # (SlimLinear: smaller dense layers) or masked
    "heads+neurons 50% compressed": dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                                         overrides={ATTENTION: {"pattern": "head"}},
                                         compress=True),
    "heads+neurons 50% masked-dense": dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                                           overrides={ATTENTION: {"pattern": "head"}},
                                           compress=False),
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
        block = str(MODELS[model].block)
        settings = {k: v.replace("BxB", f"{block}x{block}") if isinstance(v, str) else v
                    for k, v in settings.items()}
        settings["deny"] = list(MODELS[model].deny)
    return settings, COMPILE_MODES.get(suffix), base != "dense"


def user_adamw(parameters, fused: bool):
    """The user's ``torch.optim.AdamW(lr=1e-5)``: ``fused=True`` when ``fused``, else torch's
    default (foreach). ``fused=False`` would not mean the default: torch then takes its
    single-tensor loop, since it picks foreach only when both options are left unset."""
    import torch

    return torch.optim.AdamW(parameters, lr=1e-5, **({"fused": True} if fused else {}))


def build(model_name: str, layers: int, device: str = "cpu"):
    """(HF model on ``device``, one batch on the CPU), seeded (:mod:`_e2e_models`)."""
    import torch

    torch.manual_seed(0)
    return MODELS[model_name].build(layers, device)


def run_child(args: argparse.Namespace) -> dict:
    """One variant in this process: fit ``warmup + steps`` steps, time the last ``steps``."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader

    from sparse_training import (
        BlockSparseLinear,
        SemiStructuredLinear,
        SlimLinear,
        SparsityCallback,
    )

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
        callbacks.append(profiler := step_profiler(timed_total, PROFILED_STEPS, gpu,
                                                   args.trace_to))
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
        if isinstance(m, (BlockSparseLinear, SemiStructuredLinear, SlimLinear)):
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
        profiled["linear_shapes"] = linear_shapes(hf_model, list(MODELS[args.model].deny))
    return {
        "variant": args.child, "ms": ms, **profiled,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "compressed_layers": kinds,
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "tokens": tokens_of(batch, hf_model.config),
        "masked_dense_tensors": len(engine.masked) if engine is not None else 0,
        "sparsity": engine.sparsity if engine is not None else 0.0,
        "loss_first": losses[0], "loss_last": losses[-1],
        "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
        "step_ms": timer.ms,
    }


def tokens_of(batch: dict, config) -> int:
    """The rows of the Linear layers' input a step: tokens, or images x (patches + 1)."""
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    patches = (config.image_size // config.patch_size) ** 2 + 1  # ViT: the class token too
    return batch["pixel_values"].shape[0] * patches


def variants_for(args: argparse.Namespace) -> list[str]:
    if args.variants:
        return args.variants
    return list(BASE_VARIANTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=list(MODELS), default=["bert-base"],
                        help="one or more models, run in turn (one JSON each)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the Llama-"
                        "shaped models (llama, decoder-1.5b, decoder-2048)")
    parser.add_argument("--steps", type=at_least(1), default=20)
    parser.add_argument("--warmup", type=at_least(0), default=8)
    parser.add_argument("--variants", nargs="*", help="names (default: every base variant)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile {PROFILED_STEPS} more steps; Amdahl limits")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: each variant's Chrome trace of the profiled "
                             "steps, trace_<model>_<variant>.json.gz beside the JSON")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no variant once this many seconds have passed (the rest "
                             "are listed as skipped)")
    parser.add_argument("--child-timeout", type=float, default=300.0,
                        help="seconds one variant may take (a timeout is an error row)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="print the tables of saved runs (their limits added) and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--trace-to", help=argparse.SUPPRESS)
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
        args.model = args.model[0]
        try:
            row = run_child(args)
            if "linear_shapes" in row:
                row["shrinkable"] = shrinkable_ms(row["linear_shapes"], row["tokens"])
        except Exception as err:  # noqa: BLE001 - a failed run is a row of the table
            row = {"variant": args.child, "error": f"{type(err).__name__}: {err}"[:400],
                   "traceback": traceback.format_exc()[-3000:]}
        Path(args.result).write_text(json.dumps(row))
        return
    if args.trace and not args.profile:
        parser.error("--trace needs --profile (the trace is the profiled steps')")
    for model in args.model:
        for variant in variants_for(args):
            settings_of(variant, model)  # a bad name stops before any run
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    start, failed, skipped = time.perf_counter(), [], []
    for model in args.model:
        rows = run_model(args, model, out, start, skipped)
        failed += [f"{model}: {r['variant']}" for r in rows
                   if "error" in r or not r.get("ms")]
    if skipped:
        print(f"skipped (past --budget-s {args.budget_s:g}): {skipped}")
    if failed:
        sys.exit(f"e2e_step: {len(failed)} variants failed: {failed}")


def run_model(args: argparse.Namespace, model: str, out: Path, start: float,
              skipped: list[str]) -> list[dict]:
    """Every variant of ``model``, one subprocess each; the table, and its JSON saved after
    each row."""
    rows, path = [], None
    result = out / "_row.json"
    for variant in variants_for(args):
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            skipped.append(f"{model}: {variant}")
            continue
        result.unlink(missing_ok=True)
        begun = time.perf_counter()
        command = [sys.executable, __file__, "--child", variant, "--result", str(result),
                   "--model", model, "--layers", str(args.layers), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), *["--profile"] * args.profile,
                   *["--trace-to", str(out / trace_name(model, variant))] * args.trace]
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=args.child_timeout)
            died = f"process died ({proc.returncode}): {proc.stderr.strip()[-400:]}"
        except subprocess.TimeoutExpired:
            died = f"timed out after {args.child_timeout:g} s"
        row = (json.loads(result.read_text()) if result.exists() else
               {"variant": variant, "error": died})
        row["wall_s"] = time.perf_counter() - begun
        rows.append(row)
        path = save(args, model, rows, out)
        print(f"{model}: {variant}: {row.get('ms') or row.get('error')}", flush=True)
    result.unlink(missing_ok=True)
    if rows:
        report(argparse.Namespace(model=model, layers=args.layers), rows, device_name())
        print(f"wrote {path}")
    return rows


def trace_name(model: str, variant: str) -> str:
    """``trace_<model>_<variant>.json.gz``, the variant's spaces and signs as ``-``."""
    slug = "".join(c if c.isalnum() else "-" for c in variant)
    return f"trace_{model}_{slug}.json.gz"


def saved_run(payload: dict) -> tuple[argparse.Namespace, list[dict], str]:
    """The settings, rows and "device, torch version" of one saved run (its metadata in
    ``environment``, or at the top level as older runs kept it)."""
    env = payload.get("environment", payload)
    saved = argparse.Namespace(**{k: payload[k] for k in ("model", "layers")})
    return saved, payload["rows"], f"{env['device']}, torch {env['torch']}"


def save(args: argparse.Namespace, model: str, rows: list[dict], out: Path) -> Path:
    """The rows so far as ``e2e_step_<model><tag>.json`` in ``out`` (written after every
    run, so a sweep cut short by a time limit keeps the rows it finished)."""
    add_limits(rows)
    payload = {"model": model, "layers": args.layers, "steps": args.steps,
               "warmup": args.warmup, "rows": rows}
    return write_json(f"e2e_step_{model}{args.tag}.json", payload, out=out,
                      device=device_name())


if __name__ == "__main__":
    main()
