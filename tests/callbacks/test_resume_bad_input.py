"""Resuming a fit from a bad checkpoint: masks of the wrong shape, count or structure,
changed settings, a damaged or missing file, compressed layers that do not fit the model.
Each is a clear error naming the value and the fix, before the first step: layers compressed
at setup are given back as they were, and no mask is installed."""

from __future__ import annotations

import pickle
import re

import pytest
import pytorch_lightning as pl
import torch
from conftest import BLOCKNET_COMPRESSED, BlockNet, TinyNet, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from sparse_training import SparsityCallback
from sparse_training.kernels.bitpack import pack_mask, unpack_mask

GMP_EVERY_2 = dict(pattern="unstructured", sparsity=0.8, schedule="gmp", end=10, frequency=2)


def callback_state(saved: dict) -> dict:
    """The SparsityCallback's state in a checkpoint read back with torch.load."""
    (key,) = [k for k in saved["callbacks"] if k.startswith("SparsityCallback")]
    return saved["callbacks"][key]


@pytest.fixture(scope="module")
def saved_fit(tmp_path_factory):
    """``saved_fit(model_class, **settings)``: the last.ckpt of a one-epoch fit of
    ``model_class`` with those settings, read back (a copy, free to change), and its path;
    each fit runs once per module."""
    paths = {}

    def checkpoint(model_class=TinyNet, **settings):
        key = (model_class, repr(sorted(settings.items())))
        if key not in paths:
            folder = tmp_path_factory.mktemp("fit")
            pl.seed_everything(0, verbose=False)
            trainer = make_trainer([SparsityCallback(**settings),
                                    ModelCheckpoint(dirpath=folder, save_last=True)],
                                   max_epochs=1, enable_checkpointing=True)
            trainer.fit(model_class(), make_loader())
            paths[key] = folder / "last.ckpt"
        return torch.load(paths[key], weights_only=False), paths[key]

    return checkpoint


def assert_refused_before_any_mask(saved, settings, message, path):
    """Resuming ``saved`` (written to ``path``) with ``settings`` raises ``message`` as
    Lightning restores the state, after it loaded the model's weights, before any mask is
    installed."""
    torch.save(saved, path)
    model = TinyNet()
    with pytest.raises(ValueError, match=message):
        make_trainer([SparsityCallback(**settings)], max_epochs=2).fit(
            model, make_loader(), ckpt_path=path)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def _drop(masks, name):
    del masks[name]


CHECKPOINTS = [  # (change to the saved state, change to the settings, message)
    (lambda s: s["masks"]["net.2.weight"].update(shape=[3, 4]), {},
     r"mask 'net.2.weight' has shape \[3, 4\], the tensor \[32, 32\]"),
    (lambda s: _drop(s["masks"], "net.0.weight"), {},
     r"no mask for selected tensors \['net.0.weight'\]"),
    (lambda s: s["masks"].update(extra=s["masks"]["net.0.weight"]), {},
     r"masks for tensors that are not selected now \['extra'\]"),
    (lambda s: s["masks"]["net.4.weight"].update(bits=torch.zeros(3, dtype=torch.uint8)), {},
     r"mask 'net.4.weight' is not 16 packed bytes \(uint8\)"),
    (lambda s: s["masks"]["net.4.weight"].update(bits=torch.ones(128, dtype=torch.bool)), {},
     r"mask 'net.4.weight' is not 16 packed bytes"),
    (lambda s: s.update(format=0), {}, "not a sparse_training engine state of format 1 "
                                       r"\(got 0\)"),
    (lambda s: s.update(masks=[1, 2]), {}, "checkpoint masks must be a dict, got list"),
    (lambda s: None, dict(sparsity=0.7), "masks were made with other settings: sparsity=0.8 in "
                                         "the checkpoint, 0.7 now"),
    (lambda s: None, dict(pattern="block:2x2"), "pattern='unstructured' in the checkpoint, "
                                                "'block:2x2' now"),
    (lambda s: None, dict(deny=[r"net\.4"]), r"deny=\[\] in the checkpoint"),
    (lambda s: None, dict(layer_types=["Linear"]), r"layer_types=\[.*Conv1d.*\] in the check"),
    (lambda s: None, dict(distribution="erk"), "distribution='uniform' in the checkpoint"),
]


@pytest.mark.parametrize(("mutate", "change", "message"), CHECKPOINTS,
                         ids=[m[:30] for *_, m in CHECKPOINTS])
def test_checkpoint_errors_come_before_any_mask_changes(saved_fit, tmp_path, mutate, change,
                                                        message):
    saved, _ = saved_fit(**GMP_EVERY_2)
    mutate(callback_state(saved))
    assert_refused_before_any_mask(saved, {**GMP_EVERY_2, **change}, message,
                                   tmp_path / "bad.ckpt")


