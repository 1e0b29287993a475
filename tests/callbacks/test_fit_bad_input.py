"""Bad input around a fit with SparsityCallback: selection and settings that fail at setup,
optimizers that miss the sparse tensors, swaps while an engine trains, compress with nothing
to compress. Each is a clear error naming the value and the fix, raised before any weight or
mask changes, or is handled as docs/enforcement.md says."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
from conftest import (
    BLOCKNET_COMPRESSED,
    BlockNet,
    TinyNet,
    assert_masks_hold,
    make_loader,
    make_trainer,
    refused_while_training,
)
from pytorch_lightning.callbacks import BackboneFinetuning, Callback
from torch import nn
from torch.nn.utils import parametrize

from sparse_training import (
    SparsityCallback,
    SparsityConfig,
    SparsityEngine,
    densify,
    make_permanent,
    sparsify,
)

GMP = dict(pattern="unstructured", sparsity=0.5, schedule="gmp")


class FrozenFirst(TinyNet):
    """TinyNet with its first layer frozen (requires_grad False), the rest trained."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


class OnlyEmbedding(TinyNet):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(16, 4))

    def training_step(self, batch, batch_idx):
        return self.net(batch[1]).sum()


class SparseEmbedding(OnlyEmbedding):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(16, 4, sparse=True))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)  # takes sparse gradients


class PlusOne(nn.Module):
    def forward(self, x):
        return x + 1


class Parametrized(TinyNet):
    def __init__(self):
        super().__init__()
        parametrize.register_parametrization(self.net[2], "weight", PlusOne())


class WeightNormed(TinyNet):
    def __init__(self):
        super().__init__()
        torch.nn.utils.parametrizations.weight_norm(self.net[0])


class OldWeightNormed(TinyNet):
    def __init__(self):
        super().__init__()
        torch.nn.utils.weight_norm(self.net[0])


class TorchPruned(TinyNet):
    def __init__(self):
        super().__init__()
        torch.nn.utils.prune.random_unstructured(self.net[0], "weight", amount=0.5)


class ForeignMask(TinyNet):
    def __init__(self):
        super().__init__()
        self.net[2].register_buffer("weight_mask", torch.zeros(32, 32))


class RMSNet(TinyNet):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


