"""Results pages from their JSON: the tables of docs/results/*.md are generated from the
results files committed beside them, by the same code that writes each sweep's results.md,
so that a page cannot disagree with its data.

    python examples/results_pages.py           # rewrite the generated parts (and plots)
    python examples/results_pages.py --check   # exit 1, with a diff, where a page differs

A page marks each generated part with the renderer's name and the JSON files it reads
(paths relative to the page; several files are read as one list of rows; a renderer of
runs names a folder, whose JSON files are the runs):

    <!-- generated: squad-table squad_distill/results.json -->
    ...                                       (replaced on every run)
    <!-- end generated -->

After copying a sweep's results.json into docs/results/, run this script and commit both.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mnist_report
import squad_report
from omegaconf import OmegaConf
from reporting import markdown_table, plot_vs_sparsity

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the time-to-quality benchmark's report
import _quality_report  # noqa: E402

SQUAD_CONFIG = ROOT / "examples" / "configs" / "squad.yaml"  # the runs and seeds of the sweep
PAGES = [ROOT / "docs" / "results" / "mnist.md", ROOT / "docs" / "results" / "squad.md",
         ROOT / "docs" / "results" / "time_to_quality.md"]
BLOCK = re.compile(r"(<!-- generated: (?P<renderer>\S+) (?P<files>[^>]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.DOTALL)

SQUAD_COLUMNS = [c for c in squad_report.COLUMNS if c[0] not in ("family", "error")]
# The goals of the distillation sweep: the F1 gap to dense with the same budget (mean of the
# seeds) each run should reach.
# the accuracy goals of coarse and high sparsity, for the magnitude rows and the rows of the
# scores that learn from training (examples/configs/squad.yaml)
SQUAD_GOALS = {"2:4": -1.5, "2:4 second-order 20 ep": -1.5, "gmp 80%": -3.0,
               "second-order 80%": -3.0, "second-order 80% damp 0.1": -3.0, "gmp 90%": -6.0,
               "second-order 90%": -6.0, "second-order 90% damp 0.1": -6.0,
               "block 32x32 50%": -3.0, "block 32x32 50% second-order": -3.0,
               "block 32x32 75%": -8.0, "block 32x32 75% second-order": -8.0,
               "heads+neurons 50%": -3.0, "heads+neurons 50% second-order": -3.0}


def mnist_tables(content: dict[str, Any]) -> str:
    """The MNIST sweep: accuracy by sparsity, every run, where it ran."""
    return "\n\n".join([mnist_report.about(content), mnist_report.by_sparsity_table(content),
                        mnist_report.every_run_table(content), mnist_report.environment(content)])


def mnist_summary(content: dict[str, Any]) -> str:
    """Accuracy by sparsity only, and where it ran."""
    return "\n\n".join([mnist_report.by_sparsity_table(content),
                        mnist_report.environment(content)])


def squad_table(rows: list[dict[str, Any]]) -> str:
    """One line per run: mean F1 over its seeds, each seed's, the spread, the gap."""
    if not rows:
        return "Not run yet: no rows in the results file."
    return markdown_table(squad_report.summarize(rows), SQUAD_COLUMNS)


def squad_goals(rows: list[dict[str, Any]]) -> str:
    """Each goal's run: its mean gap to the baseline, and whether it reaches the goal."""
    lines = {line["name"]: line for line in squad_report.summarize(rows)}
    goals = []
    for name, goal in SQUAD_GOALS.items():
        line = lines.get(name, {})
        gap = line.get("f1_gap")
        verdict = ("not run" if "f1" not in line else "baseline not run" if gap is None
                   else "met" if gap >= goal else "MISSED")
        goals.append({"name": name, "goal": goal, "gap": gap, "verdict": verdict,
                      "seeds": line.get("seeds"), "baseline": line.get("baseline")})
    return markdown_table(goals, [("name", "run", ""), ("goal", "goal (F1 - baseline)", "+.1f"),
                                  ("gap", "F1 - baseline", "+.2f"), ("verdict", "verdict", ""),
                                  ("baseline", "baseline", ""), ("seeds", "seeds", "d")])


def squad_left_to_run(rows: list[dict[str, Any]]) -> str:
    """The (run, seed) pairs of examples/configs/squad.yaml without a result (failed ones
    included), per run: what the next sweep calls have to run."""
    config = OmegaConf.load(SQUAD_CONFIG)
    done = {(row["name"], row["seed"]) for row in rows if "f1" in row}
    left = []
    for run in config.runs:
        seeds = [seed for seed in config.seeds if (run.name, seed) not in done]
        if seeds:
            have = [seed for seed in config.seeds if seed not in seeds]
            left.append({"name": run.name, "have": ", ".join(map(str, have)) or "none",
                         "left": ", ".join(map(str, seeds))})
    if not left:
        return f"Every run of {SQUAD_CONFIG.name} has a result at every seed."
    return markdown_table(left, [("name", "run", ""), ("have", "seeds with results", ""),
                                 ("left", "seeds not run yet", "")])


