"""The checkpoint side of a resume: this callback's state among a checkpoint's, and a
checkpoint that cannot be read, named.

Nothing is read ahead of Lightning: the compressed layers are swapped at ``setup`` as in a
fresh fit, Lightning loads the checkpoint's (dense-form) weights into them, each layer
takes the blocks its loaded weight holds, and the callback's state then sets the exact
masks and is checked against the settings and the plan, before any training step.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparse_training.engine.state import check_settings

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig

# what torch.load raises for a file cut short or empty (zip reader, legacy pickle, seek)
_UNREADABLE = (pickle.UnpicklingError, EOFError, OSError)
_UNREADABLE_TEXT = ("PytorchStreamReader failed", "failed finding central directory",
                    "file not found: archive", "Ran out of input")


def unreadable_checkpoint(path: str | Path | None, error: BaseException) -> bool:
    """Whether ``error``, raised in a fit that resumes ``path``, is ``torch.load`` failing on
    the file (truncated, empty, half-written); then a note naming the file and what to do
    is added to it."""
    if path is None or isinstance(error, FileNotFoundError) or not (
            isinstance(error, _UNREADABLE) or (
            isinstance(error, RuntimeError) and any(t in str(error) for t in _UNREADABLE_TEXT))):
        return False
    error.add_note(f"SparsityCallback: the checkpoint {path} cannot be read; it is likely "
                   f"truncated or half-written (a save cut short by a crash, a full disk or a "
                   f"copy still running): resume from another checkpoint")
    return True


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
