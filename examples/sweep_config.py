"""A sweep's settings: its YAML file, recipe files and key=value overrides, each value checked.

    cfg = load_config(sys.argv[1:], CONFIG, __doc__)   # unknown keys fail, naming the nearest
    check_keys(cfg, RULES)                             # every value against its Rule

`load_config` checks the structure (which keys exist), `check_keys` what every top-level
value must be (a `Rule`: a test and the valid form in words), so that `epochs=1O`,
`sparsities=0.9` or `batch_size=0` fail before any training with a message naming the key,
the value and the valid form. `config_help` is the `--help` text.
"""

from __future__ import annotations

import difflib
import numbers
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A setting that cannot work; raised before any training."""


# -- what a value must be ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """What a config value must be: `accepts` tests a value, `form` says it in words
    ("an int >= 1"), for the message."""

    form: str
    accepts: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(minimum: int) -> Rule:
    """An int >= minimum."""
    return Rule(f"an int >= {minimum}", lambda v: _is_int(v) and v >= minimum)


def number(low: float, high: float, *, low_open: bool = False, high_open: bool = False
           ) -> Rule:
    """A number in [low, high] (either end open with low_open / high_open); ints count."""
    opening, closing = "(" if low_open else "[", ")" if high_open else "]"
    return Rule(f"a number in {opening}{low:g}, {high:g}{closing}",
                lambda v: _is_real(v) and (low < v if low_open else low <= v)
                and (v < high if high_open else v <= high))


def positive_number() -> Rule:
    return Rule("a number > 0", lambda v: _is_real(v) and v > 0)


def one_of(*choices: Any) -> Rule:
    shown = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
    return Rule(shown, lambda v: any(v == c and type(v) is type(c) for c in choices))


def text(*, optional: bool = False) -> Rule:
    """A string (a path, a name); `optional`: or null."""
    form = "a string or null" if optional else "a string"
    return Rule(form, lambda v: isinstance(v, str) or (optional and v is None))


BOOL = Rule("true or false", lambda v: isinstance(v, bool))
MAPPING = Rule("a mapping of named entries", lambda v: isinstance(v, Mapping | DictConfig))


def list_of(item: Rule, example: str, *, allow_empty: bool = False, unique: bool = False
            ) -> Rule:
    """A list whose every entry passes `item` (each once where `unique`); `example` shows one
    in the message."""
    some = ("a list" if allow_empty else "a non-empty list") + (" of distinct" if unique else
                                                               " of")
    return Rule(f"{some} entries each {item.form}, e.g. {example}",
                lambda v: isinstance(v, list | ListConfig) and (allow_empty or len(v) > 0)
                and all(item.accepts(x) for x in v) and (not unique or len(set(v)) == len(v)))


# the keys every sweep has (examples/reporting.py reads them)
LOGGING_RULES = {
    "out_dir": text(),
    "logger": one_of("wandb", "none"),
    "wandb_project": text(),
    "wandb_mode": one_of("auto", "online", "offline", "disabled"),
    "progress_bar": BOOL,
}


def check_keys(cfg: DictConfig, rules: Mapping[str, Rule]) -> None:
    """Every top-level value of `cfg` against its rule.

    Raises:
        ConfigError: "epochs must be an int >= 1, got '1O'", for the first bad value.
        KeyError: a key of `cfg` without a rule (the sweep's own mistake, not the user's).
    """
    for key in cfg:
        if key not in rules:
            raise KeyError(f"config key {key!r} has no Rule: add one to the sweep's RULES")
        if OmegaConf.is_missing(cfg, key):  # ??? in a recipe file: the user must set it
            raise ConfigError(f"{key} must be set ({rules[key].form}): pass {key}=...")
        value = cfg[key]
        if not rules[key].accepts(value):
            shown = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
            hint = (" (YAML reads an unquoted on/off/yes/no as true/false: quote the word)"
                    if isinstance(value, bool) else "")
            raise ConfigError(f"{key} must be {rules[key].form}, got {shown!r}{hint}")


def prepare_dirs(cfg: DictConfig, keys: Iterable[str]) -> None:
    """Create the folder each of `keys` names (where missing) and write a file in it: call
    it after every other check and before the first training, so that an unusable path
    stops the sweep before any work is lost.

    Raises:
        ConfigError: "out_dir '/proc/x' cannot be written: ...", naming the key.
    """
    for key in keys:
        folder = Path(cfg[key])  # as the sweep writes it (no ~ expansion there either)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            reason = error.strerror or type(error).__name__
            raise ConfigError(f"{key} {str(cfg[key])!r} cannot be written ({reason}): give a "
                              f"folder this user can create and write") from error


# -- the YAML file, then key=value overrides from the command line ------------------------------


def load_config(
    argv: list[str],
    yaml_path: Path,
    description: str,
    *,
    prog: str | None = None,
    open_keys: Iterable[str] = ("method_specs",),
) -> DictConfig:
    """The YAML at yaml_path, then the keys of each `config=PATH` file (a recipe: any subset
    of the keys), then OmegaConf dot-list overrides.

    Unknown keys fail naming the nearest valid key, except below `open_keys` (mappings of
    named entries, where new ones may be added); a file's top-level `???` marks a key the
    command line must set (`check_keys` says so). What the values mean is checked by
    `check_keys`. `-h`/`--help` prints `config_help(...)` and exits 0. Raises ConfigError.
    """
    if "-h" in argv or "--help" in argv:
        print(config_help(yaml_path, description, prog or f"python {sys.argv[0]}"))
        raise SystemExit(0)
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("config=")]
    overrides = [a for a in argv if not a.startswith("config=")]
    if bad := [a for a in overrides if "=" not in a]:
        raise ConfigError(f"arguments must be key=value overrides, got {bad} (see --help)")
    cfg = OmegaConf.load(yaml_path)
    open_keys = [k for k in open_keys if isinstance(cfg.get(k), DictConfig)]
    for path in map(Path, paths):
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        recipe = OmegaConf.load(path)
        for key in _leaf_keys(recipe, open_keys):
            _check_key(cfg, key, open_keys)
        cfg = OmegaConf.merge(cfg, recipe)
        for key in recipe:  # merging keeps the old value where the file says ??? (must be set)
            if OmegaConf.is_missing(recipe, key):
                cfg[key] = "???"
    for override in overrides:
        _check_key(cfg, override.split("=", 1)[0], open_keys)
    OmegaConf.set_struct(cfg, True)  # a misspelt key in the code fails too
    for key in open_keys:
        OmegaConf.set_struct(cfg[key], False)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as e:  # OmegaConf's errors name the key
        raise ConfigError(str(e)) from e
    return cfg


def _leaf_keys(cfg: DictConfig, open_keys: list[str], prefix: str = "") -> list[str]:
    """Dotted paths of a mapping's leaves (lists are leaves; nothing below an open key)."""
    keys = []
    for key in cfg:
        dotted = f"{prefix}{key}"
        value = None if OmegaConf.is_missing(cfg, key) else cfg[key]  # ???: set later
        if isinstance(value, DictConfig) and dotted not in open_keys:
            keys += _leaf_keys(value, open_keys, f"{dotted}.")
        else:
            keys.append(dotted)
    return keys


