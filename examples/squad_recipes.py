"""The SQuAD sweep's settings: every key checked before any training (RULES, check_config),
recipes (how a run trains) merged into runs (what it prunes), and the learning-rate schedules
recipes name.

A run of examples/configs/squad.yaml names a recipe and adds its own keys; the run is the
recipe's keys, then the run's (a nested `callback` merged key by key), over RUN_DEFAULTS:

    recipes: {asp_distill: {distill: ${distillation}, callback: {schedule: oneshot, start: 0}}}
    runs: [{name: "2:4", family: "N:M 50%", recipe: asp_distill, callback: {pattern: "2:4"}}]

Keys of a run (RUN_DEFAULTS has their defaults):
    init         dense: start from the seed's dense fine-tuned model; pretrained: from the
                 pretrained checkpoint
    epochs       training epochs (default: the sweep's `epochs`; 0: score without training)
    lr_schedule  linear: warm-up then linear decay to 0; rewind: back to the peak at every
                 mask update, then linear decay to 0 until the next (oBERT's LR rewinding)
    distill      null, or {temperature, hardness}: distil from the seed's dense model
    permute      ASP's channel permutations before pruning
    callback     SparsityCallback's arguments (null: dense)
    baseline     the run the F1 gap is measured against (default: the sweep's `baseline`)
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import squad_data
from omegaconf import DictConfig, ListConfig, OmegaConf
from sweep_config import (
    LOGGING_RULES,
    MAPPING,
    ConfigError,
    Rule,
    check_keys,
    integer,
    list_of,
    number,
    one_of,
    positive_number,
    text,
)
from torch import nn

from sparse_training import DistillationLoss, SparsityConfig, SparsityEngine

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
RULES = {  # what every key of configs/squad.yaml must be
    "squad_file": text(optional=True), "train_file": text(optional=True),
    "model_dir": text(optional=True), "cache_dir": text(),
    "max_length": integer(32), "doc_stride": integer(1), "train_questions": integer(0),
    "encoder_layers": integer(0), "eval_questions": integer(0), "batch_size": integer(1),
    "precision": one_of(*PRECISIONS), "threads": integer(0),
    "seeds": list_of(integer(0), "[0, 1, 2]", unique=True),
    "dense_epochs": integer(1), "epochs": integer(1), "lr": positive_number(),
    "warmup": number(0, 1, high_open=True), "weight_decay": number(0, 1),
    "replay": Rule("null, a results.json path or a list of them, e.g. [a/results.json, "
                   "b/results.json]", lambda v: v is None or isinstance(v, str)
                   or list_of(text(), "").accepts(v)),
    "resume": one_of(True, False), "time_limit_s": integer(0),
    "distillation": MAPPING, "baseline": text(optional=True),
    "only": Rule("a list of run names (quote N:M names: 'only=[\"2:4\"]')",
                 lambda v: isinstance(v, ListConfig) and all(isinstance(n, str | int)
                                                             for n in v)),
    "recipes": MAPPING, "runs": list_of(MAPPING, "[{name: dense, family: dense, ...}]"),
    **LOGGING_RULES,
}
RUN_DEFAULTS = {"init": "dense", "epochs": None, "lr_schedule": "linear", "distill": None,
                "permute": False, "callback": None, "baseline": None}
NAMING_KEYS = ("name", "family", "recipe")  # a run's own; a recipe has the others
DENY = ["qa_outputs"]  # the 2-output span head stays dense in every run (embeddings: not Linear)

LrSchedule = Callable[[int], float]  # optimizer step -> multiplier of the peak learning rate


def warmup_then_linear(total: int, warmup: int, updates: list[int]) -> LrSchedule:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `total` (BERT's SQuAD
    recipe); mask updates do not matter."""
    return lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup)))


def rewound_at_updates(total: int, warmup: int, updates: list[int]) -> LrSchedule:
    """oBERT's learning-rate rewinding (Kurtic et al. 2022): back to the peak at every mask
    update, then linear decay to 0 at the next one (after the last: at `total`), under the
    same warm-up ramp over the first `warmup` steps."""
    bounds = sorted({0, *(u for u in updates if 0 < u < total), total})

    def multiplier(step: int) -> float:
        segment = max(0, bisect.bisect_right(bounds, step) - 1)
        begin, end = bounds[segment], bounds[min(segment + 1, len(bounds) - 1)]
        decay = max(0.0, (end - step) / max(1, end - begin))
        return min((step + 1) / warmup, decay)

    return multiplier


LR_SCHEDULES = {"linear": warmup_then_linear, "rewind": rewound_at_updates}

