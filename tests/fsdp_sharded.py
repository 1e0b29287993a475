"""Two-process CPU FSDP2 runs (gloo, Lightning's ``ModelParallelStrategy``, ``fully_shard``
in ``configure_model``) of 2:4 (oneshot), GMP (unstructured, global distribution), block
masks, RigL, compressed block-sparse layers (values sharded along the kept blocks),
fixed and moved by RigL, and heads and neurons compressed into ``SlimLinear`` layers.
Each rank writes, per optimizer step, its whole masks' checksums and counts, a hash of the
whole parameters, and whether every pruned weight and optimizer moment of its local shards
is zero. RigL and the compressed runs also run one epoch, save a sharded (distributed)
checkpoint and resume from it for the second; the slim run's full state dict is saved and
loaded back into the sharded model. The compressed run also records every collective each
rank issued after its first step, and those sparse_training issued (none expected).

    python tests/fsdp_sharded.py OUT_DIR [cpu|gpu]   # Lightning relaunches it for rank 1

With ``gpu``: the same on 2 GPUs (NCCL). Used by tests/engine/test_fsdp.py, which trains the same
runs in one process (the reference). Each rank also records the errors that refuse what
sharded training does not support: SR-STE, the fused step on plain (unsharded) optimizer
state and FSDP1 modules.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import traceback
from collections import Counter, OrderedDict
from pathlib import Path

# Before anything imports Triton (Lightning does), which fixes the mode at decoration:
# compiled kernels on GPUs, Triton's interpreter for the CPU runs over gloo, whatever the
# parent's setting (on a CUDA machine the suite compiles).
if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0" if sys.argv[2:3] == ["gpu"] else "1"

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from pytorch_lightning.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conftest import SaveAndStop, exit_skipping_teardown, make_loader  # noqa: E402

import sparse_training  # noqa: E402
from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine  # noqa: E402
from sparse_training.engine.distributed import mask_checksum  # noqa: E402
from sparse_training.engine.protocol import CompressedLayer  # noqa: E402
from sparse_training.engine.sharding import full, local  # noqa: E402
from sparse_training.layers.slim import SlimLinear  # noqa: E402
from sparse_training.layers.swap import make_permanent  # noqa: E402

# every run: schedules in absolute steps, so a run stopped after one epoch resolves the
# same steps as the whole run (8 optimizer steps: 128 samples, 2 ranks x 16 per batch)
RUNS = {
    "2:4": dict(pattern="2:4", schedule="oneshot"),
    "gmp": dict(pattern="unstructured", sparsity=0.8, distribution="global", schedule="gmp",
                start=0, end=6, frequency=2),
    # 8x4 blocks: rows 8-15 of the 24-row layer span both ranks' shards (12 rows each)
    "block": dict(pattern="block:8x4", sparsity=0.5, schedule="linear", start=0, end=4,
                  frequency=2),
    "rigl": dict(pattern="unstructured", sparsity=0.9, distribution="erk", score="random",
                 regrow="rigl", schedule="constant", frequency=2, regrow_end=6),
    # training scores: statistics of the local shards (the second-order Fisher blocks lie
    # within rows), ranked on them and gathered at updates; an update at step 5 of 8 makes
    # the first epoch's checkpoint carry statistics between updates
    "second-order": dict(pattern="unstructured", sparsity=0.8, distribution="global",
                         schedule="gmp", start=0, end=7, frequency=5, score="second-order"),
    "movement": dict(pattern="block:8x4", sparsity=0.5, schedule="linear", start=0, end=6,
                     frequency=3, score="movement"),
}
# the hook path above ("auto" takes the fused step on GPUs), and the fused masked step on
# the local shards (Triton's interpreter on CPU)
RUNS = {name: {**settings, "fused": False} for name, settings in RUNS.items()}
RUNS |= {f"{name} fused": {**RUNS[name], "fused": True} for name in ("2:4", "rigl")}
# compressed BlockSparseLinear layers (swapped in at setup), their values sharded by
# fully_shard along the kept blocks: 2 of 4 blocks and 4 of 8, split evenly over the ranks
RUNS["compressed"] = dict(pattern="block:16x16", sparsity=0.5, schedule="oneshot",
                          compress=True)
# RigL moving them: 3 of 6 and 9 of 18 blocks (2 + 1 and 5 + 4 on the ranks), gathered,
# moved and re-sliced on every rank
RUNS["compressed rigl"] = dict(pattern="block:16x16", sparsity=0.5, schedule="constant",
                               regrow="rigl", frequency=2, regrow_end=6, compress=True)
# heads (2 of 4 kept: q, k, v 8 rows, 4 + 4 on the ranks) and FFN neurons (9 of 18: fc1
# 9 rows, 5 + 4) compressed into SlimLinear layers, row- and column-sliced
RUNS["slim"] = dict(pattern="neuron", sparsity=0.5, schedule="oneshot", compress=True,
                    overrides={"attn": {"pattern": "head"}})
# the head (5 rows) cannot take 16x16 blocks; slim: 2 tokens of 8 features, 4 heads of 4,
# 18 neurons
WIDTHS = {"compressed": (16, 64, 32, 5), "compressed rigl": (16, 96, 48, 5),
          "slim": (8, 16, 18, 5)}


class ShardedNet(pl.LightningModule):
    """An MLP (:meth:`layers`) whose Linear (or compressed) layers ``configure_model`` shards
    with FSDP2 (when a device mesh is there); the head's 5 rows split unevenly, 3 and 2. With
    ``built_in_configure_model`` its layers join the module in ``configure_model``, which
    compresses them there (``SparsityCallback.compress``) before sharding."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 24, 5),
                 built_in_configure_model: bool = False) -> None:
        super().__init__()
        net = self.layers(*widths)
        self.pending = [net] if built_in_configure_model else []  # a list: no submodule
        if not built_in_configure_model:
            self.net = net

    @staticmethod
    def layers(first: int, second: int, third: int, head: int) -> nn.Sequential:
        """The MLP of these widths."""
        return nn.Sequential(nn.Linear(first, second), nn.ReLU(), nn.Linear(second, third),
                             nn.ReLU(), nn.Linear(third, head))

    def configure_model(self) -> None:
        if self.pending:
            self.net = self.pending.pop()
            sparse = next(c for c in self.trainer.callbacks if isinstance(c, SparsityCallback))
            sparse.compress(self)
        if self.device_mesh is None:  # one process: the reference run
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.modules():
            if isinstance(layer, (nn.Linear, CompressedLayer)):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y % 5)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-2)


