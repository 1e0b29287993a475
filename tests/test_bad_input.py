"""The bad-input table: every case is a clear error naming the value and the valid forms,
raised before any weight or mask changes, or is handled as documented. None silent, none
crashing inside torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, TinyNet, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.utils import parametrize

from sparse_training import BlockSparseLinear, SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.kernels.bitpack import pack_mask, unpack_mask

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
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader(), ckpt_path=tmp_path / "bad.ckpt")
    # a state's layout and settings are checked at setup, before Lightning restores any
    # weight; the masks after it restored the checkpoint's weights, all of them
    at_setup = bool(change) or "of format 1" in message
    expected = initial if at_setup else saved["state_dict"]
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
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


# == issue 22: compressed checkpoints and auto ==
# Resuming a compressed fit (BlockNet, 16x16 blocks at 0.75: net.0 and net.2 compressed,
# 1 and 4 of their 4 and 16 blocks) with changed settings, a damaged file or state, or
# another model; loading BlockSparseLinear state dicts; restored masks' structure.

COMPRESSED = dict(pattern="block:16x16", sparsity=0.75, compress=True)


class WideHead(BlockNet):
    """BlockNet whose net.2 has 32 outputs: a 2 x 4 block grid, not the checkpoint's 4 x 4."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 4))


@pytest.fixture(scope="module")
def compressed_checkpoint(tmp_path_factory):
    """A compress=True fit's last.ckpt (read back) and its path."""
    folder = tmp_path_factory.mktemp("compressed")
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer([SparsityCallback(**COMPRESSED),
                            ModelCheckpoint(dirpath=folder, save_last=True)],
                           max_epochs=1, enable_checkpointing=True)
    trainer.fit(BlockNet(), make_loader())
    return torch.load(folder / "last.ckpt", weights_only=False), folder / "last.ckpt"


def _compressed_state(saved):
    (key,) = [k for k in saved["callbacks"] if k.startswith("SparsityCallback")]
    return saved["callbacks"][key]


def _entry(saved, name):
    return _compressed_state(saved)["compressed"][name]


def _flip_bit(saved, name, bit):
    """Flip one bit of a packed compressed mask: the kept count changes."""
    bits = _entry(saved, name)["bits"]
    bits[bit // 8] ^= 1 << (bit % 8)


def _swap_blocks(saved, name):
    """Move one kept block of a packed mask to a dropped position: the count holds."""
    entry = _entry(saved, name)
    mask = unpack_mask(entry["bits"], entry["shape"]).flatten()
    kept, free = mask.nonzero()[0], (~mask).nonzero()[0]
    mask[kept], mask[free] = False, True
    entry["bits"] = pack_mask(mask)


def _write_truncated(saved, path, source):
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])


def _write_empty(saved, path, source):
    path.write_bytes(b"")


