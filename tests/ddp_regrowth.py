"""Two-process CPU DDP run (gloo) of RigL and SET, masked-dense and RigL on compressed
layers; each rank writes its mask checksums and a checksum of its parameters.

    python tests/ddp_regrowth.py OUT_DIR     # Lightning relaunches this script for rank 1

Used by tests/test_ddp.py. After training, rank 1 flips one mask bit and the cross-rank
check must raise on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

sys.path.insert(0, str(Path(__file__).parent))
from conftest import BlockNet, TinyNet, make_loader  # noqa: E402

from sparse_training import SparsityCallback  # noqa: E402
from sparse_training.ranks import check_across_ranks, mask_checksum  # noqa: E402


class Recorder(Callback):
    """Per step: the step, the last regrowth step, every layer's mask checksum and count
    (masked and compressed), and the sum of all parameters."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.rows = sparse, []

    def on_train_start(self, trainer, pl_module):  # the masks before the first step
        self.on_train_batch_end(trainer, pl_module, None, None, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = self.sparse.engine
        slots = [*engine.slots, *engine.compressed]
        self.rows.append({"step": trainer.global_step, "last_regrow": engine.updater.last_regrow,
                          "checksums": [int(mask_checksum(slot.mask)) for slot in slots],
                          "counts": [int(slot.mask.sum()) for slot in slots],
                          "parameters": float(sum(p.double().sum()
                                                  for p in pl_module.parameters())),
                          "masks_broadcast": masks_broadcast(trainer, slots)})


def masks_broadcast(trainer, slots) -> list[str]:
    """The mask buffers among those DDP's ``broadcast_buffers`` sends before a forward
    (DDP's own listing, which it redoes at every forward)."""
    ddp = trainer.strategy.model
    ddp._assign_modules_buffers()
    masks = {id(slot.mask) for slot in slots}
    return [name for name, buffer in ddp.named_module_buffers.items() if id(buffer) in masks]


RUNS = {
    "rigl": (TinyNet, dict(pattern="unstructured", sparsity=0.9, distribution="erk",
                           score="random")),
    "set": (TinyNet, dict(pattern="unstructured", sparsity=0.9, distribution="erk",
                          score="random", regrow="set")),
    # each rank records the dense gradient of its own shard: averaged, as DDP averages
    "rigl-compressed": (BlockNet, dict(pattern="block:16x16", sparsity=0.75, compress=True,
                                       regrow_fraction=1.0)),
}


def run(name: str, out: Path) -> None:
    pl.seed_everything(0)
    model, settings = RUNS[name]
    sparse = SparsityCallback(**{"regrow": "rigl", **settings}, schedule="constant",
                              frequency=2)
    recorder = Recorder(sparse)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[sparse, recorder])
    trainer.fit(TinyNet(lr=3e-2) if model is TinyNet else model(), make_loader(n=128))
    rank = trainer.global_rank
    slots = [*sparse.engine.slots, *sparse.engine.compressed]
    if rank == 1:  # a rank that went its own way must be caught
        slots[0].mask.view(-1)[0] ^= True
    try:
        check_across_ranks(slots, step=-1, broadcast=False, check=True)
        mismatch_caught = False
    except RuntimeError as error:
        mismatch_caught = "masks differ across ranks" in str(error)
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(
        {"rows": recorder.rows, "mismatch_caught": mismatch_caught}))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for run_name in RUNS:
        run(run_name, out_dir)