class Attention(nn.Module):
    """Self-attention over the tokens (dim 1) in heads of ``head_dim``, whose count follows
    the projections' rows (as BERT's and Llama's)."""

    def __init__(self, width: int, features: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, features) for _ in range(3))
        self.o_proj = nn.Linear(features, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (p(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        heads = torch.softmax(q @ k.transpose(2, 3) / self.head_dim ** 0.5, -1) @ v
        return self.o_proj(heads.transpose(1, 2).reshape(batch, tokens, -1))


class SlimNet(ShardedNet):
    """A transformer layer whose heads and FFN neurons compress into SlimLinear layers: the
    inputs as 2 tokens of ``width``, attention of ``features`` in heads of 4, an FFN of
    ``neurons`` (``fc1``, ``fc2``), and a head of ``head`` rows over the flattened tokens."""

    @staticmethod
    def layers(width: int, features: int, neurons: int, head: int) -> nn.Sequential:
        ffn = nn.Sequential(OrderedDict(fc1=nn.Linear(width, neurons), act=nn.ReLU(),
                                        fc2=nn.Linear(neurons, width)))
        return nn.Sequential(OrderedDict(
            tokens=nn.Unflatten(1, (2, width)), attn=Attention(width, features, 4), ffn=ffn,
            flat=nn.Flatten(), head=nn.Linear(2 * width, head)))


NETS = {"slim": SlimNet}  # the runs that train another model than ShardedNet


def parameters_digest(model: nn.Module) -> str:
    """A hash of the whole parameters (gathered: a collective on every rank)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(full(param).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Recorder(Callback):
    """Before the first step and after every optimizer step: the whole masks' checksums
    and counts, a hash of the whole parameters (gathered: a collective on every rank),
    whether the local shards hold zeros at every pruned weight and moment, and the local
    mask shapes."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.rows, self._step = sparse, [], None

    def on_train_start(self, trainer, pl_module):
        self.record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._step:  # an optimizer step ran (not accumulating)
            self.record(trainer, pl_module)

    def record(self, trainer, pl_module) -> None:
        self._step = trainer.global_step
        engine = self.sparse.engine
        masks = [slot.full_mask() for slot in engine.masked]
        zeros = all(not slot.local_param[~slot.mask].any() for slot in engine.masked)
        for optimizer in trainer.optimizers:
            for slot in engine.masked:
                for value in optimizer.state.get(slot.param, {}).values():
                    if torch.is_tensor(value) and value.shape == slot.param.shape:
                        zeros &= not local(value)[~slot.mask].any()
        self.rows.append({
            "step": trainer.global_step,
            "checksums": [int(mask_checksum(mask)) for mask in masks],
            "counts": [int(mask.sum()) for mask in masks],
            "parameters": parameters_digest(pl_module), "zeros_hold": bool(zeros),
            "block_checksums": [int(mask_checksum(slot.mask)) for slot in engine.compressed],
            "local_shapes": [list(slot.mask.shape) for slot in engine.masked],
            "local_blocks": [local(slot.param).shape[0] for slot in engine.compressed],
            "sharded": [slot.sharded for slot in engine.masked],
            "fused": bool(engine.fused_optimizers),
            "kinds": [plan.kind for plan in engine.plans if plan.selected]})


PACKAGE = str(Path(sparse_training.__file__).parent) + os.sep
_TORCH = str(Path(torch.__file__).parent) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _issuer(stack: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and the standard library: the code that issued
    the op (FSDP2's hooks answer to the module call or ``backward`` that ran them)."""
    for frame in reversed(stack):
        name = frame.filename
        if not (name.startswith((_TORCH, "<frozen")) or (
                name.startswith(_STDLIB) and "-packages" + os.sep not in name)):
            return frame
    return None


class _Collectives(TorchDispatchMode):
    """Counts every op of the ``c10d`` (``dist.*``: FSDP2's all-gathers and
    reduce-scatters) and ``_c10d_functional`` (DTensor redistribution, ``full_tensor``)
    namespaces by its issuer (:func:`_issuer`), and keeps those sparse_training issued.
    A frame of sparse_training anywhere on the stack is not enough: the engine's optimizer
    pre-hook runs Lightning's closure, so forward and backward sit below it. The
    Recorder's own gathers (``Recorder.record``) are left out."""

    def __init__(self, watch: CollectiveWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            stack = traceback.extract_stack()[:-1]
            if not any(f.name == "record" and f.filename == __file__ for f in stack):
                op, issuer = f"{func.namespace}.{func._opname}", _issuer(stack)
                where = f"{Path(issuer.filename).name}:{issuer.name}" if issuer else "?"
                self.watch.total[f"{op} from {where}"] += 1
                if issuer is not None and issuer.filename.startswith(PACKAGE):
                    self.watch.from_sparse_training.append({"op": op, "stack": [
                        f"{f.filename[len(PACKAGE):]}:{f.lineno}:{f.name}" for f in stack
                        if f.filename.startswith(PACKAGE)][-6:]})
        return func(*args, **(kwargs or {}))


class CollectiveWatch(Callback):
    """Every collective a rank issues from the end of the first optimizer step (step 0
    prunes) to the end of training: forward, backward, the optimizer step and the
    callbacks' step hooks, through :class:`_Collectives`."""

    def __init__(self) -> None:
        self.total, self.from_sparse_training, self.mode = Counter(), [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is None and trainer.global_step >= 1:
            self.mode = _Collectives(self)
            self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None

    def summary(self) -> dict:
        return {"total": sum(self.total.values()), "ops": dict(self.total),
                "from_sparse_training": self.from_sparse_training}


def fit(settings: dict, loader, callbacks=(), ckpt_path=None, accelerator="cpu",
        widths: tuple[int, ...] = (16, 32, 24, 5), built_in_configure_model: bool = False,
        net: type[ShardedNet] = ShardedNet, **trainer_args) -> Recorder:
    """Train a fresh ``net`` of ``widths`` for 2 epochs (FSDP2 over 2 processes unless
    ``trainer_args`` name another strategy); the Recorder of the run."""
    pl.seed_everything(0)
    model = net(widths, built_in_configure_model)
    sparse = SparsityCallback(**settings)
    recorder = Recorder(sparse)
    if "strategy" not in trainer_args:
        trainer_args.update(strategy=_strategy(), devices=2)
    trainer = pl.Trainer(accelerator=accelerator, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[sparse, recorder, *callbacks],
                         **trainer_args)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    recorder.rank, recorder.model = trainer.global_rank, model
    return recorder


def _strategy():
    from pytorch_lightning.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def refused(settings: dict, accelerator: str) -> str:
    """The error a fit with ``settings`` raises at its start on sharded parameters."""
    try:
        fit(settings, make_loader(n=32), accelerator=accelerator)
    except ValueError as error:
        return str(error)
    return "no error"


def fsdp1_refused(rank: int, accelerator: str) -> str:
    """The error of an engine on a model wrapped in FSDP1 (whose parameters are 1-D
    shards), in the process group the runs left."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    device = torch.device("cpu") if accelerator == "cpu" else torch.device("cuda", rank)
    model = FullyShardedDataParallel(ShardedNet().net.to(device), use_orig_params=True,
                                     device_id=device)
    try:
        SparsityEngine(model, SparsityConfig(pattern="2:4"))
    except ValueError as error:
        return str(error)
    return "no error"


def plain_state_refused(recorder: Recorder) -> str:
    """The error of the fused step on a sharded weight whose AdamW state is plain and whole
    (as a state dict saved without sharding loads it): refused before any write."""
    from sparse_training.kernels import fused_masked_step

    weight = recorder.model.net[0].weight
    optimizer = torch.optim.AdamW([weight])
    weight.grad = torch.zeros_like(weight)
    optimizer.state[weight].update(step=torch.tensor(0.0), exp_avg=torch.zeros(weight.shape),
                                   exp_avg_sq=torch.zeros(weight.shape))
    try:
        fused_masked_step(optimizer, {weight: torch.ones_like(local(weight), dtype=torch.bool)})
    except ValueError as error:
        return str(error)
    finally:
        weight.grad = None
    return "no error"


def full_state_round_trip(recorder: Recorder, path: Path) -> dict:
    """The full (gathered) state dict of a run's sharded model, saved at ``path`` by rank 0,
    loaded back after every weight and kept band of the model was changed: whether that
    restores the same parameters, bands and full state dict."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model, options = recorder.model, StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=options)
    if recorder.rank == 0:
        torch.save(state, path)
    digest = parameters_digest(model)
    slim = [m for m in model.modules() if isinstance(m, SlimLinear)]
    bands = [m.band_mask.clone() for m in slim]
    with torch.no_grad():
        for layer in slim:
            layer.band_mask.copy_(layer.band_mask.roll(1))
        for param in model.parameters():
            local(param).uniform_(-1, 1)
    changed = parameters_digest(model) != digest
    set_model_state_dict(model, dict(state), options=options)  # it replaces the values
    again = get_model_state_dict(model, options=options)
    return {"changed": changed, "parameters": parameters_digest(model) == digest,
            "bands": all(torch.equal(m.band_mask, b) for m, b in zip(slim, bands, strict=True)),
            "state_dict": state.keys() == again.keys() and all(
                torch.equal(state[k], again[k]) for k in state)}


def after_fit(recorder: Recorder) -> dict:
    """On the masks a run left: whether the engine's mask installation catches rank 1
    computing another whole mask of a sharded tensor, and whether ``make_permanent``
    removes the shards' buffers."""
    engine = recorder.sparse.engine
    whole = {slot.name: slot.full_mask() for slot in engine.masked}
    if recorder.rank == 1:  # a rank that went its own way must be caught
        whole[engine.masked[0].name].view(-1)[0] ^= True
    try:
        engine.set_masks(whole, step=-1, broadcast=False, reset_state=False, check=True)
        caught = False
    except RuntimeError as error:
        caught = "masks differ across ranks" in str(error)
    make_permanent(recorder.model)
    left = [name for name, _ in recorder.model.named_buffers() if name.endswith("_mask")]
    return {"mismatch_caught": caught, "masks_left": left}


def main(out: Path, accelerator: str) -> None:
    results = {}
    for name, settings in RUNS.items():
        if settings.get("compress"):  # run below, with their own models
            continue
        recorder = fit(settings, make_loader(n=128), accelerator=accelerator)
        results[name] = recorder.rows
    results["after"] = after_fit(recorder)
    plain_state = plain_state_refused(recorder)
    stopped = fit(RUNS["rigl"], make_loader(n=128), [SaveAndStop(out / "rigl.ckpt")],
                  accelerator=accelerator)
    resumed = fit(RUNS["rigl"], make_loader(n=128), ckpt_path=out / "rigl.ckpt",
                  accelerator=accelerator)
    results["rigl-stopped"], results["rigl-resumed"] = stopped.rows, resumed.rows
    results["second-order-stopped"] = fit(
        RUNS["second-order"], make_loader(n=128),
        [SaveAndStop(out / "second-order.ckpt")], accelerator=accelerator).rows
    results["second-order-resumed"] = fit(
        RUNS["second-order"], make_loader(n=128), ckpt_path=out / "second-order.ckpt",
        accelerator=accelerator).rows
    compressed = {"settings": RUNS["compressed"], "widths": WIDTHS["compressed"],
                  "accelerator": accelerator}
    watch = CollectiveWatch()
    results["compressed"] = fit(**compressed, loader=make_loader(n=128),
                                callbacks=[watch]).rows
    results["compressed collectives"] = watch.summary()
    results["compressed in configure_model"] = fit(
        **compressed, loader=make_loader(n=128), built_in_configure_model=True).rows
    results["compressed-stopped"] = fit(
        **compressed, loader=make_loader(n=128),
        callbacks=[SaveAndStop(out / "compressed.ckpt")]).rows
    results["compressed-resumed"] = fit(
        **compressed, loader=make_loader(n=128), ckpt_path=out / "compressed.ckpt").rows
    moving = {"settings": RUNS["compressed rigl"], "widths": WIDTHS["compressed rigl"],
              "accelerator": accelerator}
    results["compressed rigl"] = fit(**moving, loader=make_loader(n=128)).rows
    results["compressed rigl-stopped"] = fit(
        **moving, loader=make_loader(n=128),
        callbacks=[SaveAndStop(out / "compressed-rigl.ckpt")]).rows
    results["compressed rigl-resumed"] = fit(
        **moving, loader=make_loader(n=128), ckpt_path=out / "compressed-rigl.ckpt").rows
    slim = {"settings": RUNS["slim"], "widths": WIDTHS["slim"], "net": NETS["slim"],
            "accelerator": accelerator}
    recorder = fit(**slim, loader=make_loader(n=128))
    results["slim"] = recorder.rows
    results["slim round trip"] = full_state_round_trip(recorder, out / "slim-full.pt")
    results["slim-stopped"] = fit(**slim, loader=make_loader(n=128),
                                  callbacks=[SaveAndStop(out / "slim.ckpt")]).rows
    results["slim-resumed"] = fit(**slim, loader=make_loader(n=128),
                                  ckpt_path=out / "slim.ckpt").rows
    rank = resumed.rank
    results["refused"] = {"sr-ste": refused({**RUNS["2:4"], "regrow": "sr-ste"}, accelerator),
                          "2:4 compressed": refused({**RUNS["2:4"], "compress": True},
                                                    accelerator),
                          "plain state": plain_state,
                          "fsdp1": fsdp1_refused(rank, accelerator)}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the reference: CPU matmuls round by their thread count
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    main(out_dir, sys.argv[2] if len(sys.argv) > 2 else "cpu")
    exit_skipping_teardown()
