"""The hint beside an unknown name: the valid name a setting most likely meant.

One signature: ``did_you_mean(value, valid) -> str``, ``"did you mean 'gmp'? "`` or ``""``,
written just before the message's list of valid names. A name in another case or with
``_``/space for ``-`` ("GMP", "soft_movement", "SR-STE") names its valid spelling;
otherwise the closest valid name by :mod:`difflib`, if any. A valid value that is not a
string (True, None) is matched by its name ("true": True).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def _folded(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def did_you_mean(value: object, valid: Iterable[object]) -> str:
    """``"did you mean 'x'? "`` for the valid string ``value`` most likely meant, else ``""``.

    Example:
        >>> did_you_mean("GMP", ["oneshot", "gmp", "linear"])
        "did you mean 'gmp'? "
    """
    if not isinstance(value, str):
        return ""
    names = {_folded(str(v)): v for v in valid}
    near = difflib.get_close_matches(_folded(value), names, n=1)
    return f"did you mean {names[near[0]]!r}? " if near else ""
