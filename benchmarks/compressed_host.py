"""Host (Python and dispatch) cost of a training step with compressed block-sparse layers.

A 12-layer HF ``BertForQuestionAnswering`` of tiny widths (hidden 64, intermediate 128: 72
Linear layers of the encoder, the shapes of BERT-base's layout at 1/12 the width) trains
through ``pl.Trainer`` (``bf16-mixed`` by default) with ``torch.optim.AdamW(foreach=True)``,
the default on a GPU, in three variants in one process: dense, masked-dense
(``SparsityCallback(pattern="block:BxB", compress=False)``) and compressed (the same with
``compress=True``: 72 ``BlockSparseLinear`` layers); embeddings and the QA head denied.

    python3 benchmarks/compressed_host.py                   # CPU: products stubbed
    python3 benchmarks/compressed_host.py --products reference
    python3 benchmarks/compressed_host.py --device cuda     # GPU: real kernels, sync check
    python3 benchmarks/compressed_host.py --compile default --rounds 1   # torch.compile

Each variant's timed steps run ``--rounds`` times, interleaved with the other variants'
(a load change on a shared machine hits them all), in one process. Columns: median ms per
step (step end to step end after ``--warmup`` steps; on a GPU synchronized at every step
end: at these widths the GPU waits for the host), the extra over dense in ms and per
compressed layer (us); from cProfile over ``--profile-steps`` more steps (backward on the
calling thread) sparse_training's own time and the Python calls per step; the aten ops of
one step (below autograd, views apart: on a GPU each is a launch or an allocation) and their
extra per compressed layer; launches of the block-sparse kernels that missed the tuned-launch
cache in the timed window (each pays Triton's launch path). Then, per sparse variant, its
sparse_training functions by own time with calls and cumulative time per step, and one
layer's forward + backward alone: host us of ``nn.Linear`` and ``BlockSparseLinear``, in
float32 and under the precision's autocast. ``--compile default`` compiles the HF model
(``torch.compile``, default mode, ``--backend`` inductor: the Python wrapper Inductor
generates calls the block-sparse custom ops) before the callback swaps its layers; the
profile then also splits the step's host time by package (``torch/_functorch`` is
AOTAutograd's runtime wrappers, ``torch/_library`` the custom ops' dispatch layers) and
lists the step's top functions of any package. JSON in ``$OUT`` (or ``benchmarks/results/``).

What is the product's compute and what is Python around it: on the CPU, ``--products launch``
(the default) runs the Triton launchers' host path as the GPU runs it once tuned (checks,
allocations, the cached direct launch of :class:`~sparse_training.kernels.block_sparse.launch.
TunedKernel`) with a compiled kernel whose launch does nothing, so the compressed products
cost no compute; ``--products reference`` runs the pure-torch references (what a CPU user
gets). The dense variants' products do compute (bf16 matmuls of these shapes take ~15 us on
a CPU, fp32 ~5 us, about what a GPU launch costs the host): compare the float32 rows, and
the own-time and ops columns, which hold no product, for the library's share. On a GPU, ``--device cuda`` also runs
``--sync-steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` and lists each
synchronizing call site.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import logging
import os
import pstats
import statistics
import time
import warnings

os.environ["TRITON_INTERPRET"] = "0"  # products stubbed or referenced, never interpreted

import torch  # noqa: E402
from _common import at_least, stubbed_products, write_json  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

VARIANTS = ("dense", "masked-dense", "compressed")
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
REFERENCES = ("forward_reference", "input_grad_reference", "weight_grad_reference")


def products(args: argparse.Namespace):
    """The context the products run in: :func:`stubbed_products` for ``--products launch``
    on the CPU, else as they are."""
    if args.device == "cpu" and args.products == "launch":
        return stubbed_products()
    return contextlib.nullcontext()


def layer_host_us(args: argparse.Namespace, repeats: int = 7, calls: int = 200
                  ) -> dict[str, float]:
    """Host us of one forward + backward of a ``hidden -> 2 hidden`` layer at the step's
    token count: ``nn.Linear`` against ``BlockSparseLinear`` (the step's block and
    sparsity), in float32 and under the precision's autocast; the least of ``repeats`` runs
    of ``calls`` back-to-back calls (on a GPU these only enqueue: the device is synchronized
    around each run, not inside)."""
    from sparse_training import BlockSparseLinear

    device, autocast = args.device, AUTOCAST.get(args.precision)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    dense = torch.nn.Linear(args.hidden, 2 * args.hidden, device=device)
    layers = {"nn.Linear": dense, "BlockSparseLinear": BlockSparseLinear.from_dense(
        dense, (args.block, args.block), density=1 - args.sparsity)}
    layers = {name: compiled(layer, args) for name, layer in layers.items()}
    x = torch.randn(args.batch * args.seq, args.hidden, device=device, requires_grad=True)
    results = {}
    with products(args):
        for dtype in (None, autocast)[:1 + (autocast is not None)]:
            grad = torch.ones(x.shape[0], 2 * args.hidden, device=device,
                              dtype=dtype or torch.float32)
            for name, layer in layers.items():
                def call(layer=layer, dtype=dtype, grad=grad):
                    with torch.autocast(device, dtype or torch.float32, enabled=bool(dtype)):
                        y = layer(x)
                    y.backward(grad)

                call()  # tunes and compiles on a GPU
                best = float("inf")
                for _ in range(repeats):
                    sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    best = min(best, time.perf_counter() - start)
                    sync()
                results[f"{name} {'float32' if dtype is None else f'autocast {dtype}'}"] = (
                    best / calls * 1e6)
    return results


def compiled(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` under ``torch.compile`` (default mode, ``--backend``) for ``--compile
    default``, else as it is."""
    if args.compile == "none":
        return model
    return torch.compile(model, backend=args.backend)


