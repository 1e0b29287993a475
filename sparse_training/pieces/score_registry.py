"""The ``score`` setting: names and options of the training scores, parsed once.

A setting is a name (``"movement"``), a mapping of a name and the piece's options
(``{"name": "second-order", "block_size": 50}``: what a YAML file can say), or a piece
(``SecondOrderScore(damp=1e-3)``). :func:`parse_training_score` turns each into the piece,
:func:`score_setting` turns a piece back into the plainest setting that builds it (what a
checkpoint keeps and compares on resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sparse_training.pieces.second_order import SecondOrderScore
from sparse_training.pieces.spelling import did_you_mean
from sparse_training.pieces.training_scores import MovementScore, SoftMovementScore, TrainingScore

TRAINING_SCORES: dict[str, type] = {cls.name: cls for cls in (
    MovementScore, SoftMovementScore, SecondOrderScore)}


def parse_training_score(setting: Any) -> TrainingScore | None:
    """The training score a setting names, or None for a setting that names none (a
    plain string such as ``"magnitude"`` is the caller's to check).

    Raises:
        ValueError: a mapping without a known ``name``, or with options the piece does
            not take (naming them and the valid ones), or a bad option value.
    """
    if isinstance(setting, TrainingScore):
        return setting
    if isinstance(setting, str):
        cls = TRAINING_SCORES.get(setting)
        return None if cls is None else cls()
    if not isinstance(setting, Mapping):
        return None
    options = dict(setting)
    name = options.pop("name", None)
    cls = TRAINING_SCORES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"a score given as a mapping needs 'name' from "
                         f"{', '.join(map(repr, TRAINING_SCORES))}; "
                         f"{did_you_mean(name, TRAINING_SCORES)}got {setting!r}")
    valid = [f.name for f in dataclasses.fields(cls)]
    if unknown := sorted(set(options) - set(valid)):
        raise ValueError(f"score {name!r} takes the options {valid}, got {unknown}")
    if isinstance(options.get("betas"), list):  # YAML has no tuples
        options["betas"] = tuple(options["betas"])
    return cls(**options)


def score_setting(score: TrainingScore) -> str | dict[str, Any]:
    """The plainest setting of ``score``: its name when every option is the default, else
    ``{"name": ..., options that differ}``."""
    default = type(score)()
    changed = {f.name: getattr(score, f.name) for f in dataclasses.fields(score)
               if getattr(score, f.name) != getattr(default, f.name)}
    return {"name": score.name, **changed} if changed else score.name