RESUMES = [  # (change to the checkpoint, settings, model class, stage it raises at, message)
    (None, dict(pattern="block:32x32"), BlockNet, "setup",
     r"masks were made with other settings: pattern='block:16x16' in the checkpoint, "
     r"'block:32x32' now"),
    (None, dict(sparsity=0.5), BlockNet, "setup",
     r"sparsity=0.75 in the checkpoint, 0.5 now"),
    (None, dict(compress=False), BlockNet, "setup", r"compress=True in the checkpoint, False now"),
    (None, dict(compress="auto"), BlockNet, "setup",
     r"compress=True in the checkpoint, 'auto' now"),
    (None, dict(pattern="2:4", sparsity=None), BlockNet, "setup",
     r"pattern='block:16x16' in the checkpoint, '2:4' now"),
    (_write_truncated, {}, BlockNet, "setup",
     r"cannot resume: the checkpoint \S+bad.ckpt cannot be read \(\w+Error: .*\); it is "
     r"likely truncated or half-written .*: resume from another checkpoint"),
    (_write_empty, {}, BlockNet, "setup",
     r"the checkpoint \S+bad.ckpt cannot be read \(\w+Error: .*truncated or half-written"),
    (lambda s: _flip_bit(s, "net.2.values", 0), {}, BlockNet, "setup",
     r"compressed mask 'net.2.values' keeps (3|5) blocks; the layer keeps exactly nnz = 4 "
     r"\(corrupted\)"),
    (lambda s: _entry(s, "net.0.values")["bits"].fill_(0xF2), {}, BlockNet, "setup",
     r"compressed mask 'net.0.values' has nonzero padding bits after its 4 entries"),
    (lambda s: _entry(s, "net.2.values").update(bits=torch.zeros(3, dtype=torch.uint8)), {},
     BlockNet, "setup", r"compressed mask 'net.2.values' is not 2 packed bytes \(uint8\)"),
    (lambda s: _entry(s, "net.2.values").update(pattern="block:32x32"), {}, BlockNet, "setup",
     r"compressed mask 'net.2.values' is of pattern 'block:32x32', the layer 'block:16x16'"),
    (lambda s: _entry(s, "net.2.values").update(shape=[2, 8]), {}, BlockNet, "setup",
     r"compressed mask 'net.2.values' has shape \[2, 8\], the tensor \[4, 4\]"),
    (lambda s: _compressed_state(s)["compressed"].update(
        {"net.4.values": _entry(s, "net.0.values")}), {}, BlockNet, "setup",
     r"compressed layers net.4.values \(not selected: shape cannot take 'block:16x16': 4 rows "
     r"are not a multiple of the block's 16\) cannot be compressed in this model"),
    (lambda s: _compressed_state(s).update(compressed=[1]), {}, BlockNet, "setup",
     r"checkpoint compressed masks must be a dict, got list"),
    (None, {}, WideHead, "setup",
     r"compressed mask 'net.2.values' has shape \[4, 4\], the tensor \[2, 4\]"),
    (lambda s: s.pop("callbacks"), {}, BlockNet, "setup",
     r"(?s)compress=True but no selected tensor can train compressed.*net.0.weight: "
     r"masked-dense in the checkpoint resumed"),
    (lambda s: _swap_blocks(s, "net.2.values"), {}, BlockNet, "restore",
     r"the checkpoint's mask of 'net.2.values' drops 1 blocks that hold nonzero weights in "
     r"its state_dict: its weights and masks disagree \(corrupted\)"),
]


@pytest.mark.parametrize(("mutate", "change", "model_class", "stage", "message"), RESUMES,
                         ids=[f"{i}-{m[:28]}" for i, (*_, m) in enumerate(RESUMES)])
def test_compressed_resume_errors(compressed_checkpoint, tmp_path, mutate, change, model_class,
                                  stage, message):
    """Errors found at setup come before any change: the model keeps its nn.Linear layers
    and weights. A state whose masks disagree with its weights is found once Lightning
    restored them (into the layers swapped with the checkpoint's masks)."""
    saved, source = compressed_checkpoint
    saved = copy.deepcopy(saved)
    bad = tmp_path / "bad.ckpt"
    if mutate in (_write_truncated, _write_empty):
        mutate(saved, bad, source)
    else:
        if mutate is not None:
            mutate(saved)
        torch.save(saved, bad)
    pl.seed_everything(1, verbose=False)
    model = model_class()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer([SparsityCallback(**{**COMPRESSED, **change})], max_epochs=2)
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, make_loader(), ckpt_path=bad)
    if stage == "setup":
        assert all(type(model.net[i]) is nn.Linear for i in (0, 2, 4))
        assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())
    else:  # Lightning restored the checkpoint's (dense) weights into the swapped layers
        assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("weight_mask") for name, _ in model.named_buffers())


def test_a_missing_checkpoint_is_named_before_any_change():
    model = BlockNet()
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*nowhere.ckpt"):
        make_trainer([SparsityCallback(**COMPRESSED)], max_epochs=1).fit(
            model, make_loader(), ckpt_path="nowhere.ckpt")
    assert type(model.net[0]) is nn.Linear


OUT, IN, GRID = 40, 70, (3, 3)  # BlockSparseLinear(70, 40, block 16x32): both tails hang over