class WideHead(BlockNet):
    """BlockNet whose net.2 has 32 outputs: a 2 x 4 block grid, not the checkpoint's 4 x 4."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 4))


def _entry(saved, name):
    return callback_state(saved)["compressed"][name]


def _flip_bit(entry, bit):
    """Flip one bit of a saved mask entry's packed bits: the kept count changes."""
    entry["bits"][bit // 8] ^= 1 << (bit % 8)


def _swap_blocks(saved, name):
    """Move one kept block of a packed mask to a dropped position: the count holds."""
    entry = _entry(saved, name)
    mask = unpack_mask(entry["bits"], entry["shape"]).flatten()
    kept, free = mask.nonzero()[0], (~mask).nonzero()[0]
    mask[kept], mask[free] = False, True
    entry["bits"] = pack_mask(mask)


def _write_truncated(path, source):
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])


def _write_empty(path, source):
    path.write_bytes(b"")


RESUMES = [  # (change to the checkpoint, settings, model class, message)
    (None, dict(pattern="block:32x32"), BlockNet,
     r"net.2.weight has nonzeros in 4 of its 4 32x32 blocks, .* the layer keeps nnz = 1: .*"
     r"resuming a checkpoint saved with other settings"),
    (None, dict(sparsity=0.5), BlockNet, r"sparsity=0.75 in the checkpoint, 0.5 now"),
    (None, dict(compress=False), BlockNet, r"compress=True in the checkpoint, False now"),
    (None, dict(pattern="2:4", sparsity=None), BlockNet,
     r"pattern='block:16x16' in the checkpoint, '2:4' now"),
    (lambda s: _flip_bit(_entry(s, "net.2.values"), 0), {}, BlockNet,
     r"compressed mask 'net.2.values' keeps (3|5) blocks; the layer keeps exactly nnz = 4 "
     r"\(corrupted\)"),
    (lambda s: _entry(s, "net.0.values")["bits"].fill_(0xF2), {}, BlockNet,
     r"compressed mask 'net.0.values' has nonzero padding bits after its 4 entries"),
    (lambda s: _entry(s, "net.2.values").update(bits=torch.zeros(3, dtype=torch.uint8)), {},
     BlockNet, r"compressed mask 'net.2.values' is not 2 packed bytes \(uint8\)"),
    (lambda s: _entry(s, "net.2.values").update(pattern="block:32x32"), {}, BlockNet,
     r"compressed mask 'net.2.values' is of pattern 'block:32x32', the layer 'block:16x16'"),
    (lambda s: _entry(s, "net.2.values").update(shape=[2, 8]), {}, BlockNet,
     r"compressed mask 'net.2.values' has shape \[2, 8\], the tensor \[4, 4\]"),
    (lambda s: callback_state(s)["compressed"].update(
        {"net.4.values": _entry(s, "net.0.values")}), {}, BlockNet,
     r"compressed layers net.4.values \(not selected: 4 rows < the block's 16: a task head\? "
     r"name it in allow or overrides to prune it\) cannot be compressed in this model"),
    (lambda s: callback_state(s).update(compressed=[1]), {}, BlockNet,
     r"checkpoint compressed masks must be a dict, got list"),
    (None, {}, WideHead, r"net.2.weight has shape \(64, 64\), the layer's dense weight "
                         r"\(out_features, in_features\) = \(32, 64\)"),
    (lambda s: _swap_blocks(s, "net.2.values"), {}, BlockNet,
     r"the checkpoint's mask of 'net.2.values' drops 1 blocks that hold nonzero weights in "
     r"its state_dict: its weights and masks disagree \(corrupted\)"),
]


@pytest.mark.parametrize(("mutate", "change", "model_class", "message"), RESUMES,
                         ids=[f"{i}-{m[:28]}" for i, (*_, m) in enumerate(RESUMES)])
def test_compressed_resume_errors(saved_fit, tmp_path, mutate, change, model_class, message):
    """Every error comes before the first step; the layers compressed at setup are given
    back as the nn.Linear layers they were, with their weights; the others hold their
    weights or those Lightning loaded."""
    saved, _ = saved_fit(BlockNet, **BLOCKNET_COMPRESSED)
    bad = tmp_path / "bad.ckpt"
    if mutate is not None:
        mutate(saved)
    torch.save(saved, bad)
    pl.seed_everything(1, verbose=False)
    model = model_class()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    settings = {**BLOCKNET_COMPRESSED, **change}
    trainer = make_trainer([SparsityCallback(**settings)], max_epochs=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader(), ckpt_path=bad)
    assert all(type(model.net[i]) is nn.Linear for i in (0, 2, 4))
    for key, value in model.state_dict().items():  # as it was, or as Lightning loaded it
        assert any(torch.equal(state[key], value) for state in (initial, saved["state_dict"])
                   if state[key].shape == value.shape), key
    assert not any(name.endswith("weight_mask") for name, _ in model.named_buffers())


