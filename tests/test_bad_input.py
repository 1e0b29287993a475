"""The bad-input table: every case is a clear error naming the value and the valid forms,
raised before any weight or mask changes, or is handled as documented. None silent, none
crashing inside torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, TinyNet, assert_masks_hold, make_loader, make_trainer
from pytorch_lightning.callbacks import BackboneFinetuning, Callback, ModelCheckpoint
from torch import nn
from torch.nn.utils import parametrize

from sparse_training import (
    BlockSparseLinear,
    SemiStructuredLinear,
    SparsityCallback,
    SparsityConfig,
    SparsityEngine,
    densify,
    make_permanent,
    sparsify,
)

GMP = dict(pattern="unstructured", sparsity=0.5, schedule="gmp")
V = ValueError

CONSTRUCTION = [
    (dict(pattern="2-4"), V, r"unknown pattern '2-4'; valid forms: \"unstructured\", \"N:M\""),
    (dict(pattern="5:4"), V, "N must satisfy 1 <= N <= M, got N=5, M=4"),
    (dict(pattern="0:4"), V, "N must satisfy 1 <= N <= M, got N=0"),
    (dict(pattern="block:0x4", sparsity=0.5), V, "block dimensions must be >= 1, got 0x4"),
    (dict(pattern="vector:0", sparsity=0.5), V, "block dimensions must be >= 1, got 0x1"),
    (dict(pattern="1:9:2d"), V, r"transposable N:M supports M <= 5 \(exact .*\), got M=9"),
    (dict(pattern=124), V, r"got the number 124: YAML reads an unquoted 2:4 as the base-60 "
                           r"number 124; quote it: pattern: \"2:4\""),
    (dict(pattern=None), V, "pattern must be a string, got None of type NoneType"),
    (dict(pattern=["2:4"]), V, r"pattern must be a string, got \['2:4'\] of type list"),
    (dict(pattern="unstructured"), V, r"pattern 'unstructured' needs a sparsity in \[0, 1\)"),
    (dict(pattern="unstructured", sparsity=1.0), V, r"sparsity must be a number in \[0, 1\)"),
    (dict(pattern="unstructured", sparsity=-0.1), V, r"sparsity must be a number in \[0, 1\), "
                                                     r"got -0.1"),
    (dict(pattern="unstructured", sparsity="0.5"), V, r"sparsity must be a number .* got '0.5'"),
    (dict(pattern="unstructured", sparsity=True), V, r"sparsity must be a number .* got True"),
    (dict(pattern="unstructured", sparsity=float("nan")), V, "sparsity must be a number .* nan"),
    (dict(pattern="2:4", sparsity=0.7), V, "pattern '2:4' implies sparsity 0.5; leave sparsity"),
    (dict(schedule="cubic"), V, "unknown schedule 'cubic'; valid: oneshot, gmp, linear, const"),
    (dict(schedule=None), V, "unknown schedule None; valid: oneshot"),
    (dict(**GMP, start=50, end=10), V, "start must come before end, got start=50, end=10"),
    (dict(**GMP, start=0.8, end=0.2), V, "start must come before end, got start=0.8"),
    (dict(**GMP, start=1.5), V, r"start as a fraction of training must lie in \[0, 1\], got 1.5"),
    (dict(start=-1), V, "start must be >= 0 optimizer steps, got -1"),
    (dict(start="0"), V, r"start must be an int \(optimizer steps\) or a float .* got '0'"),
    (dict(schedule="oneshot", end=10), V, "end applies to gradual schedules .* not to 'oneshot'"),
    (dict(frequency=0), V, "frequency must be an int >= 1, got 0"),
    (dict(frequency=2.5), V, "frequency must be an int >= 1, got 2.5"),
    (dict(frequency=True), V, "frequency must be an int >= 1, got True"),
    (dict(allow="fc1"), V, r"allow must be a list of regex strings, e.g. \['fc1'\]"),
    (dict(allow=[1]), V, r"allow must be a list of regex strings, e.g. \[\[1\]\], got \[1\]"),
    (dict(deny=["("]), V, r"deny regex '\(' is invalid: missing \)"),
    (dict(dense_ratio=1.0), V, r"dense_ratio must be a number in \[0, 1\), got 1.0"),
    (dict(dense_ratio=-0.1), V, r"dense_ratio must be a number in \[0, 1\), got -0.1"),
    (dict(dense_ratio="0.2"), V, r"dense_ratio must be a number in \[0, 1\), got '0.2'"),
    (dict(pattern="unstructured", sparsity=0.5, distribution="erdos"), V,
     "unknown distribution 'erdos'; valid: 'uniform', 'erk', 'global'"),
    (dict(distribution="global"), V, "distribution 'global' needs an unstructured or block"),
    (dict(distribution="erk"), V, r"distribution 'erk' needs .* N:M \('2:4'\) fixes each"),
    (dict(overrides={"fc": {"density": 0.5}}), V, r"overrides\['fc'\] must be a dict with keys "
                                                  r"from \('sparsity', 'pattern'\)"),
    (dict(overrides={"fc": 0.5}), V, r"overrides\['fc'\] must be a dict with keys"),
    (dict(overrides=["fc"]), V, r"overrides must be a dict \{regex: \{'sparsity'"),
    (dict(overrides={"(": {"sparsity": 0.5}}), V, r"overrides regex '\(' is invalid"),
    (dict(overrides={"fc": {"pattern": "1:9:2d"}}), V, "transposable N:M supports M <= 5"),
    (dict(overrides={"fc": {"pattern": "unstructured"}}), V,
     r"overrides\['fc'\]: pattern 'unstructured' needs a sparsity .* add 'sparsity'"),
    (dict(overrides={"fc": {"sparsity": 0.9}}), V,
     r"overrides\['fc'\]: pattern '2:4' implies sparsity 0.5"),
    (dict(overrides={"fc": {"sparsity": 1.5}}), V,
     r"overrides\['fc'\]\['sparsity'\] must be a number in \[0, 1\), got 1.5"),
    (dict(layer_types=("Dense",)), V, "layer_types entry 'Dense' is not a torch.nn.Module "
                                      "subclass; give classes, torch.nn names"),
    (dict(layer_types=(int,)), V, "layer_types entry <class 'int'> is not a torch.nn.Module"),
    (dict(layer_types=()), V, r"layer_types must be a non-empty list of torch.nn.Module"),
    (dict(layer_types="torch.nn.NotAThing"), V, "entry 'torch.nn.NotAThing' is not a torch"),
    (dict(layer_types="no_such_package.Layer"), V, "entry 'no_such_package.Layer' is not a"),
    (dict(log_layers="false"), V, "log_layers must be True or False, got 'false'"),
    (dict(check_masks=1), V, "check_masks must be True or False, got 1"),
    (dict(fused="yes"), V, "unknown fused 'yes'; valid: 'auto', True, False"),
    (dict(score="gradient"), V, "unknown score 'gradient'; valid: 'magnitude', 'random'"),
    (dict(**GMP, score="random"), V, "score='random' draws one random mask; it needs schedule "
                                     "'oneshot' or 'constant', got 'gmp'"),
    (dict(regrow="grow"), V, "unknown regrow 'grow'; valid: None, 'rigl', 'set', 'sr-ste'"),
    (dict(pattern="2:4:2d", regrow="rigl"), V, "regrow='rigl' does not support transposable"),
    (dict(pattern="unstructured", sparsity=0.5, regrow="sr-ste"), V,
     "regrow='sr-ste' trains N:M masks; got pattern 'unstructured'"),
    (dict(regrow="rigl", overrides={"fc": {"pattern": "2:4:2d"}}), V,
     r"overrides\['fc'\]: regrow='rigl' does not support transposable patterns"),
    (dict(regrow="sr-ste", overrides={"fc": {"pattern": "block:4x4", "sparsity": 0.5}}), V,
     r"overrides\['fc'\]: regrow='sr-ste' trains N:M masks; got pattern 'block:4x4'"),
    (dict(regrow="rigl", regrow_fraction=0.0), V, r"regrow_fraction must be a number in \(0, 1\]"),
    (dict(regrow="rigl", regrow_fraction=1.5), V, r"regrow_fraction .* got 1.5"),
    (dict(regrow="set", regrow_end=2.0), V, r"regrow_end as a fraction of training must lie in"),
    (dict(regrow="set", regrow_end=-5), V, "regrow_end must be >= 0 optimizer steps, got -5"),
    (dict(regrow="sr-ste", sr_ste_decay=-1), V, "sr_ste_decay must be a number >= 0, got -1"),
    (dict(seed=1.5), V, "seed must be an int, got 1.5"),
    (dict(seed="0"), V, "seed must be an int, got '0'"),
    (dict(sparsty=0.5), TypeError, "unknown setting 'sparsty'; did you mean 'sparsity'\\?"),
    (dict(patern="2:4"), TypeError, "unknown setting 'patern'; did you mean 'pattern'\\?"),
    (dict(warmup=10), TypeError, "unknown setting 'warmup' Valid settings: pattern, sparsity"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), CONSTRUCTION,
                         ids=[f"{i}-{m[:28]}" for i, (_, _, m) in enumerate(CONSTRUCTION)])
def test_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        SparsityCallback(**kwargs)


CONFIG_FILES = [
    ("pattern: 2:4\n", "YAML reads an unquoted 2:4 as the base-60 number 124"),
    ("sparsty: 0.5\n", "unknown setting 'sparsty'; did you mean 'sparsity'"),
    ("- 2:4\n", "a sparsity config must be a mapping"),
    ("layer_types: [Dense]\n", "layer_types entry 'Dense' is not a torch.nn.Module"),
]


@pytest.mark.parametrize(("text", "message"), CONFIG_FILES, ids=[m[:30] for _, m in CONFIG_FILES])
def test_config_file_errors(tmp_path, text, message):
    path = tmp_path / "sparse.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        SparsityCallback.from_config(path)


HANDLED = [  # accepted, normalized as the docs say
    (dict(pattern="unstructured", sparsity=np.float32(0.5)), "sparsity", 0.5),
    (dict(pattern="unstructured", sparsity=np.float64(0.25)), "sparsity", 0.25),
    (dict(layer_types=nn.Linear), "layer_types", (nn.Linear,)),
    (dict(layer_types=["Linear", "torch.nn.Conv2d"]), "layer_types", (nn.Linear, nn.Conv2d)),
    (dict(pattern=" 2:4 "), "parsed_pattern.spec", "2:4"),
    (dict(pattern="UNSTRUCTURED", sparsity=0.5), "parsed_pattern.spec", "unstructured"),
    (dict(start=np.int64(3)), "parsed_schedule.start", 3),
    (dict(**GMP, frequency=np.int32(7)), "parsed_schedule.frequency", 7),
    (dict(dense_ratio=np.float32(0.5)), "dense_ratio", 0.5),
    (dict(allow=("net",)), "allow", ("net",)),
]


@pytest.mark.parametrize(("kwargs", "attribute", "value"), HANDLED,
                         ids=[f"{a}={v!r}" for _, a, v in HANDLED])
def test_handled_inputs(kwargs, attribute, value):
    config = SparsityCallback(**kwargs).config
    for part in attribute.split("."):
        config = getattr(config, part)
    assert config == value and type(config) is type(value)


class OnlyEmbedding(TinyNet):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(16, 4))

    def training_step(self, batch, batch_idx):
        return self.net(batch[1]).sum()


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
    ([dict(pattern="block:3x3", sparsity=0.5, overrides={r"net\.2": {"sparsity": 0.5}})],
     TinyNet, {}, "'net.2.weight' .* cannot take pattern 'block:3x3': 32 rows are not"),
    ([dict(**GMP, end=0.5)], TinyNet, dict(max_epochs=-1, max_steps=-1, max_time="00:00:00:05"),
     "0.75 is a fraction of training, but the training length is unknown|training length is "
     "unknown"),
    ([dict()], OnlyEmbedding, {}, "(?s)selected no weight tensor .*type Embedding not in"),
    ([dict()], Parametrized, {},
     r"tensor 'net.2.weight' \(Linear\) is parametrized \(PlusOne\) so that zeros at random "
     r"positions in its original do not stay zeros of the weight; use an N:M pattern"),
    ([dict(pattern="unstructured", sparsity=0.5)], WeightNormed, {},
     r"'net.0.weight' \(Linear\) is parametrized \(_WeightNorm\) so that a whole row of "
     r"zeros, which this pattern can prune, in its original do not stay zeros"),
    ([dict()], TorchPruned, {}, r"'net.0.weight_orig' .* pruned by torch.nn.utils.prune"),
    ([dict()], ForeignMask, {}, r"'weight_mask' \(torch.float32, \(32, 32\)\) is not a bool"),
    ([dict(fused=True)], RMSNet, {}, "fused=True cannot serve RMSprop: .*use fused='auto'"),
    ([dict(allow=[r"net\.0"]), dict(allow=[r"net\.[02]"])], TinyNet, {},
     r"'net.0.weight' \(Linear\) is already masked by another SparsityEngine"),
]


@pytest.mark.parametrize(("settings", "model_class", "trainer_kwargs", "message"), SETUP,
                         ids=[f"{i}-{m[:28]}" for i, (*_, m) in enumerate(SETUP)])
def test_setup_errors_come_before_any_change(settings, model_class, trainer_kwargs, message):
    model = model_class()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callbacks = [SparsityCallback(**s) for s in settings]
    trainer = make_trainer(callbacks, **{"max_epochs": 1, **trainer_kwargs})
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(before) == set(model.state_dict())
    first = callbacks[0].engine
    masks = [] if first is None else [s.mask for s in first.slots]
    assert all(m.all() for m in masks)  # at most the all-kept masks of a first callback


def sparse_checkpoint(tmp_path, **settings):
    settings = settings or dict(pattern="unstructured", sparsity=0.8, schedule="gmp", end=10,
                                frequency=2)
    trainer = make_trainer([SparsityCallback(**settings),
                            ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                           max_epochs=1, enable_checkpointing=True)
    trainer.fit(TinyNet(), make_loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    (key,) = [k for k in saved["callbacks"] if k.startswith("SparsityCallback")]
    return saved, saved["callbacks"][key], settings


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
def test_checkpoint_errors_come_before_any_mask_changes(tmp_path, mutate, change, message):
    saved, state, settings = sparse_checkpoint(tmp_path)
    mutate(state)
    torch.save(saved, tmp_path / "bad.ckpt")
    model = TinyNet()
    trainer = make_trainer([SparsityCallback(**{**settings, **change})], max_epochs=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader(), ckpt_path=tmp_path / "bad.ckpt")
    # Lightning restored the checkpoint's weights, all of them; no mask was installed
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def test_a_checkpoint_stores_normalized_patterns():
    """A resume compares settings: " 2:4 " and "2:4" are one pattern, not a change."""
    settings = SparsityConfig(" 2:4 ", overrides={"fc": {"pattern": "BLOCK:4x4",
                                                          "sparsity": 0.5}}).as_dict()
    assert settings["pattern"] == "2:4"
    assert settings["overrides"] == {"fc": {"pattern": "block:4x4", "sparsity": 0.5}}


def test_engine_misuse():
    model = nn.Sequential(nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig("2:4", schedule="gmp", end=0.5))
    with pytest.raises(RuntimeError, match=r"call SparsityEngine.start\(total_steps\) before"):
        engine.on_step_start(0)
    with pytest.raises(ValueError, match="not a sparse_training engine state of format 1"):
        engine.load_state_dict({"masks": {}})
    with pytest.raises(ValueError, match="is a fraction of training, but the training length"):
        engine.start(None)
    with pytest.raises(RuntimeError, match="callback.state_key. must be unique"):
        make_trainer([SparsityCallback("2:4"), SparsityCallback("1:4")])  # Lightning's check
    with pytest.raises(RuntimeError, match="SparsityCallback was not set up: add it to a"):
        SparsityCallback().on_train_batch_start(None, None, None, 0)


def test_count():
    """The table holds at least 80 cases (the issue's minimum)."""
    total = len(CONSTRUCTION) + len(CONFIG_FILES) + len(HANDLED) + len(SETUP) \
        + len(CHECKPOINTS) + 5
    assert total >= 80, total
    pl.seed_everything(0, verbose=False)


# == issue 22: fit-time misuse ==
# Around a fit: optimizers that miss the sparse tensors (compress swaps layers at setup),
# swaps and make_permanent while an engine trains, the engine stepped without attach(),
# sparsify rules that prune nothing. Each raises naming the value and the fix before the
# change, or is handled as docs/enforcement.md and docs/block_sparse.md say.

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


class AfterSetup(Callback):
    """The model as every callback's setup left it (compress swaps layers there)."""

    def setup(self, trainer, pl_module, stage):
        self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.buffers = sorted(name for name, _ in pl_module.named_buffers())


COMPRESS = dict(pattern="block:16x16", sparsity=0.75, compress=True)
MISSING = "parameters of the sparse layers require grad but are in no optimizer"
FIX = r"\. Build the optimizers in configure_optimizers from self.parameters\(\)"

FIT_START = [  # (settings, model, message): a ValueError at fit start, nothing changed since setup
    (COMPRESS, CapturedParams,
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
    model, sparse, after_setup = model_class(), SparsityCallback(**settings), AfterSetup()
    with pytest.raises(ValueError, match=message):
        make_trainer([sparse, after_setup], max_epochs=1).fit(model, make_loader(n=32))
    assert sparse.engine is None
    assert sorted(name for name, _ in model.named_buffers()) == after_setup.buffers
    assert all(torch.equal(after_setup.state[k], v) for k, v in model.state_dict().items())


class MidFit(Callback):
    """Calls ``action(model)`` after the second batch, recording the model just before."""

    def __init__(self, action):
        self.action, self.state, self.buffers = action, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            self.buffers = {n: b.clone() for n, b in pl_module.named_buffers()}
            self.action(pl_module)


TRAINED = "would swap modules of a {} that a SparsityEngine is training .* call it after "
AFTER_FIT = r"trainer.fit returns \(SparsityCallback detaches its engine when the fit ends\)"
MID_FIT = [  # (settings, model, action, message): a RuntimeError, the model as it was
    (dict(), TinyNet, make_permanent, "^make_permanent " + TRAINED.format("TinyNet") + AFTER_FIT),
    (dict(), TinyNet, lambda m: make_permanent(m.net), "^make_permanent " + TRAINED.format(
        "TinyNet")),
    (COMPRESS, BlockNet, make_permanent, "^make_permanent " + TRAINED.format("BlockNet")),
    (COMPRESS, BlockNet, densify, "^densify " + TRAINED.format("BlockNet")),
    (dict(), TinyNet, lambda m: sparsify(m, {r"net\.4": {"pattern": "block:16x16",
                                                         "density": 0.5}}),
     "^sparsify " + TRAINED.format("TinyNet")),
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


def small_engine(model: nn.Module | None = None):
    model = model or nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig("2:4"))
    engine.start(10)
    return model, engine, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _attached(engine, optimizer):
    engine.attach(optimizer)


def _attached_then_detached(engine, optimizer):
    engine.attach(optimizer)
    engine.detach()


def _sparsified(model):
    sparsify(model, {r"^2$": {"pattern": "block:16x16", "density": 0.5}}, verbose=False)
    return model


NO_ATTACH = r"no optimizer is attached to this SparsityEngine: call engine.attach\(optimizer\)"
ENGINE_STEPS = [  # (model, preparation, misuse, message): a RuntimeError, nothing changed
    (None, None, lambda m, e, o: e.on_step_start(0),
     NO_ATTACH + r" before the training loop .*; for masks without training, engine.prune\(\)$"),
    (None, _attached_then_detached, lambda m, e, o: e.on_step_start(0), NO_ATTACH),
    (None, _attached, lambda m, e, o: e.before_optimizer_step(
        torch.optim.AdamW(m.parameters()), 0),
     r"before_optimizer_step got a AdamW that is not attached to this SparsityEngine: call "
     r"engine.attach\(optimizer\) once before training"),
    (None, lambda e, o: make_permanent(e.model), lambda m, e, o: e.attach(o),
     r"masks or compressed layers are no longer in its model \(make_permanent, densify\): "
     r"build a new SparsityEngine"),
    (None, _attached, lambda m, e, o: make_permanent(m), "^make_permanent " + TRAINED.format(
        "Sequential") + r"trainer.fit returns .* or after engine.detach\(\)"),
    (None, _attached, lambda m, e, o: make_permanent(nn.ModuleList([m])),
     "^make_permanent " + TRAINED.format("Sequential")),
    (None, _attached, lambda m, e, o: sparsify(m, {r"^0$": {"pattern": "2:4"}}),
     "^sparsify " + TRAINED.format("Sequential")),
    (_sparsified, _attached, lambda m, e, o: densify(m), "^densify " + TRAINED.format(
        "Sequential")),
]


@pytest.mark.parametrize(("model", "prepare", "misuse", "message"), ENGINE_STEPS,
                         ids=[f"{i}-{m[:24]}" for i, (*_, m) in enumerate(ENGINE_STEPS)])
def test_engine_misuse_without_lightning_raises_before_any_change(model, prepare, misuse,
                                                                  message):
    model = None if model is None else model(nn.Sequential(nn.Linear(16, 8), nn.ReLU(),
                                                           nn.Linear(8, 32)))
    model, engine, optimizer = small_engine(model)
    if prepare is not None:
        prepare(engine, optimizer)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(RuntimeError, match=message):
        misuse(model, engine, optimizer)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert buffers.keys() == dict(model.named_buffers()).keys()
    assert all(torch.equal(buffers[k], b) for k, b in model.named_buffers())


SPARSIFY_RULES = [  # (Linear shapes (in, out), rules, message): a ValueError, nothing swapped
    ([(16, 32)], {".": {"pattern": "block:64x64", "sparsity": 0.9}},
     r"rule '\.' can make none of the Linears it matches sparse \(nothing was swapped\):\n  "
     r"0: block 64x64 covers the whole 32x16 weight: sparsity 0.9 keeps 1 of 1 blocks \("
     r"nothing pruned; use smaller blocks or a higher sparsity\)"),
    ([(32, 32)], {".": {"pattern": "block:16x16", "density": 0.9}},
     r"0: the 32x32 weight has 4 blocks of 16x16: density 0.9 keeps 4 of 4 blocks"),
    ([(16, 10)], {".": {"pattern": "2:4"}},
     r"rule '\.' can make none .*\n  0: 2:4: out_features must be a positive multiple of 4 "
     r"\(2:4 groups\), got 10"),
    ([(6, 8)], {".": {"pattern": "2:4:2d"}}, r"0: 2:4:2d: weight of shape \(8, 6\) cannot "
                                             r"take pattern '2:4:2d': 6 input features are not "
                                             r"a multiple of M = 4"),
    ([(64, 64), (16, 32)], {"0": {"pattern": "block:16x16", "density": 0.5},
                            "1": {"pattern": "block:64x64", "sparsity": 0.5}},
     r"rule '1' can make none .*\n  1: block 64x64 covers the whole 32x16 weight: sparsity "
     r"0.5 keeps 1 of 1"),
]


def linears(shapes) -> nn.Module:
    return nn.ModuleList([nn.Linear(i, o) for i, o in shapes])


@pytest.mark.parametrize(("shapes", "rules", "message"), SPARSIFY_RULES,
                         ids=[f"{i}-{m[-28:]}" for i, (*_, m) in enumerate(SPARSIFY_RULES)])
def test_sparsify_rules_that_prune_nothing_raise_before_any_swap(shapes, rules, message):
    model = linears(shapes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        sparsify(model, rules, verbose=False)
    assert all(type(m) is nn.Linear for m in model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


SPARSIFY_HANDLED = [  # (shapes, rules, decisions): the Linears that cannot be sparse stay
    ([(16, 32), (32, 256)], {".": {"pattern": "block:64x64", "sparsity": 0.9}},
     ["skipped: block 64x64 covers the whole 32x16 weight: sparsity 0.9 keeps 1 of 1 blocks "
      "(nothing pruned; use smaller blocks or a higher sparsity)", "compressed"]),
    ([(16, 32), (32, 10)], {".": {"pattern": "2:4"}},
     ["compressed", "skipped: 2:4: out_features must be a positive multiple of 4 (2:4 "
                    "groups), got 10"]),
    ([(16, 32)], {".": {"pattern": "block:64x64", "density": 1.0}}, ["compressed"]),  # asked
]


@pytest.mark.parametrize(("shapes", "rules", "decisions"), SPARSIFY_HANDLED,
                         ids=[str(d)[:30] for *_, d in SPARSIFY_HANDLED])
def test_sparsify_skips_the_linears_a_rule_cannot_make_sparse(shapes, rules, decisions):
    model = linears(shapes)
    dense = copy.deepcopy(model)
    rows = sparsify(model, rules, verbose=False)
    assert [row["decision"] for row in rows] == decisions
    for row, layer, reference in zip(rows, model, dense, strict=True):
        if row["decision"] == "compressed":  # as sparse as its row says
            assert isinstance(layer, (BlockSparseLinear, SemiStructuredLinear))
            kept = layer.to_dense().weight.ne(0).double().mean()
            assert float(kept) == pytest.approx(row["density"])
        else:  # untouched
            x = torch.randn(layer.in_features, 5).T  # non-contiguous
            assert type(layer) is nn.Linear and torch.equal(layer(x), reference(x))


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
    ({**COMPRESS, "compress": False}, CapturedParams, list, 1, _captured_trained),
]


@pytest.mark.parametrize(("settings", "model_class", "callbacks", "epochs", "check"),
                         FIT_HANDLED, ids=[m.__name__ for _, m, *_ in FIT_HANDLED])
def test_fit_time_cases_handled_as_documented(settings, model_class, callbacks, epochs, check):
    model, sparse = model_class(), SparsityCallback(**settings)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer([sparse, *callbacks()], max_epochs=epochs)
    trainer.fit(model, make_loader(n=48))
    check(model, sparse, trainer, start)


def test_count_fit_misuse():
    """This section's cases (issue 22 asks for >= 15 here)."""
    sizes = [len(FIT_START), len(MID_FIT), len(ENGINE_STEPS), len(SPARSIFY_RULES),
             len(SPARSIFY_HANDLED), len(FIT_HANDLED)]
    assert sizes == [6, 5, 8, 5, 3, 3]
    assert sum(sizes) >= 15