def _layer() -> nn.Sequential:
    """One BlockSparseLinear keeping 5 of its 9 blocks, float64 values never zero."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return nn.Sequential(BlockSparseLinear(IN, OUT, (16, 32), block_mask=mask,
                                           dtype=torch.float64))


def _compact(layer, **changes):
    state = {"0.values": layer[0].values.detach().clone(),
             "0.block_mask": layer[0].block_mask.clone(), "0.bias": layer[0].bias.detach()}
    state.update({f"0.{k}": v for k, v in changes.items()})
    return state


def _dense(layer, weight=None):
    return {"0.weight": layer[0].to_dense().weight.detach() if weight is None else weight,
            "0.bias": layer[0].bias.detach()}


LOADS = [  # (state dict from the layer, message)
    (lambda layer: _compact(layer, block_mask=layer[0].block_mask.to(torch.uint8)),
     r"0.block_mask must be a bool tensor of the block grid's shape \(3, 3\), got torch.uint8"),
    (lambda layer: _compact(layer, block_mask=torch.ones(2, 3, dtype=torch.bool)),
     r"0.block_mask shape \(2, 3\) != block grid \(3, 3\)"),
    (lambda layer: _compact(layer, block_mask=torch.ones(GRID, dtype=torch.bool)),
     r"0.block_mask keeps 9 blocks but values holds 5: the state_dict is inconsistent"),
    (lambda layer: _compact(layer, values=torch.randn(5, 16, 16, dtype=torch.float64)),
     r"0.values has shape \(5, 16, 16\), the layer's \(nnz, R, C\) = \(5, 16, 32\)"),
    (lambda layer: {"0.block_mask": layer[0].block_mask.flip(1)},
     r"0.block_mask without 0.values: the compact form loads both"),
    (lambda layer: _dense(layer, torch.randn(OUT, IN, dtype=torch.float64)),
     r"0.weight has nonzeros in 9 of its 9 16x32 blocks, some outside the layer's block_mask,"
     r" and the layer keeps nnz = 5: load a weight that is zero outside 5 blocks"),
    (lambda layer: _dense(layer, torch.randn(OUT, 64, dtype=torch.float64)),
     r"0.weight has shape \(40, 64\), the layer's dense weight \(out_features, in_features\) "
     r"= \(40, 70\)"),
    (lambda layer: {**_dense(layer), "0.values": layer[0].values.detach()},
     r"0.weight and the compact 0.values/block_mask are both given; give one form"),
]


@pytest.mark.parametrize(("make_state", "message"), LOADS,
                         ids=[m[:30] for _, m in LOADS])
def test_block_sparse_state_dict_errors_come_before_any_copy(make_state, message):
    layer = _layer()
    state = make_state(_layer())
    with torch.no_grad():
        layer[0].values.mul_(-1)  # differs from every state above
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    mask = layer[0].block_mask.clone()
    with pytest.raises(ValueError, match=message):
        layer.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    assert torch.equal(layer[0].block_mask, mask)


def _zero_block(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with its kept block (0, 0) (rows 0:16, columns 0:32) zeroed."""
    weight = weight.clone()
    weight[:16, :32] = 0
    return weight


def _elsewhere(layer) -> torch.Tensor:
    """A dense weight nonzero in exactly 5 blocks, the layer's mask flipped upside down."""
    mask = layer[0].block_mask.flip(0)
    keep = mask.repeat_interleave(16, 0).repeat_interleave(32, 1)[:OUT, :IN]
    return torch.where(keep, torch.randn(OUT, IN, dtype=torch.float64), 0)


LOADED = [  # (dense weight from the layer's own, the block mask kept after loading)
    # a kept block of zeros: the weight is zero outside the current mask, which stays
    (lambda layer: _zero_block(layer[0].to_dense().weight.detach()), lambda layer: layer[0].block_mask),
    # nonzeros in exactly nnz other blocks: those become the mask
    (_elsewhere, lambda layer: layer[0].block_mask.flip(0)),
]