@pytest.mark.parametrize("write", [_write_truncated, _write_empty])
def test_an_unreadable_checkpoint_is_named_and_the_model_kept(saved_fit, tmp_path, write):
    _, source = saved_fit(BlockNet, **BLOCKNET_COMPRESSED)
    bad = tmp_path / "bad.ckpt"
    write(bad, source)
    model = BlockNet()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((OSError, RuntimeError, EOFError, pickle.UnpicklingError)) as caught:
        make_trainer([SparsityCallback(**BLOCKNET_COMPRESSED)], max_epochs=2).fit(
            model, make_loader(), ckpt_path=bad)
    assert re.search(r"the checkpoint \S+bad.ckpt cannot be read; it is likely truncated or "
                     r"half-written .*: resume from another checkpoint",
                     " ".join(getattr(caught.value, "__notes__", [])))
    assert all(type(model.net[i]) is nn.Linear for i in (0, 2, 4))
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())


def test_a_compressed_checkpoint_without_callback_state_resumes_from_its_weights(
        saved_fit, tmp_path):
    """No SparsityCallback state (saved without the callback): the compressed layers take
    the blocks the loaded weights hold, and the schedule starts at the resumed step."""
    saved, _ = saved_fit(BlockNet, **BLOCKNET_COMPRESSED)
    saved.pop("callbacks")
    torch.save(saved, tmp_path / "plain.ckpt")
    model = BlockNet()
    with pytest.warns(UserWarning, match="holds no SparsityCallback state"):
        make_trainer([SparsityCallback(**BLOCKNET_COMPRESSED)], max_epochs=2).fit(
            model, make_loader(), ckpt_path=tmp_path / "plain.ckpt")
    for i in (0, 2):  # one-shot, no regrowth: the blocks stay those the weights held
        weight = saved["state_dict"][f"net.{i}.weight"]
        held = weight.reshape(weight.shape[0] // 16, 16, -1, 16).ne(0).any(3).any(1)
        assert torch.equal(model.net[i].block_mask.cpu(), held)


def test_a_missing_checkpoint_is_named_before_any_change():
    model = BlockNet()
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*nowhere.ckpt"):
        make_trainer([SparsityCallback(**BLOCKNET_COMPRESSED)], max_epochs=1).fit(
            model, make_loader(), ckpt_path="nowhere.ckpt")
    assert type(model.net[0]) is nn.Linear


def _mask_entry(saved, name):
    return callback_state(saved)["masks"][name]


def _column_broken_2_4() -> torch.Tensor:
    """A 32 x 32 mask 2:4 along every row but keeping all 4 of each tile's first column."""
    return pack_mask(torch.tensor([True, True, False, False]).repeat(32, 8))


MASKS = [  # (settings of the saved fit, change to its state, message)
    (GMP_EVERY_2, lambda s: _flip_bit(_mask_entry(s, "net.0.weight"), 3),
     r"mask 'net.0.weight' keeps \d+ of 512 blocks; sparsity 0.\d+ keeps \d+ \(corrupted\)"),
    (dict(pattern="block:4x4", sparsity=0.5),
     lambda s: _flip_bit(_mask_entry(s, "net.2.weight"), 0),
     r"mask 'net.2.weight' is not constant on 4x4 block \(0, 0\): (1|15) of 16 entries kept"),
    (dict(pattern="2:4"), lambda s: _flip_bit(_mask_entry(s, "net.2.weight"), 0),
     r"mask 'net.2.weight' is not 2:4: row 0, blocks 0:4 keep (1|3) \(corrupted\)"),
    (dict(pattern="2:4:2d"), lambda s: _mask_entry(s, "net.2.weight").update(
        bits=_column_broken_2_4()),
     r"mask 'net.2.weight' is not 2:4: column 0, blocks 0:4 keep 4 \(corrupted\)"),
]


@pytest.mark.parametrize(("settings", "mutate", "message"), MASKS,
                         ids=[m[:30] for *_, m in MASKS])
def test_corrupted_masks_at_the_right_length_are_refused(saved_fit, tmp_path, settings, mutate,
                                                         message):
    """Masks are checked for their pattern's structure and the schedule's exact count
    before any is installed (Lightning has restored the weights by then)."""
    saved, _ = saved_fit(**settings)
    mutate(saved)
    assert_refused_before_any_mask(saved, settings, message, tmp_path / "bad.ckpt")


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    sizes = [len(CHECKPOINTS), len(RESUMES), len(MASKS)]
    assert sizes == [12, 13, 4], sizes
