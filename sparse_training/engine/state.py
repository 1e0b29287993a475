"""The engine's checkpoint state: bit-packed masks, the settings they were made with, and
the updater's progress. A state is checked in full before anything is installed.

Layout (plain values and CPU tensors, so ``torch.save`` and Lightning carry it)::

    {"format": 1, "settings": SparsityConfig.as_dict(),
     "masks": {tensor name: {"shape": [...], "bits": uint8 tensor (pack_mask)}},
     "compressed": {layer weight name: {"pattern": "block:RxC" | "2:4" | "2:4:2d",
                                        "shape": [...], "bits": uint8 tensor}},
     "updater": ScheduledMasks.state_dict() and its subclasses' additions}

``"compressed"`` holds the compressed layers' masks (block grids, 2:4 masks): a resume
swaps layers with them (the callback, at setup), so the model's plain state_dict loads
exactly. States saved before it existed lack it and load as before.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparse_training.engine.protocol import LayerForm, Slot
from sparse_training.engine.slots import MaskedSlot
from sparse_training.kernels.bitpack import pack_mask, unpack_mask
from sparse_training.kernels.semi_structured.masks import check_mask
from sparse_training.pieces.masks import as_matrix, kept_count, pool_blocks
from sparse_training.pieces.patterns import Pattern
from sparse_training.pieces.schedules import parse_schedule

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

FORMAT = 1
# Settings that decide which tensors are masked and how: masks saved under other values
# cannot continue under these.
MASK_SETTINGS = ("pattern", "sparsity", "layer_types", "allow", "deny", "dense_ratio",
                 "overrides", "distribution", "regrow", "score", "compress")
# Settings whose resolved values the checkpoint carries: its values win on resume.
SCHEDULE_SETTINGS = ("schedule", "start", "end", "frequency", "regrow_end")
# Settings read at setup only, whose effect the checkpoint carries: compress="auto"'s
# measurements, which a resume replaces with the checkpoint's compressed layers.
SETUP_SETTINGS = ("auto_tokens",)


def pack_masks(slots: Sequence[MaskedSlot]) -> dict[str, dict[str, Any]]:
    """Every slot's mask of the whole tensor, bit-packed on the CPU (1 bit per weight); a
    sharded tensor's is gathered (a collective: every rank saves)."""
    masks = {}
    for slot in slots:
        mask = slot.full_mask()
        masks[slot.name] = {"shape": list(mask.shape), "bits": pack_mask(mask).cpu()}
    return masks


def pack_compressed(slots: Sequence[Slot]) -> dict[str, dict[str, Any]]:
    """Every compressed layer's mask (block grid or 2:4 mask), bit-packed on the CPU, with
    its pattern: ``{name: {"pattern", "shape", "bits"}}``."""
    return {slot.name: {"pattern": slot.form.pattern, "shape": list(slot.mask.shape),
                        "bits": pack_mask(slot.mask).cpu()} for slot in slots}


def saved_fraction(updater: Any) -> float | None:
    """The share of the final sparsity the saved masks hold: the schedule's at the last
    update, 0 before the first (nothing pruned), None if masks were set otherwise
    (``SparsityEngine.prune``).

    Raises:
        ValueError: an updater state without a readable schedule.
    """
    try:
        if updater["last_update"] is not None:
            return parse_schedule(*updater["schedule"]).fraction(updater["last_update"])
        return 0.0 if not updater["target"] else None
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"the checkpoint's updater state is malformed ({error!r}); it needs "
                         f"schedule, last_update and target") from None


