"""SparsityCallback(compress=...): selected Linear layers train as BlockSparseLinear."""

import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, expanded, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from sparse_training import BlockSparseLinear, SparsityCallback, make_permanent
from sparse_training.compression import slower_reason
from sparse_training.patterns import parse_pattern

SETTINGS = dict(pattern="block:16x16", sparsity=0.75)


def masked_dense_masks(**settings) -> dict[int, torch.Tensor]:
    """The masks a compress=False fit of the same model and settings keeps."""
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    make_trainer([SparsityCallback(**settings)], max_epochs=1).fit(model, make_loader())
    return {i: model.net[i].weight_mask for i in (0, 2)}


def test_compress_true_trains_compressed_from_setup_and_reports_forward_sparsity():
    expected = masked_dense_masks(**SETTINGS)
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    trainer = make_trainer([SparsityCallback(**SETTINGS, compress=True, log_layers=True)],
                           max_epochs=1, logger=pl.loggers.CSVLogger("logs"))
    trainer.fit(model, make_loader())
    for i in (0, 2):
        layer = model.net[i]
        assert isinstance(layer, BlockSparseLinear)
        # the blocks masked-dense training keeps: the largest at setup, by the same rule
        assert torch.equal(expanded(layer), expected[i])
        assert layer.nnz == layer.block_mask.numel() // 4
    assert type(model.net[4]) is nn.Linear  # 4 outputs cannot take 16x16 blocks
    # the optimizer was built over the compressed values: no dense weight of the layers
    assert (4, 16, 16) in model.optimizer_shapes and (64, 64) not in model.optimizer_shapes
    logged = trainer.callback_metrics
    zeros = sum(int((model.net[i].weight == 0).sum()) for i in (0, 2))
    total = sum(model.net[i].weight.numel() for i in (0, 2))
    assert float(logged["sparsity/global"]) == pytest.approx(zeros / total, abs=1e-6)
    assert float(logged["sparsity/net.2.values"]) == pytest.approx(
        float((model.net[2].weight == 0).float().mean()), abs=1e-6)


def fit(max_epochs, ckpt_path=None, callbacks=()):
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    trainer = make_trainer([SparsityCallback(**SETTINGS, compress=True), *callbacks],
                           max_epochs=max_epochs, enable_checkpointing=bool(callbacks))
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    return model


def test_a_compressed_checkpoint_resumes_exactly(tmp_path):
    uninterrupted = fit(2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(1, callbacks=[checkpoint])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert saved["net.2.values"].shape == (4, 16, 16)  # the compressed form
    assert "net.2.weight" not in saved
    resumed = fit(2, ckpt_path=tmp_path / "last.ckpt")
    for i in (0, 2):
        assert torch.equal(resumed.net[i].block_mask, uninterrupted.net[i].block_mask)
        assert torch.equal(resumed.net[i].values, uninterrupted.net[i].values)


def test_random_static_masks_are_the_seeded_draw_of_masked_dense_training():
    settings = dict(SETTINGS, score="random", schedule="constant", seed=3)
    expected = masked_dense_masks(**settings)
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    make_trainer([SparsityCallback(**settings, compress=True)],
                 max_epochs=1).fit(model, make_loader())
    for i in (0, 2):
        assert torch.equal(expanded(model.net[i]), expected[i])


def test_auto_keeps_masked_dense_where_the_kernels_would_be_slower(lightning_log):
    model = BlockNet()
    callback = SparsityCallback(**SETTINGS, compress="auto")
    make_trainer([callback], max_epochs=1).fit(model, make_loader())
    assert type(model.net[2]) is nn.Linear and hasattr(model.net[2], "weight_mask")
    assert "auto: 64x64 is under 16,777,216 weights, where launch costs" in lightning_log.text
    assert callback.engine.sparsity == pytest.approx(0.75)


@pytest.mark.parametrize("pattern, shape, reason", [
    ("block:64x64", (4096, 4096), "on cpu the compressed layer multiplies a dense copy"),
    ("block:64x64", (1024, 4096), "1024x4096 is under 16,777,216 weights, where launch"),
    ("2:4", (14336, 4096), "cuSPARSELt runs on CUDA, not cpu"),
    ("2:4:2d", (4096, 4096), "4096x4096 is under 33,554,432 weights, where cuSPARSELt's "
                             "host time per eager call"),
    ("2:4", (4096, 4100), "in_features 4100 not a multiple of 16"),
])
def test_auto_reasons_name_the_size_the_device_and_the_shape(pattern, shape, reason):
    """compress="auto" keeps small weights masked-dense (blocks under 16M entries, 2:4
    under 32M: measured slower or no faster there), and says so before any device check."""
    found = slower_reason(shape, parse_pattern(pattern), 0.25, torch.device("cpu"))
    assert found.startswith("auto: ") and reason in found


def test_make_permanent_gives_dense_linear_layers_with_the_zeros():
    model = fit(1)
    x = torch.randn(5, 16)
    with torch.no_grad():
        outputs = model(x)
    make_permanent(model)
    assert type(model.net[2]) is nn.Linear
    assert float((model.net[2].weight == 0).float().mean()) == 0.75
    with torch.no_grad():
        assert torch.allclose(model(x), outputs, atol=1e-6)


@pytest.mark.parametrize("settings, message", [
    (dict(schedule="gmp"), "schedule='gmp' from start=0 reaches its sparsity after the first"),
    (dict(regrow="rigl", schedule="gmp"), "schedule='gmp' from start=0"),
    (dict(start=10), "schedule='oneshot' from start=10"),
    (dict(pattern="unstructured"), "pattern 'unstructured' is neither a block pattern nor 2:4"),
])
def test_compress_true_refuses_schedules_without_a_fixed_count(settings, message):
    with pytest.raises(ValueError, match=message):
        SparsityCallback(**{**SETTINGS, **settings}, compress=True)


def test_compress_true_on_layers_the_kernels_cannot_take_names_each_reason():
    model = BlockNet()
    callback = SparsityCallback(pattern="block:4x4", sparsity=0.5, compress=True)
    with pytest.raises(ValueError, match=r"net.0.weight: block 4x4: the kernels take blocks"):
        make_trainer([callback], max_epochs=1).fit(model, make_loader())
    assert type(model.net[0]) is nn.Linear
