"""Cost of one mask update relative to one training step, engine level (no Lightning).

    python benchmarks/mask_update.py [--layers 12] [--width 768] [--tokens 4096]

A stack of BERT-base-shaped linear blocks (per layer: 768x768 x4 attention-like, 768x3072
and 3072x768 MLP; 85M weights at the defaults) trains on random tokens with AdamW. One table:
the median time of a dense step, of a masked step (gradient mask + re-mask), and of each kind
of mask update (RigL drop/grow, SET, GMP magnitude top-k, 2:4, global threshold), and each
update's cost in training steps. Timed with CUDA events (triton.testing.do_bench medians) on
a GPU, a synchronizing host clock on CPU. Writes JSON with the device name and torch version.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from _common import bench_ms, device_name, file_tag, wall_ms, write_json
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine


def bench(fn: Callable[[], None], device: str, reps: int) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU, the wall clock on a CPU."""
    return bench_ms(fn) if device == "cuda" else wall_ms(fn, reps)


def make_model(layers: int, width: int) -> nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width) for _ in range(4)]
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, help="default: $OUT, else benchmarks/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = make_model(args.layers, args.width).to(device)
    weights = sum(m.weight.numel() for m in model if isinstance(m, nn.Linear))
    x = torch.randn(args.tokens, args.width, device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def forward_backward() -> None:
        with autocast:
            loss = model(x).float().square().mean()
        loss.backward()

    def step_with(optimizer: torch.optim.Optimizer, engine: SparsityEngine | None) -> Callable:
        def step() -> None:
            forward_backward()
            if engine is not None:
                engine.before_optimizer_step(optimizer, step=1, clipping=False)
            optimizer.step()
            optimizer.zero_grad()

        return step

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    results = {"dense step (AdamW fused)": bench(step_with(adamw(), None), device, args.reps)}
    engines = {}
    for path, fused in (("hooks", False), ("fused", "auto")):
        if engines:
            engines["hooks"].detach()  # one engine per tensor at a time
        engine = SparsityEngine(model, SparsityConfig(  # the second adopts the first's masks
            "unstructured", sparsity=0.9, schedule="constant", regrow="rigl", score="random",
            fused=fused))
        engine.start(10_000)
        optimizer = adamw()
        engine.attach(optimizer)
        engine.on_step_start(0)
        served = "Triton step" if optimizer in engine.fused_optimizers else "torch step"
        results[f"masked step, {path} path ({served})"] = bench(step_with(optimizer, engine),
                                                                device, args.reps)
        engines[path] = engine
    engine = engines["fused"]
    forward_backward()  # dense gradients for RigL's grow score
    results["RigL drop/grow (all layers)"] = bench(
        lambda: engine.updater.regrow(engine, engine.slots, 1), device, args.reps)
    engine.detach()
    set_engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.9,
                                                      regrow="set"))  # adopts the masks
    results["SET drop/grow (all layers)"] = bench(
        lambda: set_engine.updater.regrow(set_engine, set_engine.slots, 1), device, args.reps)
    for name, config in {
        "magnitude top-k 90% (GMP update)": SparsityConfig("unstructured", sparsity=0.9),
        "2:4 update": SparsityConfig("2:4"),
        "global threshold 90%": SparsityConfig("unstructured", sparsity=0.9,
                                               distribution="global"),
    }.items():
        other = make_model(args.layers, args.width).to(device)
        update_engine = SparsityEngine(other, config)  # a fresh model: no owner to detach
        results[name] = bench(lambda e=update_engine: e.prune(), device, args.reps)

    name = device_name(device)
    step = results["dense step (AdamW fused)"]
    lines = [f"Mask update cost vs one training step: {args.layers}x BERT-base-shaped blocks "
             f"({weights / 1e6:.0f}M weights), {args.tokens} tokens, bf16 autocast, AdamW; "
             f"{name}, torch {torch.__version__}", "",
             "| operation | median ms | in training steps |", "|---|---|---|"]
    lines += [f"| {op} | {ms:.3f} | {ms / step:.3f} |" for op, ms in results.items()]
    table = "\n".join(lines)
    print(table)
    print("wrote", write_json(f"mask_update_{file_tag(name)}.json", {
        "weights": weights, "ms": results, "args": {k: str(v) for k, v in vars(args).items()},
        "table": table}, out=args.out, device=device))


if __name__ == "__main__":
    main()