def build(args: argparse.Namespace):
    """(HF model, one batch), seeded: 12 layers of tiny widths."""
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    config = BertConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=2, vocab_size=512,
                        max_position_embeddings=max(64, args.seq))
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    return BertForQuestionAnswering(config), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "start_positions": torch.randint(0, args.seq, (args.batch,), generator=g),
        "end_positions": torch.randint(0, args.seq, (args.batch,), generator=g)}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach the kernels (below autograd), views apart: on a GPU
    each other op is a launch or an allocation, the host cost per op of a CUDA step."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            self.views += 1
        else:
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def cached_launches() -> int:
    """Argument signatures the block-sparse kernels have cached launches for, plus the
    launches that found none kept for their topology: a count that grows after the warmup
    means launches that miss a cache (and pay Triton's path, or the kernels' own)."""
    from sparse_training.kernels.block_sparse import kernels as bsk

    return sum(len(k._launches) + k.owned_misses
               for k in (bsk._DENSE_SPARSE, bsk._SAMPLED_DENSE_DENSE))


def step_windows(args: argparse.Namespace, gpu: bool, timed_only: bool):
    """A Lightning callback over consecutive windows of steps: the timed ``steps`` after
    ``warmup``, a cProfile of ``profile_steps``, one step counting aten ops
    (:class:`OpCounter`), and on a GPU ``sync_steps`` under the CUDA sync debug mode. The
    backward runs on the calling thread in all but the timed window."""
    from pytorch_lightning.callbacks import Callback

    class Windows(Callback):
        def __init__(self):
            self.ms: list[float] = []
            self.last: float | None = None
            self.profiler = cProfile.Profile()
            self.counter = OpCounter()
            self.syncs: list[str] = []
            self._caught = warnings.catch_warnings(record=True)
            self._recorded: list = []
            more = not timed_only
            phases = [("timed", args.steps), ("profile", args.profile_steps * more),
                      ("count", more), ("sync", args.sync_steps * (gpu and more))]
            self.ends, end = {}, args.warmup
            for name, steps in phases:
                end += steps
                self.ends[name] = end
            self.total = end

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if gpu:
                torch.cuda.synchronize()
            step, now = trainer.global_step, time.perf_counter()
            if self.last is not None and args.warmup < step <= self.ends["timed"]:
                self.ms.append((now - self.last) * 1e3)
            self.last = now
            ends = self.ends
            if step == args.warmup:
                self.gc = [g["collections"] for g in gc.get_stats()]
                self.launches = cached_launches()
            if step == ends["timed"]:
                self.gc = [g["collections"] - before
                           for g, before in zip(gc.get_stats(), self.gc, strict=True)]
                self.launch_misses = cached_launches() - self.launches
                torch.autograd.set_multithreading_enabled(False)
                self.profiler.enable()
            if step == ends["profile"]:
                self.profiler.disable()
                if ends["count"] > step:
                    self.counter.__enter__()
            if step == ends["count"] and ends["count"] > ends["profile"]:
                self.counter.__exit__(None, None, None)
                if ends["sync"] > step:
                    self._recorded = self._caught.__enter__()
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
            if step == ends["sync"] and ends["sync"] > ends["count"]:
                torch.cuda.set_sync_debug_mode(0)
                self._caught.__exit__(None, None, None)
                self.syncs = sorted({f"{w.filename}:{w.lineno}" for w in self._recorded
                                     if "synchroniz" in str(w.message)})
            if step == self.total:
                torch.autograd.set_multithreading_enabled(True)

    return Windows()


