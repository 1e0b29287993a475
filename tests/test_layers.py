"""The package's layers: every import of ``sparse_training`` runs down the rank order that
``sparse_training/__init__.py`` draws, and no modules import each other in a circle.

Every import counts: module level, inside functions, under ``TYPE_CHECKING``. A module may
import modules of a lower rank and of its own folder; a folder's modules import each other
without a circle. The graph is read from the source with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sparse_training"

# the folders (and single modules) of the package, lowest first; one rank may hold several
# folders, which then import nothing of each other
RANKS: tuple[tuple[str, ...], ...] = (
    ("kernels",),
    ("pieces",),
    ("config",),
    ("engine",),
    ("layers", "permutations"),
    ("callbacks",),
    ("",),  # sparse_training/__init__.py: the public API
)
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    """The folder (or top-level module) ``module`` belongs to: its rank's entry."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(module: str) -> int:
    unit = _unit(module)
    return next(i for i, units in enumerate(RANKS) if unit in units)


def _imports(module: str) -> list[tuple[int, str]]:
    """``(line, imported name)`` of every import in ``module``; names of the package are
    resolved to the module they load (``from pkg import mod`` -> ``pkg.mod``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if full in MODULES else base))
    return found


def _package_edges() -> dict[str, list[tuple[int, str]]]:
    return {m: [(line, name) for line, name in _imports(m)
                if name.split(".")[0] == "sparse_training" and name != m]
            for m in MODULES}


def test_every_module_has_a_rank():
    units = {u for units in RANKS for u in units}
    assert {_unit(m) for m in MODULES} <= units, "a new folder: give it a rank in RANKS"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_ranks(module):
    bad = []
    for line, name in _package_edges()[module]:
        if name not in MODULES:
            bad.append(f"{module}:{line} imports {name}, which is not a module of the package")
        elif _unit(name) != _unit(module) and _rank(name) >= _rank(module):
            bad.append(f"{module}:{line} imports {name} ({_unit(name) or 'the package'}, rank "
                       f"{_rank(name)}), not below {_unit(module) or 'the package'} (rank "
                       f"{_rank(module)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _unit(m) != "callbacks"))
def test_only_the_callbacks_import_lightning(module):
    lightning = [f"{module}:{line} imports {name}" for line, name in _imports(module)
                 if name.split(".")[0] in LIGHTNING]
    assert not lightning, "\n".join(lightning)


def test_no_import_circles():
    edges = {m: sorted({n for _, n in found if n in MODULES})
             for m, found in _package_edges().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = 2
        return None

    for module in edges:
        if module not in state and (circle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """The walk sees function-local and TYPE_CHECKING imports (a test that can fail)."""
    engine = tmp_path / "sparse_training" / "engine"
    engine.mkdir(parents=True)
    (engine / "a.py").write_text("def f():\n    from sparse_training.layers import b\n")
    (engine / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from sparse_training.engine import d\n")
    (engine / "d.py").write_text("import sparse_training.engine.c\n")
    layers = tmp_path / "sparse_training" / "layers"
    layers.mkdir()
    (layers / "b.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "sparse_training")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {
        _module_name(p): p for p in sorted((tmp_path / "sparse_training").rglob("*.py"))})
    with pytest.raises(AssertionError, match="engine.a:2 imports sparse_training.layers.b"):
        test_imports_run_down_the_ranks("sparse_training.engine.a")
    with pytest.raises(pytest.fail.Exception, match="engine.c -> .*engine.d -> .*engine.c"):
        test_no_import_circles()


PUBLIC = {
    "sparse_training": ["BlockSparseLinear", "Pattern", "SemiStructuredLinear",
                        "SparsityCallback", "SparsityConfig", "SparsityEngine", "densify",
                        "find_sites", "global_masks", "kept_magnitude", "make_permanent",
                        "parse_pattern", "pattern_mask", "permute_channels",
                        "search_permutation", "sparsify"],
    "sparse_training.callbacks": ["SparsityCallback"],
    "sparse_training.kernels": ["fused_masked_step", "fused_unsupported_reason",
                                "global_magnitude_threshold",
                                "global_magnitude_threshold_reference",
                                "masked_step_reference", "nm_topk_mask",
                                "nm_topk_mask_reference", "nm_topk_masks", "pack_mask",
                                "unpack_mask", "zero_pruned_", "zero_pruned_reference"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_stay_where_they_were(module):
    """Every name the package exported before it took folders is still importable there."""
    imported = __import__(module, fromlist=["_"])
    assert [n for n in PUBLIC[module] if not hasattr(imported, n)] == []
    assert set(PUBLIC[module]) <= set(imported.__all__)