def squad_plot(rows: list[dict[str, Any]]) -> str:
    """The plot's image link, once there are rows to plot."""
    return "![F1 versus sparsity](squad_f1_vs_sparsity.png)" if rows else ""


TIME_TO_QUALITY_COLUMNS = [
    ("budget_s", "budget (s)", "d"), ("model", "model", ""), ("name", "configuration", ""),
    ("seeds", "seeds", "d"),
    ("final", "final held-out loss", ".4f"), ("final_min", "min", ".4f"),
    ("final_max", "max", ".4f"), ("gap", "vs dense", "+.4f"),
    ("time_to_baseline_s", "s to dense's final loss", ".1f"),
    ("time_ratio", "x dense's time", ".2f"), ("tokens_per_s", "tokens/s", ",.0f"),
    ("speed", "tokens/s vs dense", ".2f"), ("peak_gib", "peak GiB", ".1f"),
    ("kept_millions", "parameters kept (M)", ".1f"), ("caches", "Triton caches", ""),
    ("process", "process", "")]


def time_to_quality_table(runs: list[dict[str, Any]]) -> str:
    """One line per (budget, model, configuration) against the best dense configuration of
    its budget and model."""
    return markdown_table(_quality_report.summarize(runs), TIME_TO_QUALITY_COLUMNS)


def time_to_quality_goals(runs: list[dict[str, Any]]) -> str:
    """The issue's goals per (budget, model) on the configurations with 3 seeds."""
    return markdown_table(_quality_report.goals(_quality_report.summarize(runs)),
                          [("budget_s", "budget (s)", "d"), ("model", "model", ""),
                           ("goal", "goal", ""), ("name", "best configuration", ""),
                           ("baseline", "against", ""), ("value", "measured", ""),
                           ("verdict", "verdict", "")])


def time_to_quality_where(runs: list[dict[str, Any]]) -> str:
    """The devices and the corpus the runs measured."""
    devices = sorted({run["device"] for run in runs})
    corpus = runs[0]["corpus"] if runs else {}
    return (f"Runs: {len(runs)} on {', '.join(devices)}; corpus: "
            f"{corpus.get('train_files')} training files ({corpus.get('train_tokens'):,} "
            f"tokens), {corpus.get('held_out_files')} held-out files "
            f"({corpus.get('held_out_tokens'):,} tokens), BPE vocabulary "
            f"{corpus.get('vocab'):,}." if runs else "Not run yet.")


Renderer = tuple[Callable[[Any], str], str]  # (render, what it takes: content, rows, runs)
RENDERERS: dict[str, Renderer] = {
    "mnist": (mnist_tables, "content"),
    "mnist-summary": (mnist_summary, "content"),
    "squad-table": (squad_table, "rows"),
    "squad-goals": (squad_goals, "rows"),
    "squad-left": (squad_left_to_run, "rows"),
    "squad-plot": (squad_plot, "rows"),
    "time-to-quality-table": (time_to_quality_table, "runs"),
    "time-to-quality-goals": (time_to_quality_goals, "runs"),
    "time-to-quality-where": (time_to_quality_where, "runs"),
}


def load(page: Path, files: str, takes: str) -> Any:
    """The JSON a block names: one file's content, the rows of all its files, or the runs
    of one folder's files."""
    paths = [page.parent / name for name in files.split()]
    exists = Path.is_dir if takes == "runs" else Path.is_file
    if missing := [str(path) for path in paths if not exists(path)]:
        raise FileNotFoundError(f"{page.name} renders from {missing}, which do not exist")
    if takes == "runs":
        return [run for path in paths for run in _quality_report.read_runs(path)]
    if takes == "content":
        (path,) = paths
        return json.loads(path.read_text())
    return [row for path in paths for row in squad_report.read_rows(path)]


def render(page: Path) -> str:
    """The page with every generated block rendered from its JSON.

    Raises:
        KeyError: a block naming an unknown renderer.
    """
    def block(match: re.Match) -> str:
        render_fn, takes = RENDERERS[match["renderer"]]
        body = render_fn(load(page, match["files"], takes)).strip()
        body = body + "\n" if body else ""
        return match.group(1) + body + match.group(5)

    return BLOCK.sub(block, page.read_text())


