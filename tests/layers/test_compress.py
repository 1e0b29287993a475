"""SparsityCallback(compress=...): selected Linear layers train as BlockSparseLinear."""

import types
import warnings

import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, assert_same_training, expanded, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from sparse_training import (
    BlockSparseLinear,
    SparsityCallback,
    SparsityConfig,
    make_permanent,
    sparsify,
)
from sparse_training.engine.plan import SparsityPlan
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.layers import auto_paths
from sparse_training.layers.auto_paths import Timing
from sparse_training.layers.compress import compress_selected

SETTINGS = dict(pattern="block:16x16", sparsity=0.75)


def loader():
    """Two batches an epoch: a fit still steps after the masks' fixed count is set, and a
    resume from the first epoch's checkpoint still starts mid-fit; each step's compressed
    products run in Triton's interpreter on the CPU, so the tests take no more."""
    return make_loader(n=32)


def masked_dense_masks(**settings) -> dict[int, torch.Tensor]:
    """The masks a compress=False fit of the same model and settings keeps."""
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    make_trainer([SparsityCallback(**settings)], max_epochs=1).fit(model, loader())
    return {i: model.net[i].weight_mask for i in (0, 2)}


def test_compress_true_trains_compressed_from_setup_and_reports_the_pruned_share(tmp_path):
    expected = masked_dense_masks(**SETTINGS)
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    trainer = make_trainer([SparsityCallback(**SETTINGS, compress=True, log_layers=True)],
                           max_epochs=1, logger=pl.loggers.CSVLogger(tmp_path))
    trainer.fit(model, loader())
    for i in (0, 2):
        layer = model.net[i]
        assert isinstance(layer, BlockSparseLinear)
        # the blocks masked-dense training keeps: the largest at setup, by the same rule
        assert torch.equal(expanded(layer), expected[i])
        assert layer.nnz == layer.block_mask.numel() // 4
    assert type(model.net[4]) is nn.Linear  # 4 outputs cannot take 16x16 blocks
    # the optimizer was built over the compressed values: no dense weight of the layers
    assert (4, 16, 16) in model.optimizer_shapes and (64, 64) not in model.optimizer_shapes
    logged = trainer.callback_metrics  # the share of the dense weights the blocks drop
    pruned = sum(int((~expanded(model.net[i])).sum()) for i in (0, 2))
    total = sum(model.net[i].weight.numel() for i in (0, 2))
    assert float(logged["sparsity/global"]) == pytest.approx(pruned / total, abs=1e-6)
    assert float(logged["sparsity/net.2.weight"]) == pytest.approx(
        float((~expanded(model.net[2])).float().mean()), abs=1e-6)
    assert not model.net[2].weight[~expanded(model.net[2])].any()


def fit(max_epochs, ckpt_path=None, callbacks=(), init_seed=0, **settings):
    """A compress=True fit of a BlockNet initialized from ``init_seed``: (model, trainer)."""
    pl.seed_everything(init_seed, verbose=False)
    model = BlockNet()
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer = make_trainer([SparsityCallback(**{**SETTINGS, "compress": True, **settings}),
                            *callbacks], max_epochs=max_epochs, enable_checkpointing=saves)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("pattern", ["block:16x16", "2:4"])
def test_a_compressed_checkpoint_resumes_exactly_and_loads_plainly(tmp_path, pattern):
    """The resumed model starts from another initialization: only the checkpoint's masks
    (swapped in at setup) and its dense weights make it the uninterrupted run."""
    settings = dict(pattern=pattern, sparsity=0.75 if pattern.startswith("block") else None)
    uninterrupted = fit(2, **settings)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    stopped, _ = fit(1, callbacks=[checkpoint], **settings)
    resumed = fit(2, ckpt_path=tmp_path / "last.ckpt", init_seed=1, **settings)
    assert_same_training(*uninterrupted, *resumed)
    plain = BlockNet.load_from_checkpoint(tmp_path / "last.ckpt")  # strict, nn.Linear layers
    for i in (0, 2):
        assert type(plain.net[i]) is nn.Linear
        layer = stopped.net[i]
        assert torch.equal(plain.net[i].weight, layer.to_dense().weight)
        kept = expanded(layer) if pattern.startswith("block") else layer.mask
        assert not plain.net[i].weight[~kept].any() and plain.net[i].weight[kept].all()
    if pattern == "2:4":  # the compact legacy format below is the block layers'
        return
    # a checkpoint of the earlier format (compact keys, no compressed masks in the state)
    legacy = torch.load(tmp_path / "last.ckpt", weights_only=False)
    for i in (0, 2):
        del legacy["state_dict"][f"net.{i}.weight"]
        legacy["state_dict"][f"net.{i}.values"] = stopped.net[i].values.detach()
        legacy["state_dict"][f"net.{i}.block_mask"] = stopped.net[i].block_mask
    for state in legacy["callbacks"].values():
        state.pop("compressed", None)
    torch.save(legacy, tmp_path / "legacy.ckpt")
    assert_same_training(*uninterrupted, *fit(2, ckpt_path=tmp_path / "legacy.ckpt",
                                              init_seed=1, **settings))