def package(where: str) -> str:
    """What a profiled file belongs to: ``sparse_training``, a torch subpackage or module
    (``torch/_functorch``), another site package, Inductor's generated code, the standard
    library, or ``C`` (builtins: the dispatcher and the kernels below it)."""
    if where == "~":
        return "C"
    if "site-packages/" in where:
        parts = where.split("site-packages/", 1)[1].split("/")
        return "/".join(parts[:2]) if parts[0] == "torch" and len(parts) > 1 else parts[0]
    if "/sparse_training/" in where:
        return "sparse_training"
    if "torchinductor" in where:
        return "inductor output code"
    return "stdlib" if "/lib/python3" in where else "other"


def profile_rows(profiler: cProfile.Profile, steps: int) -> list[dict]:
    """Every function in a profile: its package, calls, own and cumulative us per step, by
    own time."""
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in \
            pstats.Stats(profiler).stats.items():
        where = filename.replace(os.sep, "/")
        short = where.split("/sparse_training/")[-1].split("site-packages/")[-1]
        rows.append({"package": package(where), "function": f"{short}:{line}({name})",
                     "calls": calls / steps, "own_us": own * 1e6 / steps,
                     "cum_us": cumulative * 1e6 / steps})
    return sorted(rows, key=lambda r: -r["own_us"])


