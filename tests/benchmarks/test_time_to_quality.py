"""benchmarks/time_to_quality.py in its CPU mode (``--size tiny``) on a tiny folder, and its
corpus (:mod:`_corpus`): the split, the tokens and the run's JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_env

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "time_to_quality.py"
sys.path.insert(0, str(SCRIPT.parent))
from _corpus import corpus_files, is_held_out, load_corpus  # noqa: E402


def folder(tmp_path: Path, files: int = 12) -> Path:
    src = tmp_path / "src"
    (src / "site-packages").mkdir(parents=True)
    (src / "site-packages" / "installed.py").write_text("x = 1\n" * 50)
    for i in range(files):
        (src / f"module_{i}.py").write_text(
            f'"""Module {i}."""\n\n' + "".join(f"def f{j}(x):\n    return x * {i + j}\n\n"
                                                for j in range(40)))
    return src


def test_the_split_is_by_path_hash_and_the_tokens_are_cached(tmp_path):
    src = folder(tmp_path)
    files = corpus_files(src)
    assert len(files) == 12 and not any("site-packages" in str(p) for p in files)
    held = [p for p in files if is_held_out(p.name, 0.3)]
    assert held == [p for p in files if is_held_out(p.name, 0.3)]  # deterministic
    corpus = load_corpus(src, vocab=0, held_out=0.3, cache=tmp_path / "cache")
    assert corpus.files == (12 - len(held), len(held)) and corpus.vocab == 256
    expected = sum(len(p.read_bytes()) for p in held)
    assert corpus.held_out.numel() == expected  # bytes: one token each
    again = load_corpus(src, vocab=0, held_out=0.3, cache=tmp_path / "cache")
    assert again.train.equal(corpus.train)
    bpe = load_corpus(src, vocab=300, held_out=0.3, cache=tmp_path / "cache")
    assert bpe.vocab <= 300 and bpe.train.numel() < corpus.train.numel()  # merges shorten it
    with pytest.raises(ValueError, match="both splits need at least one"):
        load_corpus(src, vocab=0, held_out=0.0, cache=tmp_path / "cache")


@pytest.mark.slow
def test_tiny_runs_write_curves_by_wall_clock_and_a_plot(tmp_path):
    src, out = folder(tmp_path), tmp_path / "out"
    env = script_env(OUT=str(out), SPARSE_TRAINING_CACHE=str(tmp_path / "cache"))
    variants = ["dense", "block 75% wide"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--layers", "1",
                           "--budget-s", "2", "--vocab", "0", "--folder", str(src),
                           "--held-out", "0.3", "--eval-every", "3", "--eval-batches", "1",
                           "--warmup-steps", "2", "--variants", *variants],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["variant"]: r for r in (json.loads(p.read_text())["run"]
                                      for p in out.glob("time_to_quality_*.json"))}
    assert sorted(runs) == sorted(variants)
    for run in runs.values():
        curve = run["curve"]
        assert curve[0]["step"] == 0 and curve[-1]["step"] == run["steps"] >= 1
        walls = [p["wall_s"] for p in curve]
        assert walls == sorted(walls) and run["corpus"]["held_out_files"] >= 1
        assert curve[-1]["tokens"] == run["steps"] * run["batch"] * run["seq"]
        assert run["final_held_out_loss"] == curve[-1]["held_out_loss"]
    dense, wide = runs["dense"], runs["block 75% wide"]
    assert (wide["hidden"], wide["intermediate"]) == (2 * dense["hidden"],
                                                      2 * dense["intermediate"])
    plotted = subprocess.run([sys.executable, str(SCRIPT), "--plot",
                              *map(str, out.glob("time_to_quality_*.json"))],
                             env=env, capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert (out / "time_to_quality.png").stat().st_size > 0