def test_random_static_masks_are_the_seeded_draw_of_masked_dense_training():
    settings = dict(SETTINGS, score="random", schedule="constant", seed=3)
    expected = masked_dense_masks(**settings)
    pl.seed_everything(0, verbose=False)
    model = BlockNet()
    make_trainer([SparsityCallback(**settings, compress=True)],
                 max_epochs=1).fit(model, loader())
    for i in (0, 2):
        assert torch.equal(expanded(model.net[i]), expected[i])


def test_auto_keeps_masked_dense_where_the_kernels_would_be_slower(lightning_log):
    model = BlockNet()
    callback = SparsityCallback(**SETTINGS, compress="auto")
    make_trainer([callback], max_epochs=1).fit(model, loader())
    assert type(model.net[2]) is nn.Linear and hasattr(model.net[2], "weight_mask")
    assert "auto: on cpu the compressed layer multiplies a dense copy" in lightning_log.text
    assert callback.engine.sparsity == pytest.approx(0.75)


def faster_compressed(key, device):
    """A measure that finds every compressed layer faster (no GPU is needed to decide)."""
    return Timing(masked_dense_ms=2.0, compressed_ms=1.0)


class Big(pl.LightningModule):
    """One 4096 x 4096 Linear (16M weights: where auto starts compressing blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16))


class FakeTrainer:
    """What SparsityCallback.setup reads of a Trainer on a GPU (none is needed: the
    decision is pure, and the swap runs on the CPU model)."""

    def __init__(self, precision: str) -> None:
        self.strategy = types.SimpleNamespace(root_device=torch.device("cuda", 0),
                                              broadcast=lambda obj, src=0: obj)
        self.precision, self.ckpt_path, self.callbacks = precision, None, []


@pytest.mark.parametrize("precision, compressed, header", [
    ("bf16-mixed", True, "compress='auto' for cuda:0, bf16 compute"),
    ("16-true", True, "compress='auto' for cuda:0, fp16 compute"),
    ("32-true", True, "compress='auto' for cuda:0, fp32 compute"),
    ("64-true", False, "compress='auto' for cuda:0, fp64 compute"),
])
def test_auto_at_setup_decides_for_the_strategys_device_and_the_precision(
        lightning_log, monkeypatch, tmp_path, precision, compressed, header):
    """Measured on the Trainer's GPU in the precision's compute dtype (here a fake measure);
    fp64 is not measured: no compressed kernel takes it."""
    monkeypatch.setenv("SPARSE_TRAINING_CACHE", str(tmp_path))
    monkeypatch.setattr(auto_paths, "measure_step", faster_compressed)
    model = Big()
    callback = SparsityCallback(pattern="block:128x128", sparsity=0.9, compress="auto")
    callback.setup(FakeTrainer(precision), model, "fit")
    assert isinstance(model.net[0], BlockSparseLinear) is compressed
    assert f"training paths ({header})" in lightning_log.text
    assert ("128x128  0.0996   102  compressed: auto: compressed measured 1.000 ms, "
            "masked-dense 2.000 ms per step at 8192 tokens" in lightning_log.text) is compressed
    assert ("fp64 compute; the compressed kernels take bf16, fp16 and fp32"
            in lightning_log.text) is not compressed


def test_compress_selected_decides_for_the_arguments_not_the_weights_device(tmp_path):
    config = SparsityConfig(pattern="block:128x128", sparsity=0.9, compress="auto")
    cache = auto_paths.PathCache(tmp_path / "times.json")
    on_cpu = Big()
    (row,), _ = compress_selected(on_cpu, SparsityPlan.build(on_cpu, config),
                                  measure=faster_compressed)  # the weights' device: cpu
    assert row.layer is None and "on cpu" in row.decision
    on_gpu = Big()
    (row,), _ = compress_selected(on_gpu, SparsityPlan.build(on_gpu, config),
                                  torch.device("cuda"), torch.bfloat16,
                                  measure=faster_compressed, cache=cache)
    assert row.decision.startswith("compressed: auto: compressed measured")
    assert isinstance(on_gpu.net[0], BlockSparseLinear)
    big = Big()
    (row,), _ = compress_selected(big, SparsityPlan.build(big, config), torch.device("cuda"),
                                  torch.float64, measure=faster_compressed, cache=cache)
    assert row.layer is None and "fp64 compute" in row.decision


def test_a_target_that_prunes_no_block_keeps_the_layer_masked_dense():
    """Sparsity 0.1 prunes round(0.1 x 4) = 0 of net.0's four 16x16 blocks: it stays an
    nn.Linear (trained masked-dense, as sparsify leaves it), saying so; net.2 loses 2 of
    16 blocks and compresses."""
    model = BlockNet()
    config = SparsityConfig(pattern="block:16x16", sparsity=0.1, compress=True)
    rows = {r.name: r for r in compress_selected(model, SparsityPlan.build(model, config))[0]}
    assert rows["net.0"].layer is None and type(model.net[0]) is nn.Linear
    assert rows["net.0"].decision == (
        "masked-dense: the 64x16 weight has 4 blocks of 16x16: sparsity 0.1 keeps 4 of 4 "
        "blocks (nothing pruned; use smaller blocks or a higher sparsity)")
    assert rows["net.2"].decision == "compressed" and model.net[2].nnz == 14


class TenClasses(BlockNet):
    """BlockNet with a 10-class head: 2:4 masks its inputs, but no 2:4 layer takes 10
    outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net[4] = nn.Linear(64, 10)


