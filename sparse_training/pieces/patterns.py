"""Sparsity patterns: one grammar, one parser, one dataclass.

Every pattern is a block shape plus an optional N:M rule over blocks, read on the
weight's 2-D view ``(rows, in_features)`` (see :func:`sparse_training.pieces.masks.as_matrix`):

==========================  =====================================================
spec                        meaning
==========================  =====================================================
``"unstructured"``          any weight may go: blocks of 1x1, magnitude top-k
``"N:M"``                   N weights KEPT in every M consecutive weights along the
                            input dimension (NVIDIA's convention: ``2:4`` is 50%
                            sparse; some libraries write the pruned count first)
``"N:M:2d"``                transposable N:M: every MxM tile keeps N per row and N
                            per column, so the transposed weight is N:M too
``"block:RxC"``             whole blocks of R rows by C columns kept or pruned (any
                            weight shape: the last block row and column may overhang)
``"vector:V"``              V consecutive rows of one column (``block:Vx1``)
``"block:RxC+N:M"``         N of every M consecutive blocks along the input
                            dimension kept (nmSPARSE's block-wise N:M)
``"vector:V+N:M"``          the same with ``Vx1`` blocks (vector-wise N:M)
``"head"``, ``"head:D"``    whole attention heads: the rows of the query, key and
                            value projections and the columns of the output
                            projection that serve one head, kept or pruned together
                            (head size D, or the model's own; under grouped-query
                            attention a unit is one key/value head and its queries)
``"neuron"``                whole FFN neurons: a row of the up (and gate) projection
                            and the matching column of the down projection
==========================  =====================================================

Heads and neurons are *unit* patterns: one unit spans several tensors, so the engine finds
the units of the model (:mod:`sparse_training.engine.structure`) and gives each member
tensor the block pattern of its share (``block:32x384`` for one head's query rows in a
384-wide BERT) tied to the other members (:mod:`sparse_training.pieces.units`).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, fields

PATTERN_FORMS = (
    '"unstructured"',
    '"N:M" (e.g. "2:4")',
    '"N:M:2d" (transposable, e.g. "2:4:2d")',
    '"block:RxC" (e.g. "block:4x4")',
    '"vector:V" (e.g. "vector:8")',
    '"block:RxC+N:M"',
    '"vector:V+N:M"',
    '"head" or "head:D" (whole attention heads of size D)',
    '"neuron" (whole FFN neurons)',
)
UNITS = ("head", "neuron")

MAX_TRANSPOSABLE_M = 5  # exact search over every N-regular MxM tile: at most 2040 tiles

_NM = r"(?P<n>\d+):(?P<m>\d+)"
_GRAMMAR = (
    re.compile(r"unstructured"),  # ASCII digits only: "２:４" is not "2:4"
    re.compile(_NM + r"(?P<transposable>:2d)?", re.ASCII),
    re.compile(r"block:(?P<rows>\d+)x(?P<cols>\d+)(\+" + _NM + r")?", re.ASCII),
    re.compile(r"vector:(?P<rows>\d+)(\+" + _NM + r")?", re.ASCII),
    re.compile(r"(?P<unit>head)(:(?P<unit_size>\d+))?", re.ASCII),
    re.compile(r"(?P<unit>neuron)"),
)


@dataclass(frozen=True)
class Pattern:
    """A parsed sparsity pattern.

    Attributes:
        block_rows: rows of one block (1 for element-wise patterns).
        block_cols: columns (input features) of one block.
        n: blocks kept in every group of ``m`` along the input dimension, or None.
        m: group size along the input dimension, or None for magnitude top-k.
        transposable: N:M along rows and columns of every MxM tile.
        spec: the string this pattern was parsed from.
        unit: ``"head"`` or ``"neuron"`` for unit patterns (several tensors per unit; the
            block fields are then resolved per tensor by selection), else None.
        unit_size: the head size a ``"head:D"`` pattern gives, or None (the model's).

    Raises:
        ValueError: fields no pattern string gives: a block dimension below 1, N:M not
            ints ``1 <= N <= M`` (or both None), transposable without N:M or with
            M > MAX_TRANSPOSABLE_M, a head size below 1.
    """

    block_rows: int = 1
    block_cols: int = 1
    n: int | None = None
    m: int | None = None
    transposable: bool = False
    spec: str = "unstructured"
    unit: str | None = None
    unit_size: int | None = None

    def __post_init__(self) -> None:
        if problem := self._field_problem():
            # a parsed string names itself; a Pattern built by hand is named by its fields
            given = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name != "spec" and getattr(self, f.name) != f.default}
            built = ", ".join(f"{name}={value!r}" for name, value in given.items())
            name = repr(self.spec) if self.spec != "unstructured" else f"Pattern({built})"
            raise ValueError(f"pattern {name}: {problem}")

    def _field_problem(self) -> str | None:
        """What no pattern string could give in these fields, or None."""
        if not (_is_int(self.block_rows) and _is_int(self.block_cols)
                and self.block_rows >= 1 and self.block_cols >= 1):
            return f"block dimensions must be >= 1, got {self.block_rows!r}x{self.block_cols!r}"
        if (self.n, self.m) != (None, None) and not (
                _is_int(self.n) and _is_int(self.m) and 1 <= self.n <= self.m):
            return f"N must satisfy 1 <= N <= M, got N={self.n!r}, M={self.m!r}"
        if self.transposable and self.m is None:
            return "transposable needs an N:M pattern (n and m), got none"
        if self.transposable and self.m > MAX_TRANSPOSABLE_M:
            return (f"transposable N:M supports M <= {MAX_TRANSPOSABLE_M} (exact search over "
                    f"all N-regular tiles), got M={self.m!r}")
        if self.unit_size is not None and not (_is_int(self.unit_size) and self.unit_size >= 1):
            return f"the head size must be >= 1, got {self.unit_size!r}"
        return None

    @property
    def is_unit(self) -> bool:
        """Whether this is a unit pattern (heads, neurons): one unit spans several tensors."""
        return self.unit is not None

    @property
    def is_2_4(self) -> bool:
        """Whether this is 2:4 of single entries (``2:4`` or ``2:4:2d``): what the sparse
        tensor cores take."""
        return (self.n, self.m, self.block_rows, self.block_cols) == (2, 4, 1, 1)

    @property
    def compression_problem(self) -> str | None:
        """Why no compressed layer takes patterns of this kind, or None: blocks
        (``BlockSparseLinear``, whose block sizes it checks itself), 2:4
        (``SemiStructuredLinear``) and heads and neurons (``SlimLinear``, per group of
        units) compress."""
        if self.is_unit:
            return None
        if self.is_nm and not self.is_2_4:
            return (f"pattern {self.spec!r}: of the N:M patterns only '2:4' and '2:4:2d' "
                    f"compress (the sparse tensor cores)")
        if not self.is_nm and self.block_rows * self.block_cols == 1:
            return f"pattern {self.spec!r} is neither a block pattern nor 2:4"
        return None

    @property
    def is_nm(self) -> bool:
        """Whether the pattern fixes the kept count per group (N:M over blocks)."""
        return self.m is not None

    @property
    def nm_sparsity(self) -> float:
        """The sparsity an N:M pattern implies: 1 - N/M."""
        if self.m is None or self.n is None:
            raise ValueError(f"pattern {self.spec!r} is not N:M")
        return 1.0 - self.n / self.m

    def kept_per_group(self, sparsity: float) -> int:
        """Blocks kept per group of M at ``sparsity``: round(M(1 - s)), never below N.

        A gradual schedule ramps an N:M pattern through exact N':M stages, for example
        8:8 -> 6:8 -> 4:8 -> 2:8 for ``2:8``.
        """
        if self.m is None or self.n is None:
            raise ValueError(f"pattern {self.spec!r} is not N:M")
        return min(self.m, max(self.n, int(self.m * (1.0 - sparsity) + 0.5)))

    def shape_error(self, rows: int, cols: int) -> str | None:
        """Why a ``(rows, cols)`` weight view cannot take this pattern, or None.

        Block patterns without N:M take any shape: the last block row and column may hang
        over the edge (a clipped block is kept or pruned whole, as in ``BlockSparseLinear``).
        N:M patterns need whole groups: rows a multiple of the block's rows (and of M when
        transposable), input features a multiple of M x block columns.
        """
        if not self.is_nm:
            return None
        problems = []
        if rows % self.block_rows:
            problems.append(f"{rows} rows are not a multiple of the block's {self.block_rows}")
        group_cols = self.block_cols * self.m
        if cols % group_cols:
            what = "M x block columns" if self.block_cols > 1 else "M"
            problems.append(f"{cols} input features are not a multiple of {what} = {group_cols}")
        if self.transposable and rows % self.m:
            problems.append(f"{rows} rows are not a multiple of M = {self.m} (transposable tiles)")
        return "; ".join(problems) or None


def parse_pattern(spec: str | Pattern) -> Pattern:
    """Parse a pattern string (see the module docstring) into a :class:`Pattern`.

    Raises:
        ValueError: for an unknown form, or fields :class:`Pattern` refuses (N < 1, N > M,
            a block dimension below 1, a transposable pattern with M > MAX_TRANSPOSABLE_M).

    Example:
        >>> parse_pattern("2:4")
        Pattern(block_rows=1, block_cols=1, n=2, m=4, transposable=False, spec='2:4')
    """
    if isinstance(spec, Pattern):
        return _checked(spec)
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool):
        n, m = divmod(int(spec), 60)
        raise ValueError(f"pattern must be a string, got the number {spec}" + (
            f": YAML reads an unquoted {n}:{m} as the base-60 number {spec}; quote it: "
            f"pattern: \"{n}:{m}\"" if 1 <= n <= m else
            f"; valid forms: {', '.join(PATTERN_FORMS)}"))
    if not isinstance(spec, str):
        sparsity = isinstance(spec, numbers.Real) and not isinstance(spec, bool) and 0 < spec < 1
        raise ValueError(f"pattern must be a string, got {spec!r} of type "
                         f"{type(spec).__name__}" + (
                             f" (a sparsity? give it as sparsity={spec!r} beside a pattern, e.g. "
                             f"SparsityCallback('unstructured', sparsity={spec!r}))"
                             if sparsity else "") + f"; valid forms: {', '.join(PATTERN_FORMS)}")
    text = spec.strip().lower()
    match = next((m for g in _GRAMMAR if (m := g.fullmatch(text))), None)
    if match is None:
        raise ValueError(f"unknown pattern {spec!r}; {_meant(text)}valid forms: "
                         f"{', '.join(PATTERN_FORMS)}")
    fields = {k: v for k, v in match.groupdict().items() if v is not None}
    n, m = (int(fields["n"]), int(fields["m"])) if "n" in fields else (None, None)
    unit_size = int(fields["unit_size"]) if "unit_size" in fields else None
    return Pattern(int(fields.get("rows", 1)), int(fields.get("cols", 1)), n, m,
                   "transposable" in fields, text, fields.get("unit"), unit_size)


# near misses of the grammar (lower case), each rewritten to the form it likely meant
_NEAR_MISSES = (
    (r"\s+", ""),  # "2 :4", "block: 4x4"
    (r"^(\d+)(?:/|of|in|-|_)(\d+)", r"\1:\2"),  # "2/4", "2of4", "2-4"
    (r"^(\d+)[x*](\d+)$", r"block:\1x\2"),  # "1x4", "32*32"
    (r"^block:(\d+)$", r"block:\1x\1"),  # "block:32"
    (r"^(block|vector|head)s?[-_:]?(?=\d)", r"\1:"),  # "block32x32", "blocks:4x4"
    (r"^(head|neuron)s$", r"\1"),  # "heads", "neurons"
)


def _meant(text: str) -> str:
    """``"did you mean 'X'? "`` for a near miss of the grammar (:data:`_NEAR_MISSES`,
    applied in turn), or ``""``."""
    for regex, form in _NEAR_MISSES:
        text = re.sub(regex, form, text)
        if any(g.fullmatch(text) for g in _GRAMMAR):
            return f"did you mean {text!r}? "
    return ""


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked(pattern: Pattern) -> Pattern:
    """``pattern`` if it is what its own ``spec`` parses to (a ``Pattern`` built by hand
    gets the string's checks, and its spec, which checkpoints keep, says what it prunes).

    Raises:
        ValueError: a spec that does not parse, or parses to another pattern.
    """
    try:
        parsed = parse_pattern(pattern.spec)
    except ValueError as error:
        raise ValueError(f"{pattern!r} is not a valid pattern: {error}") from error
    if parsed != pattern:
        raise ValueError(f"{pattern!r} is not the pattern its spec {pattern.spec!r} names "
                         f"({parsed!r}): build patterns with parse_pattern(spec)")
    return pattern