SETUP = [  # (callbacks' settings, model, trainer settings, message)
    ([dict(allow=["encoder"])], TinyNet, {},
     "allow regex 'encoder' matches no weight tensor; they are: 'net.0.weight'"),
    ([dict(deny=["encoder"])], TinyNet, {}, "deny regex 'encoder' matches no weight tensor"),
    ([dict(overrides={"head": {"sparsity": 0.5}})], TinyNet, {},
     "overrides regex 'head' matches no weight tensor"),
    ([dict(pattern="2:32", allow=[r"net\.0"])], TinyNet, {},
     r"tensor 'net.0.weight' \(shape \(32, 16\)\) was asked for by name but cannot take "
     r"pattern '2:32': 16 input features are not a multiple of M = 32"),
    ([dict(pattern="vector:3+1:4", overrides={r"net\.2": {"pattern": "vector:3+1:4"}})],
     TinyNet, {}, r"'net.2.weight' .* cannot take pattern 'vector:3\+1:4': 32 rows are not"),
    ([dict(**GMP, end=0.5)], TinyNet, dict(max_epochs=-1, max_steps=-1, max_time="00:00:00:05"),
     "0.75 is a fraction of training, but the training length is unknown|training length is "
     "unknown"),
    ([dict(**GMP, score="movement", regrow="rigl")], FrozenFirst, {},
     r"^SparsityCallback: score='movement' and regrow='rigl' need the gradients of the tensors "
     r"pruned, but \['net.0.weight'\] are frozen \(requires_grad=False\) and get none: deny "
     r"them, unfreeze them, or use score='magnitude' and regrow='set'$"),
    ([dict(pattern="unstructured", sparsity=0.5, schedule="constant", regrow="rigl")],
     FrozenFirst, {}, r"^SparsityCallback: regrow='rigl' needs the gradients .* or use "
                      r"regrow='set'$"),
    ([dict()], OnlyEmbedding, {}, "(?s)selected no weight tensor .*type Embedding not in"),
    ([dict(pattern="unstructured", sparsity=0.5, layer_types=["Embedding"])], SparseEmbedding,
     {}, r"tensor 'net.0.weight' \(Embedding\) has sparse gradients \(sparse=True\)"),
    ([dict()], Parametrized, {},
     r"tensor 'net.2.weight' \(Linear\) is parametrized \(PlusOne\) so that zeros at random "
     r"positions in its original do not stay zeros of the weight; use an N:M pattern"),
    ([dict(pattern="unstructured", sparsity=0.5)], WeightNormed, {},
     r"'net.0.weight' \(Linear\) is parametrized \(_WeightNorm\) so that a whole row of "
     r"zeros, which this pattern can prune, in its original do not stay zeros"),
    ([dict(pattern="unstructured", sparsity=0.5, deny=["weight_g"])], OldWeightNormed, {},
     r"'net.0.weight_v' \(Linear\) belongs to the old-style torch.nn.utils.weight_norm of "
     r"layer 'net.0'"),
    ([dict()], TorchPruned, {}, r"'net.0.weight_orig' .* pruned by torch.nn.utils.prune"),
    ([dict()], ForeignMask, {}, r"'weight_mask' \(torch.float32, \(32, 32\)\) is not a bool"),
    ([dict(fused=True)], RMSNet, {}, "fused=True cannot serve RMSprop: .*use fused='auto'"),
    ([dict(pattern="unstructured", sparsity=0.5, schedule="gmp", start=10, end=0.1)], TinyNet,
     {}, r"start must come before end, got start=10 -> .* \(over the 8 steps of this fit\)"),
    ([dict(allow=[r"net\.0"]), dict(allow=[r"net\.[02]"])], TinyNet, {},
     r"tensor 'net.0.weight' is selected by two callbacks, SparsityCallback\(pattern='2:4', "
     r"allow=\['net\\\\.0'\]\) and SparsityCallback\(pattern='2:4', allow=\['net\\\\.\[02\]'\]\)"),
]


@pytest.mark.parametrize(("settings", "model_class", "trainer_kwargs", "message"), SETUP,
                         ids=[f"{i}-{m[:28]}" for i, (*_, m) in enumerate(SETUP)])
def test_setup_errors_come_before_any_change(settings, model_class, trainer_kwargs, message):
    model = model_class()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = dict(model.named_buffers())
    callbacks = [SparsityCallback(**s) for s in settings]
    trainer = make_trainer(callbacks, **{"max_epochs": 1, **trainer_kwargs})
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(before) == set(model.state_dict())
    if len(callbacks) == 1:  # no mask buffer either (a second callback: the first's stay)
        assert dict(model.named_buffers()).keys() == buffers.keys()
    first = callbacks[0].engine
    masks = [] if first is None else [s.mask for s in first.slots]
    assert all(m.all() for m in masks)  # at most the all-kept masks of a first callback


class Batches(torch.utils.data.IterableDataset):
    """make_loader's batches with no length: Lightning cannot count an epoch's steps."""

    def __iter__(self):
        return iter(make_loader())


@pytest.mark.parametrize(("settings", "named"), [
    (dict(GMP), r"0.75 \(end, the default\)"), (dict(GMP, end=0.5), r"0.5 \(end\)"),
    (dict(schedule="oneshot", start=0.5), r"0.5 \(start\)"),
    (dict(schedule="constant", regrow="rigl"), r"0.75 \(regrow_end\)")])