def test_a_2to4_head_of_10_outputs_stays_masked_dense_with_its_line(lightning_log):
    model = TenClasses()
    sparse = SparsityCallback("2:4", compress=True)
    make_trainer([sparse], max_epochs=1).fit(model, loader())
    assert [type(model.net[i]).__name__ for i in (0, 2, 4)] == [
        "SemiStructuredLinear", "SemiStructuredLinear", "Linear"]
    assert [s.name for s in sparse.engine.masked] == ["net.4.weight"]
    assert sparse.engine.tensor_sparsity["net.4.weight"] == 0.5
    (line,) = [line for line in lightning_log.text.splitlines() if line.startswith("net.4 ")]
    assert line.endswith("masked-dense: SemiStructuredLinear: out_features must be a positive "
                         "multiple of 4 (2:4 groups), got 10")


def test_a_new_callback_on_layers_compressed_before_says_they_keep_their_blocks():
    """A second fit with a new callback: the layers the first compressed keep their blocks;
    other settings than theirs get a warning naming them, the same settings none."""
    model, _ = fit(1)  # 0.75: net.0 keeps 1 of 4 blocks, net.2 4 of 16
    again = SparsityCallback(**{**SETTINGS, "sparsity": 0.5, "compress": True})
    with pytest.warns(UserWarning, match=r"2 layers were compressed before this fit and keep "
                      r"their own blocks, not what these settings give them: net.0 "
                      r"\(block:16x16, 1 of 4 blocks kept; these settings: block:16x16 at "
                      r"sparsity 0.5\), net.2 \(block:16x16, 4 of 16 blocks kept; these"):
        make_trainer([again], max_epochs=1).fit(model, loader())
    assert model.net[2].nnz == 4
    for settings in (SETTINGS, {**SETTINGS, "pattern": "BLOCK:16x16"}):  # the same settings
        same = SparsityCallback(**{**settings, "compress": True})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer([same], max_epochs=1).fit(model, loader())
        assert not [w for w in caught if "compressed before this fit" in str(w.message)]
    overridden, _ = fit(1, overrides={r"net\.2\.weight": {"sparsity": 0.5}})
    again = SparsityCallback(**{**SETTINGS, "compress": True,
                                "overrides": {r"net\.2\.weight": {"sparsity": 0.5}}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([again], max_epochs=1).fit(overridden, loader())
    assert overridden.net[2].nnz == 8
    assert not [w for w in caught if "compressed before this fit" in str(w.message)]


def test_make_permanent_gives_dense_linear_layers_with_the_zeros():
    model, _ = fit(1)
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
        make_trainer([callback], max_epochs=1).fit(model, loader())
    assert type(model.net[0]) is nn.Linear


@pytest.mark.parametrize("saved, now", [(True, "auto"), ("auto", True)])
def test_compress_true_and_auto_resume_each_other(tmp_path, saved, now):
    """On resume the checkpoint decides which layers are compressed: a compress=True
    checkpoint resumed with compress='auto' (which on the CPU would compress nothing) is
    the uninterrupted run, and so is an 'auto' one (every layer masked-dense here) resumed
    with compress=True, whose layers go back to ``nn.Linear`` to follow it."""
    uninterrupted = fit(2, compress=saved)
    fit(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], compress=saved)
    resumed = fit(2, ckpt_path=tmp_path / "last.ckpt", init_seed=1, compress=now)
    assert_same_training(*uninterrupted, *resumed)
    compressed = any(isinstance(m, CompressedLayer) for m in resumed[0].modules())
    assert compressed == (saved is True)


def test_a_weight_two_linears_share_stays_masked_dense_saying_it_is_tied():
    """Both owners are nn.Linear: the reason is the tie (compressing one name would untie
    them), not the owner's type."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32))
    model[2].weight = model[0].weight
    rows, _ = compress_selected(model, SparsityPlan.build(
        model, SparsityConfig(**SETTINGS, compress="auto")))
    decisions = {row.name: row.decision for row in rows}
    assert decisions["0"] == "masked-dense: weight tied to 2.weight: compressing one name " \
        "would untie them"
    assert decisions["3"].startswith("masked-dense: auto: on cpu")


def test_compress_true_on_a_model_with_no_selectable_weight_says_so():
    """Not the message for models that build their layers in configure_model."""
    model = BlockNet()
    model.net = nn.Sequential(nn.LayerNorm(16), nn.ReLU())
    callback = SparsityCallback(pattern="block:16x16", sparsity=0.5, compress=True)
    with pytest.raises(ValueError, match="selected no weight tensor"):
        make_trainer([callback], max_epochs=1).fit(model, loader())


class PreSparsified(BlockNet):
    """A model that compresses its second layer itself, in ``__init__``."""

    def __init__(self):
        super().__init__()
        sparsify(self, {r"net\.2$": {"pattern": "block:16x16", "sparsity": 0.75}},
                 verbose=False)


@pytest.mark.parametrize("compress", [False, "auto", True])
def test_a_model_holding_compressed_layers_resumes_exactly(tmp_path, compress):
    """Layers the model already holds compressed take the checkpoint's masks (they are not
    layers the checkpoint compressed that cannot compress now)."""
    settings = dict(SETTINGS, compress=compress)

    def run(epochs, seed, **kwargs):
        pl.seed_everything(seed, verbose=False)
        model = PreSparsified()
        callbacks = [SparsityCallback(**settings), *kwargs.pop("callbacks", [])]
        make_trainer(callbacks, max_epochs=epochs, enable_checkpointing=len(callbacks) > 1
                     ).fit(model, loader(), **kwargs)
        return model

    uninterrupted = run(2, 0)
    run(1, 0, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    resumed = run(2, 1, ckpt_path=tmp_path / "last.ckpt")
    for key, value in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


class BuiltInConfigureModel(BlockNet):
    """BlockNet whose layers come in ``configure_model`` (built in ``__init__``, held out
    of the module until then), compressed there with ``SparsityCallback.compress`` when
    ``compress_there``."""

    def __init__(self, compress_there: bool = True) -> None:
        super().__init__()
        self.pending, self.compress_there = [self.net], compress_there  # a list: no submodule
        del self.net

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        self.net = self.pending.pop()
        if self.compress_there:
            sparse = next(c for c in self.trainer.callbacks if isinstance(c, SparsityCallback))
            sparse.compress(self)


def test_layers_built_in_configure_model_compress_there_as_at_setup():
    """compress(self) in configure_model trains the layers as the swap at setup does: the
    same blocks, weights and optimizer state, bit for bit."""
    runs = []
    for model_class in (BlockNet, BuiltInConfigureModel):
        pl.seed_everything(0, verbose=False)
        model = model_class()
        trainer = make_trainer([SparsityCallback(**SETTINGS, compress=True)], max_epochs=2)
        trainer.fit(model, loader())
        runs += [model, trainer]
    assert isinstance(runs[2].net[2], BlockSparseLinear)
    assert (4, 16, 16) in runs[2].optimizer_shapes  # the optimizer got the compressed values
    assert_same_training(*runs)


def test_compress_in_configure_model_is_needed_and_refuses_what_it_cannot_do():
    sparse = SparsityCallback(**SETTINGS, compress=True)
    model = BuiltInConfigureModel(compress_there=False)
    with pytest.raises(ValueError, match=r"compress=True but the model had no weights at "
                                         r"setup and configure_model compressed none"):
        make_trainer([sparse], max_epochs=1).fit(model, loader())
    assert type(model.net[0]) is nn.Linear and sparse.engine is None
    with pytest.raises(RuntimeError, match=r"call it in configure_model with the "
                                           r"LightningModule being fit"):
        sparse.compress(BlockNet())  # no fit under way
    with torch.device("meta"):
        lazy = BlockNet()
    with pytest.raises(ValueError, match=r"\['net.0.weight', 'net.2.weight'\] are on the meta "
                                         r"device: .* initialize the weights first"):
        compress_selected(lazy, SparsityPlan.build(lazy, SparsityConfig(**SETTINGS,
                                                                        compress=True)))
    assert type(lazy.net[0]) is nn.Linear
    SparsityCallback(**SETTINGS, compress=False).compress(BlockNet())  # nothing to do


class MetaNet(BlockNet):
    """BlockNet whose layers are still on the meta device at setup."""

    def __init__(self) -> None:
        super().__init__()
        self.net.to("meta")


class MetaInConfigureModel(BuiltInConfigureModel):
    """Builds its layers on the meta device in configure_model and compresses them there."""

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        self.pending[0].to("meta")
        super().configure_model()


@pytest.mark.parametrize("model_class", [MetaNet, MetaInConfigureModel])
def test_compress_on_meta_layers_raises_its_own_error_from_fit(model_class):
    """Not Lightning's teardown error (it moves the model to the CPU, which meta refuses)."""
    model = model_class()
    with pytest.raises(ValueError, match=r"\['net.0.weight', 'net.2.weight'\] are on the meta "
                                         r"device: .* initialize the weights first"):
        make_trainer([SparsityCallback(**SETTINGS, compress=True)],
                     max_epochs=1).fit(model, loader())
    assert type(model.net[0]) is nn.Linear and model.net[0].weight.is_meta


