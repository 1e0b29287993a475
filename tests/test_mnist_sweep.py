"""examples/mnist_sweep.py: config handling, and a reduced sweep on real MNIST whose outputs
and offline W&B runs are read back (3,000 training images, one sparsity, two methods)."""

from __future__ import annotations

import csv
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import mnist_data  # noqa: E402
import mnist_sweep  # noqa: E402

MNIST_DIR = mnist_data.resolve_data_dir(None)
needs_mnist = pytest.mark.skipif(
    not all((MNIST_DIR / name).is_file() for name in mnist_data.SHA256),
    reason=f"MNIST files not in {MNIST_DIR}; set ${mnist_data.ENV_VAR}",
)


# -- config -------------------------------------------------------------------------------------


def test_default_config_is_the_issue_sweep() -> None:
    cfg = mnist_sweep.load_config([])
    assert list(cfg.sparsities) == [0.7, 0.8, 0.9, 0.95, 0.98, 0.99]
    assert list(cfg.methods) == ["oneshot", "oneshot+finetune", "gmp", "rigl"]
    for method in cfg.methods:  # every method's callback arguments build a SparsityCallback
        mnist_sweep.SparsityCallback(**mnist_sweep.callback_kwargs(cfg, method, 0.9))


def test_command_line_overrides() -> None:
    cfg = mnist_sweep.load_config(
        [
            "sparsities=[0.9]",
            "methods=[gmp]",
            "epochs=3",
            "out_dir=/tmp/x",
            "method_specs.gmp.callback.end=0.5",
        ]
    )
    assert list(cfg.sparsities) == [0.9] and list(cfg.methods) == ["gmp"] and cfg.epochs == 3
    assert cfg.out_dir == "/tmp/x"
    assert mnist_sweep.callback_kwargs(cfg, "gmp", 0.9)["end"] == 0.5


def test_new_method_from_the_command_line() -> None:
    cfg = mnist_sweep.load_config(
        [
            "methods=[gmp,linear]",
            "method_specs.linear={init: dense, train: true, callback: {pattern: unstructured, "
            "schedule: linear, end: 0.5}}",
        ]
    )
    assert mnist_sweep.callback_kwargs(cfg, "linear", 0.8) == {
        "pattern": "unstructured",
        "schedule": "linear",
        "end": 0.5,
        "sparsity": 0.8,
    }


def test_other_yaml_as_base(tmp_path: Path) -> None:
    base = mnist_sweep.CONFIG.read_text().replace("epochs: 10 ", "epochs: 2 ")
    (tmp_path / "mine.yaml").write_text(base)
    cfg = mnist_sweep.load_config([f"config={tmp_path / 'mine.yaml'}", "seed=3"])
    assert cfg.epochs == 2 and cfg.seed == 3


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["epoch=3"], "epoch"),  # misspelt key: OmegaConf's struct mode names it
        (["methods=[magic]"], r"unknown methods \['magic'\]; defined: \['oneshot'"),
        (["sparsities=[1.0]"], r"sparsities must lie in \[0, 1\), got \[1.0\]"),
        (["logger=tensorboard"], "logger must be wandb or none, got 'tensorboard'"),
        (["wandb_mode=cloud"], "wandb_mode must be auto, online, offline or disabled"),
        (["method_specs.gmp.init=random"], "method gmp: init must be dense or scratch"),
        (["method_specs.gmp.trian=false"], r"method gmp must have exactly the keys init, train"),
        (["method_specs.gmp.callback.ned=0.5"], r"method gmp: .*unexpected keyword argument 'ned'"),
        (["sparsities=[]"], "sparsities and methods must each name at least one entry"),
        (["method_specs.gmp.callback.schedule=cosine"], "unknown schedule 'cosine'"),
        (["epochs"], r"key=value overrides, got \['epochs'\]"),
    ],
)
def test_bad_config_fails_before_training(argv: list[str], match: str) -> None:
    with pytest.raises(mnist_sweep.ConfigError, match=match):
        mnist_sweep.load_config(argv)


def test_count_separates_pruned_layers_from_all_params() -> None:
    net = mnist_sweep.LeNet300100()
    engine = mnist_sweep.SparsityEngine(
        net, mnist_sweep.SparsityConfig(pattern="unstructured", sparsity=0.9, deny=["fc3"])
    )
    engine.prune()
    counts = mnist_sweep.count(net)
    assert counts.weights_total == 784 * 300 + 300 * 100  # fc3 is not masked
    assert counts.sparsity_layers == pytest.approx(0.9, abs=1e-5)
    assert counts.params_total == 266_610
    assert counts.params_kept == counts.weights_kept + 100 * 10 + 300 + 100 + 10


