"""SparsityCallback in real Trainer runs (CPU): schedules, AMP, accumulation, resume, errors."""

import logging

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet, TwoOptimizerNet, assert_masks_hold, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn

from sparse_training import SparsityCallback, make_permanent
from sparse_training.masks import as_matrix, kept_count


class MaskAudit(Callback):
    """After every mask update: exact counts, zero weights, zero optimizer state."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.updates = sparse, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = self.sparse.engine
        if engine.last_update != trainer.global_step:
            return
        self.updates += 1
        fraction = engine.schedule.fraction(trainer.global_step)
        for layer in engine.layers:
            pattern, mask = layer.plan.pattern, layer.mask
            if pattern.is_nm:
                kept = pattern.kept_per_group(layer.plan.sparsity * fraction)
                groups = as_matrix(mask).reshape(-1, pattern.m)
                assert (groups.sum(-1) == kept).all()
            elif layer.plan.sparsity is not None:
                block = pattern.block_rows * pattern.block_cols
                kept_blocks = kept_count(mask.numel() // block, layer.plan.sparsity * fraction)
                assert int(mask.sum()) == kept_blocks * block
        self.check_zeros(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.check_zeros(trainer)

    def check_zeros(self, trainer):
        assert_masks_hold(self.sparse.engine, trainer.optimizers)


SCHEDULES = [
    dict(pattern="2:4"),
    dict(pattern="unstructured", sparsity=0.9, schedule="gmp", start=2, end=12, frequency=3),
    dict(pattern="2:8", schedule="gmp", start=0, end=0.5, frequency=2),
    dict(pattern="block:4x4", sparsity=0.5, schedule="linear", frequency=4),
    dict(pattern="unstructured", sparsity=0.8, schedule="constant", start=3),
    dict(pattern="unstructured", sparsity=0.7, schedule="gmp", distribution="global",
         frequency=2),
]


@pytest.mark.parametrize("settings", SCHEDULES, ids=lambda s: f"{s['pattern']}-"
                         f"{s.get('schedule', 'oneshot')}-{s.get('distribution', 'uniform')}")
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_schedule_runs_to_completion(settings, optimizer):
    sparse = SparsityCallback(**settings)
    audit = MaskAudit(sparse)
    model = TinyNet(optimizer)
    trainer = make_trainer([sparse, audit], max_epochs=2)
    trainer.fit(model, make_loader())
    assert audit.updates >= 1
    final = settings.get("sparsity") or sparse.config.parsed_pattern.nm_sparsity
    assert sparse.engine.sparsity == pytest.approx(final, abs=0.01)
    assert trainer.callback_metrics["sparsity/global"] == pytest.approx(sparse.engine.sparsity)
    assert trainer.callback_metrics["sparsity/target"] == pytest.approx(final)


def test_conv_net_and_gradient_accumulation_count_optimizer_steps():
    sparse = SparsityCallback("2:4", schedule="oneshot", start=3, deny=[r"net\.5"])
    audit = MaskAudit(sparse)
    trainer = make_trainer([sparse, audit], max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(TinyNet(conv=True), make_loader(conv=True))
    assert trainer.global_step == 4 and sparse.engine.last_update == 3
    names = [layer.plan.name for layer in sparse.engine.layers]
    assert names == ["net.0", "net.2"]  # input channels 4 and 8 take 2:4; the head is denied


def test_bf16_autocast_on_cpu():
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="gmp", frequency=2)
    audit = MaskAudit(sparse)
    trainer = make_trainer([sparse, audit], precision="bf16-mixed", max_epochs=2)
    trainer.fit(TinyNet(), make_loader())
    assert sparse.engine.sparsity == pytest.approx(0.5, abs=0.01)


def test_gradient_clipping_sees_the_masked_norm():
    seen = []

    class Spy(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            w = pl_module.net[0]
            seen.append(bool(w.weight.grad[~w.weight_mask].any()))

    sparse = SparsityCallback("2:4")
    trainer = make_trainer([sparse, Spy()], max_epochs=1, gradient_clip_val=0.01)
    trainer.fit(TinyNet(), make_loader())
    assert seen and not any(seen)  # masked before the clip reads the gradients


def test_several_optimizers():
    sparse = SparsityCallback("unstructured", sparsity=0.6, schedule="gmp", frequency=2)
    audit = MaskAudit(sparse)
    trainer = make_trainer([sparse, audit], max_epochs=2)
    trainer.fit(TwoOptimizerNet(), make_loader())
    assert audit.updates >= 3
    assert sparse.engine.sparsity == pytest.approx(0.6, abs=0.01)


def test_setup_table_lists_every_candidate(caplog):
    class WithEmbedding(TinyNet):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 16)

    sparse = SparsityCallback("2:4", deny=["net.4"], dense_ratio=0.5)
    with caplog.at_level(logging.INFO):
        make_trainer([sparse], max_epochs=1).fit(WithEmbedding(), make_loader())
    table = caplog.text
    assert "1 of 4 candidate layers selected" in table
    assert "type Embedding not in layer_types" in table
    assert "deny 'net.4'" in table
    assert "dense_ratio 0.5: first 1 of 2 eligible layers stay dense" in table
    assert [layer.plan.name for layer in sparse.engine.layers] == ["net.2"]


def test_overrides_and_log_layers():
    sparse = SparsityCallback("unstructured", sparsity=0.5, log_layers=True,
                              overrides={r"net\.0": {"pattern": "1:4"},
                                         r"net\.4": {"sparsity": 0.0}})
    trainer = make_trainer([sparse], max_epochs=1)
    trainer.fit(TinyNet(), make_loader())
    assert trainer.callback_metrics["sparsity/net.0"] == pytest.approx(0.75)
    assert trainer.callback_metrics["sparsity/net.2"] == pytest.approx(0.5)
    assert "sparsity/net.4" not in trainer.callback_metrics


def run_for(model, callbacks, max_epochs, ckpt_path=None, **kwargs):
    trainer = make_trainer(callbacks, max_epochs=max_epochs, **kwargs)
    trainer.fit(model, make_loader(n=96), ckpt_path=ckpt_path)
    return trainer


def sparse_settings():
    return dict(pattern="unstructured", sparsity=0.8, schedule="gmp", start=1, end=10,
                frequency=2)


def test_resume_mid_schedule_is_bit_exact(tmp_path):
    pl.seed_everything(0)
    straight = TinyNet("adam")
    run_for(straight, [SparsityCallback(**sparse_settings())], max_epochs=2)

    pl.seed_everything(0)
    first = TinyNet("adam")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(first, [SparsityCallback(**sparse_settings()), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    resumed = TinyNet("adam")
    sparse = SparsityCallback(**sparse_settings())
    run_for(resumed, [sparse], max_epochs=2, ckpt_path=tmp_path / "last.ckpt")

    assert sparse.engine.last_update == 10  # steps 6..11 ran after the resume
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_with_wrong_masks_is_rejected(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(TinyNet(), [SparsityCallback("2:4"), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    saved["state_dict"]["net.2.weight_mask"] = torch.ones(3, 4, dtype=torch.bool)
    torch.save(saved, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="checkpoint mask 'net.2.weight_mask'"):
        run_for(TinyNet(), [SparsityCallback("2:4")], max_epochs=2,
                ckpt_path=tmp_path / "bad.ckpt")


def test_make_permanent_after_fit():
    model = TinyNet()
    run_for(model, [SparsityCallback("2:4")], max_epochs=1)
    make_permanent(model)
    assert set(model.state_dict()) == set(TinyNet().state_dict())
    assert (model.net[0].weight == 0).float().mean() == 0.5


BAD_CONSTRUCTION = [
    (dict(pattern="2-4"), "unknown pattern '2-4'; valid forms"),
    (dict(pattern="5:4"), "N must satisfy 1 <= N <= M"),
    (dict(pattern="unstructured"), "needs a sparsity in"),
    (dict(pattern="unstructured", sparsity=1.0), r"sparsity must be a number in \[0, 1\)"),
    (dict(pattern="unstructured", sparsity=-0.1), r"sparsity must be a number in \[0, 1\)"),
    (dict(pattern="2:4", sparsity=0.7), "pattern '2:4' implies sparsity 0.5"),
    (dict(schedule="cubic"), "unknown schedule 'cubic'; valid: oneshot, gmp, linear, constant"),
    (dict(schedule="gmp", start=50, end=10), "start must come before end"),
    (dict(schedule="gmp", start=0.8, end=0.2), "start must come before end"),
    (dict(schedule="gmp", start=1.5), r"start as a fraction of training must lie in \[0, 1\]"),
    (dict(schedule="oneshot", end=10), "end applies to gradual schedules"),
    (dict(frequency=0), "frequency must be an int >= 1, got 0"),
    (dict(allow="fc1"), "allow must be a list of regex strings"),
    (dict(deny=["("]), "deny regex '\\(' is invalid"),
    (dict(dense_ratio=1.0), r"dense_ratio must be a number in \[0, 1\)"),
    (dict(distribution="erdos"), "unknown distribution 'erdos'; valid: uniform, erk, global"),
    (dict(distribution="global"), "distribution 'global' needs an unstructured or block"),
    (dict(overrides={"fc": {"density": 0.5}}), "overrides\\['fc'\\] must be a dict with keys"),
    (dict(overrides={"fc": {"pattern": "1:9:2d"}}), "transposable N:M supports M <= 5"),
    (dict(layer_types=("Linear",)), "layer_types must be torch.nn.Module subclasses"),
    (dict(overrides={"fc": {"pattern": "unstructured"}}),
     "overrides\\['fc'\\]: pattern 'unstructured' needs a sparsity"),
    (dict(overrides={"fc": {"sparsity": 0.9}}),
     "overrides\\['fc'\\]: pattern '2:4' implies sparsity 0.5"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONSTRUCTION,
                         ids=[m[:30] for _, m in BAD_CONSTRUCTION])
def test_bad_construction_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparsityCallback(**kwargs)


BAD_SETUP = [
    (dict(allow=["encoder"]), "allow regex 'encoder' matches no layer; layers are: 'net.0'"),
    (dict(overrides={"head": {"sparsity": 0.5}}), "overrides regex 'head' matches no layer"),
    (dict(pattern="2:32", allow=[r"net\.0"]),
     "layer 'net.0' .* was asked for by name but cannot take pattern '2:32'"),
    (dict(schedule="gmp", end=10_000.0), r"end as a fraction of training must lie in"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SETUP, ids=[m[:30] for _, m in BAD_SETUP])
def test_bad_setup_raises_before_any_weight_changes(kwargs, message):
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        SparsityCallback(**kwargs)  # construction errors count too
        make_trainer([SparsityCallback(**kwargs)], max_epochs=1).fit(model, make_loader())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)


def test_layers_built_in_configure_model_are_an_error():
    class Lazy(TinyNet):
        def __init__(self):
            super().__init__()
            del self.net

        def configure_model(self):
            self.net = nn.Sequential(nn.Linear(16, 4))

    with pytest.raises(ValueError, match="selected no layer .* builds in configure_model"):
        make_trainer([SparsityCallback("2:4")], max_epochs=1).fit(Lazy(), make_loader())


def test_a_reused_callback_prunes_a_fresh_model_after_a_resume(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(TinyNet(), [SparsityCallback("2:4"), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    sparse = SparsityCallback("2:4")
    run_for(TinyNet(), [sparse], max_epochs=2, ckpt_path=tmp_path / "last.ckpt")
    fresh = TinyNet()
    run_for(fresh, [sparse], max_epochs=1)
    assert (fresh.net[0].weight == 0).float().mean() == 0.5


def test_from_config_yaml_and_unknown_keys(tmp_path):
    path = tmp_path / "sparse.yaml"
    path.write_text("pattern: block:2x2\nsparsity: 0.5\nschedule: gmp\nlayer_types: [Linear]\n"
                    "overrides:\n  'net\\.4': {sparsity: 0.25}\n")
    sparse = SparsityCallback.from_config(path)
    assert sparse.config.layer_types == (nn.Linear,)
    assert sparse.config.parsed_pattern.block_rows == 2
    with pytest.raises(ValueError, match=r"unknown config keys \['sparsty'\]; valid keys: pattern"):
        SparsityCallback.from_config({"sparsty": 0.5})
    with pytest.raises(ValueError, match="layer_types entry 'Dense' is not a torch.nn module"):
        SparsityCallback.from_config({"layer_types": ["Dense"]})


def test_two_callbacks_have_distinct_state_keys():
    a = SparsityCallback("2:4", allow=[r"net\.0"])
    b = SparsityCallback("unstructured", sparsity=0.5, allow=[r"net\.2"])
    assert a.state_key != b.state_key


def test_metrics_reach_the_loggers(tmp_path):
    import csv

    from pytorch_lightning.loggers import CSVLogger

    sparse = SparsityCallback("unstructured", sparsity=0.6, schedule="gmp", frequency=2,
                              log_layers=True)
    trainer = make_trainer([sparse], max_epochs=2, logger=CSVLogger(tmp_path),
                           log_every_n_steps=2)
    trainer.fit(TinyNet(), make_loader())
    with open(trainer.logger.experiment.metrics_file_path) as file:
        rows = list(csv.DictReader(file))
    logged = [float(r["sparsity/global"]) for r in rows if r.get("sparsity/global")]
    assert len(logged) >= 8 and logged == sorted(logged)  # GMP only grows
    assert logged[-1] == pytest.approx(0.6, abs=0.01)
    assert any(r.get("sparsity/net.2") for r in rows)