def check_masks(saved: Any, slots: Sequence[MaskedSlot], fraction: float | None = None,
                pooled_sparsity: float | None = None,
                held: Collection[str] = ()) -> dict[str, Tensor]:
    """The saved masks as bool tensors keyed by tensor name, after checking every one
    against the selected tensors: shape, packing (padding bits zero) and structure
    (:func:`structure_problem`). With ``fraction`` (:func:`saved_fraction`) the counts are
    exact: each tensor's at ``plan.sparsity * fraction``, the pooled tensors' (global
    distribution, ``plan.sparsity`` None) together at ``pooled_sparsity * fraction``. The
    ``held`` masks, carried from an earlier run (``ScheduledMasks.carried``), are neither
    the schedule's nor, maybe, of the pattern: shape and packing only.

    Raises:
        ValueError: naming every missing, extra, misshapen, malformed or misstructured mask.
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
        if slot.name not in saved:
            continue
        mask = _unpack(f"mask {slot.name!r}", saved[slot.name], tuple(slot.param.shape),
                       problems)
        pooled = slot.plan.sparsity is None
        sparsity = None if fraction is None or pooled else slot.plan.sparsity * fraction
        if mask is not None and slot.name not in held and (problem := structure_problem(
                mask, slot.plan.pattern, sparsity, slot.plan.input_dim)):
            problems.append(f"mask {slot.name!r} {problem}")
        elif mask is not None:
            masks[slot.name] = mask.to(slot.param.device)
    pooled = [s for s in slots if s.plan.sparsity is None and s.name in masks]
    if pooled and fraction is not None and not problems and not any(
            s.name in held for s in pooled):
        pattern = pooled[0].plan.pattern
        blocks = [masks[s.name].sum() // (pattern.block_rows * pattern.block_cols)
                  for s in pooled]
        total = sum(s.plan.numel for s in pooled) // (pattern.block_rows * pattern.block_cols)
        kept, want = int(sum(blocks)), kept_count(total, pooled_sparsity * fraction)
        if kept != want:
            problems.append(f"the masks of the global distribution {[s.name for s in pooled]} "
                            f"keep {kept} of {total} blocks together; the schedule's sparsity "
                            f"keeps {want}")
    if problems:
        raise ValueError("the checkpoint's masks do not fit this model and selection: "
                         + "; ".join(problems))
    return masks


def check_compressed(saved: Any, forms: Mapping[str, LayerForm],
                     every: bool = True) -> dict[str, Tensor]:
    """The saved masks of compressed layers as bool tensors (on the CPU) keyed by the
    layers' weight names, after checking each against its :class:`LayerForm`: pattern,
    shape, packing, and exactly ``nnz`` blocks or 2:4 in every group. ``every``: each
    layer of ``forms`` must have a mask (else the checkpoint may hold fewer).

    Raises:
        ValueError: naming every missing, extra, misshapen, malformed or misstructured mask.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint compressed masks must be a dict, got "
                         f"{type(saved).__name__}")
    problems = []
    if every and (missing := [n for n in forms if n not in saved]):
        problems.append(f"no mask for compressed layers {missing}")
    if extra := [n for n in saved if n not in forms]:
        problems.append(f"masks for layers that are not compressed now {extra}")
    masks = {}
    for name, form in forms.items():
        entry = saved.get(name)
        if entry is None:
            continue
        pattern = entry.get("pattern") if isinstance(entry, dict) else None
        if pattern != form.pattern:
            problems.append(f"compressed mask {name!r} is of pattern {pattern!r}, the layer "
                            f"{form.pattern!r}")
        elif (mask := _unpack(f"compressed mask {name!r}", entry, form.shape, problems)
              ) is not None:
            if problem := _compressed_problem(mask, form):
                problems.append(f"compressed mask {name!r} {problem}")
            else:
                masks[name] = mask
    if problems:
        raise ValueError("the checkpoint's compressed layers do not fit this model and "
                         "settings: " + "; ".join(problems))
    return masks


def _unpack(what: str, entry: Any, shape: tuple[int, ...], problems: list[str]
            ) -> Tensor | None:
    """The bool mask of a packed ``entry`` of ``shape``, or None with its problem added."""
    size = math.prod(shape)
    saved_shape = entry.get("shape") if isinstance(entry, dict) else None
    bits = entry.get("bits") if isinstance(entry, dict) else None
    if saved_shape != list(shape):
        problems.append(f"{what} has shape {saved_shape}, the tensor {list(shape)}")
    elif not (isinstance(bits, Tensor) and bits.dtype == torch.uint8 and bits.dim() == 1
              and bits.numel() == math.ceil(size / 8)):
        problems.append(f"{what} is not {math.ceil(size / 8)} packed bytes (uint8)")
    elif (pad := -size % 8) and int(bits[-1]) >> (8 - pad):
        problems.append(f"{what} has nonzero padding bits after its {size} entries "
                        f"(corrupted)")
    else:
        return unpack_mask(bits.cpu(), shape)
    return None


def structure_problem(mask: Tensor, pattern: Pattern, sparsity: float | None,
                      input_dim: int = 1) -> str | None:
    """Why ``mask`` (its 2-D view, input dimension ``input_dim``) does not have ``pattern``'s
    structure, or None: constant on every block;
    N:M: the same count in every group (along rows and, transposable, columns), the count
    ``sparsity`` gives if known; other patterns: the ``kept_count`` of blocks ``sparsity``
    gives, if known."""
    r, c = pattern.block_rows, pattern.block_cols
    counts = pool_blocks(as_matrix(mask, input_dim).to(torch.int32), r, c)
    mixed = ((counts > 0) & (counts < r * c)).nonzero()
    if len(mixed):
        i, j = mixed[0].tolist()
        return (f"is not constant on {r}x{c} block ({i}, {j}): {int(counts[i, j])} of "
                f"{r * c} entries kept (corrupted)")
    kept = counts > 0
    if not pattern.is_nm:
        want = None if sparsity is None else kept_count(kept.numel(), sparsity)
        if want is not None and int(kept.sum()) != want:
            return (f"keeps {int(kept.sum())} of {kept.numel()} blocks; sparsity "
                    f"{sparsity:.4g} keeps {want} (corrupted)")
        return None
    m = pattern.m
    want = None if sparsity is None else pattern.kept_per_group(sparsity)
    for direction, view in [("row", kept)] + ([("column", kept.T)] if pattern.transposable
                                               else []):
        groups = view.reshape(view.shape[0], -1, m).sum(-1)
        expected = int(groups.flatten()[0]) if want is None else want
        if len(bad := (groups != expected).nonzero()):
            i, g = bad[0].tolist()
            return (f"is not {expected}:{m}: {direction} {i}, blocks {g * m}:{g * m + m} keep "
                    f"{int(groups[i, g])} (corrupted)")
    return None