def test_fractions_of_an_iterable_of_unknown_length_are_refused(settings, named):
    """Under max_epochs an iterable's length is unknown (Lightning's estimate is -1), so
    a fraction of training (a default end, start=0.5, RigL's regrow_end) is refused, not
    resolved to step 0, naming the setting (a default the user never typed included)."""
    trainer = make_trainer([SparsityCallback(**settings)], max_epochs=2)
    with pytest.raises(ValueError, match=rf"{named} is a fraction of training, but the "
                                         rf"training length is unknown; set max_steps"):
        trainer.fit(TinyNet(), torch.utils.data.DataLoader(Batches(), batch_size=None))


def test_a_callback_used_outside_one_fit_is_refused():
    with pytest.raises(RuntimeError, match="callback.state_key. must be unique"):
        make_trainer([SparsityCallback("2:4"), SparsityCallback("1:4")])  # Lightning's check
    with pytest.raises(RuntimeError, match="SparsityCallback has no engine in this process: no "
                                           "fit trained with it here. Add it to a Trainer"):
        SparsityCallback().on_train_batch_start(None, None, None, 0)



class CapturedParams(BlockNet):
    """The optimizer is built from parameters captured in __init__, before setup."""

    def __init__(self):
        super().__init__()
        self.captured = list(self.parameters())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.captured, lr=1e-2)


class CopyOptimizer(TinyNet):
    def configure_optimizers(self):  # another module's parameters
        return torch.optim.AdamW(copy.deepcopy(self.net).parameters(), lr=1e-2)


class HeadOnlyOptimizer(TinyNet):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[4].parameters(), lr=1e-2)


class NoOptimizer(TinyNet):
    def configure_optimizers(self):
        return None