# -- reading an offline W&B run back ------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """Records of a `run-*.wandb` file: W&B's LevelDB-style log of protobuf `Record`s.

    Layout: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each
    with a 7-byte header (crc32c, little-endian length, type: 1 full, 2 first, 3 middle,
    4 last); a block tail shorter than a chunk header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def offline_run(run_dir: Path) -> dict[str, Any]:
    """Name, config, history keys and summary of one offline run, from its .wandb file."""
    run: dict[str, Any] = {"history": {}, "summary": {}, "config": {}}
    for record in wandb_records(next(run_dir.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # wandb.init's config rides in the run record
            if kind == "run":
                run["name"] = record.run.display_name
            config = record.run.config if kind == "run" else record.config
            for item in config.update:
                run["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("history", "summary"):
            items = record.history.item if kind == "history" else record.summary.update
            for item in items:
                key = item.key or "/".join(item.nested_key)
                run[kind][key] = json.loads(item.value_json)
    return run


# -- the reduced sweep --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sweep")
    argv = [
        f"data_dir={MNIST_DIR}",
        f"out_dir={out}",
        f"cache_dir={out / 'cache'}",
        "train_size=3000",
        "test_size=2000",
        "sparsities=[0.9]",
        "methods=[oneshot,gmp]",
        "dense_epochs=3",
        "epochs=2",
        "batch_size=100",
        "progress_bar=false",
        "method_specs.gmp.callback.frequency=10",
        "logger=wandb",
        "wandb_mode=offline",
    ]
    result = mnist_sweep.main(argv)
    return {"out": out, "argv": argv, **result}


@needs_mnist
def test_sweep_tables(sweep: dict[str, Any]) -> None:
    out = sweep["out"]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], float(r["sparsity"])) for r in rows] == [("oneshot", 0.9), ("gmp", 0.9)]
    for row in rows:
        assert float(row["sparsity_layers"]) == pytest.approx(0.9, abs=1e-5)  # exactly reached
        assert float(row["sparsity_all"]) < float(row["sparsity_layers"])  # biases stay dense
        assert int(row["weights_kept"]) == 26_620 and int(row["params_total"]) == 266_610
        assert 0.0 < float(row["seconds"]) < 60
    dense = sweep["dense"]["accuracy"]
    accuracy = {r["method"]: float(r["accuracy"]) for r in rows}
    assert dense > 0.85  # 3 epochs on 3,000 images
    assert accuracy["gmp"] > 0.8  # fine-tuned at 90%
    results = json.loads((out / "results.json").read_text())
    assert results["rows"] == sweep["rows"] and results["dense"]["accuracy"] == dense
    assert [r["accuracy"] for r in results["rows"]] == [accuracy["oneshot"], accuracy["gmp"]]
    md = (out / "results.md").read_text()
    assert "| sparsity | original | oneshot | gmp | ref original | ref prune | ref finetune" in md
    assert f"| 90% | {dense:.4f} | {accuracy['oneshot']:.4f} | {accuracy['gmp']:.4f} | 0.9534" in md
    assert "2,000 test images" in md
    png = (out / "accuracy_vs_sparsity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@needs_mnist
def test_sweep_pruned_nets_are_really_sparse(sweep: dict[str, Any]) -> None:
    # The gmp run's reported counts come from the net itself: recount from a fresh prune.
    rows = {r["method"]: r for r in sweep["rows"]}
    assert rows["gmp"]["weights_kept"] == rows["oneshot"]["weights_kept"]
    assert rows["gmp"]["accuracy"] > rows["oneshot"]["accuracy"] - 0.02


@needs_mnist
def test_sweep_offline_wandb_runs(sweep: dict[str, Any]) -> None:
    run_dirs = sorted((sweep["out"] / "wandb").glob("offline-run-*"))
    runs = {run["name"]: run for run in map(offline_run, run_dirs)}
    assert set(runs) == {"dense", "oneshot@0.9", "gmp@0.9", "summary"}
    for row in sweep["rows"]:  # one run per configuration, its result in the summary
        run = runs[f"{row['method']}@0.9"]
        assert run["summary"]["accuracy"] == row["accuracy"]
        assert run["config"]["method"] == row["method"]
    assert any(k.startswith("sparsity/global") for k in runs["gmp@0.9"]["history"])
    summary = runs["summary"]
    # The results table: logged as a table file whose rows are results.csv's.
    assert summary["history"]["results/_type"] == "table-file"
    table_dir = next(d for d in run_dirs if offline_run(d)["name"] == "summary") / "files"
    table = json.loads((table_dir / summary["history"]["results/path"]).read_text())
    assert table["columns"][:3] == ["method", "sparsity", "sparsity_layers"]
    assert [row[table["columns"].index("accuracy")] for row in table["data"]] == [
        r["accuracy"] for r in sweep["rows"]
    ]
    # The line plot: a custom chart over its own table, one stroke per method.
    assert summary["history"]["accuracy_vs_sparsity_table/_type"] == "table-file"
    chart = summary["config"]["_wandb/visualize/accuracy_vs_sparsity"]["panel_config"]
    assert chart["panelDefId"] == "wandb/line/v0"
    assert chart["fieldSettings"] == {"x": "sparsity", "y": "accuracy", "stroke": "method"}
    assert "accuracy_vs_sparsity_png/_type" in summary["history"]
    assert summary["summary"]["dense_accuracy"] == sweep["dense"]["accuracy"]


@needs_mnist
def test_sweep_reuses_the_dense_cache(sweep: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = sweep["out"] / "again"
    argv = [a for a in sweep["argv"] if not a.startswith(("out_dir=", "methods=", "logger="))]
    torch.manual_seed(123)  # the sweep seeds itself; outside state must not matter
    result = mnist_sweep.main([*argv, f"out_dir={out}", "methods=[oneshot]", "logger=none"])
    assert "dense net: cached" in capsys.readouterr().out
    assert result["dense"]["accuracy"] == sweep["dense"]["accuracy"]
    assert result["rows"][0] == {**sweep["rows"][0], "seconds": result["rows"][0]["seconds"]}
    assert not (out / "wandb").exists()
