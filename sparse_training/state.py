"""The engine's checkpoint state: bit-packed masks, the settings they were made with, and
the updater's progress. A state is checked in full before anything is installed.

Layout (plain values and CPU tensors, so ``torch.save`` and Lightning carry it)::

    {"format": 1, "settings": SparsityConfig.as_dict(),
     "masks": {tensor name: {"shape": [...], "bits": uint8 tensor (pack_mask)}},
     "updater": ScheduledMasks.state_dict() and its subclasses' additions}
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sparse_training.kernels.bitpack import pack_mask, unpack_mask
from sparse_training.slots import MaskedSlot

FORMAT = 1
# Settings that decide which tensors are masked and how: masks saved under other values
# cannot continue under these.
MASK_SETTINGS = ("pattern", "sparsity", "layer_types", "allow", "deny", "dense_ratio",
                 "overrides", "distribution", "regrow", "score", "compress")
# Settings whose resolved values the checkpoint carries: its values win on resume.
SCHEDULE_SETTINGS = ("schedule", "start", "end", "frequency", "regrow_end")


def pack_masks(slots: Sequence[MaskedSlot]) -> dict[str, dict[str, Any]]:
    """Every slot's mask of the whole tensor, bit-packed on the CPU (1 bit per weight); a
    sharded tensor's is gathered (a collective: every rank saves)."""
    masks = {}
    for slot in slots:
        mask = slot.full_mask()
        masks[slot.name] = {"shape": list(mask.shape), "bits": pack_mask(mask).cpu()}
    return masks


def check_masks(saved: Any, slots: Sequence[MaskedSlot]) -> dict[str, Tensor]:
    """The saved masks as bool tensors keyed by tensor name, after checking every one
    against the selected tensors.

    Raises:
        ValueError: naming every missing, extra, misshapen or malformed mask.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint masks must be a dict, got {type(saved).__name__}")
    names = [s.name for s in slots]
    problems = []
    if missing := [n for n in names if n not in saved]:
        problems.append(f"no mask for selected tensors {missing}")
    if extra := [n for n in saved if n not in names]:
        problems.append(f"masks for tensors that are not selected now {extra}")
    masks = {}
    for slot in slots:
        entry = saved.get(slot.name)
        if entry is None:
            continue
        shape, bits = entry.get("shape"), entry.get("bits")
        expected = list(slot.param.shape)
        if shape != expected:
            problems.append(f"mask {slot.name!r} has shape {shape}, the tensor {expected}")
        elif not (isinstance(bits, Tensor) and bits.dtype == torch.uint8 and bits.dim() == 1
                  and bits.numel() == math.ceil(math.prod(expected) / 8)):
            problems.append(f"mask {slot.name!r} is not {math.ceil(math.prod(expected) / 8)} "
                            f"packed bytes (uint8)")
        else:
            masks[slot.name] = unpack_mask(bits.to(slot.param.device), slot.param.shape)
    if problems:
        raise ValueError("the checkpoint's masks do not fit this model and selection: "
                         + "; ".join(problems))
    return masks


def _changes(saved: dict[str, Any], current: dict[str, Any], keys: Sequence[str]) -> list[str]:
    return [f"{k}={saved.get(k)!r} in the checkpoint, {current[k]!r} now" for k in keys
            if saved.get(k) != current[k]]


def check_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Compare the checkpoint's settings with the current ones.

    Raises:
        ValueError: a setting of :data:`MASK_SETTINGS` changed: the masks belong to the
            saved value.

    Warns:
        UserWarning: a setting of :data:`SCHEDULE_SETTINGS` changed (the checkpoint's
            resolved schedule is kept), or another setting changed (the new value applies).
    """
    if changed := _changes(saved, current, MASK_SETTINGS):
        raise ValueError(
            "cannot resume: the checkpoint's masks were made with other settings: "
            + "; ".join(changed) + ". Resume with the checkpoint's settings, or start a new "
            "fit from its weights (load the state dict, no ckpt_path) to change them")
    if changed := _changes(saved, current, SCHEDULE_SETTINGS):
        warnings.warn("resuming keeps the checkpoint's schedule; ignored: " + "; ".join(changed)
                      + " (a new fit without ckpt_path runs the new schedule)", stacklevel=3)
    other = [k for k in current if k not in MASK_SETTINGS + SCHEDULE_SETTINGS]
    if changed := _changes(saved, current, other):
        warnings.warn("resuming with changed settings, which apply from now on: "
                      + "; ".join(changed), stacklevel=3)


def check_state(state: Any) -> None:
    """The state's outer layout.

    Raises:
        ValueError: not a state of this format.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT or not {
            "settings", "masks", "updater"} <= set(state):
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a sparse_training engine state of format {FORMAT} (got "
                         f"{got!r}); it needs the keys format, settings, masks, updater")
