"""Two-process DDP runs of RigL (hook and fused steps) and SET masked-dense, RigL on
compressed block layers and fixed 2:4 compressed (``SemiStructuredLinear``) layers; each
rank writes its mask checksums and a checksum of its parameters. RigL also stops after
the first epoch with a checkpoint and resumes from it; the compressed runs also train on
ranks that initialized their weights differently.

    python tests/ddp_regrowth.py OUT_DIR [cpu|gpu]   # Lightning relaunches it for rank 1

On CPU the ranks talk over gloo, with ``gpu`` over NCCL on 2 GPUs. Used by
tests/engine/test_ddp.py. After training, rank 1 flips one mask bit and the cross-rank check must
raise on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Before anything imports Triton (Lightning does), which fixes the mode at decoration:
# compiled kernels on GPUs, Triton's interpreter for the CPU runs over gloo, whatever the
# parent's setting (on a CUDA machine the suite compiles).
if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0" if sys.argv[2:3] == ["gpu"] else "1"

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import Callback  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import BlockNet, SaveAndStop, TinyNet, exit_skipping_teardown, make_loader  # noqa: E402

from sparse_training import SparsityCallback  # noqa: E402
from sparse_training.engine.distributed import check_across_ranks, mask_checksum  # noqa: E402
from sparse_training.engine.protocol import CompressedLayer  # noqa: E402


class Recorder(Callback):
    """Per step: the step, the last regrowth step, every layer's mask checksum and count
    (masked and compressed), the sum of all parameters, the mask buffers DDP broadcasts,
    whether DDP broadcasts buffers at all and whether the fused masked step serves the
    optimizer."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.rows, self.mismatch_caught = sparse, [], None

    def on_train_start(self, trainer, pl_module):  # the masks before the first step
        self.on_train_batch_end(trainer, pl_module, None, None, 0)

    def on_train_end(self, trainer, pl_module):
        """Whether a rank that went its own way (rank 1 flips one mask bit) is caught, on
        every rank; here, not after the fit, which moves a GPU model to the CPU, where
        NCCL cannot reduce. The bit is flipped back."""
        slots = self.sparse.engine.slots
        flipped = slots[0].mask.view(-1)[:1]
        if trainer.global_rank == 1:
            flipped ^= True
        try:
            check_across_ranks(slots, step=-1, broadcast=False, check=True)
            self.mismatch_caught = False
        except RuntimeError as error:
            self.mismatch_caught = "masks differ across ranks" in str(error)
        if trainer.global_rank == 1:
            flipped ^= True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = self.sparse.engine
        slots = engine.slots
        regrow = getattr(engine.updater, "last_regrow", None)  # None: no regrowth updater
        self.rows.append({"step": trainer.global_step, "last_regrow": regrow,
                          "checksums": [int(mask_checksum(slot.mask)) for slot in slots],
                          "counts": [int(slot.mask.sum()) for slot in slots],
                          "parameters": float(sum(p.double().sum()
                                                  for p in pl_module.parameters())),
                          "masks_broadcast": masks_broadcast(trainer, slots),
                          "broadcast_buffers": trainer.strategy.model.broadcast_buffers,
                          "fused": bool(engine.fused_optimizers)})


def masks_broadcast(trainer, slots) -> list[str]:
    """The mask buffers among those DDP's ``broadcast_buffers`` sends before a forward (its
    listing, which it redoes at every broadcast; not by calling it, which would refresh the
    list DDP decides by whether to broadcast at all)."""
    ddp = trainer.strategy.model
    masks = {id(slot.mask) for slot in slots}
    return [name for name, buffer in ddp.module.named_buffers()
            if name not in ddp.parameters_to_ignore and id(buffer) in masks]


