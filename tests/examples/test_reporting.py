"""examples/reporting.py: progress lines, threads, the dense-run cache, result files, the plot,
and a W&B summary run written offline and read back. Config loading and checks:
tests/examples/test_sweep_config.py."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import reporting  # noqa: E402

# -- Progress ----------------------------------------------------------------------------------


def test_progress_lines_and_estimate(capsys: pytest.CaptureFixture) -> None:
    now = iter([0.0, 0.0, 30.0, 30.0, 130.0, 134.0, 200.0, 3700.0])
    progress = reporting.Progress(3, clock=lambda: next(now))
    progress.start("gmp @ 0.90")  # t=0
    progress.finish("accuracy 0.9812")  # t=30: 30 s
    progress.start("rigl @ 0.90")  # t=30: mean 30 s x 2 runs left
    progress.finish("accuracy 0.9790")  # t=130: 100 s
    progress.start("gmp @ 0.95")  # t=134: mean 65 s x 1 run left
    progress.finish("accuracy 0.9701")  # t=200: 66 s
    assert capsys.readouterr().out.splitlines() == [
        "run 1/3 · gmp @ 0.90 · 0s elapsed · estimating time left",
        "  gmp @ 0.90: accuracy 0.9812 · 30s",
        "run 2/3 · rigl @ 0.90 · 30s elapsed · ~1m left",
        "  rigl @ 0.90: accuracy 0.9790 · 100s",
        "run 3/3 · gmp @ 0.95 · 2m14s elapsed · ~1m left",
        "  gmp @ 0.95: accuracy 0.9701 · 66s",
    ]
    assert progress.elapsed == 3700.0 and progress.done == 3


def test_progress_uses_perf_counter_by_default(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    now = iter([100.0, 100.0, 700.0, 700.0])
    monkeypatch.setattr(reporting.time, "perf_counter", lambda: next(now))
    progress = reporting.Progress(25)
    progress.start("a")
    progress.finish("done")  # 600 s: 24 runs left -> 14,400 s
    progress.start("b")
    assert capsys.readouterr().out.splitlines()[-1] == "run 2/25 · b · 10m00s elapsed · ~240m left"


# -- result files -------------------------------------------------------------------------------


ROWS = [
    {"method": "gmp", "sparsity": 0.9, "accuracy": 0.98123},
    {"method": "rigl", "sparsity": 0.9, "accuracy": 0.97, "per_layer": "fc1 95%, fc2 80%"},
    {"method": "oneshot", "sparsity": 0.99, "accuracy": None},
]


def test_markdown_table_formats_and_marks_missing_values() -> None:
    columns = [
        ("method", "method", ""),
        ("sparsity", "target", ".0%"),
        ("accuracy", "accuracy", ".4f"),
        ("per_layer", "per layer", ""),
    ]
    assert reporting.markdown_table(ROWS, columns).splitlines() == [
        "| method | target | accuracy | per layer |",
        "|---|---|---|---|",
        "| gmp | 90% | 0.9812 | – |",
        "| rigl | 90% | 0.9700 | fc1 95%, fc2 80% |",
        "| oneshot | 99% | – | – |",
    ]
    pipe = reporting.markdown_table([{"a": "x|y"}], [("a", "a", "")])
    assert pipe.splitlines()[-1] == "| x\\|y |"


def test_write_results_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir"
    paths = reporting.write_results(out, ROWS, meta={"dense": {"accuracy": 0.98}})
    assert paths == [out / "results.csv", out / "results.json"]
    with open(paths[0]) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["method", "sparsity", "accuracy", "per_layer"]
    assert rows[0] == {"method": "gmp", "sparsity": "0.9", "accuracy": "0.98123", "per_layer": ""}
    assert rows[1]["per_layer"] == "fc1 95%, fc2 80%" and rows[2]["accuracy"] == ""
    assert json.loads(paths[1].read_text()) == {"dense": {"accuracy": 0.98}, "rows": ROWS}
    assert json.loads(reporting.write_results(tmp_path, ROWS)[1].read_text()) == ROWS


@pytest.mark.parametrize("zoom", [None, (0.9, 1.0)])
def test_plot_vs_sparsity_writes_a_png(tmp_path: Path, zoom: tuple[float, float] | None) -> None:
    series = {"gmp": [(0.9, 0.98), (0.5, 0.985)], "reference": [(0.5, 0.97), (0.9, 0.96)]}
    path = reporting.plot_vs_sparsity(
        tmp_path / "sub" / "f1.png",
        series,
        metric="F1",
        title="test",
        dense=0.99,
        zoom=zoom,
        dashed=["reference"],
    )
    png = path.read_bytes()
    assert path == tmp_path / "sub" / "f1.png"
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # A sparsity of 0 (the dense point) cannot go on a logit axis: a linear one instead.
    series["gmp"].append((0.0, 0.99))
    linear = reporting.plot_vs_sparsity(tmp_path / "lin.png", series, metric="F1", title="t")
    assert linear.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and linear.stat().st_size > 10_000


# -- Weights & Biases ---------------------------------------------------------------------------


def wandb_cfg(tmp_path: Path, **settings: str) -> DictConfig:
    base = {"out_dir": str(tmp_path), "logger": "wandb", "wandb_project": "test-reporting"}
    return OmegaConf.create({**base, "wandb_mode": "offline", **settings})


def test_sync_hint_and_setup_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = wandb_cfg(tmp_path)
    assert reporting.sync_hint(cfg) == f"wandb sync {tmp_path}/wandb/offline-run-*"
    assert reporting.sync_hint(wandb_cfg(tmp_path, wandb_mode="online")) is None
    assert reporting.sync_hint(wandb_cfg(tmp_path, logger="none")) is None
    spaced = wandb_cfg(tmp_path / "a b")
    assert reporting.sync_hint(spaced) == f"wandb sync '{tmp_path}/a b/wandb'/offline-run-*"
    monkeypatch.setenv("WANDB_MODE", "offline")
    import wandb

    def no_login(**kwargs):
        raise AssertionError("$WANDB_MODE decides: no login attempt")
    monkeypatch.setattr(wandb, "login", no_login)
    auto = wandb_cfg(tmp_path, wandb_mode="auto")
    reporting.setup_wandb(auto)
    assert auto.wandb_mode == "offline"
    off = wandb_cfg(tmp_path, logger="none", wandb_mode="auto")
    reporting.setup_wandb(off)
    assert off.wandb_mode == "auto"
    assert reporting.make_logger(off, "g", "gmp@0.9", {}) is False
    reporting.finish_logger(False, {"accuracy": 1.0})  # nothing to finish


def test_summary_run_offline_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [
        {"method": "gmp", "sparsity": 0.9, "f1": 88.1},
        {"method": "gmp", "sparsity": 0.5, "f1": 89.0, "seconds": 3.0},
    ]
    curve = [["gmp", r["sparsity"], r["f1"]] for r in rows] + [["dense", 0.9, 90.0]]
    series = {"gmp": [(0.9, 88.1), (0.5, 89.0)]}
    png = reporting.plot_vs_sparsity(tmp_path / "f1.png", series, metric="F1", title="t")
    run_dir = reporting.log_summary_run(
        wandb_cfg(tmp_path),
        "group-1",
        rows,
        metric="f1",
        curve=curve,
        title="SQuAD: F1 vs sparsity",
        plot=png,
        summary={"dense_f1": 90.0},
    )
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    run = reporting.read_offline_run(run_dir)
    assert run["_name"] == "summary"
    assert run["_config"]["wandb_project"] == "test-reporting"
    assert run["dense_f1"] == 90.0  # the summary
    assert {"results", "f1_vs_sparsity", "f1_vs_sparsity_png"} <= set(run)  # what was logged
    assert not [key for key in run if key.startswith("_") and key not in ("_name", "_config")]
    results = run["results"]
    assert results["_type"] == "table-file"
    assert results["columns"] == ["method", "sparsity", "f1", "seconds"]
    assert results["data"] == [["gmp", 0.9, 88.1, None], ["gmp", 0.5, 89.0, 3.0]]
    assert run["f1_vs_sparsity_table"]["data"] == curve
    chart = run["f1_vs_sparsity"]["panel_config"]
    assert chart["fieldSettings"] == {"x": "sparsity", "y": "f1", "stroke": "series"}
    assert chart["stringSettings"]["title"] == "SQuAD: F1 vs sparsity"
    assert run["f1_vs_sparsity_png"]["_type"] == "image-file"


def test_read_offline_run_rejects_other_files(tmp_path: Path) -> None:
    (tmp_path / "run-x.wandb").write_bytes(b"not a run")
    with pytest.raises(ValueError, match="is not a W&B run file"):
        reporting.read_offline_run(tmp_path)


def test_cached_training_saves_whole_files_and_retrains_over_torn_or_foreign_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls = []

    def train() -> dict:
        calls.append(1)
        return {"w": torch.arange(4.0)}

    cache = tmp_path / "cache"
    state, _ = reporting.cached_training(cache, "dense", {"seed": 0}, train)
    (path,) = cache.iterdir()  # the file only: no temporary one left
    assert path.name.startswith("dense-") and path.suffix == ".pt"
    again, _ = reporting.cached_training(cache, "dense", {"seed": 0}, train)
    assert len(calls) == 1 and torch.equal(again["w"], state["w"])
    assert f"dense net: cached {path}" in capsys.readouterr().out

    whole = path.read_bytes()
    for broken in (whole[: len(whole) // 2], b"not a checkpoint", None):
        if broken is None:  # a file of another program that torch loads
            torch.save([1, 2, 3], path)
        else:
            path.write_bytes(broken)
        state, _ = reporting.cached_training(cache, "dense", {"seed": 0}, train)
        shown = capsys.readouterr().out
        assert f"dense net: the cache file {path} (cache_dir={cache}) does not load (" in shown
        assert "training again to replace it" in shown and torch.equal(state["w"], torch.arange(4.0))
        assert torch.load(path)["state_dict"].keys() == {"w"}  # replaced by a whole file
    assert len(calls) == 4

    def killed(obj: object, file: str) -> None:  # a kill in the middle of the write
        Path(file).write_bytes(whole[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(reporting.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        reporting.cached_training(cache, "dense", {"seed": 1}, train)
    assert [p.name for p in cache.iterdir()] == [path.name]  # no torn file, no leftover