class BlockLayersFromMeta(BlockNet):
    """BlockSparseLinear layers built on the meta device in configure_model, given storage
    with to_empty() and, with ``reset``, initialized."""

    def __init__(self, reset: bool) -> None:
        super().__init__()
        self.reset = reset
        del self.net

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        with torch.device("meta"):
            self.net = nn.Sequential(BlockSparseLinear(16, 64, (16, 16), density=0.5),
                                     nn.ReLU(), BlockSparseLinear(64, 64, (16, 16), density=0.25),
                                     nn.ReLU(), nn.Linear(64, 4))
        self.net.to_empty(device="cpu")
        self.net[4].reset_parameters()
        for i in (0, 2):
            self.net[i].block_mask.fill_(True)  # what uninitialized memory may hold
            if self.reset:
                self.net[i].reset_parameters()


def test_rigl_on_layers_built_on_the_meta_device_trains_their_drawn_blocks():
    rigl = dict(SETTINGS, compress=True, regrow="rigl", frequency=2, regrow_end=1.0)
    model = BlockLayersFromMeta(reset=True)
    sparse = SparsityCallback(**rigl)
    make_trainer([sparse], max_epochs=1).fit(model, make_loader())
    assert sparse.engine.updater.last_regrow is not None
    for i, nnz in ((0, 2), (2, 4)):
        assert int(model.net[i].block_mask.sum()) == model.net[i].nnz == nnz
    model = BlockLayersFromMeta(reset=False)
    with pytest.raises(ValueError, match=r"compressed layer 'net.0' \(BlockSparseLinear\): its "
                                         r"block_mask is uninitialized memory"):
        make_trainer([SparsityCallback(**rigl)], max_epochs=1).fit(model, make_loader())