RUN_RULES = {
    "init": one_of("dense", "pretrained"),
    "epochs": integer(0),
    "lr_schedule": one_of(*LR_SCHEDULES),
    "distill": Rule("null or a mapping {temperature, hardness}",
                    lambda v: v is None or isinstance(v, DictConfig)),
    "permute": one_of(True, False),
    "callback": Rule("null or a mapping of SparsityCallback arguments",
                     lambda v: v is None or isinstance(v, DictConfig)),
    "baseline": Rule("null or a run's name", lambda v: v is None or isinstance(v, str)),
}


def callback_kwargs(spec: DictConfig) -> dict[str, Any] | None:
    """SparsityCallback's arguments of a run (None: dense), the span head denied."""
    if not spec.callback:
        return None
    kwargs = OmegaConf.to_container(spec.callback, resolve=True)
    return {**kwargs, "deny": [*kwargs.get("deny", []), *DENY]}


def distill_settings(spec: DictConfig) -> DistillationLoss | None:
    """The run's distillation settings, or None."""
    if spec.distill is None:
        return None
    return DistillationLoss(**OmegaConf.to_container(spec.distill, resolve=True))


def mask_updates(spec: DictConfig, total_steps: int) -> list[int]:
    """The optimizer steps at which the run's masks change (none for a dense run)."""
    kwargs = callback_kwargs(spec)
    if kwargs is None:
        return []
    return SparsityConfig(**kwargs).parsed_schedule.resolve(total_steps).updates()


def resolve_runs(cfg: DictConfig) -> list[DictConfig]:
    """The runs to do (``only`` of ``runs``), each merged with its recipe and checked.

    Raises:
        ConfigError: naming the run, the key, the bad value and the valid forms.
    """
    if numbers := [n for n in cfg.only if isinstance(n, int)]:  # YAML 1.1 reads 2:4 as 124
        raise ConfigError(
            f"only has numbers {numbers}: YAML reads an unquoted N:M as a base-60 number "
            f"(2:4 is 124); quote the names: 'only=[\"2:4\",\"4:8\"]'")
    names = [run.get("name") for run in cfg.runs]
    if unknown := set(cfg.only) - set(names):
        raise ConfigError(f"only names unknown runs {sorted(unknown)}; runs are {names}")
    if repeated := {n for n in names if names.count(n) > 1}:
        raise ConfigError(f"run names must be unique, repeated: {sorted(map(str, repeated))}")
    for name, recipe in cfg.recipes.items():
        if not isinstance(recipe, DictConfig) or set(recipe) - set(RUN_DEFAULTS):
            raise ConfigError(f"recipe {name!r} must be a mapping with keys from "
                              f"{sorted(RUN_DEFAULTS)}, got {recipe!r}")
    specs = [_merge(cfg, run) for run in cfg.runs if not cfg.only or run.name in cfg.only]
    for spec in specs:
        _check(spec, names)
    return specs


def _merge(cfg: DictConfig, run: Any) -> DictConfig:
    """The run's recipe, then the run's own keys, over RUN_DEFAULTS with the sweep's
    ``epochs`` and ``baseline`` (resolved: a recipe's ``${distillation}`` is the sweep's)."""
    if not isinstance(run, DictConfig):
        raise ConfigError(f"every entry of runs must be a mapping, got {run!r}")
    name = run.get("name", "?")
    if missing := [k for k in NAMING_KEYS if not isinstance(run.get(k), str)]:
        raise ConfigError(f"run {name!r} must name its {', '.join(missing)} (strings)")
    if extra := set(run) - set(RUN_DEFAULTS) - set(NAMING_KEYS):
        raise ConfigError(f"run {name!r} has unknown keys {sorted(extra)}; a run takes "
                          f"{sorted([*NAMING_KEYS, *RUN_DEFAULTS])}")
    if run.recipe not in cfg.recipes:
        raise ConfigError(f"run {name!r}: unknown recipe {run.recipe!r}; recipes are "
                          f"{list(cfg.recipes)}")
    own = {k: v for k, v in OmegaConf.to_container(run, resolve=True).items() if k != "recipe"}
    defaults = {**RUN_DEFAULTS, "epochs": cfg.epochs, "baseline": cfg.baseline}
    recipe = OmegaConf.to_container(cfg.recipes[run.recipe], resolve=True)  # in cfg's scope
    return OmegaConf.merge(defaults, recipe, own, {"recipe": run.recipe})


