"""docs/results/*.md against the JSON committed beside them: every generated table equals what
examples/results_pages.py renders from its files, and a page that disagrees fails."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import results_pages  # noqa: E402


@pytest.mark.parametrize("page", results_pages.PAGES, ids=lambda p: p.name)
def test_every_results_page_equals_its_json(page):
    blocks = list(results_pages.BLOCK.finditer(page.read_text()))
    assert blocks, f"{page} has no generated block"
    assert results_pages.render(page) == page.read_text(), (
        f"{page} differs from its JSON: run python examples/results_pages.py")


def test_a_page_whose_json_changed_fails_the_check(tmp_path, monkeypatch, capsys):
    """One accuracy changed in the JSON: the check exits 1 and shows the line; a rewrite
    makes the page agree again."""
    results = tmp_path / "docs" / "results"
    shutil.copytree(results_pages.PAGES[0].parent / "mnist", results / "mnist")
    shutil.copytree(results_pages.PAGES[0].parent / "mnist_dynamic", results / "mnist_dynamic")
    page = results / "mnist.md"
    shutil.copy(results_pages.PAGES[0], page)
    monkeypatch.setattr(results_pages, "PAGES", [page])
    monkeypatch.setattr(results_pages, "PLOTS", {})
    assert results_pages.main(["--check"]) == 0
    data = json.loads((results / "mnist" / "results.json").read_text())
    row = next(r for r in data["rows"] if r["method"] == "gmp" and r["sparsity"] == 0.9)
    row["accuracy"] = 0.123456
    (results / "mnist" / "results.json").write_text(json.dumps(data))
    assert results_pages.main(["--check"]) == 1
    assert "0.1235" in capsys.readouterr().out  # the diff shows the new value
    assert results_pages.main([]) == 0 and results_pages.main(["--check"]) == 0
    assert "| 0.1235 |" in page.read_text()


def test_a_block_naming_a_missing_file_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- generated: squad-table nowhere/results.json -->\n"
                    "<!-- end generated -->\n")
    with pytest.raises(FileNotFoundError, match=r"page.md renders from .*nowhere"):
        results_pages.render(page)