class OwnOptimizerInStep(NoOptimizer):
    """Manual optimization with an optimizer Lightning never sees."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        if not hasattr(self, "own"):
            self.own = torch.optim.SGD(self.parameters(), lr=0.1)
        self.manual_backward(super().training_step(batch, batch_idx))
        self.own.step()


class ForeignSecondOptimizer(TinyNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False  # Lightning's rule for two optimizers

    def configure_optimizers(self):
        return (torch.optim.AdamW(self.parameters(), lr=1e-2),
                torch.optim.SGD([nn.Parameter(torch.randn(3, 5))], lr=0.1))


MISSING = "parameters of the sparse layers require grad but are in no optimizer"
FIX = r"\. Build the optimizers in configure_optimizers from self.parameters\(\)"


FIT_START = [  # (settings, model, message): a ValueError at fit start, the model as before
    (BLOCKNET_COMPRESSED, CapturedParams,
     r"optimizer 0 \(AdamW\) holds 4 parameters that are not the model's \(shapes \(64, 16\), "
     rf"\(64,\), \(64, 64\), \(64,\)\); 4 {MISSING}: net.0.values, net.0.bias, net.2.values, "
     rf"net.2.bias{FIX} \(compress swaps layers at setup, before it\)"),
    (dict(), CopyOptimizer, rf"optimizer 0 \(AdamW\) holds 6 parameters that are not the "
                            rf"model's .*; 3 {MISSING}: net.0.weight, net.2.weight, net.4.weight"),
    (dict(), HeadOnlyOptimizer, rf"^SparsityCallback: 2 {MISSING}: net.0.weight, net.2.weight"
                                rf"{FIX}.* freeze \(requires_grad_\(False\)\) or deny"),
    (dict(), NoOptimizer, r"3 parameters of the sparse layers require grad but are in no "
                          r"optimizer \(configure_optimizers returned None\): net.0.weight"),
    (dict(), OwnOptimizerInStep, r"in no optimizer \(configure_optimizers returned None\)"),
    (dict(), ForeignSecondOptimizer, r"^SparsityCallback: optimizer 1 \(SGD\) holds 1 "
                                     r"parameters that are not the model's \(shapes \(3, 5\)\)"
                                     rf"{FIX}"),
]


@pytest.mark.parametrize(("settings", "model_class", "message"), FIT_START,
                         ids=[m.__name__ for _, m, _ in FIT_START])
def test_optimizers_that_miss_the_sparse_tensors_raise_at_fit_start(settings, model_class,
                                                                    message):
    """The error leaves the model as it was before the fit: the layers compress swapped
    at setup are put back."""
    model, sparse = model_class(), SparsityCallback(**settings)
    state, buffers = copy.deepcopy(model.state_dict()), dict(model.named_buffers())
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=message):
        make_trainer([sparse], max_epochs=1).fit(model, make_loader(n=32))
    assert sparse.engine is None
    assert [type(m) for m in model.modules()] == types
    assert dict(model.named_buffers()).keys() == buffers.keys()
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


class MidFit(Callback):
    """Calls ``action(model)`` after the second batch, recording the model just before."""

    def __init__(self, action):
        self.action, self.state, self.buffers = action, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.buffers = {n: b.clone() for n, b in pl_module.named_buffers()}
            self.action(pl_module)


AFTER_FIT = r"trainer.fit returns \(SparsityCallback detaches its engine when the fit ends\)"
MID_FIT = [  # (settings, model, action, message): a RuntimeError, the model as it was
    (dict(), TinyNet, make_permanent,
     refused_while_training("make_permanent", "TinyNet") + AFTER_FIT),
    (dict(), TinyNet, lambda m: make_permanent(m.net),
     refused_while_training("make_permanent", "TinyNet")),
    (BLOCKNET_COMPRESSED, BlockNet, make_permanent,
     refused_while_training("make_permanent", "BlockNet")),
    (BLOCKNET_COMPRESSED, BlockNet, densify, refused_while_training("densify", "BlockNet")),
    (dict(), TinyNet, lambda m: sparsify(m, {r"net\.4": {"pattern": "block:16x16",
                                                         "density": 0.5}}),
     refused_while_training("sparsify", "TinyNet")),
]


@pytest.mark.parametrize(("settings", "model_class", "action", "message"), MID_FIT,
                         ids=[f"{i}-{m[:20]}" for i, (*_, m) in enumerate(MID_FIT)])
def test_swaps_while_an_engine_trains_raise_and_work_after_fit(settings, model_class, action,
                                                               message):
    model, mid_fit = model_class(), MidFit(action)
    with pytest.raises(RuntimeError, match=message):
        make_trainer([SparsityCallback(**settings), mid_fit], max_epochs=1).fit(
            model, make_loader(n=48))
    assert all(torch.equal(mid_fit.state[k], v) for k, v in model.state_dict().items())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == mid_fit.buffers.keys()
    assert all(torch.equal(mid_fit.buffers[k], v) for k, v in buffers.items())
    action(model)  # the failed fit detached its engine (on_exception): allowed now




class FrozenMiddle(TinyNet):
    """net.2 frozen and left out of the optimizer: it keeps its (pruned) weights."""

    def __init__(self):
        super().__init__()
        self.net[2].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class WithBackbone(pl.LightningModule):
    """BackboneFinetuning's layout: the optimizer starts with the head; the callback adds the
    unfrozen backbone as a new parameter group at epoch 1."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)


def _backbone_trained_and_masked(model, sparse, trainer, start):
    (optimizer,) = trainer.optimizers
    assert len(optimizer.param_groups) == 2  # the backbone's group came at epoch 1
    assert_masks_hold(sparse.engine, trainer.optimizers)
    for name in ("backbone.0.weight", "backbone.2.weight"):
        weight = model.get_parameter(name)
        assert not torch.equal(weight, start[name])  # it trained after the unfreeze
        assert (weight == 0).float().mean() == 0.5


def _frozen_kept(model, sparse, trainer, start):
    weight = model.net[2].weight
    assert torch.equal(weight, start["net.2.weight"] * model.net[2].weight_mask)
    assert not torch.equal(model.net[0].weight, start["net.0.weight"])
    assert_masks_hold(sparse.engine, trainer.optimizers)


