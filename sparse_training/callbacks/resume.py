"""A checkpoint's callback states, read at ``setup`` before Lightning restores anything.

Lightning restores the model after the callbacks' ``setup``, and compressed layers are
swapped in at ``setup``: :func:`resume_path` finds the checkpoint the fit resumes and
:func:`read_callback_states` reads its callback states first, so the swap uses the
checkpoint's masks (:func:`checkpoint_compressed`) and its settings are checked before any
change.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.utilities.cloud_io import _load as pl_load
from lightning_fabric.utilities.cloud_io import get_filesystem
from lightning_fabric.utilities.load import _METADATA_FILENAME
from pytorch_lightning.utilities import rank_zero_warn

from sparse_training.engine.state import check_mask_settings, check_settings, check_state

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

_ZIP_MAGIC = b"PK\x03\x04"  # what torch.save writes first (the format mmap reads)


def resume_path(trainer: object) -> str | Path | None:
    """The checkpoint this fit resumes from, or None, during ``Trainer.fit``'s setup.

    Lightning 2 resolves ``fit(ckpt_path=...)`` (``"last"``, a path, one set as
    ``trainer.ckpt_path``) into the ``ckpt_path`` argument of ``Trainer._run``, which calls
    the callbacks' ``setup``, and records it as ``trainer.ckpt_path`` only when it restores,
    after setup (the attribute may hold an earlier fit's path until then). So the path is
    read from that call's frame; a Lightning without it gives None (the masks are then
    installed when Lightning restores the state).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")
        frame = frame.f_back
    return None


def read_callback_states(path: str | Path) -> dict[str, Any] | None:
    """``checkpoint["callbacks"]`` of a Lightning checkpoint (``{}`` without it): a file
    (memory-mapped on a local disk, tensors on the CPU) or the ``meta.pt`` of a sharded
    checkpoint's directory (``ModelParallelStrategy``), loaded with ``weights_only=True``.

    Returns:
        None where the states cannot be read ahead of Lightning: a URL, a directory of
        another layout (DeepSpeed's), or a file holding objects that only
        ``weights_only=False`` loads.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: a file that cannot be read, naming it (truncated or half-written).
    """
    text = str(path)
    if text.startswith(("http://", "https://")):
        return None
    fs = get_filesystem(text)
    if not fs.exists(text):
        raise FileNotFoundError(f"Checkpoint file not found: {text}")
    if fs.isdir(text):
        text = f"{text.rstrip('/')}/{_METADATA_FILENAME}"
        if not fs.isfile(text):
            return None
    try:
        checkpoint = _load(text, local=isinstance(fs, LocalFileSystem))
    except pickle.UnpicklingError as error:
        if str(error).startswith("Weights only load failed"):
            return None
        raise _unreadable(text, error) from error
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise _unreadable(text, error) from error
    states = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    return states if isinstance(states, dict) else {}


def _load(path: str, local: bool) -> Any:
    if not local:
        return pl_load(path, map_location="cpu", weights_only=True)
    with open(path, "rb") as file:
        zipped = file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    return torch.load(path, mmap=zipped, map_location="cpu", weights_only=True)


def _unreadable(path: str, error: BaseException) -> ValueError:
    return ValueError(f"cannot resume: the checkpoint {path} cannot be read "
                      f"({type(error).__name__}: {str(error)[:200]}); it is likely truncated "
                      f"or half-written (a save cut short by a crash, a full disk or a copy "
                      f"still running): resume from another checkpoint")


def checkpoint_compressed(trainer: object, claims: tuple[str, Sequence[str]],
                          config: SparsityConfig) -> dict[str, Any] | None:
    """The compressed masks of the checkpoint a SparsityCallback's fit resumes (``{}``: it
    holds no SparsityCallback state, so no compressed layers), after checking its state's
    layout and mask settings; None: not resuming, or a state that has none (saved before
    they were kept) or cannot be read ahead (:func:`read_callback_states`; then the masks
    are installed when Lightning restores the state). ``claims``: as :func:`own_state`.

    Raises:
        ValueError: an unreadable checkpoint, a state of another format, changed mask
            settings (``compress`` included), or a state filed under another selection.
    """
    path = resume_path(trainer)
    if path is None:
        return None
    states = read_callback_states(path)
    if states is None:
        rank_zero_warn(f"SparsityCallback: cannot read the callback state of {path} before "
                       f"Lightning restores it; compressed layers take its masks then")
        return None
    state = own_state(states, claims, config)
    if state is None and config.compress is True:
        raise ValueError(f"SparsityCallback: compress=True resumes the compressed layers of "
                         f"a checkpoint, but {path} holds no SparsityCallback state (a "
                         f"dense run's?): load its weights (load_from_checkpoint) and start "
                         f"a new fit to compress them, or resume with compress='auto' or "
                         f"False (masked-dense)")
    if state is None:
        return {}
    check_state(state)
    check_mask_settings(state["settings"], config.as_dict())
    return state.get("compressed")


def own_state(states: Mapping[str, Any], claims: tuple[str, Sequence[str]],
              config: SparsityConfig) -> dict[str, Any] | None:
    """A SparsityCallback's state among a checkpoint's callback states, or None.

    Args:
        claims: the callback's state key, and every SparsityCallback's of the Trainer.

    Raises:
        ValueError: the only SparsityCallback state no callback claims was saved with
            other mask settings (naming them), or with another selection.
    """
    key, claimed = claims
    if key in states:
        return states[key]
    unclaimed = [k for k in states if str(k).startswith("SparsityCallback")
                 and k not in claimed]
    if len(unclaimed) == 1:
        check_settings(states[unclaimed[0]].get("settings", {}), config.as_dict())
    if unclaimed:
        raise ValueError(f"cannot resume: the checkpoint's sparsity state is filed under "
                         f"{unclaimed}, made with another selection than this callback's "
                         f"{key!r}")
    return None
