"""Shared helpers: small models and data made on the fly (never zeros); the suite's rules
(Triton interpreted or compiled, a checkout left as it was found)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch  # imports no Triton: the choice below comes before Triton decorates any kernel

# Triton fixes each kernel as interpreted or compiled when it is decorated (on the first
# import of sparse_training or Lightning), so the choice is made here, once per process:
# without a CUDA GPU the kernels run in Triton's CPU interpreter; on a GPU machine they
# compile (``pytest -m gpu``), and the tests that run kernels on CPU tensors (marker
# ``interpreter``) are skipped with the reason. An explicit TRITON_INTERPRET wins.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import BlockSparseLinear
from sparse_training.callbacks.steps import logs_batch, schedule_step
from sparse_training.kernels._triton import interpret_mode
from sparse_training.pieces.masks import as_matrix, kept_count, pool_blocks

ROOT = Path(__file__).resolve().parents[1]


class TinyNet(pl.LightningModule):
    """A small MLP (or conv net) classifier with a configurable optimizer."""

    def __init__(self, optimizer: str = "adamw", conv: bool = False, lr: float = 1e-2) -> None:
        super().__init__()
        self.optimizer_name, self.lr = optimizer, lr
        if conv:
            self.net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
        else:
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                     nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=1e-4)
        return torch.optim.AdamW(self.parameters(), lr=self.lr,
                                 fused=self.optimizer_name == "adamw-fused")


class TwoOptimizerNet(TinyNet):
    """Manual optimization with two optimizers (Adam for the first block, SGD for the rest):
    ``global_step`` grows once per ``opt.step()``."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self(x), y))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.net[:2].parameters(), lr=1e-2),
                torch.optim.SGD(self.net[2:].parameters(), lr=1e-2, momentum=0.9))


def assert_masks_hold(engine, optimizers) -> None:
    """Pruned weights, and every weight-shaped optimizer-state tensor there, are exactly 0."""
    for slot in engine.slots:
        assert not slot.param[~slot.mask].any(), slot.name
        for optimizer in optimizers:
            for value in optimizer.state.get(slot.param, {}).values():
                if torch.is_tensor(value) and value.shape == slot.param.shape:
                    assert not value[~slot.mask].any(), slot.name


def assert_reported_is_pruned(engine) -> None:
    """The one rule: the sparsity the engine reports (per tensor and global) is the share of
    the weights the masks prune, and every pruned weight the forward pass uses is zero, so
    the forward weights' zero fraction is at least it (a kept weight that happens to be zero
    counts as kept)."""
    pruned, forward = pruned_share(engine), forward_sparsity(engine)
    for slot in engine.slots:
        assert not slot.forward_weight()[~slot.mask].any(), slot.name
        assert engine.tensor_sparsity[slot.name] == pytest.approx(pruned[slot.name],
                                                                  abs=1e-12), slot.name
        assert forward[slot.name] >= pruned[slot.name], slot.name
    assert engine.sparsity == pytest.approx(pruned["global"], abs=1e-9)