def _check_key(cfg: DictConfig, dotted: str, open_keys: list[str]) -> None:
    """Fail on a key the YAML does not have, naming the nearest one it has."""
    node: Any = cfg
    path: list[str] = []
    for part in dotted.split("."):
        if isinstance(node, ListConfig):  # OmegaConf's merge fails without naming it
            raise ConfigError(f"{dotted!r}: {'.'.join(path)} is a list, replaced whole "
                              f"({'.'.join(path)}=[...]) or by a config=PATH file; its "
                              f"entries cannot be set one by one")
        if not isinstance(node, DictConfig) or ".".join(path) in open_keys:
            return
        if part not in list(node):  # `in node` is False for a ??? value
            near = difflib.get_close_matches(part, [str(k) for k in node], n=1, cutoff=0.0)
            hint = f"; did you mean {'.'.join([*path, *near])!r}?" if near else ""
            raise ConfigError(f"unknown key {dotted!r}{hint} (see --help)")
        path.append(part)
        node = None if OmegaConf.is_missing(node, part) else node.get(part)


_KEY = re.compile(r"(?P<key>[A-Za-z_][\w.+-]*)\s*:(?P<rest>.*)")  # a top-level key's line
_SECTION = re.compile(r"#\s*--+\s*(?P<title>.*?)\s*-*\s*$")  # "# -- logging -----"


def config_help(yaml_path: Path, description: str, prog: str) -> str:
    """Usage text: the description, the command forms, then every key of the YAML with its
    default and the comment beside or above it (a nested mapping by its top-level key)."""
    cfg = OmegaConf.load(yaml_path)
    lines = [
        description.strip(),
        "",
        "usage:",
        f"  {prog} [KEY=VALUE ...]              override any key below (OmegaConf dot-list)",
        f"  {prog} config=PATH [KEY=VALUE ...]  a YAML of keys to replace (a recipe)",
        f"  {prog} --help                       this text",
        "",
        f"configuration keys of {yaml_path.name} (KEY: default  # comment):",
    ]
    above: list[str] = []  # comment lines right above the next key
    for raw in yaml_path.read_text().splitlines():
        if section := _SECTION.match(raw):
            lines += ["", section["title"]]
            above = []
        elif raw.startswith("#"):
            above.append(raw.lstrip("# ").strip())
        elif (match := _KEY.fullmatch(raw)) and match["key"] in cfg:
            key, value = match["key"], cfg[match["key"]]
            comment = " ".join(filter(None, [*above, match["rest"].partition(" #")[2].strip()]))
            if isinstance(value, DictConfig):
                shown = "{" + ", ".join(map(str, value)) + "}"
                named = all(isinstance(v, DictConfig) for v in value.values())
                field = f"{key}.NAME.FIELD" if named else f"{key}.FIELD"
                comment += f" (a mapping: set a field as {field}=VALUE)"
            elif isinstance(value, ListConfig) and value and all(
                    isinstance(v, DictConfig) and "name" in v for v in value):
                shown = "[" + ", ".join(str(v.name) for v in value) + "]"
                comment += " (named entries, listed by name)"
            else:
                shown = yaml.safe_dump(OmegaConf.to_container(cfg)[key], default_flow_style=True)
                shown = shown.removesuffix("...\n").strip()  # null, true, [0.7, 0.8]
            lines.append(_entry(f"  {key}: {shown}", comment.strip()))
            above = []
        elif not raw.startswith(" "):
            above = []  # a blank or other line ends the comment above a key
    return "\n".join(lines) + "\n"


def _entry(head: str, comment: str, width: int = 28) -> str:
    """`head`, then its comment in a column from `width`, wrapped at 110 characters."""
    if not comment:
        return head
    first = head.ljust(width) if len(head) < width else head + "\n" + " " * width
    return first + "# " + f"\n{' ' * width}# ".join(textwrap.wrap(comment, 108 - width))