@pytest.mark.parametrize(("make_weight", "expected_mask"), LOADED, ids=["zero-block", "moved"])
def test_dense_weights_load_as_documented(make_weight, expected_mask):
    """A dense weight zero outside the layer's mask keeps it; one nonzero in exactly nnz
    other blocks sets the mask to those blocks; the dense form then reads back exactly."""
    source, target = _layer(), _layer()
    weight = make_weight(source)
    target.load_state_dict(_dense(source, weight))
    assert torch.equal(target[0].block_mask, expected_mask(source))
    assert torch.equal(target.state_dict()["0.weight"], weight)
    x = torch.randn(3, 5, IN, dtype=torch.float64).transpose(0, 1)  # non-contiguous
    # float64 products accumulated in fp32 by the kernels (IN = 70 terms of O(1))
    torch.testing.assert_close(target(x), x @ weight.T + source[0].bias, rtol=1e-5, atol=1e-5)


def test_a_compressed_state_dict_loads_strictly_into_nn_linear_and_back():
    layer = _layer()
    plain = nn.Sequential(nn.Linear(IN, OUT, dtype=torch.float64))
    plain.load_state_dict(layer.state_dict())  # strict
    expected = layer[0].block_mask.repeat_interleave(16, 0).repeat_interleave(32, 1)[:OUT, :IN]
    assert torch.equal(plain[0].weight != 0, expected)
    back = _layer()
    with torch.no_grad():
        back[0].values.zero_()
    back.load_state_dict(plain.state_dict())
    assert torch.equal(back[0].values, layer[0].values)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.weight"'):
        back.load_state_dict({"0.bias": layer[0].bias})


def _masked_state(saved):
    (key,) = [k for k in saved["callbacks"] if k.startswith("SparsityCallback")]
    return saved["callbacks"][key]["masks"]


def _flip_masked(saved, name, bit):
    _masked_state(saved)[name]["bits"][bit // 8] ^= 1 << (bit % 8)


def _column_broken_2_4() -> torch.Tensor:
    """A 32 x 32 mask 2:4 along every row but keeping all 4 of each tile's first column."""
    return pack_mask(torch.tensor([True, True, False, False]).repeat(32, 8))


MASKS = [  # (settings of the saved fit, change to its state, message)
    (dict(pattern="unstructured", sparsity=0.8, schedule="gmp", end=10, frequency=2),
     lambda s: _flip_masked(s, "net.0.weight", 3),
     r"mask 'net.0.weight' keeps \d+ of 512 blocks; sparsity 0.\d+ keeps \d+ \(corrupted\)"),
    (dict(pattern="block:4x4", sparsity=0.5), lambda s: _flip_masked(s, "net.2.weight", 0),
     r"mask 'net.2.weight' is not constant on 4x4 block \(0, 0\): (1|15) of 16 entries kept"),
    (dict(pattern="2:4"), lambda s: _flip_masked(s, "net.2.weight", 0),
     r"mask 'net.2.weight' is not 2:4: row 0, blocks 0:4 keep (1|3) \(corrupted\)"),
    (dict(pattern="2:4:2d"), lambda s: _masked_state(s)["net.2.weight"].update(
        bits=_column_broken_2_4()),
     r"mask 'net.2.weight' is not 2:4: column 0, blocks 0:4 keep 4 \(corrupted\)"),
]


@pytest.mark.parametrize(("settings", "mutate", "message"), MASKS,
                         ids=[m[:30] for *_, m in MASKS])
def test_corrupted_masks_at_the_right_length_are_refused(tmp_path, settings, mutate, message):
    """Masks are checked for their pattern's structure and the schedule's exact count
    before any is installed (Lightning has restored the weights by then)."""
    saved, _, _ = sparse_checkpoint(tmp_path, **settings)
    mutate(saved)
    torch.save(saved, tmp_path / "bad.ckpt")
    model = TinyNet()
    with pytest.raises(ValueError, match=message):
        make_trainer([SparsityCallback(**settings)], max_epochs=2).fit(
            model, make_loader(), ckpt_path=tmp_path / "bad.ckpt")
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())


def test_count_compressed_checkpoints():
    """This section's cases: resumes, loads (errors and documented behavior), masks."""
    total = len(RESUMES) + 1 + len(LOADS) + len(LOADED) + 2 + len(MASKS)
    assert (len(RESUMES), len(LOADS), len(LOADED), len(MASKS)) == (17, 8, 2, 4)
    assert total >= 15, total
