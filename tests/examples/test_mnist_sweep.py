"""examples/mnist_sweep.py: config handling, and a reduced sweep on real MNIST whose outputs,
printed lines and offline W&B runs are read back (3,000 training images, one sparsity, two
methods). The generic pieces (examples/reporting.py) are tested in tests/examples/test_reporting.py."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import mnist_data  # noqa: E402
import mnist_sweep  # noqa: E402
import reporting  # noqa: E402
import sweep_config  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

MNIST_DIR = mnist_data.resolve_data_dir(None)
needs_mnist = pytest.mark.skipif(
    not all((MNIST_DIR / name).is_file() for name in mnist_data.SHA256),
    reason=f"MNIST files not in {MNIST_DIR}; set ${mnist_data.ENV_VAR}",
)


# -- config -------------------------------------------------------------------------------------


def load(argv: list[str]) -> DictConfig:
    """The sweep's config as main() gets it: loaded, then checked."""
    cfg = sweep_config.load_config(argv, mnist_sweep.CONFIG, mnist_sweep.DESCRIPTION)
    mnist_sweep.check_config(cfg)
    return cfg


def test_default_config_sweeps_four_methods_over_six_sparsities() -> None:
    cfg = load([])
    assert list(cfg.sparsities) == [0.7, 0.8, 0.9, 0.95, 0.98, 0.99]
    assert list(cfg.methods) == ["oneshot", "oneshot+finetune", "gmp", "rigl"]
    for method in cfg.methods:  # every method's callback arguments build a SparsityCallback
        mnist_sweep.SparsityCallback(**mnist_sweep.callback_kwargs(cfg, method, 0.9))


def test_command_line_overrides() -> None:
    cfg = load(
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
    cfg = load(
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
    cfg = load([f"config={tmp_path / 'mine.yaml'}", "seed=3"])
    assert cfg.epochs == 2 and cfg.seed == 3


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["epoch=3"], r"unknown key 'epoch'; did you mean 'epochs'\?"),
        (["methods=[magic]"], r"unknown methods \['magic'\]; defined: \['oneshot'"),
        (["sparsities=[1.0]"], r"sparsities must be a non-empty list of distinct entries each a number "
                               r"in \[0, 1\), e.g. \[0.9, 0.99\], got \[1.0\]"),
        (["sparsities=0.9"], r"sparsities must be a non-empty list .*, got 0.9"),
        (["sparsities=[0.5,0.5]"], r"sparsities must be a non-empty list of distinct entries"),
        (["momentum=0"], r"momentum must be a number in \(0, 1\), got 0"),
        (["warmup=0"], r"warmup must be a number in \(0, 1\), got 0"),
        (["wandb_mode=off"], r"wandb_mode must be auto, online, offline or disabled, got False "
                             r"\(YAML reads an unquoted on/off/yes/no as true/false"),
        (["epochs=1O"], r"epochs must be an int >= 1, got '1O'"),
        (["dense_epochs=2.5"], r"dense_epochs must be an int >= 1, got 2.5"),
        (["batch_size=0"], r"batch_size must be an int >= 1, got 0"),
        (["threads=-1"], r"threads must be an int >= 0, got -1"),
        (["lr=0"], r"lr must be a number > 0, got 0"),
        (["warmup=1.0"], r"warmup must be a number in \(0, 1\), got 1.0"),
        (["train_size=all"], r"train_size must be an int >= 0, got 'all'"),
        (["data_dir=3"], r"data_dir must be a string or null, got 3"),
        (["methods=gmp"], r"methods must be a non-empty list .*, got 'gmp'"),
        (["progress_bar=maybe"], r"progress_bar must be true or false, got 'maybe'"),
        (["method_specs.gmp.train=often"], r"method gmp: train must be true or false, got 'often'"),
        (["method_specs.gmp.init=random"], "method gmp: init must be dense or scratch"),
        (["method_specs.gmp.trian=false"], r"method gmp must have exactly the keys init, train"),
        (["method_specs.gmp.callback.ned=0.5"], r"method gmp at sparsity .*: unknown setting "
                                                r"'ned'; did you mean 'end'\? valid settings:"),
        # every sparsity and the model's own weights, checked before the dense run
        (["methods=[nm]", "method_specs.nm={init: dense, train: true, callback: {pattern: "
          "'2:4'}}", "sparsities=[0.5,0.9]"],
         r"method nm at sparsity 0.9: .*pattern '2:4' implies sparsity 0.5"),
        (["method_specs.oneshot.callback.allow=[nomatch]"],
         r"method oneshot at sparsity .*: allow regex 'nomatch' matches no weight tensor; they "
         r"are: 'fc1.weight'"),
        (["sparsities=[]"], r"sparsities must be a non-empty list .*, got \[\]"),
        (["method_specs.gmp.callback.schedule=cosine"], "unknown schedule 'cosine'"),
        (["epochs"], r"key=value overrides, got \['epochs'\]"),
    ],
)
def test_bad_config_fails_before_training(argv: list[str], match: str) -> None:
    with pytest.raises(sweep_config.ConfigError, match=match):
        load(argv)


def test_every_key_of_the_yaml_has_a_rule() -> None:
    keys = set(OmegaConf.load(mnist_sweep.CONFIG))
    assert keys == set(mnist_sweep.RULES)


