"""Bad settings of a SparsityCallback / SparsityConfig and its config files: each is a
clear error naming the value and the valid forms, or a warning for settings the chosen
method does not read, or is normalized as the docs say."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from sparse_training import GMP as GMPSchedule
from sparse_training import SRSTE, MovementScore, SparsityCallback, SparsityConfig

GMP = dict(pattern="unstructured", sparsity=0.5, schedule="gmp")
V = ValueError

CONSTRUCTION = [
    (dict(pattern="2-4"), V, r"unknown pattern '2-4'; did you mean '2:4'\? valid forms: "
                             r"\"unstructured\", \"N:M\""),
    (dict(pattern="5:4"), V, "N must satisfy 1 <= N <= M, got N=5, M=4"),
    (dict(pattern="0:4"), V, "N must satisfy 1 <= N <= M, got N=0"),
    (dict(pattern="block:0x4", sparsity=0.5), V, "block dimensions must be >= 1, got 0x4"),
    (dict(pattern="vector:0", sparsity=0.5), V, "block dimensions must be >= 1, got 0x1"),
    (dict(pattern="1:9:2d"), V, r"transposable N:M supports M <= 5 \(exact .*\), got M=9"),
    (dict(pattern=24), V, r"pattern must be a string, got the number 24; valid forms: "),
    (dict(pattern=124), V, r"got the number 124: YAML reads an unquoted 2:4 as the base-60 "
                           r"number 124; quote it: pattern: \"2:4\""),
    (dict(pattern=0.9), V, r"^pattern must be a string, got 0.9 of type float \(a sparsity\? "
                           r"give it as sparsity=0.9 beside a pattern, e.g. SparsityCallback\("
                           r"'unstructured', sparsity=0.9\)\); valid forms: \"unstructured\""),
    (dict(pattern=None), V, "pattern must be a string, got None of type NoneType"),
    (dict(pattern=["2:4"]), V, r"pattern must be a string, got \['2:4'\] of type list"),
    (dict(pattern="unstructured"), V, r"pattern 'unstructured' needs a sparsity in \[0, 1\)"),
    (dict(pattern="unstructured", sparsity=1.0), V, r"sparsity must be a number in \[0, 1\)"),
    (dict(pattern="unstructured", sparsity=1), V, r"got 1 \(1 would prune every weight\)"),
    (dict(pattern="unstructured", sparsity=90), V, r"sparsity must be a number in \[0, 1\), "
                                                   r"got 90 \(a percentage\? give the fraction "
                                                   r"pruned, 0.9\)"),
    (dict(pattern="unstructured", sparsity=0.5, overrides={"fc": {"sparsity": 75.0}}), V,
     r"overrides\['fc'\]\['sparsity'\] must be .* got 75.0 \(a percentage\? .* 0.75\)"),
    (dict(pattern="unstructured", sparsity="90%"), V, r"got '90%' \(a percentage\? give the "
                                                      r"fraction pruned, 0.9\)$"),
    (dict(pattern="unstructured", sparsity=" 0.75"), V, r"got ' 0.75' \(a string; give the "
                                                       r"number 0.75\)$"),
    (dict(pattern="unstructured", sparsity="most"), V, r"got 'most'$"),
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
    (dict(allow=[1]), V, r"allow must be a list of regex strings, e.g. \['encoder', .*got \[1\]"),
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
    (dict(regrow="sr-ste", sr_ste_decay=-1), V, "sr_ste_decay must be a finite number >= 0, "
                                                "got -1"),
    (dict(regrow="sr-ste", sr_ste_decay=float("nan")), V, "sr_ste_decay must be a finite .* nan"),
    (dict(regrow="sr-ste", sr_ste_decay=float("inf")), V, "sr_ste_decay must be a finite .* inf"),
    # regrowth that could never run, and regrowth settings no method reads
    (dict(regrow="rigl", regrow_end=0), V, "regrow_end=0 is not after start=0: regrow='rigl' "
                                           "would never drop and grow; give a later step"),
    (dict(regrow="set", regrow_end=0.0), V, "regrow_end=0.0 is not after start=0"),
    (dict(pattern="unstructured", sparsity=0.5, schedule="constant", start=20, regrow="rigl",
          regrow_end=10), V, "regrow_end=10 is not after start=20"),
    (dict(pattern="unstructured", sparsity=0.5, schedule="gmp", start=0.5, end=0.9,
          regrow="rigl", regrow_end=0.25), V, "regrow_end=0.25 is not after start=0.5"),
    (dict(compress="auto", auto_tokens=0), V, r"auto_tokens must be a positive int \(the "
                                              r"tokens per step.*\), got 0"),
    (dict(compress="auto", auto_tokens=-8), V, "auto_tokens must be a positive int .*got -8"),
    (dict(compress="auto", auto_tokens=512.0), V, "auto_tokens must be a positive .*got 512.0"),
    (dict(compress="auto", auto_tokens="8k"), V, "auto_tokens must be a positive .*got '8k'"),
    (dict(compress="auto", auto_tokens=True), V, "auto_tokens must be a positive .*got True"),
    (dict(seed=1.5), V, "seed must be an int, got 1.5"),
    (dict(seed="0"), V, "seed must be an int, got '0'"),
    (dict(sparsty=0.5), TypeError, "unknown setting 'sparsty'; did you mean 'sparsity'\\?"),
    (dict(patern="2:4"), TypeError, "unknown setting 'patern'; did you mean 'pattern'\\?"),
    (dict(warmup=10), TypeError, "unknown setting 'warmup'; valid settings: pattern, sparsity"),
    # a name in another case, with _ for -, or a near miss names the valid spelling
    (dict(**GMP, warmup_steps=10), TypeError, "unknown setting 'warmup_steps'; valid settings"),
    (dict(schedule="GMP"), V, r"unknown schedule 'GMP'; did you mean 'gmp'\? valid: oneshot, "),
    (dict(schedule="one-shot"), V, r"unknown schedule 'one-shot'; did you mean 'oneshot'\? "),
    (dict(**GMP, score="soft_movement"), V, r"unknown score 'soft_movement'; did you mean "
                                            r"'soft-movement'\? valid: 'magnitude'"),
    (dict(**GMP, score="Magnitude"), V, r"unknown score 'Magnitude'; did you mean 'magnitude'"),
    (dict(**GMP, distribution="ERK"), V, r"unknown distribution 'ERK'; did you mean 'erk'\? "
                                         r"valid: 'uniform', 'erk', 'global'"),
    (dict(**GMP, regrow="RigL"), V, r"unknown regrow 'RigL'; did you mean 'rigl'\? valid: None"),
    (dict(pattern="2:4", regrow="SR-STE"), V, r"unknown regrow 'SR-STE'; did you mean 'sr-ste'"),
    # a piece's class for its instance: refused at once, not a TypeError in the fit
    (dict(**GMP, score=MovementScore), V, r"^score=MovementScore is a class; give an instance, "
                                          r"MovementScore\(\), or a name: 'magnitude', "),
    (dict(**GMP, score={"name": "Movement"}), V, r"a score given as a mapping needs 'name' "
                                                r"from 'movement', .*; did you mean "
                                                r"'movement'\? got \{'name': 'Movement'\}"),
    (dict(pattern="unstructured", sparsity=0.5, schedule=GMPSchedule), V,
     r"^schedule=GMP is a class; give an instance, GMP\(\), or a name: 'oneshot', 'gmp'"),
    (dict(pattern="2:4", regrow=SRSTE), V, r"^regrow=SRSTE is a class; .* 'sr-ste'$"),
    (dict(layer_types=["Linaer"]), V, r"^layer_types entry 'Linaer' is not a torch.nn.Module "
                                      r"subclass; did you mean 'Linear'\? give classes"),
    (dict(layer_types=["conv2d"]), V, r"did you mean 'Conv2d'\? give classes"),
    (dict(compress="true"), V, r"^unknown compress 'true'; did you mean True\? valid: 'auto'"),
    (dict(pattern="2:4", regrow="none"), V, r"unknown regrow 'none'; did you mean None\? "),
    (dict(fused="Auto"), V, r"unknown fused 'Auto'; did you mean 'auto'\? valid: 'auto', True"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), CONSTRUCTION,
                         ids=[f"{i}-{m[:28]}" for i, (_, _, m) in enumerate(CONSTRUCTION)])
def test_construction_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        SparsityCallback(**kwargs)


UNREAD = [  # (settings, the settings the warning names): accepted, but said not to be read
    (dict(regrow_fraction=0.5), "regrow_fraction=0.5"),
    (dict(regrow_end=0.5, sr_ste_decay=-3), "regrow_end=0.5, sr_ste_decay=-3"),
    (dict(regrow="rigl", sr_ste_decay=1e-3), "sr_ste_decay=0.001"),
    (dict(regrow="sr-ste", regrow_fraction=0.5), "regrow_fraction=0.5"),
    (dict(pattern="unstructured", sparsity=0.5, frequency=7), "frequency=7"),
]


@pytest.mark.parametrize(("kwargs", "named"), UNREAD, ids=[n for _, n in UNREAD])
def test_settings_the_method_does_not_read_are_said(kwargs, named):
    with pytest.warns(UserWarning, match=rf"SparsityConfig: {re.escape(named)} not read with "
                                         rf"regrow=.* leave them out"):
        SparsityCallback(**kwargs)


NOTHING_PRUNED = [  # (settings, as the warning names them): every target 0, said
    (dict(pattern="unstructured", sparsity=0.0), "pattern='unstructured', sparsity=0.0"),
    (dict(pattern="4:4"), "pattern='4:4'"),
    (dict(pattern="block:4x4", sparsity=0.0, overrides={"fc": {"pattern": "1:1"}}),
     "pattern='block:4x4', sparsity=0.0 and every override"),
]


@pytest.mark.parametrize(("kwargs", "named"), NOTHING_PRUNED, ids=[n for _, n in NOTHING_PRUNED])
def test_settings_that_prune_nothing_are_said(kwargs, named):
    with pytest.warns(UserWarning, match=rf"^SparsityConfig: with {re.escape(named)} nothing is "
                                         rf"pruned \(the masks keep every weight\) and the fit "
                                         rf"trains dense; give a sparsity in \(0, 1\), e.g. 0.9$"):
        SparsityCallback(**kwargs)


@pytest.mark.parametrize("overrides", [{"fc": {"sparsity": 0.5}}, {"fc": {"pattern": "2:4"}}])
def test_a_zero_sparsity_beside_overrides_that_prune_says_nothing(recwarn, overrides):
    SparsityCallback(pattern="unstructured", sparsity=0.0, overrides=overrides)
    assert not [w for w in recwarn if "nothing is pruned" in str(w.message)]


def test_settings_the_method_reads_say_nothing(recwarn):
    SparsityCallback(pattern="unstructured", sparsity=0.5, regrow="rigl", regrow_fraction=0.5,
                     regrow_end=0.5, frequency=7)
    SparsityCallback(regrow="sr-ste", sr_ste_decay=1e-3)
    SparsityCallback(pattern="unstructured", sparsity=0.5, schedule="gmp", end=0.5, frequency=7)
    assert not [w for w in recwarn if "not read with" in str(w.message)]


def test_auto_tokens_without_compress_auto_is_said(recwarn):
    with pytest.warns(UserWarning, match=r"SparsityConfig: auto_tokens=512 not read with "
                                         r"compress=True \(it sizes compress='auto''s "
                                         r"measurements\); leave it out"):
        SparsityCallback(pattern="block:16x16", sparsity=0.5, compress=True, auto_tokens=512)
    SparsityCallback(pattern="block:16x16", sparsity=0.5, compress="auto", auto_tokens=512)
    assert not [w for w in recwarn if "auto_tokens" in str(w.message)]


CONFIG_FILES = [
    ("pattern: 2:4\n", "YAML reads an unquoted 2:4 as the base-60 number 124"),
    ("sparsty: 0.5\n", "unknown setting 'sparsty'; did you mean 'sparsity'"),
    ("- 2:4\n", "a sparsity config must be a mapping"),
    ("layer_types: [Dense]\n", "layer_types entry 'Dense' is not a torch.nn.Module"),
    ("", r"the sparsity config file '.*sparse.yaml' holds no setting \(an empty file would "
         r"train with every default\); give them"),
    ("# pattern: '2:4'\n", r"file '.*sparse.yaml' holds no setting"),
    ("class_path: sparse_training.SparsityCallback\ninit_args:\n  pattern: '2:4'\n",
     r"^a sparsity config holds the settings themselves; got a LightningCLI entry \(class_path: "
     r"'sparse_training.SparsityCallback'\): give its init_args, or put the entry under "
     r"trainer.callbacks of the CLI's config$"),
]


@pytest.mark.parametrize(("text", "message"), CONFIG_FILES, ids=[m[:30] for _, m in CONFIG_FILES])
def test_config_file_errors(tmp_path, text, message):
    path = tmp_path / "sparse.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        SparsityCallback.from_config(path)


@pytest.mark.parametrize("source", ["sparse.yaml", "pattern: '2:4'", Path("configs")])
def test_config_path_that_is_no_file_is_named_with_the_valid_sources(tmp_path, source):
    """A missing file, YAML text given as a path, and a folder."""
    (tmp_path / "configs").mkdir()
    source = tmp_path / source if isinstance(source, Path) else source
    with pytest.raises(FileNotFoundError, match=rf"^SparsityConfig.load: no file "
                                                rf"{re.escape(repr(str(source)))} \(resolved: "
                                                rf".*\); give the path of a YAML or JSON file "
                                                rf"of settings, or a mapping of them$"):
        SparsityCallback.from_config(source)


@pytest.mark.parametrize("source", [[1, 2], 3, None, b"pattern: 2:4"])
def test_config_source_neither_path_nor_mapping(source):
    with pytest.raises(TypeError, match=rf"^SparsityConfig.load takes the path of a YAML or JSON "
                                        rf"file \(a str or pathlib.Path\), a mapping of "
                                        rf"settings or a SparsityConfig, got "
                                        rf"{re.escape(repr(source))} of type "
                                        rf"{type(source).__name__}$"):
        SparsityCallback.from_config(source)


def test_from_config_takes_a_config():
    """The config a user holds builds the callback it describes (its as_dict settings)."""
    config = SparsityConfig("unstructured", sparsity=0.8, schedule="gmp", end=0.5,
                            score={"name": "movement"}, layer_types=[nn.Linear])
    assert SparsityCallback.from_config(config).config.as_dict() == config.as_dict()


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
    # the regrowth settings' defaults, written out, are what leaving them out gives
    (dict(regrow_fraction=0.3, regrow_end=0.75, sr_ste_decay=2e-4), "parsed_regrowth", None),
    (dict(pattern="unstructured", sparsity=0.5, schedule="constant", start=0.1, regrow="rigl",
          regrow_end=20), "parsed_regrowth.end", 20),  # steps against a fraction: at fit
]


@pytest.mark.parametrize(("kwargs", "attribute", "value"), HANDLED,
                         ids=[f"{a}={v!r}" for _, a, v in HANDLED])
def test_handled_inputs(kwargs, attribute, value):
    config = SparsityCallback(**kwargs).config
    for part in attribute.split("."):
        config = getattr(config, part)
    assert config == value and type(config) is type(value)


def test_a_checkpoint_stores_normalized_patterns():
    """A resume compares settings: " 2:4 " and "2:4" are one pattern, not a change."""
    settings = SparsityConfig(" 2:4 ", overrides={"fc": {"pattern": "BLOCK:4x4",
                                                          "sparsity": 0.5}}).as_dict()
    assert settings["pattern"] == "2:4"
    assert settings["overrides"] == {"fc": {"pattern": "block:4x4", "sparsity": 0.5}}


def test_the_unread_settings_warning_points_at_the_users_line():
    with pytest.warns(UserWarning, match="not read with") as caught:
        SparsityCallback(pattern="2:4", regrow_fraction=0.5)
    assert {w.filename for w in caught if "not read with" in str(w.message)} == {__file__}


def test_sr_ste_reads_frequency_and_numpy_starts_are_compared(recwarn):
    SparsityCallback(regrow="sr-ste", frequency=10)  # how often ranks compare their masks
    assert not [w for w in recwarn if "not read with" in str(w.message)]
    with pytest.raises(ValueError, match="regrow_end=100 is not after start=500"):
        SparsityCallback(pattern="unstructured", sparsity=0.5, schedule="constant",
                         start=np.int64(500), regrow="rigl", regrow_end=100)


WRONG_TYPES = [  # (call, message): wrong types given to SparsityConfig directly
    (lambda: SparsityConfig("2:4", overrides={1: {"sparsity": 0.5}}),
     r"overrides' keys must be regex strings naming tensors, e.g. .* got the key 1"),
    (lambda: SparsityConfig("2:4", deny="fc"),
     r"deny must be a list of regex strings, e.g. \['fc'\], got 'fc'"),
]


@pytest.mark.parametrize(("call", "message"), WRONG_TYPES, ids=[m[:30] for _, m in WRONG_TYPES])
def test_wrong_types_given_to_the_config_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_tables_hold_every_case():
    """Guards against a row lost in an edit: the exact size of every table here."""
    sizes = [len(CONSTRUCTION), len(UNREAD), len(NOTHING_PRUNED), len(CONFIG_FILES), len(HANDLED),
             len(WRONG_TYPES)]
    assert sizes == [105, 5, 3, 7, 12, 2], sizes