RUNS = {
    # fused=False: the hook path ("auto" takes the fused step on GPUs; "rigl fused" below)
    "rigl": (TinyNet, dict(pattern="unstructured", sparsity=0.9, distribution="erk",
                           score="random", fused=False)),
    "set": (TinyNet, dict(pattern="unstructured", sparsity=0.9, distribution="erk",
                          score="random", regrow="set", fused=False)),
    # each rank records the dense gradient of its own shard: averaged, as DDP averages
    "rigl-compressed": (BlockNet, dict(pattern="block:16x16", sparsity=0.75, compress=True,
                                       regrow_fraction=1.0)),
}
RUNS["rigl fused"] = (TinyNet, {**RUNS["rigl"][1], "fused": True})  # the masked AdamW kernel
# a training score on each rank from the averaged gradients: the same statistics everywhere
RUNS["rigl movement"] = (TinyNet, {**RUNS["rigl"][1], "score": "movement"})
# SemiStructuredLinear layers swapped in at setup, their 2:4 masks fixed
RUNS["2:4-compressed"] = (BlockNet, dict(pattern="2:4:2d", compress=True, regrow=None))


def fit(name: str, accelerator: str, callbacks=(), ckpt_path: Path | None = None,
        strategy: str | DDPStrategy = "ddp", seed: int = 0
        ) -> tuple[pl.Trainer, SparsityCallback, Recorder]:
    """Train run ``name`` for 2 epochs on 2 processes (from ``ckpt_path`` if given), the
    model initialized after seeding with ``seed``."""
    pl.seed_everything(seed)
    model, settings = RUNS[name]
    sparse = SparsityCallback(**{"regrow": "rigl", **settings}, schedule="constant",
                              frequency=2)
    recorder = Recorder(sparse)
    trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=2, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[sparse, recorder, *callbacks])
    trainer.fit(TinyNet(lr=3e-2) if model is TinyNet else model(), make_loader(n=128),
                ckpt_path=ckpt_path)
    return trainer, sparse, recorder


def run(name: str, out: Path, accelerator: str) -> None:
    trainer, sparse, recorder = fit(name, accelerator)
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(
        {"rows": recorder.rows, "mismatch_caught": recorder.mismatch_caught,
         "compressed": [type(slot.layer).__name__ for slot in sparse.engine.compressed]}))


def stop_and_resume(name: str, out: Path, accelerator: str) -> None:
    """Run ``name`` stopped after its first epoch with a checkpoint, then resumed from it."""
    checkpoint = out / f"{name}.ckpt"
    _, _, stopped = fit(name, accelerator, [SaveAndStop(checkpoint)])
    trainer, _, resumed = fit(name, accelerator, ckpt_path=checkpoint)
    (out / f"{name}-resumed_rank{trainer.global_rank}.json").write_text(json.dumps(
        {"stopped": stopped.rows, "resumed": resumed.rows}))


class SetupMasks(Callback):
    """The checksums of the compressed layers' masks as each rank made them at setup."""

    def __init__(self) -> None:
        self.checksums: list[int] = []

    def setup(self, trainer, pl_module, stage):
        layers = [m for m in pl_module.modules() if isinstance(m, CompressedLayer)]
        self.checksums = [int(mask_checksum(m.block_mask if hasattr(m, "block_mask") else m.mask))
                          for m in layers]


def differently_initialized(name: str, out: Path, accelerator: str) -> None:
    """Run ``name`` (compressed at setup) on ranks whose weights differ (each seeded by its
    rank, as an unseeded script), DDP's buffer broadcast off: it sends rank 0's parameters
    at the wrap, and the masks the ranks made at setup only with the broadcast."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    setup = SetupMasks()
    _, _, recorder = fit(name, accelerator, [setup], seed=rank,
                         strategy=DDPStrategy(broadcast_buffers=False))
    (out / f"{name}-unseeded_rank{rank}.json").write_text(json.dumps(
        {"rows": recorder.rows, "at_setup": setup.checksums}))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator_name = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    for run_name in RUNS:
        run(run_name, out_dir, accelerator_name)
    stop_and_resume("rigl", out_dir, accelerator_name)
    for run_name in ("rigl-compressed", "2:4-compressed"):
        differently_initialized(run_name, out_dir, accelerator_name)
    exit_skipping_teardown()