def by_package(rows: list[dict]) -> dict[str, float]:
    """Own us per step summed by package, the largest first."""
    totals: dict[str, float] = {}
    for row in rows:
        totals[row["package"]] = totals.get(row["package"], 0.0) + row["own_us"]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def run(variant: str, args: argparse.Namespace, timed_only: bool = False) -> dict:
    """One variant: fit, time, and unless ``timed_only`` profile, count ops, check syncs."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from sparse_training import BlockSparseLinear, SparsityCallback

    gpu = args.device == "cuda"
    torch._dynamo.reset()  # each variant's model compiles afresh (no recompile limit)
    hf_model, batch = build(args)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = compiled(hf_model, args)  # traced at the first step, swapped

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, foreach=True)

    window = step_windows(args, gpu, timed_only)
    callbacks: list = [window]
    if variant != "dense":
        callbacks.append(SparsityCallback(
            pattern=f"block:{args.block}x{args.block}", sparsity=args.sparsity,
            compress=variant == "compressed", deny=["embeddings", "qa_outputs"]))
    total = window.total
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1,
                         precision=args.precision, max_steps=total, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    module = Module()
    with products(args):
        trainer.fit(module, DataLoader([batch] * total, batch_size=None))
    if timed_only:
        return {"variant": variant, "ms": statistics.median(window.ms), "step_ms": window.ms}
    everything = profile_rows(window.profiler, args.profile_steps)
    functions = [f for f in everything if f["package"] == "sparse_training"]
    return {"variant": variant, "ms": statistics.median(window.ms), "step_ms": window.ms,
            "compressed_layers": sum(isinstance(m, BlockSparseLinear) for m in module.modules()),
            "own_ms": sum(f["own_us"] for f in functions) / 1e3,
            "reference_ms": sum(f["cum_us"] for f in functions
                                if f["function"].endswith(REFERENCES)) / 1e3,
            "gc_collections": window.gc, "launch_misses": window.launch_misses,
            "python_calls": pstats.Stats(window.profiler).total_calls / args.profile_steps,
            "aten_ops": sum(window.counter.ops.values()), "views": window.counter.views,
            "ops": dict(sorted(window.counter.ops.items(), key=lambda kv: -kv[1])),
            "functions": functions, "packages": by_package(everything),
            "top_functions": everything[:args.top], "sync_sites": window.syncs}


def report(rows: list[dict], top: int) -> None:
    dense = next((r for r in rows if r["variant"] == "dense"), None)
    print(f"\n{'variant':13s} {'ms/step':>8s} {'vs dense':>8s} {'us/layer':>8s} {'own ms':>7s} "
          f"{'ref ms':>7s} {'py calls':>8s} {'aten ops':>8s} {'ops/layer':>9s} {'misses':>6s}")
    for r in rows:
        extra = ops = ""
        if dense is not None:
            extra = f"{r['ms'] - dense['ms']:+8.2f}"
            if r["compressed_layers"]:
                layers = r["compressed_layers"]
                extra += f" {(r['ms'] - dense['ms']) * 1e3 / layers:8.1f}"
                ops = f"{(r['aten_ops'] - dense['aten_ops']) / layers:+9.1f}"
        print(f"{r['variant']:13s} {r['ms']:8.2f} {extra:17s} {r['own_ms']:7.2f} "
              f"{r['reference_ms']:7.2f} {r['python_calls']:8.0f} {r['aten_ops']:8d} "
              f"{ops:>9s} {r['launch_misses']:6d}")
    print("vs dense: ms over the dense step, us/layer: the same per compressed layer; own ms: "
          "sparse_training's own time, ref ms: the references' (cumulative), py calls: Python "
          "calls, each per step under cProfile; aten ops: non-view ops of one step, ops/layer: "
          "their extra over dense per compressed layer; misses: block-sparse launches that "
          "missed the tuned-launch cache or the launches kept per topology in the timed "
          "window")
    for r in rows:
        print(f"\n{r['variant']}: host us per step under cProfile by package (own time): "
              + ", ".join(f"{name} {us:.0f}" for name, us in r["packages"].items() if us >= 1))
        print(f"{'calls':>7s} {'own us':>8s} {'cum us':>8s}  top function of any package")
        for f in r["top_functions"]:
            print(f"{f['calls']:7.0f} {f['own_us']:8.0f} {f['cum_us']:8.0f}  {f['function']}")
        if not r["functions"]:
            continue
        print(f"\n{r['variant']}: sparse_training functions per step (top {top} by own time)")
        print(f"{'calls':>7s} {'own us':>8s} {'cum us':>8s}  function")
        for f in r["functions"][:top]:
            print(f"{f['calls']:7.0f} {f['own_us']:8.0f} {f['cum_us']:8.0f}  {f['function']}")
        if r["sync_sites"]:
            print("synchronizing calls: " + ", ".join(r["sync_sites"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--products", choices=["launch", "reference"], default="launch",
                        help="CPU: the launchers with no-op kernels, or the references")
    parser.add_argument("--compile", choices=["none", "default"], default="none",
                        help="torch.compile the model (and the single layers), default mode")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--steps", type=at_least(1), default=100)
    parser.add_argument("--warmup", type=at_least(0), default=10)
    parser.add_argument("--rounds", type=at_least(1), default=3,
                        help="timed runs of each variant, interleaved; the median is shown")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--sync-steps", type=int, default=3, help="GPU: steps in sync debug")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host cost, not intra-op parallelism (and a shared machine)
    import pytorch_lightning  # noqa: F401  (sets its loggers' level on import: quiet them after)

    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    rows = [run(variant, args) for variant in args.variants]
    for _ in range(args.rounds - 1):  # interleaved, so that a load change hits every variant
        for row in rows:
            row.setdefault("round_ms", [row["ms"]]).append(
                run(row["variant"], args, timed_only=True)["ms"])
    for row in rows:
        row["ms"] = statistics.median(row.get("round_ms", [row["ms"]]))
    layers = layer_host_us(args)
    report(rows, args.top)
    print("\nlayer forward + backward, host us: " + ", ".join(
        f"{name} {us:.1f}" for name, us in layers.items()))
    path = write_json(f"compressed_host_{args.device}{args.tag}.json", {
        "args": vars(args), "rows": rows, "layer_host_us": layers}, device=args.device)
    print(f"\n{path}")


if __name__ == "__main__":
    main()