def _captured_trained(model, sparse, trainer, start):
    assert not torch.equal(model.net[2].weight, start["net.2.weight"])
    assert_masks_hold(sparse.engine, trainer.optimizers)
    assert sparse.engine.sparsity == pytest.approx(0.75)


FIT_HANDLED = [  # (settings, model, extra callbacks, epochs, check): trains as documented
    (dict(pattern="unstructured", sparsity=0.5), WithBackbone,
     lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], 2, _backbone_trained_and_masked),
    (dict(pattern="unstructured", sparsity=0.5), FrozenMiddle, list, 1, _frozen_kept),
    ({**BLOCKNET_COMPRESSED, "compress": False}, CapturedParams, list, 1, _captured_trained),
]


@pytest.mark.parametrize(("settings", "model_class", "callbacks", "epochs", "check"),
                         FIT_HANDLED, ids=[m.__name__ for _, m, *_ in FIT_HANDLED])
def test_fit_time_cases_handled_as_documented(settings, model_class, callbacks, epochs, check):
    model, sparse = model_class(), SparsityCallback(**settings)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer([sparse, *callbacks()], max_epochs=epochs)
    trainer.fit(model, make_loader(n=48))
    check(model, sparse, trainer, start)


class SwitchToSGD(Callback):
    """At epoch 1 the optimizer is replaced (Adam, then SGD with momentum), ``how``: through
    ``trainer.strategy.setup_optimizers`` (configure_optimizers again) or the
    ``trainer.optimizers`` setter; at every later batch end the new optimizer's state and
    the weights are checked zero where pruned, and the replaced optimizer unhooked."""

    def __init__(self, sparse: SparsityCallback, how: str) -> None:
        self.sparse, self.how, self.replaced, self.checked = sparse, how, None, 0

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != 1:
            return
        self.replaced = trainer.optimizers[0]
        if self.how == "setup_optimizers":
            pl_module.optimizer_name = "sgd"
            trainer.strategy.setup_optimizers(trainer)
        else:
            trainer.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=1e-2,
                                                  momentum=0.9)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.replaced is None:
            return
        (optimizer,) = trainer.optimizers
        assert isinstance(optimizer, torch.optim.SGD) and optimizer.state
        assert_masks_hold(self.sparse.engine, [optimizer])
        assert not self.replaced._optimizer_step_pre_hooks  # released, not kept alive
        assert not self.replaced._optimizer_step_post_hooks
        self.checked += 1


@pytest.mark.parametrize("how", ["setup_optimizers", "setter"])
def test_an_optimizer_replaced_during_the_fit_is_attached(how):
    """Replacing the optimizers mid-fit (a switch from Adam to SGD) hands the new ones the
    masks, through RigL's regrowth too; the replaced ones are released."""
    sparse = SparsityCallback(pattern="unstructured", sparsity=0.75, schedule="constant",
                              score="random", regrow="rigl", frequency=2, regrow_end=1.0)
    switch = SwitchToSGD(sparse, how)
    make_trainer([sparse, switch], max_epochs=2).fit(TinyNet(), make_loader(n=64))
    assert switch.checked == 4 and sparse.engine.updater.last_regrow == 6


def _square_net() -> TinyNet:
    model = TinyNet()
    model.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return model


def test_compress_without_a_tensor_that_can_train_compressed_is_refused():
    """A block layer whose sparsity rounds to no kept block would be dense labelled sparse:
    with the head denied, nothing is left to compress, and the error names each weight."""
    sparse = SparsityCallback(pattern="block:16x16", sparsity=0.6, compress=True,
                              deny=["net.2"])
    with pytest.raises(ValueError, match=r"compress=True but no selected tensor can train "
                                         r"compressed; .*\n  net.0.weight: not selected: "
                                         r"pattern 'block:16x16' at sparsity 0.6 keeps none of "
                                         r"its 1 blocks"):
        make_trainer([sparse], max_epochs=1).fit(_square_net(), make_loader(n=32))