class MaskAudit(Callback):
    """Checks a SparsityCallback while it trains: after every mask update the exact
    structure and counts; after every step zeros in weights and optimizer state and the
    reported sparsity equal to the masks' pruned share (:func:`assert_reported_is_pruned`);
    and every value the callback logged equal to the pruned share when it was logged."""

    def __init__(self, sparse) -> None:
        self.sparse, self.updates, self.steps, self.logged_checks = sparse, 0, 0, 0
        self.expected: dict | None = None  # pruned share at the last logging step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.check_logged(trainer)
        engine, step = self.sparse.engine, schedule_step(trainer)
        if engine.updater.last_update != step:
            return
        self.updates += 1
        fraction = engine.updater.schedule.fraction(step)
        for slot in engine.slots:
            pattern, mask = slot.plan.pattern, as_matrix(slot.mask, slot.plan.input_dim)
            if pattern.is_nm:
                kept = pattern.kept_per_group(slot.plan.sparsity * fraction)
                blocks = pool_blocks(mask.float(), pattern.block_rows, pattern.block_cols)
                assert ((blocks == 0) | (blocks == pattern.block_rows * pattern.block_cols)).all()
                groups = (blocks > 0).reshape(-1, pattern.m)
                assert (groups.sum(-1) == kept).all(), slot.name
            elif slot.plan.sparsity is not None:
                block = pattern.block_rows * pattern.block_cols
                kept_blocks = kept_count(mask.numel() // block, slot.plan.sparsity * fraction)
                assert int(mask.sum()) == kept_blocks * block, slot.name
        self.check(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        self.check(trainer)
        if logs_batch(trainer):  # the callback logged at this step
            self.expected = pruned_share(self.sparse.engine)

    def on_train_end(self, trainer, pl_module):
        self.check_logged(trainer)

    def check(self, trainer):
        engine = self.sparse.engine
        assert_masks_hold(engine, [] if engine.updater.dense_state else trainer.optimizers)
        assert_reported_is_pruned(engine)

    def check_logged(self, trainer):
        """Lightning publishes what was logged at a batch end before the next batch."""
        if self.expected is None:
            return
        for name, value in self.expected.items():
            key = f"sparsity/{name}"
            if key in trainer.callback_metrics:
                assert float(trainer.callback_metrics[key]) == pytest.approx(value, abs=1e-6)
                self.logged_checks += 1
        self.expected = None


def pruned_share(engine) -> dict[str, float]:
    """Share of every selected tensor's entries its mask prunes, and over all of them."""
    result = {slot.name: float((~slot.mask).sum()) / slot.mask.numel() for slot in engine.slots}
    total = sum(slot.mask.numel() for slot in engine.slots)
    result["global"] = sum(float((~slot.mask).sum()) for slot in engine.slots) / total
    return result


def forward_sparsity(engine) -> dict[str, float]:
    """Zero fraction of every selected tensor's forward weight, and over all of them."""
    result, zeros, total = {}, 0, 0
    for slot in engine.slots:
        forward = slot.forward_weight()
        result[slot.name] = float((forward == 0).sum()) / forward.numel()
        zeros += int((forward == 0).sum())
        total += forward.numel()
    result["global"] = zeros / total
    return result


class BlockNet(pl.LightningModule):
    """Two 16-divisible Linear layers (selected) and a 4-output head (skipped by shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 4))
        self.optimizer_shapes: list[tuple[int, ...]] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        self.optimizer_shapes = [tuple(p.shape) for p in self.parameters()]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


BLOCKNET_COMPRESSED = dict(pattern="block:16x16", sparsity=0.75, compress=True)
"""Settings that train BlockNet's net.0 and net.2 compressed (1 of 4 and 4 of 16 blocks
kept); its 4-output head is skipped."""


def refused_while_training(function: str, model: str) -> str:
    """The start of the error (a regex) that ``function`` (make_permanent, densify,
    sparsify) raises on a model of type ``model`` while a SparsityEngine trains it."""
    return (f"^{function} would swap modules of a {model} that a SparsityEngine is training "
            f".* call it after ")


def expanded(layer: BlockSparseLinear) -> torch.Tensor:
    """A 16x16-block layer's block mask over the dense weight's entries."""
    return layer.block_mask.repeat_interleave(16, 0).repeat_interleave(16, 1)


def assert_same_training(model, trainer, other, other_trainer):
    """Two BlockNet fits hold bit-for-bit equal weights, masks of ``net.0`` and ``net.2``
    (a compressed layer's, or a masked-dense one's ``weight_mask``) and optimizer state."""
    assert_same_fit(model, trainer, other, other_trainer)

    def masks(fitted):
        return [next(getattr(m, name) for name in ("mask", "block_mask", "weight_mask")
                     if hasattr(m, name)) for m in fitted.net[:3:2]]

    assert all(torch.equal(a, b) for a, b in zip(masks(model), masks(other), strict=True))


def second_derivative(layer: nn.Module, weight: str):
    """A gradient penalty through ``layer`` (inputs of 32 features): the gradients of
    ``weight`` of a loss that holds the input's gradient, built with create_graph=True."""
    x = torch.randn(3, 32, requires_grad=True)
    y = layer(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    return torch.autograd.grad(y.sum() + g.pow(2).sum(), getattr(layer, weight))


def assert_same_fit(model, trainer, other, other_trainer) -> None:
    """Two fits hold bit-for-bit equal state dicts and optimizer state."""
    for (name, value), (other_name, other_value) in zip(
            model.state_dict().items(), other.state_dict().items(), strict=True):
        assert name == other_name and torch.equal(value, other_value), name
    states = [t.optimizers[0].state_dict()["state"] for t in (trainer, other_trainer)]
    assert states[0].keys() == states[1].keys()
    for key, moments in states[0].items():
        for name, value in moments.items():
            assert torch.equal(value, states[1][key][name]), (key, name)


def make_loader(n: int = 128, conv: bool = False, batch_size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 4, 4, generator=g) if conv else torch.randn(n, 16, generator=g)
    y = torch.randint(0, 4 if not conv else 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def two_process_problem(accelerator: str) -> str | None:
    """Why 2 processes cannot train together here on ``accelerator`` (``"cpu"`` over
    gloo, ``"gpu"`` over NCCL), naming the missing piece, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch was built without torch.distributed"
    if accelerator == "cpu" and not dist.is_gloo_available():
        return "torch.distributed has no gloo backend (2 CPU processes need it)"
    if accelerator == "gpu" and torch.cuda.device_count() < 2:
        return f"NCCL runs need 2 CUDA GPUs, {torch.cuda.device_count()} visible"
    if accelerator == "gpu" and not dist.is_nccl_available():
        return "torch.distributed has no NCCL backend"
    return None


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark script run in a subprocess: this checkout's package
    first on PYTHONPATH, no rank variables of an outer launcher, and no TRITON_INTERPRET:
    that is this process's choice for its own kernel tests; on a CPU the script runs in its
    documented CPU mode, the pure-torch references, as a user runs it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "WORLD_SIZE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def exit_skipping_teardown() -> None:
    """End a two-process script once every record is written: flush, then ``os._exit(0)``,
    skipping the interpreter's teardown, where gloo's threads, still joinable in a process
    group's destructor, now and then abort the process ("terminate called without an
    active exception", exit -6) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class SaveAndStop(Callback):
    """At the end of the first epoch: a checkpoint at ``path``, then the fit stops."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)
        trainer.should_stop = True


def make_trainer(callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(max_epochs=2, enable_checkpointing=False, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                    deterministic=True)
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


@pytest.fixture
def lightning_log(caplog):
    """Lightning's INFO messages (its logger does not propagate to the root one)."""
    logger = logging.getLogger("pytorch_lightning")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.setLevel(level)
    logger.removeHandler(caplog.handler)


@pytest.fixture(autouse=True, scope="session")
def _auto_cache(tmp_path_factory):
    """compress="auto"'s timing cache in a folder of this session, never the user's."""
    before = os.environ.get("SPARSE_TRAINING_CACHE")
    os.environ["SPARSE_TRAINING_CACHE"] = str(tmp_path_factory.mktemp("auto_cache"))
    yield
    if before is None:
        os.environ.pop("SPARSE_TRAINING_CACHE", None)
    else:
        os.environ["SPARSE_TRAINING_CACHE"] = before


@pytest.fixture(autouse=True)
def _seed():
    pl.seed_everything(0, verbose=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``interpreter`` run Triton kernels on CPU tensors: skipped, with the
    reason, where the kernels compile (TRITON_INTERPRET=0, the default on a CUDA machine)."""
    if interpret_mode():
        return
    skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs "
                                   "TRITON_INTERPRET=1 (the default without a CUDA GPU)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)


def checkout_entries() -> set[str] | None:
    """``git status`` of the checkout, ignored paths included, one line per path (Python's
    ``__pycache__`` folders and pytest's own ``.pytest_cache`` left out); None outside a
    git checkout."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {line for line in status.splitlines()
            if "__pycache__" not in line and ".pytest_cache" not in line}


def pytest_configure(config):
    """Hypothesis keeps its example database and constants cache in a temporary folder,
    removed at the end, instead of ``.hypothesis/`` in the working folder."""
    from hypothesis.configuration import set_hypothesis_home_dir

    config.hypothesis_home = Path(tempfile.mkdtemp(prefix="sparse_training-hypothesis-"))
    set_hypothesis_home_dir(config.hypothesis_home)


def pytest_unconfigure(config):
    shutil.rmtree(config.hypothesis_home, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def checkout_left_as_found():
    """The suite writes only under temporary folders: at the end the checkout must hold no
    path, tracked or ignored, that it did not hold at the start."""
    before = checkout_entries()
    if before is None:
        warnings.warn(f"{ROOT} is not a git checkout: files the tests write there go unchecked",
                      stacklevel=1)
    yield
    after = checkout_entries()
    if before is not None and after is not None:
        written = sorted(after - before)
        assert not written, (f"the tests wrote into the checkout {ROOT} (git status lines: "
                             f"{written}); write under tmp_path instead")