def _compressed_problem(mask: Tensor, form: LayerForm) -> str | None:
    """Why a compressed layer's mask lacks its structure: exactly ``nnz`` blocks, or 2:4."""
    if form.kept is not None:
        kept = int(mask.sum())
        return None if kept == form.kept else (
            f"keeps {kept} blocks; the layer keeps exactly nnz = {form.kept} (corrupted)")
    try:
        check_mask(mask, form.shape, form.pattern.endswith(":2d"), "the saved mask")
    except ValueError as error:
        return f"is not {form.pattern}: {error} (corrupted)"
    return None


def _changes(saved: dict[str, Any], current: dict[str, Any], keys: Sequence[str]) -> list[str]:
    return [f"{k}={saved.get(k)!r} in the checkpoint, {current[k]!r} now" for k in keys
            if not _same(k, saved.get(k), current[k])]


def _same(key: str, saved: Any, current: Any) -> bool:
    """Whether a setting's saved and current values make the same masks; ``compress`` True
    and ``"auto"`` do on resume (the checkpoint's compressed layers are kept either way)."""
    if key == "compress" and {type(saved), type(current)} <= {bool, str}:
        return saved == current or {saved, current} == {True, "auto"}
    return saved == current


def check_mask_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise a ValueError naming each setting of :data:`MASK_SETTINGS` that changed: the
    masks (and which layers are compressed) belong to the saved values."""
    if changed := _changes(saved, current, MASK_SETTINGS):
        raise ValueError(
            "cannot resume: the checkpoint's masks were made with other settings: "
            + "; ".join(changed) + ". Resume with the checkpoint's settings, or start a new "
            "fit from its weights (load the state dict, no ckpt_path) to change them")


def check_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Compare the checkpoint's settings with the current ones.

    Raises:
        ValueError: a setting of :data:`MASK_SETTINGS` changed (:func:`check_mask_settings`).

    Warns:
        UserWarning: a setting of :data:`SCHEDULE_SETTINGS` changed (the checkpoint's
            resolved schedule is kept), or another setting changed (the new value applies).
    """
    check_mask_settings(saved, current)
    if changed := _changes(saved, current, SCHEDULE_SETTINGS):
        warnings.warn("resuming keeps the checkpoint's schedule; ignored: " + "; ".join(changed)
                      + " (a new fit without ckpt_path runs the new schedule)", stacklevel=3)
    other = [k for k in current if k not in MASK_SETTINGS + SCHEDULE_SETTINGS + SETUP_SETTINGS]
    if changed := _changes(saved, current, other):
        warnings.warn("resuming with changed settings, which apply from now on: "
                      + "; ".join(changed), stacklevel=3)


def checked_masks(state: Any, config: SparsityConfig, slots: Sequence[MaskedSlot],
                  compressed: Sequence[Slot]
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """An engine state's masks and compressed layers' masks for these slots, all checked
    (layout, settings, every mask, and that no compressed mask drops a nonzero weight of
    its layer as loaded: :meth:`Slot.restore_problem`) before anything is
    installed; a state saved before compressed masks were kept gives none of those.

    Raises:
        ValueError: the first problem found, naming it (the functions above).
    """
    check_state(state)
    check_settings(state["settings"], config.as_dict())
    fraction, held = saved_fraction(state["updater"]), state["updater"].get("held", [])
    if not isinstance(held, list) or not all(isinstance(name, str) for name in held):
        raise ValueError(f"the checkpoint's updater state is malformed: held must be a list "
                         f"of tensor names, got {held!r}")
    masks = check_masks(state["masks"], slots, fraction, config.sparsity, held)
    if "compressed" not in state:
        return masks, {}
    saved = check_compressed(state["compressed"], {s.name: s.form for s in compressed})
    saved = {s.name: saved[s.name].to(s.mask.device) for s in compressed if s.name in saved}
    if problems := [p for s in compressed if (p := s.restore_problem(saved[s.name]))]:
        raise ValueError("; ".join(problems))
    return masks, saved


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
