"""Several SparsityCallbacks on one model: one owner per weight tensor. Each engine holds the
tensors its own selection reaches (a compressed layer by the dense weight it replaced),
overlapping selections are refused at setup naming both callbacks, and each callback
checkpoints and resumes its own layers."""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, TinyNet, assert_same_training, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from sparse_training import BlockSparseLinear, SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.engine.plan import SparsityPlan

STATIC_FIRST = dict(pattern="block:16x16", sparsity=0.5, compress=True, allow=[r"net\.0"])


def fit_block_net(callbacks, max_epochs=1, ckpt_path=None, init_seed=0, samples=128, **kwargs):
    pl.seed_everything(init_seed, verbose=False)
    model = BlockNet()
    trainer = make_trainer(callbacks, max_epochs=max_epochs, **kwargs)
    trainer.fit(model, make_loader(n=samples), ckpt_path=ckpt_path)
    return model, trainer


def test_disjoint_callbacks_each_hold_their_own_tensors():
    """A compressed block layer beside a masked-dense one: each engine reports its own
    selection only, and neither warns about the other's layer."""
    first = SparsityCallback(**STATIC_FIRST)
    second = SparsityCallback("unstructured", sparsity=0.75, allow=[r"net\.2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = fit_block_net([first, second])
    assert not [w for w in caught if "compressed before this fit" in str(w.message)]
    assert isinstance(model.net[0], BlockSparseLinear) and type(model.net[2]) is nn.Linear
    assert first.engine.tensor_sparsity == {"net.0.values": 0.5}
    assert second.engine.tensor_sparsity == {"net.2.weight": 0.75}
    assert second.engine.sparsity == 0.75
    reasons = {p.name: p.reason for p in second.engine.plans}
    assert reasons["net.0.values"] == "compressed, another selection's: matches no allow regex"


def test_a_compressed_layer_outside_the_layer_types_or_denied_is_not_held():
    model = BlockNet()
    model.net[0] = BlockSparseLinear.from_dense(model.net[0], (16, 16), density=0.5)
    for settings in (dict(layer_types=(nn.Conv2d,), pattern="unstructured", sparsity=0.5),
                     dict(deny=[r"net\.0"], pattern="unstructured", sparsity=0.5)):
        plans = SparsityPlan.build(model, SparsityConfig(**settings)).rows
        assert not any(p.compressed for p in plans), settings
    held = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5,
                                                allow=[r"net\.0\.weight"]))
    assert [s.name for s in held.compressed] == ["net.0.values"]  # by its dense name
    held.detach()


def test_rigl_moves_only_its_own_blocks_beside_a_static_callback():
    first = SparsityCallback(**STATIC_FIRST)
    rigl = SparsityCallback("block:16x16", sparsity=0.5, compress=True, allow=[r"net\.2"],
                            regrow="rigl", regrow_fraction=0.5, frequency=2, regrow_end=1.0)
    masks = {}

    class Record(pl.Callback):  # the blocks the swaps at setup chose
        def on_fit_start(self, trainer, pl_module):
            masks.update({i: pl_module.net[i].block_mask.clone() for i in (0, 2)})

    model, _ = fit_block_net([first, rigl, Record()], max_epochs=1)  # RigL every 2 of 8 steps
    assert [s.name for s in rigl.engine.slots] == ["net.2.values"]
    assert rigl.engine.updater.last_regrow is not None
    assert torch.equal(model.net[0].block_mask, masks[0])  # the static callback's blocks
    assert not torch.equal(model.net[2].block_mask, masks[2])  # RigL moved its own


@pytest.mark.parametrize("second", [
    dict(pattern="unstructured", sparsity=0.9, allow=["net.2"]),
    dict(pattern="block:16x16", sparsity=0.75, compress=True, deny=[r"net\.0"]),
])
def test_overlapping_callbacks_are_refused_at_setup_naming_both(second):
    """Both select net.2 (one compressing it): refused before either swaps or masks."""
    first = SparsityCallback("block:16x16", sparsity=0.5, compress=True, allow=[r"net\.2"])
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tensor 'net.2.weight' is selected by two callbacks, "
                                         r"SparsityCallback\(pattern='block:16x16', sparsity="
                                         r"0.5, allow=\['net\\\\.2'\], compress=True\) and "
                                         r"SparsityCallback\(.*\) \(SparsityCallbacks 1 and 2 "
                                         r"of the Trainer\)"):
        make_trainer([first, SparsityCallback(**second)], max_epochs=1).fit(model, make_loader())
    assert all(type(m) is not BlockSparseLinear for m in model.modules())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_masked_dense_callbacks_disjoint_and_overlapping_and_engines_overlapping():
    first = SparsityCallback("2:4", allow=[r"net\.0"])
    second = SparsityCallback("unstructured", sparsity=0.75, allow=[r"net\.2"])
    make_trainer([first, second], max_epochs=1).fit(TinyNet(), make_loader())
    assert first.engine.tensor_sparsity == {"net.0.weight": 0.5}
    assert second.engine.tensor_sparsity == {"net.2.weight": 0.75}
    with pytest.raises(ValueError, match=r"tensor 'net.0.weight' is selected by two "
                                         r"callbacks"):
        make_trainer([SparsityCallback("2:4", allow=[r"net\.0"]),
                      SparsityCallback("1:4", allow=[r"net\.(0|4)"])],
                     max_epochs=1).fit(TinyNet(), make_loader())
    model = BlockNet()  # without callbacks, the second engine refuses the held tensor
    model.net[2] = BlockSparseLinear.from_dense(model.net[2], (16, 16), density=0.5)
    first = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5,
                                                 allow=[r"net\.2"]))
    with pytest.raises(ValueError, match=r"tensor 'net.2.values' \(BlockSparseLinear\) is "
                                         r"already held by another SparsityEngine"):
        SparsityEngine(model, SparsityConfig("block:16x16", sparsity=0.5, allow=["net.2"]))
    first.detach()


def two_compressing(max_epochs, ckpt_path=None, checkpoint=None, init_seed=0):
    callbacks = [SparsityCallback(**STATIC_FIRST),
                 SparsityCallback("block:16x16", sparsity=0.75, compress=True,
                                  allow=[r"net\.2"], regrow="set", frequency=2, regrow_end=7)]
    # 4 steps an epoch: SET moves blocks before the first epoch's checkpoint and after it
    model, trainer = fit_block_net(callbacks + ([checkpoint] if checkpoint else []), max_epochs,
                                   ckpt_path, init_seed, samples=64,
                                   enable_checkpointing=bool(checkpoint))
    return (model, trainer), callbacks


def test_two_compressing_callbacks_resume_their_own_layers_exactly(tmp_path):
    uninterrupted, _ = two_compressing(2)
    two_compressing(1, checkpoint=ModelCheckpoint(dirpath=tmp_path, save_last=True))
    states = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]
    held = sorted(list(s["compressed"]) for k, s in states.items()
                  if k.startswith("SparsityCallback"))
    assert held == [["net.0.values"], ["net.2.values"]]  # each saved its own layer
    resumed, callbacks = two_compressing(2, ckpt_path=tmp_path / "last.ckpt", init_seed=1)
    assert [[s.name for s in c.engine.slots] for c in callbacks] == [["net.0.values"],
                                                                      ["net.2.values"]]
    assert callbacks[1].engine.updater.last_regrow > 4  # SET moved blocks after the resume
    assert_same_training(*uninterrupted, *resumed)