def _check(spec: DictConfig, names: list[str]) -> None:
    """Every key of a merged run against its rule, then its distillation and callback
    settings by the classes that take them."""
    for key, rule in RUN_RULES.items():
        if not rule.accepts(spec[key]):
            raise ConfigError(f"run {spec.name!r}: {key} must be {rule.form}, got "
                              f"{spec[key]!r}")
    if spec.baseline is not None and spec.baseline not in names:
        raise ConfigError(f"run {spec.name!r}: baseline {spec.baseline!r} is not a run; runs "
                          f"are {names}")
    try:
        distill_settings(spec)
        if (kwargs := callback_kwargs(spec)) is not None:
            SparsityConfig.from_settings(kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"run {spec.name!r}: {error}") from error
    if spec.lr_schedule == "rewind" and spec.callback is None:
        raise ConfigError(f"run {spec.name!r}: lr_schedule rewind goes back to the peak at "
                          f"every mask update, but the run has no callback (no masks)")
    if spec.permute and spec.callback is None:
        raise ConfigError(f"run {spec.name!r}: permute searches channel permutations for a "
                          f"pattern, but the run has no callback")


def check_config(cfg: DictConfig) -> list[DictConfig]:
    """Every key, then every run to do (merged with its recipe); raises ConfigError naming
    the key, the bad value and the valid forms."""
    check_keys(cfg, RULES)
    try:
        DistillationLoss(**OmegaConf.to_container(cfg.distillation))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"distillation: {error}") from error
    if cfg.doc_stride >= cfg.max_length:
        raise ConfigError(f"doc_stride must be below max_length ({cfg.max_length}), got "
                          f"{cfg.doc_stride}")
    if cfg.baseline is not None and cfg.baseline not in [r.get("name") for r in cfg.runs]:
        raise ConfigError(f"baseline {cfg.baseline!r} is not a run's name")
    return resolve_runs(cfg)


def architecture(cfg: DictConfig, model_dir: Path) -> nn.Module:
    """The run's model with random weights, under the names ``SpanQA`` gives its weights (its
    ``bert`` attribute): what the callback selects from, at none of the loading cost.

    Raises:
        ConfigError: ``encoder_layers`` above the model's pretrained layers.
    """
    from transformers import BertConfig, BertForQuestionAnswering

    try:
        config = BertConfig.from_pretrained(str(model_dir))
    except OSError as error:  # a hub name the machine cannot reach, a broken folder
        raise ConfigError(f"model_dir {str(model_dir)!r}: {error}") from error
    if cfg.encoder_layers > config.num_hidden_layers:
        raise ConfigError(f"encoder_layers must be at most the model's {config.num_hidden_layers} "
                          f"pretrained layers (0: all of them), got {cfg.encoder_layers}")
    config.num_hidden_layers = cfg.encoder_layers or config.num_hidden_layers
    return nn.ModuleDict({"bert": BertForQuestionAnswering(config)})


def check_against_model(cfg: DictConfig, specs: list[DictConfig], model_dir: Path) -> None:
    """What only the model can say, before any training: ``encoder_layers`` within its
    pretrained layers, and each run's callback settings selecting from its weights (``allow``
    and ``deny`` regexes that match, patterns that fit the shapes), on :func:`architecture`."""
    model = architecture(cfg, model_dir)
    for spec in specs:
        if (kwargs := callback_kwargs(spec)) is None:
            continue
        try:
            SparsityEngine(copy.deepcopy(model), SparsityConfig.from_settings(kwargs))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"run {spec.name!r}: {error}") from error


def check_files(cfg: DictConfig) -> Path | None:
    """The model folder (None where replaying: no model needed), after checking that it and
    the data files exist (before anything is written or trained).

    Raises:
        ConfigError: a path that is not there, named by its key.
    """
    try:
        squad_data.squad_path(cfg.squad_file)
        if cfg.replay:
            return None
        model_dir = squad_data.model_dir(cfg.model_dir)
    except (FileNotFoundError, ImportError) as error:
        raise ConfigError(str(error)) from error
    local = model_dir.exists() or model_dir.is_absolute() or str(model_dir).startswith(".")
    if local and not (model_dir / "config.json").is_file():  # else a hub name
        raise ConfigError(f"model_dir {str(model_dir)!r} holds no config.json: give the folder "
                          f"of a saved BERT (save_pretrained's) or a hub name the machine can "
                          f"reach")
    if cfg.train_file and not Path(cfg.train_file).is_file():
        raise ConfigError(f"train_file {cfg.train_file!r} is not a file: the SQuAD v1.1 train "
                          f"set (train-v1.1.json)")
    return model_dir
