"""SparsityCallback in real Trainer runs (CPU): schedules, AMP, accumulation, resume, errors."""


import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, MaskAudit, TinyNet, TwoOptimizerNet, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn

from sparse_training import SparsityCallback, make_permanent

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
    assert trainer.global_step == 4 and sparse.engine.updater.last_update == 3
    names = [slot.name for slot in sparse.engine.slots]
    assert names == ["net.0.weight", "net.2.weight"]  # 4 and 8 input channels; head denied


def test_a_layer_initialized_to_zero_reports_its_pruned_share():
    """The audit's rule: the logged sparsity is the share pruned; the zero layer's kept
    weights (zero until the first step moves them) count as kept."""

    class ZeroInit(TinyNet):
        def __init__(self):
            super().__init__()
            nn.init.zeros_(self.net[2].weight)

    sparse = SparsityCallback("unstructured", sparsity=0.8, log_layers=True)
    audit = MaskAudit(sparse)
    make_trainer([sparse, audit], max_epochs=1, log_every_n_steps=1).fit(ZeroInit(), make_loader())
    assert audit.updates == 1 and audit.logged_checks >= 8


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


class OwnClipping(TinyNet):
    """Clips in its own ``configure_gradient_clipping`` (Lightning's hook for clipping by
    its own rule), without the Trainer's ``gradient_clip_val``; records whether the first
    layer's pruned gradients were nonzero when it clipped."""

    def __init__(self):
        super().__init__()
        self.pruned_gradients_seen = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        layer = self.net[0]
        self.pruned_gradients_seen.append(bool(layer.weight.grad[~layer.weight_mask].any()))
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")


def test_clipping_of_the_module_own_sees_the_masked_norm():
    model = OwnClipping()
    make_trainer([SparsityCallback("2:4")], max_epochs=1).fit(model, make_loader())
    assert model.pruned_gradients_seen and not any(model.pruned_gradients_seen)


def test_several_optimizers():
    sparse = SparsityCallback("unstructured", sparsity=0.6, schedule="gmp", frequency=2)
    audit = MaskAudit(sparse)
    trainer = make_trainer([sparse, audit], max_epochs=2)
    trainer.fit(TwoOptimizerNet(), make_loader())
    assert audit.updates >= 3
    assert sparse.engine.sparsity == pytest.approx(0.6, abs=0.01)


def test_setup_table_lists_every_candidate(lightning_log):
    class WithEmbedding(TinyNet):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 16)

    sparse = SparsityCallback("2:4", deny=["net.4"], dense_ratio=0.5)
    make_trainer([sparse], max_epochs=1).fit(WithEmbedding(), make_loader())
    table = lightning_log.text
    assert ("1 masked-dense and 0 compressed of 4 weight tensors; mask updates at steps 0 "
            "(one update)") in table
    assert "type Embedding not in layer_types" in table
    assert "deny 'net.4'" in table
    assert "dense_ratio 0.5: block 'net.0' is one of the first 1 of 2 blocks" in table
    assert [slot.name for slot in sparse.engine.slots] == ["net.2.weight"]
    assert ("SparsityCallback: 50.00% of 1,024 weights in 1 masked-dense and 0 compressed "
            "tensors are pruned") in table


def test_fit_start_and_end_lines_count_masked_and_compressed_tensors(lightning_log):
    """compress=True: net.0 compressed, net.2 masked-dense (a forward hook keeps it from the
    swap), net.4 not selected (4 rows); both lines count each kind."""
    model = BlockNet()
    model.net[2].register_forward_hook(lambda *args: None)
    sparse = SparsityCallback(pattern="block:16x16", sparsity=0.75, compress=True)
    make_trainer([sparse], max_epochs=1).fit(model, make_loader(n=32))
    assert [s.name for s in sparse.engine.masked] == ["net.2.weight"]
    assert [s.name for s in sparse.engine.compressed] == ["net.0.values"]
    text = lightning_log.text
    assert ("SparsityCallback: 1 masked-dense and 1 compressed of 3 weight tensors; mask "
            "updates at steps 0 (one update)") in text
    weights = 64 * 16 + 64 * 64
    assert (f"SparsityCallback: 75.00% of {weights:,} weights in 1 masked-dense and 1 "
            f"compressed tensors are pruned (target now 75.00%, final 75.00%)") in text
    assert "weight tensors selected" not in text