def test_regrowth_that_resolves_to_no_step_warns_at_fit():
    """regrow_end as a fraction of training against start in steps: known only at fit,
    where a window that ends before it starts is said, not skipped silently."""
    sparse = SparsityCallback(pattern="unstructured", sparsity=0.5, schedule="constant",
                              start=5, regrow="rigl", regrow_end=0.1)
    trainer = make_trainer([sparse], max_steps=8)
    with pytest.warns(UserWarning, match=r"regrow='rigl' drops and grows from step 5 until "
                                         r"step 1 \(regrow_end=0.1\), so never"):
        trainer.fit(TinyNet(), make_loader(n=64))


class TwoOptimizers(pl.LightningModule):
    """A sparse layer under AdamW (fusable) and a dense head under Adagrad (not): manual
    optimization, as Lightning takes several optimizers."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net, self.head = nn.Linear(16, 8), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        sparse, dense = self.optimizers()
        loss = self.head(self.net(batch[0])).pow(2).mean()
        sparse.zero_grad()
        dense.zero_grad()
        self.manual_backward(loss)
        sparse.step()
        dense.step()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net.parameters()),
                torch.optim.Adagrad(self.head.parameters())]


class ClipsBeforeTheStep(TwoOptimizers):
    """Manual optimization that reads the sparse layer's gradients before ``opt.step()``,
    after masking them the way docs/enforcement.md says."""

    def training_step(self, batch, batch_idx):
        sparse, dense = self.optimizers()
        sparse.zero_grad()
        dense.zero_grad()
        self.manual_backward(self.head(self.net(batch[0])).pow(2).mean())
        callback = next(c for c in self.trainer.callbacks if isinstance(c, SparsityCallback))
        callback.engine.zero_pruned_gradients(sparse.optimizer)
        self.pruned_gradients = self.net.weight.grad[~self.net.weight_mask].abs().sum()
        self.clip_gradients(sparse, gradient_clip_val=0.1)
        sparse.step()
        dense.step()


def test_manual_optimization_masks_the_gradients_before_clipping_them():
    model = ClipsBeforeTheStep()
    make_trainer([SparsityCallback(pattern="2:4", deny=["head"])], max_steps=2).fit(
        model, make_loader(n=32))
    assert model.pruned_gradients == 0
    engine = SparsityEngine(nn.Sequential(nn.Linear(16, 8)), SparsityConfig(pattern="2:4"))
    with pytest.raises(RuntimeError, match=r"not attached to this SparsityEngine \(under "
                                           r"Lightning, pass the torch optimizer"):
        engine.zero_pruned_gradients(torch.optim.SGD(engine.model.parameters(), lr=0.1))


def test_fused_true_asks_only_the_optimizers_of_sparse_weights():
    sparse = SparsityCallback(pattern="2:4", deny=["head"], fused=True)
    make_trainer([sparse], max_steps=2).fit(TwoOptimizers(), make_loader(n=32))
    assert sparse.engine.sparsity == pytest.approx(0.5)


@pytest.mark.parametrize("trainer_kwargs", [dict(max_steps=0), dict(limit_train_batches=0)],
                         ids=["max_steps=0", "no train batches"])
def test_a_fit_without_training_steps_still_runs(trainer_kwargs):
    """Lightning counts 0 steps (max_steps=0) or -1 (no training batch): no step, no error."""
    sparse = SparsityCallback(pattern="2:4")
    make_trainer([sparse], **{"max_epochs": 1, **trainer_kwargs}).fit(TinyNet(), make_loader())


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    sizes = [len(SETUP), len(FIT_START), len(MID_FIT), len(FIT_HANDLED)]
    assert sizes == [18, 6, 5, 3], sizes