def test_a_bad_key_exits_non_zero_before_training(tmp_path: Path) -> None:
    """The command line: a bad value ends the process with status 1 and the message, before
    the output folder exists."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(EXAMPLES / "mnist_sweep.py"), "epochs=1O",
                             f"out_dir={out}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("mnist_sweep: epochs must be an int >= 1, got '1O'")
    assert not out.exists()


def test_help_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        mnist_sweep.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("MNIST sparsity sweep: accuracy versus sparsity of LeNet-300-100")
    assert "gmp                gradual magnitude pruning" in text  # the method list
    assert "config=PATH" in text
    for line in ["  epochs: 10 ", "  sparsities: [0.7, 0.8, 0.9, 0.95, 0.98, 0.99]"]:
        assert line in text
    assert "  wandb_mode: auto          # auto: online with an API key" in text


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
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        result = mnist_sweep.main(argv)
    return {"out": out, "argv": argv, "stdout": stdout.getvalue(), **result}


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
def test_sweep_prints_progress_and_the_sync_command(sweep: dict[str, Any]) -> None:
    lines = sweep["stdout"].splitlines()
    assert lines[0] == "torch CPU threads: 1 (threads=1)"  # the default, printed first
    starts = [line for line in lines if line.startswith("run ")]
    assert starts[0].startswith("run 1/2 · oneshot @ 0.90 · ")
    assert starts[0].endswith(" elapsed · estimating time left")
    assert starts[1].startswith("run 2/2 · gmp @ 0.90 · ") and starts[1].endswith(" left")
    assert "~" in starts[1]  # an estimate once one run has finished
    results = [line for line in lines if line.startswith("  gmp @ 0.90: accuracy ")]
    assert len(results) == 1 and results[0].endswith("s") and "params kept" in results[0]
    assert f"wandb sync {sweep['out'] / 'wandb'}/offline-run-*" in sweep["stdout"]


@needs_mnist
def test_sweep_pruned_nets_are_really_sparse(sweep: dict[str, Any]) -> None:
    # Both runs end at the same global target, counted from their own nets: the same number
    # of kept weights; pruning while fine-tuning (gmp) ends no worse than one-shot (2 points).
    rows = {r["method"]: r for r in sweep["rows"]}
    assert rows["gmp"]["weights_kept"] == rows["oneshot"]["weights_kept"]
    assert rows["gmp"]["accuracy"] > rows["oneshot"]["accuracy"] - 0.02


@needs_mnist
def test_sweep_offline_wandb_runs(sweep: dict[str, Any]) -> None:
    run_dirs = sorted((sweep["out"] / "wandb").glob("offline-run-*"))
    runs = {run["_name"]: run for run in map(reporting.read_offline_run, run_dirs)}
    assert set(runs) == {"dense", "oneshot@0.9", "gmp@0.9", "summary"}
    for row in sweep["rows"]:  # one run per configuration, its result in the summary
        run = runs[f"{row['method']}@0.9"]
        assert run["accuracy"] == row["accuracy"]
        assert run["_config"]["method"] == row["method"]
    assert any(k.startswith("sparsity/global") for k in runs["gmp@0.9"])
    summary = runs["summary"]
    # The results table: its rows are results.csv's.
    table = summary["results"]
    assert table["_type"] == "table-file"
    assert table["columns"][:3] == ["method", "sparsity", "sparsity_layers"]
    assert [row[table["columns"].index("accuracy")] for row in table["data"]] == [
        r["accuracy"] for r in sweep["rows"]
    ]
    # The line plot: a custom chart over its own table, one stroke per series (method, dense,
    # the reference's finetune column).
    curve = summary["accuracy_vs_sparsity_table"]
    assert curve["columns"] == ["series", "sparsity", "accuracy"]
    assert {row[0] for row in curve["data"]} == {"oneshot", "gmp", "dense", "reference finetune"}
    chart = summary["accuracy_vs_sparsity"]["panel_config"]
    assert chart["panelDefId"] == "wandb/line/v0"
    assert chart["fieldSettings"] == {"x": "sparsity", "y": "accuracy", "stroke": "series"}
    assert summary["accuracy_vs_sparsity_png"]["_type"] == "image-file"
    assert summary["dense_accuracy"] == sweep["dense"]["accuracy"]


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


@needs_mnist
def test_a_failed_run_fails_the_sweep(sweep: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in a run is not swallowed: it ends the sweep (the command exits non-zero)."""
    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a run failed")

    monkeypatch.setattr(mnist_sweep, "run_method", fails)
    argv = [a for a in sweep["argv"] if not a.startswith(("out_dir=", "logger="))]
    with pytest.raises(RuntimeError, match="a run failed"):
        mnist_sweep.main([*argv, f"out_dir={sweep['out'] / 'failing'}", "logger=none"])


def test_a_cache_dir_that_cannot_be_written_fails_before_the_dense_run(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(mnist_sweep, "load_mnist", lambda data_dir: None)  # no run reaches it
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = tmp_path / "out"
    with pytest.raises(sweep_config.ConfigError, match=rf"cache_dir '{blocker}/cache' cannot be "
                                                       rf"written \(.*\): give a folder"):
        mnist_sweep.main([f"cache_dir={blocker / 'cache'}", f"out_dir={out}", "logger=none"])
    assert not out.exists()


def test_missing_data_is_a_config_error_before_the_output_folder(tmp_path, monkeypatch):
    def missing(data_dir):
        raise FileNotFoundError(f"MNIST files missing from {data_dir}")

    monkeypatch.setattr(mnist_sweep, "load_mnist", missing)
    out = tmp_path / "out"
    with pytest.raises(sweep_config.ConfigError, match=r"data_dir: MNIST files missing from "
                                                       r"/nonexistent"):
        mnist_sweep.main(["data_dir=/nonexistent", f"out_dir={out}", "logger=none"])
    assert not out.exists()