PLOTS = {  # PNG beside the pages -> (its JSON, how to draw it)
    "mnist_accuracy_vs_sparsity.png": "mnist/results.json",
    "squad_f1_vs_sparsity.png": "squad_distill/results.json",
    "squad_scores.png": "squad_distill/results.json",
    "time_to_quality.png": "../../benchmarks/results/time_to_quality",
}
# the scores compared, per pattern: panel -> score -> its runs (examples/configs/squad.yaml);
# squad_f1_vs_sparsity.png plots every other run
SCORE_PANELS = {
    "unstructured (oBERT-style GMP)": {
        "magnitude": ["gmp 80%", "gmp 90%"], "movement": ["movement 80%", "movement 90%"],
        "soft movement": ["soft movement 80%", "soft movement 90%"],
        "second-order": ["second-order 80%", "second-order 90%"],
        "second-order, damp 0.1": ["second-order 80% damp 0.1", "second-order 90% damp 0.1"]},
    "block 32x32 (gradual)": {
        "magnitude": ["block 32x32 50%", "block 32x32 75%"],
        "movement": ["block 32x32 50% movement", "block 32x32 75% movement"],
        "soft movement": ["block 32x32 75% soft movement"],
        "second-order": ["block 32x32 50% second-order", "block 32x32 75% second-order"],
        "second-order, joint": ["block 32x32 50% second-order joint",
                                "block 32x32 75% second-order joint"]},
    "heads + FFN neurons (gradual)": {
        "magnitude": ["heads+neurons 50%"], "movement": ["heads+neurons 50% movement"],
        "second-order": ["heads+neurons 50% second-order"]},
    "2:4 (one-shot, 10 / 20 epochs)": {
        "magnitude": ["2:4"], "second-order": ["2:4 second-order", "2:4 second-order 20 ep"],
        "second-order, damp 0.1": ["2:4 second-order 20 ep damp 0.1"]},
}
SCORE_COLORS = {"magnitude": "tab:grey", "movement": "tab:orange", "soft movement": "tab:red",
                "second-order": "tab:blue", "second-order, damp 0.1": "tab:cyan",
                "second-order, joint": "tab:purple"}


def draw(png: Path, source: Path) -> None:
    """The plot of a results file, as its sweep draws it."""
    if png.name == "time_to_quality.png":
        _quality_report.plot_runs(_quality_report.read_runs(source), png)
    elif png.name.startswith("mnist"):
        content = json.loads(source.read_text())
        plot_vs_sparsity(png, mnist_report.accuracy_series(content["rows"]),
                         metric="test accuracy", title="MNIST LeNet-300-100",
                         dense=content["dense"]["accuracy"], ylim=(0.0, 1.0), zoom=(0.9, 1.0),
                         dashed=["reference finetune"])
    elif png.name == "squad_scores.png":
        draw_scores(png, squad_report.summarize(squad_report.read_rows(source)))
    elif rows := squad_report.read_rows(source):
        compared = {run for panel in SCORE_PANELS.values() for runs in panel.values()
                    for run in runs} - {"2:4"}
        lines = squad_report.summarize(rows)
        series, ranges = squad_report.f1_series([line for line in lines
                                                 if line["name"] not in compared])
        plot_vs_sparsity(png, series, metric="F1", title="SQuAD v1.1: F1 vs sparsity",
                         dense=squad_report.dense_f1(lines), ranges=ranges)


def draw_scores(png: Path, lines: list[dict[str, Any]]) -> None:
    """One panel per pattern of :data:`SCORE_PANELS`: F1 against sparsity, a line per
    score (error bars: min and max over seeds), the dashed line the run's baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {line["name"]: line for line in lines if "f1" in line}
    fig, axes = plt.subplots(1, len(SCORE_PANELS), figsize=(4.2 * len(SCORE_PANELS), 4.4),
                             sharey=True)
    for ax, (title, scores) in zip(axes, SCORE_PANELS.items(), strict=True):
        baselines = set()
        # one sparsity in the panel: a column per score (and per run) instead of an x axis
        columns = len({by_name[r]["sparsity"] for runs in scores.values() for r in runs
                       if r in by_name}) == 1
        names = [r for runs in scores.values() for r in runs if r in by_name]
        for score, runs in scores.items():
            points = [by_name[run] for run in runs if run in by_name]
            if not points:
                continue
            baselines.update(p["baseline"] for p in points)
            x = [names.index(p["name"]) if columns else p["sparsity"] for p in points]
            y = [p["f1"] for p in points]
            errors = [[p["f1"] - p["f1_min"] for p in points],
                      [p["f1_max"] - p["f1"] for p in points]]
            ax.errorbar(x, y, yerr=errors, capsize=3, marker="o", color=SCORE_COLORS[score],
                        ls="-" if len(points) > 1 and not columns else "none", label=score)
        for baseline in sorted(baselines):
            if baseline in by_name:
                ax.axhline(by_name[baseline]["f1"], color="k", ls="--", lw=0.8)
        ax.set_title(title, fontsize=10)
        if columns:
            ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=7)
            ax.set_xlim(-0.5, len(names) - 0.5)
        else:
            ax.set_xlabel("sparsity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    axes[0].set_ylabel("F1 (dashed: dense with the same distillation budget)")
    fig.suptitle("SQuAD v1.1, all-MiniLM-L6-v2: the score that ranks the weights")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 with a diff where a page differs")
    check = parser.parse_args(argv).check
    stale = []
    for page in PAGES:
        text = render(page)
        if text != page.read_text():
            stale.append(page)
            if check:
                sys.stdout.writelines(difflib.unified_diff(
                    page.read_text().splitlines(keepends=True), text.splitlines(keepends=True),
                    str(page), f"{page} from its JSON"))
            else:
                page.write_text(text)
    if check:
        return 1 if stale else 0
    for png, source in PLOTS.items():
        draw(PAGES[0].parent / png, PAGES[0].parent / source)
    print("rewrote " + (", ".join(map(str, stale)) or "nothing: every page matches its JSON"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
