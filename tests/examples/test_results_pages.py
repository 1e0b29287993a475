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


def squad_row(name: str, seed: int, baseline: str = "dense +KD", f1: float = 70.0
              ) -> dict[str, object]:
    return {"name": name, "family": "f", "seed": seed, "baseline": baseline, "f1": f1,
            "exact_match": f1 - 10, "sparsity": 0.5, "seconds": 1.0}


def test_squad_goals_tell_a_missing_run_from_a_missing_baseline():
    rows = [squad_row("dense +KD", 0, f1=73.0), squad_row("2:4", 0, f1=71.0),
            squad_row("dense +KD 20 ep", 0, "dense +KD 20 ep", 73.5),
            squad_row("second-order 80%", 0, "dense +KD 20 ep", 70.6),
            squad_row("gmp 80%", 0, "dense +KD 20 ep", 60.0),
            squad_row("gmp 90%", 0, "dense +KD 30 ep", 60.0)]
    lines = {line.split(" | ")[0].strip("| "): line
             for line in results_pages.squad_goals(rows).splitlines()[2:]}
    assert "| -2.00 | MISSED | dense +KD | 1 |" in lines["2:4"]
    assert "| -2.90 | met | dense +KD 20 ep | 1 |" in lines["second-order 80%"]
    assert "| -13.50 | MISSED | dense +KD 20 ep | 1 |" in lines["gmp 80%"]
    assert "| – | baseline not run | dense +KD 30 ep | 1 |" in lines["gmp 90%"]
    assert "| – | not run | – | – |" in lines["block 32x32 50% second-order"]


def test_squad_left_to_run_lists_the_configs_pairs_without_a_result():
    """Every run of the config at every seed of it: a failed pair is left to run too."""
    config = results_pages.OmegaConf.load(results_pages.SQUAD_CONFIG)
    seeds = list(config.seeds)
    rows = [squad_row("dense", seed) for seed in seeds] + [
        squad_row("2:4", seeds[0]), {"name": "2:4", "family": "f", "seed": seeds[1],
                                     "error": "RuntimeError: x"}]
    table = results_pages.squad_left_to_run(rows)
    names = [line.split(" | ")[0].strip("| ") for line in table.splitlines()[2:]]
    assert names == [run.name for run in config.runs if run.name != "dense"]
    rest = ", ".join(map(str, seeds[1:]))
    assert f"| 2:4 | {seeds[0]} | {rest} |" in table
    assert f"| 4:8 | none | {', '.join(map(str, seeds))} |" in table
    everything = [squad_row(run.name, seed) for run in config.runs for seed in seeds]
    assert results_pages.squad_left_to_run(everything) == (
        "Every run of squad.yaml has a result at every seed.")


def test_an_unknown_argument_rewrites_nothing():
    with pytest.raises(SystemExit) as stopped:
        results_pages.main(["--chek"])
    assert stopped.value.code == 2
