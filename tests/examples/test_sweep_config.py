"""examples/sweep_config.py: loading a sweep's YAML, recipe files and overrides, --help, and
the rules every value is checked against."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import sweep_config  # noqa: E402

MNIST_YAML = EXAMPLES / "configs" / "mnist.yaml"


@pytest.fixture
def small_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(
        "# A small sweep.\n"
        "\n"
        "# -- what is swept ----------\n"
        "sparsities: [0.5, 0.9]   # the x axis\n"
        "# the optimizer, above its key\n"
        "optim:\n"
        "  lr: 0.1\n"
        "method_specs:\n"
        "  gmp: {train: true}\n"
        "logger: none\n"
        "wandb_mode: auto\n"
    )
    return path


# -- config_help and --help -------------------------------------------------------------------


def test_config_help_lists_every_key_of_mnist_yaml_with_its_default() -> None:
    text = sweep_config.config_help(MNIST_YAML, "The MNIST sweep.", "python sweep.py")
    assert text.startswith("The MNIST sweep.\n\nusage:\n  python sweep.py [KEY=VALUE ...]")
    assert "  python sweep.py config=PATH [KEY=VALUE ...]" in text
    assert "  python sweep.py --help" in text
    cfg = OmegaConf.to_container(OmegaConf.load(MNIST_YAML))
    lines = text.splitlines()
    for key, default in cfg.items():
        entry = next(line for line in lines if line.startswith(f"  {key}: "))
        shown = entry.removeprefix(f"  {key}: ").split("  #")[0].strip()
        if isinstance(default, dict):  # a mapping: listed by its entries' names
            assert shown == "{" + ", ".join(default) + "}"
        else:
            assert yaml.safe_load(shown) == default, key
    # The comment beside a key, a section title, and the comment above a mapping.
    assert "  epochs: 10                # fine-tuning epochs per sparse run" in text
    assert "\nlogging\n" in text
    method_specs = re.sub(r"\n +# ", " ", text[text.index("  method_specs: ") :])
    assert "set} The sweep fills in `sparsity`." in method_specs
    assert "(a mapping: set a field as method_specs.NAME.FIELD=VALUE)" in method_specs


def test_config_help_comments_above_and_beside(small_yaml: Path) -> None:
    text = sweep_config.config_help(small_yaml, "Small.", "prog")
    text = re.sub(r"\n +# ", " ", text)  # undo the wrapping of long comments
    assert "A small sweep" not in text  # the file's header comment belongs to no key
    assert "\nwhat is swept\n  sparsities: [0.5, 0.9]" in text
    assert "# the x axis" in text
    assert "  optim: {lr}" in text
    assert (
        "# the optimizer, above its key (a mapping: set a field as optim.FIELD=VALUE)" in text
    )


def test_help_flag_prints_and_exits_0(small_yaml: Path, capsys: pytest.CaptureFixture) -> None:
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as exit_info:
            sweep_config.load_config(["epochs=3", flag], small_yaml, "Small.", prog="prog")
        assert exit_info.value.code == 0
        assert capsys.readouterr().out == sweep_config.config_help(small_yaml, "Small.", "prog") + "\n"


# -- load_config --------------------------------------------------------------------------------


def test_load_config_overrides_and_other_base(small_yaml: Path, tmp_path: Path) -> None:
    cfg = sweep_config.load_config(["optim.lr=0.5", "sparsities=[0.8]"], small_yaml, "")
    assert cfg.optim.lr == 0.5 and list(cfg.sparsities) == [0.8]
    # Below an open key (method_specs) new entries may be added...
    cfg = sweep_config.load_config(["method_specs.rigl={train: false}"], small_yaml, "")
    assert cfg.method_specs.rigl.train is False
    # ...and config=PATH replaces the keys it holds (a whole file, or a recipe of a few).
    other = tmp_path / "other.yaml"
    other.write_text(small_yaml.read_text().replace("lr: 0.1", "lr: 0.3"))
    assert sweep_config.load_config([f"config={other}"], small_yaml, "").optim.lr == 0.3
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("sparsities: [0.7]\n")
    cfg = sweep_config.load_config([f"config={recipe}", "optim.lr=0.2"], small_yaml, "")
    assert list(cfg.sparsities) == [0.7] and cfg.optim.lr == 0.2
    recipe.write_text("sparsity: [0.7]\n")
    with pytest.raises(sweep_config.ConfigError, match="unknown key 'sparsity'"):
        sweep_config.load_config([f"config={recipe}"], small_yaml, "")
    recipe.write_text("optim: {lrr: 0.3}\n")  # nested keys are checked too
    with pytest.raises(sweep_config.ConfigError, match="unknown key 'optim.lrr'"):
        sweep_config.load_config([f"config={recipe}"], small_yaml, "")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["sparsity=[0.5]"], r"unknown key 'sparsity'; did you mean 'sparsities'\?"),
        (["wandb_mod=offline"], r"unknown key 'wandb_mod'; did you mean 'wandb_mode'\?"),
        (["optim.lrr=0.2"], r"unknown key 'optim.lrr'; did you mean 'optim.lr'\?"),
        (["optim"], r"arguments must be key=value overrides, got \['optim'\]"),
        (["config=/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
        (["sparsities.0=0.7"], r"'sparsities.0': sparsities is a list, replaced whole "
                               r"\(sparsities=\[...\]\) or by a config=PATH file"),
    ],
)
def test_load_config_errors(small_yaml: Path, argv: list[str], match: str) -> None:
    with pytest.raises(sweep_config.ConfigError, match=match):
        sweep_config.load_config(argv, small_yaml, "")


def test_config_is_struct_after_loading(small_yaml: Path) -> None:
    cfg = sweep_config.load_config([], small_yaml, "")
    with pytest.raises(AttributeError):  # a misspelt key in the code fails too
        _ = cfg.sparsitie


# -- check_keys: every value against its Rule ---------------------------------------------------

SMALL_RULES = {
    "sparsities": sweep_config.list_of(sweep_config.number(0, 1, high_open=True), "[0.9]"),
    "optim": sweep_config.MAPPING,
    "method_specs": sweep_config.MAPPING,
    "logger": sweep_config.LOGGING_RULES["logger"],
    "wandb_mode": sweep_config.LOGGING_RULES["wandb_mode"],
}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["sparsities=0.9"], r"sparsities must be a non-empty list of entries each a number in "
                             r"\[0, 1\), e.g. \[0.9\], got 0.9"),
        (["sparsities=[]"], r"sparsities must be a non-empty list .*, got \[\]"),
        (["sparsities=[0.5,1.0]"], r"sparsities must be .*, got \[0.5, 1.0\]"),
        (["sparsities=[0.5,true]"], r"sparsities must be .*, got \[0.5, True\]"),
        (["optim=3"], "optim must be a mapping of named entries, got 3"),
        (["logger=tensorboard"], "logger must be wandb or none, got 'tensorboard'"),
        (["wandb_mode=cloud"], "wandb_mode must be auto, online, offline or disabled, got 'cloud'"),
    ],
)
def test_check_keys_names_the_key_the_value_and_the_valid_form(
        small_yaml: Path, argv: list[str], match: str) -> None:
    cfg = sweep_config.load_config(argv, small_yaml, "")
    with pytest.raises(sweep_config.ConfigError, match=match):
        sweep_config.check_keys(cfg, SMALL_RULES)


def test_check_keys_refuses_a_key_without_a_rule(small_yaml: Path) -> None:
    cfg = sweep_config.load_config([], small_yaml, "")
    sweep_config.check_keys(cfg, SMALL_RULES)  # the defaults pass
    rules = {k: v for k, v in SMALL_RULES.items() if k != "optim"}
    with pytest.raises(KeyError, match="config key 'optim' has no Rule"):
        sweep_config.check_keys(cfg, rules)


@pytest.mark.parametrize(
    ("rule", "good", "bad"),
    [
        (sweep_config.integer(1), [1, 7], [0, -1, 1.5, "1O", "two", True, None]),
        (sweep_config.integer(0), [0, 3], [-1, 2.0]),
        (sweep_config.number(0, 1), [0, 0.5, 1], [-0.1, 1.01, "0.5", False]),
        (sweep_config.number(0, 1, high_open=True), [0.0, 0.99], [1, 1.0]),
        (sweep_config.positive_number(), [1e-4, 3], [0, -1e-4, "1e-4"]),
        (sweep_config.one_of("a", "b"), ["a", "b"], ["c", None, 1]),
        (sweep_config.one_of(True, False, "auto"), [True, "auto"], [1, 0, "yes"]),
        (sweep_config.text(), ["x", ""], [None, 1]),
        (sweep_config.text(optional=True), ["x", None], [1, [1]]),
        (sweep_config.BOOL, [True, False], [1, "true", None]),
    ],
)
def test_rules_accept_and_refuse(rule: sweep_config.Rule, good: list, bad: list) -> None:
    assert all(rule.accepts(v) for v in good), rule.form
    assert not any(rule.accepts(v) for v in bad), rule.form
