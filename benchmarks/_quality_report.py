"""The results of ``time_to_quality.py``: runs grouped into configurations (mean over seeds),
each against the best dense configuration of its budget, the issue's two goals, and the
plot of held-out loss against wall-clock time. Used by ``time_to_quality.py --plot`` and by
``examples/results_pages.py`` (``docs/results/time_to_quality.md``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

TIME_GOAL = 0.75  # a sparse configuration reaches dense's final loss in <= this x dense's time


def read_run(path: Path) -> dict:
    """The run a JSON file of ``time_to_quality.py`` holds, with the seconds of unrecorded
    warm-up its sweep ran first (``warmed_up_s``, 0: Triton's caches cold), whether it
    shared its process with the sweep's other runs (``same_process``) and the device it
    ran on."""
    saved = json.loads(Path(path).read_text())
    return {**saved["run"], "warmed_up_s": saved.get("warmed_up_s", 0),
            "same_process": saved.get("same_process", False),
            "device": saved["environment"]["device"]}


def read_runs(folder: Path) -> list[dict]:
    """The runs of the JSON files in ``folder``, sorted by file name."""
    return [read_run(path) for path in sorted(Path(folder).glob("*.json"))]


def aligned(runs: list[dict]) -> list[list[dict]]:
    """The seeds' evaluations side by side: one list per step that every seed evaluated
    before its last evaluation, then their last evaluations (the budget ends each seed at
    its own step)."""
    steps = set.intersection(*({point["step"] for point in run["curve"][:-1]}
                               for run in runs))
    at = [{point["step"]: point for point in run["curve"]} for run in runs]
    return [[points[step] for points in at] for step in sorted(steps)] + [
        [run["curve"][-1] for run in runs]]


def mean_curve(runs: list[dict]) -> list[dict]:
    """The seeds' curves averaged over :func:`aligned` evaluations: ``wall_s``, ``tokens``
    and ``held_out_loss``; its last point is the mean final loss."""
    return [{key: statistics.fmean(point[key] for point in points)
             for key in ("wall_s", "tokens", "held_out_loss")} for points in aligned(runs)]


def time_to_reach(curve: list[dict], target: float) -> float | None:
    """The wall-clock seconds at which ``curve`` first reaches ``target`` (linear between
    evaluations), or None where it never does."""
    if curve and curve[0]["held_out_loss"] <= target:
        return curve[0]["wall_s"]
    for before, after in zip(curve, curve[1:], strict=False):
        if after["held_out_loss"] <= target:
            drop = before["held_out_loss"] - after["held_out_loss"]
            share = (before["held_out_loss"] - target) / drop if drop > 0 else 1.0
            return before["wall_s"] + share * (after["wall_s"] - before["wall_s"])
    return None


def summarize(runs: list[dict]) -> list[dict]:
    """One line per (budget, model size, configuration), with its ``runs``: its seeds'
    final held-out losses (mean, range, standard deviation), tokens/s, peak memory,
    parameters kept, and against the dense configuration of its budget and model with the
    lowest mean final loss (the baseline): the gap of the final losses, its tokens/s as a
    multiple of the baseline's (``speed``) and the time its mean curve takes to reach the
    baseline's final loss, as a share of the baseline's wall-clock time."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["budget_s"], model_of(run), run["name"]), []).append(run)
    lines = []
    for (budget, model, name), group in sorted(groups.items()):
        finals = [run["final_held_out_loss"] for run in group]
        curve = mean_curve(group)
        lines.append({
            "budget_s": budget, "model": model, "name": name, "variant": group[0]["variant"],
            "runs": group,
            "seeds": len(group), "final": statistics.fmean(finals),
            "final_min": min(finals), "final_max": max(finals),
            "final_std": statistics.stdev(finals) if len(finals) > 1 else None,
            "wall_s": curve[-1]["wall_s"], "curve": curve,
            "tokens_per_s": statistics.fmean(run["tokens_per_s"] for run in group),
            "peak_gib": statistics.fmean(run["peak_gib"] for run in group)
            if all(run["peak_gib"] is not None for run in group) else None,
            "kept_millions": group[0]["nonzero_parameters"] / 1e6,
            "caches": None if group[0]["variant"] == "dense"  # no Triton kernels
            else "warm" if all(run["warmed_up_s"] for run in group) else "cold",
            "process": _process(group),
            "device": group[0]["device"]})
    for setting in {(line["budget_s"], line["model"]) for line in lines}:
        alike = [line for line in lines if (line["budget_s"], line["model"]) == setting]
        dense = [line for line in alike if line["variant"] == "dense"]
        if not dense:
            continue
        baseline = min(dense, key=lambda line: line["final"])
        for line in alike:
            reached = time_to_reach(line["curve"], baseline["final"])
            line.update(baseline=baseline["name"], gap=line["final"] - baseline["final"],
                        speed=line["tokens_per_s"] / baseline["tokens_per_s"],
                        time_to_baseline_s=reached,
                        time_ratio=None if reached is None else reached / baseline["wall_s"])
    return lines


def _process(group: list[dict]) -> str:
    """Where the seeds of a configuration ran: ``shared`` (one process with the sweep's
    other runs: no start-up per run), ``own`` (a fresh process each) or ``mixed``."""
    shared = {run["same_process"] for run in group}
    return "mixed" if len(shared) > 1 else "shared" if shared.pop() else "own"


def model_of(run: dict) -> str:
    """The model size a run trained, in words (``base, 4 layers, 8x1024``): a wide
    variant widens its size's model, and is measured against its dense."""
    return f"{run['size']}, {run['layers']} layers, {run['batch']}x{run['seq']}"


def goals(lines: list[dict]) -> list[dict]:
    """The issue's goals for each (budget, model) that has a sparse configuration and its
    dense baseline with 3 seeds or more: the best sparse time to dense's final loss (goal:
    <= :data:`TIME_GOAL` x dense's time), and the best sparse final loss against dense's, by
    more than the seed spread (the larger range, max - min, of the two)."""
    by_name = {(line["budget_s"], line["model"], line["name"]): line for line in lines}
    settled: dict[tuple, list[dict]] = {}
    for line in lines:
        if line["variant"] != "dense" and line["seeds"] >= 3 and "baseline" in line and \
                by_name[(line["budget_s"], line["model"], line["baseline"])]["seeds"] >= 3:
            settled.setdefault((line["budget_s"], line["model"]), []).append(line)
    if not settled:
        return [{"goal": "both", "verdict": "not run: no sparse configuration and dense "
                                            "baseline with 3 seeds"}]
    return [goal for (budget, model), sparse in sorted(settled.items())
            for goal in _setting_goals(sparse, by_name[(budget, model, sparse[0]["baseline"])])]


def _setting_goals(sparse: list[dict], dense: dict) -> list[dict]:
    """The two goals of one (budget, model): ``sparse`` lines against their ``dense``."""
    where = {"budget_s": dense["budget_s"], "model": dense["model"], "baseline": dense["name"]}
    reached = [line for line in sparse if line["time_ratio"] is not None]
    fastest = min(reached, key=lambda line: line["time_ratio"]) if reached else None
    best = min(sparse, key=lambda line: line["gap"])
    spread = max(best["final_max"] - best["final_min"], dense["final_max"] - dense["final_min"])
    if -best["gap"] > spread:
        lower = "met"
    elif best["final_max"] < dense["final_min"]:
        lower = "partly: every sparse seed ends below every dense seed, but the mean gap " \
                "is within the larger range"
    else:
        lower = "MISSED"
    time_goal = f"time to dense's final loss <= {TIME_GOAL} x dense's time"
    return [{"goal": time_goal, "name": "none reaches it", "value": "not reached",
             "verdict": "MISSED", **where} if fastest is None else
            {"goal": time_goal, "name": fastest["name"], **where,
             "value": f"{fastest['time_ratio']:.2f}x",
             "verdict": "met" if fastest["time_ratio"] <= TIME_GOAL else "MISSED"},
            {"goal": "final loss below dense's by more than the seed spread",
             "name": best["name"], **where,
             "value": f"{best['gap']:+.3f} (spread {spread:.3f})", "verdict": lower}]


def plot_runs(runs: list[dict], png: Path) -> Path:
    """Held-out loss against wall-clock seconds, a panel per (budget, model), a line per
    configuration (the mean over its seeds; shaded: their range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = summarize(runs)
    panels = sorted({(line["budget_s"], line["model"]) for line in lines})
    figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 7), squeeze=False)
    for axis, panel in zip(axes[0], panels, strict=True):
        shown = [line for line in lines if (line["budget_s"], line["model"]) == panel]
        for line in shown:
            wall = [point["wall_s"] for point in line["curve"]]
            drawn = axis.plot(wall, [point["held_out_loss"] for point in line["curve"]],
                              lw=2 if line["variant"] == "dense" else 1.3,
                              label=f"{line['name']} ({line['seeds']} seed"
                                    f"{'s' * (line['seeds'] > 1)})")
            if line["seeds"] > 1:
                losses = [[point["held_out_loss"] for point in points]
                          for points in aligned(line["runs"])]
                axis.fill_between(wall, [min(v) for v in losses], [max(v) for v in losses],
                                  color=drawn[0].get_color(), alpha=0.15)
        curves = [line["curve"] for line in shown]
        low = min(point["held_out_loss"] for curve in curves for point in curve)
        high = max(curve[len(curve) // 4]["held_out_loss"] for curve in curves)
        axis.set(xlabel="wall-clock seconds of training", ylabel="held-out loss",
                 title=f"budget {panel[0]} s; {panel[1]}",
                 ylim=(low - 0.05, max(high, low + 0.1)))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    figure.suptitle("Time to quality: held-out loss by wall clock")
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png