def test_overrides_and_log_layers():
    sparse = SparsityCallback("unstructured", sparsity=0.5, log_layers=True,
                              overrides={r"net\.0": {"pattern": "1:4"},
                                         r"net\.4": {"sparsity": 0.0}})
    trainer = make_trainer([sparse], max_epochs=1)
    trainer.fit(TinyNet(), make_loader())
    assert trainer.callback_metrics["sparsity/net.0.weight"] == pytest.approx(0.75)
    assert trainer.callback_metrics["sparsity/net.2.weight"] == pytest.approx(0.5)
    assert "sparsity/net.4.weight" not in trainer.callback_metrics


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

    assert sparse.engine.updater.last_update == 10  # steps 6..11 ran after the resume
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_with_wrong_masks_is_rejected_before_anything_changes(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(TinyNet(), [SparsityCallback("2:4"), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("SparsityCallback")]
    state["masks"]["net.2.weight"]["shape"] = [3, 4]
    torch.save(saved, tmp_path / "bad.ckpt")
    model = TinyNet()
    with pytest.raises(ValueError, match=r"mask 'net.2.weight' has shape \[3, 4\]"):
        run_for(model, [SparsityCallback("2:4")], max_epochs=2, ckpt_path=tmp_path / "bad.ckpt")
    # Lightning restored the checkpoint's weights, all of them; no mask was installed
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def test_a_sparse_checkpoint_loads_with_a_plain_strict_call(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trained = TinyNet()
    run_for(trained, [SparsityCallback("2:4"), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    loaded = TinyNet.load_from_checkpoint(tmp_path / "last.ckpt")  # strict, no callback
    assert torch.equal(loaded.net[0].weight, trained.net[0].weight)
    assert (loaded.net[0].weight == 0).float().mean() == 0.5


def test_make_permanent_after_fit_and_a_second_fit():
    model = TinyNet()
    sparse = SparsityCallback("2:4")
    run_for(model, [sparse], max_epochs=1)
    make_permanent(model)
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    assert (model.net[0].weight == 0).float().mean() == 0.5
    run_for(model, [sparse], max_epochs=1)  # fresh masks, pruned again at step 0
    assert sparse.engine.installed and sparse.engine.sparsity == 0.5


def test_layers_built_in_configure_model_on_the_meta_device():
    class Lazy(TinyNet):
        def __init__(self):
            super().__init__()
            del self.net

        def configure_model(self):
            if hasattr(self, "net"):
                return
            with torch.device("meta"):
                self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            self.net.to_empty(device="cpu")  # uninitialized bytes until reset_parameters
            for layer in (self.net[0], self.net[2]):
                layer.reset_parameters()

    sparse = SparsityCallback("2:4")
    audit = MaskAudit(sparse)
    model = Lazy()
    make_trainer([sparse, audit], max_epochs=1).fit(model, make_loader())
    assert [s.name for s in sparse.engine.slots] == ["net.0.weight", "net.2.weight"]
    assert audit.updates == 1 and sparse.engine.sparsity == 0.5


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
    with pytest.raises(ValueError, match=r"unknown setting 'sparsty'; did you mean 'sparsity'"):
        SparsityCallback.from_config({"sparsty": 0.5})
    with pytest.raises(ValueError, match="layer_types entry 'Dense' is not a torch.nn.Module"):
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
    assert any(r.get("sparsity/net.2.weight") for r in rows)


def test_resume_with_a_changed_schedule_warns_and_keeps_the_checkpoints(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(TinyNet(), [SparsityCallback(**sparse_settings()), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    sparse = SparsityCallback(**{**sparse_settings(), "end": 8})
    with pytest.warns(UserWarning, match=r"keeps the checkpoint's schedule; ignored: end=10 "
                                         r"in the checkpoint, 8 now"):
        run_for(TinyNet(), [sparse], max_epochs=2, ckpt_path=tmp_path / "last.ckpt")
    assert sparse.engine.updater.schedule.end == 10


@pytest.mark.parametrize(("change", "message"), [
    (dict(sparsity=0.7), r"sparsity=0.8 in the checkpoint, 0.7 now"),
    (dict(deny=[r"net\.4"]), r"deny=\[\] in the checkpoint, \['net\\\\.4'\] now"),
])
def test_resume_with_changed_masks_settings_says_what_changed(tmp_path, change, message):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run_for(TinyNet(), [SparsityCallback(**sparse_settings()), checkpoint], max_epochs=1,
            enable_checkpointing=True)
    model = TinyNet()
    with pytest.raises(ValueError, match=r"cannot resume: the checkpoint's masks were made "
                                         r"with other settings: " + message):
        run_for(model, [SparsityCallback(**{**sparse_settings(), **change})], max_epochs=2,
                ckpt_path=tmp_path / "last.ckpt")
    # raised as Lightning restores the callback's state, after it loaded the model's
    # weights and before any mask was installed or any step ran
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def test_a_second_fit_runs_the_schedule_again_and_regrows():
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="constant", regrow="rigl",
                              frequency=2, regrow_end=1.0)
    model = TinyNet()
    run_for(model, [sparse], max_epochs=1)
    first = sparse.engine.updater.last_regrow
    run_for(model, [sparse], max_epochs=1)  # a new Trainer: steps count from 0 again
    assert first is not None and sparse.engine.updater.last_regrow is not None
    assert sparse.engine.updater.last_regrow <= first  # it regrew during the second fit
    assert sparse.engine.sparsity == pytest.approx(0.8, abs=0.01)


def test_log_every_n_steps_zero_and_a_short_gmp_warns():
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="gmp", frequency=100)
    with pytest.warns(UserWarning, match=r"only 2 mask updates fit between start=0 and end=9 "
                                         r"at frequency=100"):
        run_for(TinyNet(), [sparse], max_epochs=2, log_every_n_steps=0)
    assert sparse.engine.sparsity == 0.5


def test_unused_selected_tensors_are_named():
    class WithUnused(TinyNet):
        def __init__(self):
            super().__init__()
            self.pooler = nn.Linear(16, 16)

    with pytest.warns(UserWarning, match=r"1 selected tensors got no gradient in the first step"
                                         r" .*\['pooler.weight'\]; deny them"):
        run_for(WithUnused(), [SparsityCallback("2:4")], max_epochs=1)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gradients_changed_after_the_callback_do_not_leak_into_pruned_weights(optimizer):
    class NoisyGradients(TinyNet):  # gradient noise, or a regularizer, after our masking
        def on_before_optimizer_step(self, opt):
            for p in self.parameters():
                p.grad.add_(1e-3 * torch.randn_like(p.grad))

    sparse = SparsityCallback("2:4")
    audit = MaskAudit(sparse)
    make_trainer([sparse, audit], max_steps=4).fit(NoisyGradients(optimizer), make_loader())
    assert audit.steps == 4  # the audit found every pruned weight at zero after each step


class LBFGSNet(TinyNet):
    """LBFGS re-runs the step's closure (up to ``max_iter`` times); each run is counted, and
    with ``sparse`` set it finds the pruned weights at zero."""

    def __init__(self, sparse: SparsityCallback | None = None) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.sparse, self.closure_calls = sparse, 0

    def training_step(self, batch, batch_idx):
        self.closure_calls += 1
        if self.sparse is not None and self.sparse.engine is not None:
            for slot in self.sparse.engine.slots:  # LBFGS moved no pruned weight in the step
                assert not slot.param[~slot.mask].any(), slot.name
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_an_optimizer_that_re_runs_the_closure_gets_fresh_masked_gradients():
    """LBFGS calls the step's closure several times: at sparsity 0 the callback changes
    nothing (as many closure runs, the same weights); at 0.5 every run's gradients are
    masked, so no pruned weight moves within a step, and after each step they are zero."""
    dense = LBFGSNet()
    make_trainer([], max_steps=3).fit(dense, make_loader())
    nothing_pruned = LBFGSNet()
    make_trainer([SparsityCallback("unstructured", sparsity=0.0)], max_steps=3).fit(
        nothing_pruned, make_loader())
    assert nothing_pruned.closure_calls == dense.closure_calls > 3
    for a, b in zip(dense.parameters(), nothing_pruned.parameters(), strict=True):
        assert torch.equal(a, b)

    sparse = SparsityCallback("unstructured", sparsity=0.5)
    audit = MaskAudit(sparse)
    half = LBFGSNet(sparse)
    make_trainer([sparse, audit], max_steps=3).fit(half, make_loader())
    assert audit.steps == 3 and half.closure_calls > 3


def test_a_reused_callback_reclaims_its_tensors_and_make_permanent_keeps_dense_weights():
    model = TinyNet()
    first = SparsityCallback("2:4")
    run_for(model, [first], max_epochs=1)
    overlapping = SparsityCallback("unstructured", sparsity=0.9, allow=[r"net\.0"])
    with pytest.raises(ValueError, match=r"'net.0.weight' is selected by two callbacks"):
        run_for(model, [first, overlapping], max_epochs=1)
    old_mask = model.net[2].weight_mask.clone()
    second = SparsityCallback("2:4", deny=[r"net\.2"])  # net.2 trains dense from now on
    run_for(model, [second], max_epochs=1)
    dense_trained = model.net[2].weight.detach().clone()
    assert dense_trained[~old_mask].ne(0).float().mean() > 0.5  # once pruned, now trained
    make_permanent(model)  # the first fit's mask on net.2 is not in force: not applied
    assert torch.equal(model.net[2].weight, dense_trained)
    assert (model.net[0].weight == 0).float().mean() == 0.5


def test_layers_rebuilt_by_configure_model_get_a_new_engine():
    class Rebuilt(TinyNet):
        def configure_model(self):  # not idempotent: new layers every fit
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    sparse = SparsityCallback("2:4")
    model = Rebuilt()
    run_for(model, [sparse], max_epochs=1)
    first = sparse.engine
    run_for(model, [sparse], max_epochs=1)
    assert sparse.engine is not first
    assert sparse.engine.slots[0].param is model.net[0].weight
    assert (model.net[0].weight == 0).float().mean() == 0.5


def test_a_validate_from_a_checkpoint_leaves_no_state_for_a_later_fit(tmp_path):
    """Lightning restores callback states for validate/test too: a later fit without
    ckpt_path runs its own schedule, not the checkpoint's."""
    gmp = dict(pattern="unstructured", sparsity=0.75, schedule="gmp", frequency=1)
    make_trainer([SparsityCallback(**gmp), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                 max_epochs=1, enable_checkpointing=True).fit(ValidatedNet(), make_loader(n=64))
    sparse = SparsityCallback(**gmp)
    make_trainer([sparse], max_epochs=2).validate(ValidatedNet(), make_loader(n=64),
                                                  ckpt_path=tmp_path / "last.ckpt",
                                                  verbose=False)
    make_trainer([sparse], max_epochs=2).fit(ValidatedNet(), make_loader(n=64))
    fresh = SparsityCallback(**gmp)
    make_trainer([fresh], max_epochs=2).fit(ValidatedNet(), make_loader(n=64))
    assert sparse.engine.updater.schedule.end == fresh.engine.updater.schedule.end


class ValidatedNet(TinyNet):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", nn.functional.cross_entropy(self(x), y))


@pytest.mark.parametrize(("settings", "shown"), [
    (dict(pattern="unstructured", sparsity=0.0), "pattern='unstructured', sparsity=0.0"),
    (dict(pattern="2:4"), "pattern='2:4'"),
    (dict(pattern=" Block:16x16", sparsity=0.5, deny=["head"]),
     "pattern='block:16x16', sparsity=0.5, deny=['head']"),
])
def test_repr_shows_every_setting_that_tells_callbacks_apart(settings, shown):
    """A sparsity of 0.0 is shown (without it the repr reads as a callback that needs one)."""
    assert repr(SparsityCallback(**settings)) == f"SparsityCallback({shown})"
