"""The SQuAD sweep's results: one line per run over its seeds, the table, the plot, W&B.

    lines = summarize(rows)                      # rows: results.json's, one per run and seed
    print(markdown_table(lines, COLUMNS))

Used by examples/squad_sweep.py (results.md, the plot, the W&B summary) and
examples/results_pages.py (the tables of docs/results/squad.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, NoReturn

import reporting
from omegaconf import DictConfig
from reporting import markdown_table
from sweep_config import ConfigError

MEANS = ("sparsity", "exact_match", "f1", "pruned_f1", "kept_magnitude_gain", "seconds")
COLUMNS = [("name", "run", ""), ("family", "family", ""), ("sparsity", "sparsity", ".3f"),
           ("f1", "F1", ".2f"), ("f1_per_seed", "F1 per seed", ""),
           ("f1_spread", "F1 spread", ".2f"), ("f1_gap", "F1 - baseline", "+.2f"),
           ("baseline", "baseline", ""), ("exact_match", "EM", ".2f"),
           ("pruned_f1", "F1 pruned, before training", ".2f"),
           ("kept_magnitude_gain", "kept magnitude gain", "+.2%"), ("epochs", "epochs", "d"),
           ("seeds", "seeds", "d"), ("seconds", "s per run", ".0f"), ("error", "error", "")]


def read_results(path: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The rows and the run settings of a results.json: ``{"settings": ..., "rows": [...]}``,
    or the plain list of rows earlier sweeps wrote (no settings).

    Raises:
        ConfigError: a file that is not JSON of that form (each row a mapping with a run
            ``name`` and an int ``seed``), naming the file and what it holds instead.
    """
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path} is not a readable squad_sweep results.json: {error}") from error
    rows, settings = content, {}
    if isinstance(content, dict):
        rows, settings = content.get("rows"), content.get("settings", {})
    if not isinstance(rows, list) or not isinstance(settings, dict):
        _not_results(path, "not a list of rows or a mapping with 'rows'")
    for index, row in enumerate(rows):
        if not (isinstance(row, dict) and isinstance(row.get("name"), str)
                and type(row.get("seed")) is int):
            _not_results(path, f"row {index} has no run name and int seed: {str(row)[:80]}")
    return rows, settings


def _not_results(path: Path, why: str) -> NoReturn:
    raise ConfigError(f"{path} is not a squad_sweep results.json ({why}): give the "
                      f"results.json a squad_sweep run wrote")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results.json (:func:`read_results`)."""
    return read_results(path)[0]


def previous_results(cfg: DictConfig, settings: dict[str, dict[str, Any]]
                     ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The finished rows and the run settings of out_dir/results.json (nothing with
    resume=false or no file); failed rows are dropped, to run again, with new settings where
    none of the run's rows finished.

    Raises:
        ConfigError: a run of this sweep is in the file with other settings (naming them).
    """
    path = Path(cfg.out_dir) / "results.json"
    if not cfg.resume or not path.is_file():
        return [], {}
    rows, saved = read_results(path)
    finished = [r for r in rows if "error" not in r]
    # a run whose every row failed runs again with whatever settings it has now
    saved = {name: kept for name, kept in saved.items() if name in {r["name"] for r in finished}}
    for name, mine in settings.items():
        if name in saved and saved[name] != mine:
            raise ConfigError(
                f"{path} holds run {name!r} made with other settings "
                f"({differences(saved[name], mine, 'there', 'now')}); pass another out_dir, or "
                f"resume=false to start over")
    return finished, saved


def differences(old: dict[str, Any], new: dict[str, Any], old_label: str, new_label: str) -> str:
    """The keys whose values differ and both values: "epochs: [1] there, [2] now"."""
    changed = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    return (f"{', '.join(changed)}: {[old.get(k) for k in changed]} {old_label}, "
            f"{[new.get(k) for k in changed]} {new_label}")


def merge_results(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The rows and run settings of several results.json files as one (a sweep split over
    machines or calls): each (run, seed) pair's row once (a failed row gives way to a
    finished one), each run's settings once, in the files' order.

    Raises:
        ConfigError: a missing file; a run whose settings differ between two files, or a
            (run, seed) pair with two different finished rows (two trainings of it), naming
            both files and what differs.
    """
    if missing := [str(path) for path in paths if not path.is_file()]:
        raise ConfigError(f"replay: no results file {missing}")
    rows: dict[tuple[str, int], tuple[dict[str, Any], Path]] = {}
    settings: dict[str, tuple[dict[str, Any], Path]] = {}
    for path in paths:
        file_rows, saved = read_results(path)
        for name, mine in saved.items():
            if name in settings and settings[name][0] != mine:
                first, where = settings[name]
                raise ConfigError(f"run {name!r} has other settings in {path} than in {where} "
                                  f"({differences(first, mine, 'there', 'here')})")
            settings.setdefault(name, (mine, path))
        for row in file_rows:
            key = (row["name"], row["seed"])
            kept = rows.get(key)
            if kept is None or ("error" in kept[0] and "error" not in row):
                rows[key] = (row, path)
            elif "error" not in kept[0] and "error" not in row and kept[0] != row:
                raise ConfigError(
                    f"run {key[0]!r} at seed {key[1]} has other results in {path} than in "
                    f"{kept[1]} ({differences(kept[0], row, 'there', 'here')}): two trainings "
                    f"of one (run, seed) pair; keep it in one file only")
    return [row for row, _ in rows.values()], {name: s for name, (s, _) in settings.items()}


def sorted_rows(rows: list[dict[str, Any]], order: dict[str, int]) -> list[dict[str, Any]]:
    """Rows in the order of the config's runs (rows of runs it no longer has last), then by
    seed."""
    return sorted(rows, key=lambda r: (order.get(r["name"], len(order)), r["seed"]))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per run, in the rows' order: means over its seeds, each seed's F1, the
    spread (max - min) and the gap to its baseline run, paired by seed (each seed's run
    against the same seed's baseline, averaged over the seeds both have)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append(row)
    lines = []
    for name, mine in by_name.items():
        scored = sorted((r for r in mine if "f1" in r), key=lambda r: r["seed"])
        # rows of sweeps before baselines were named compare with dense
        line = {"name": name, "family": mine[0]["family"], "seeds": len(scored),
                "baseline": mine[0].get("baseline", "dense"), "epochs": mine[0].get("epochs")}
        for key in MEANS:
            if values := [r[key] for r in scored if key in r]:
                line[key] = statistics.mean(values)
        if scored:
            line["f1_per_seed"] = " / ".join(f"{r['f1']:.2f}" for r in scored)
            line["f1_min"] = min(r["f1"] for r in scored)
            line["f1_max"] = max(r["f1"] for r in scored)
            line["f1_spread"] = line["f1_max"] - line["f1_min"]
        if errors := [r["error"] for r in mine if "error" in r]:
            line["error"] = errors[0]
        lines.append(line)
    f1_by_seed = {name: {r["seed"]: r["f1"] for r in mine if "f1" in r}
                  for name, mine in by_name.items()}
    for line in lines:
        own, base = f1_by_seed[line["name"]], f1_by_seed.get(line["baseline"] or "", {})
        if common := sorted(set(own) & set(base)):
            line["f1_gap"] = statistics.mean(own[s] - base[s] for s in common)
    return lines


def f1_series(lines: list[dict[str, Any]]) -> tuple[dict[str, list[tuple[float, float]]],
                                                    dict[str, list[tuple[float, float]]]]:
    """(sparsity, mean F1) per family of sparse runs, and each point's (min, max) over seeds."""
    series: dict[str, list[tuple[float, float]]] = {}
    ranges: dict[str, list[tuple[float, float]]] = {}
    for line in lines:
        if line["family"] == "dense" or "f1" not in line:
            continue
        series.setdefault(line["family"], []).append((line["sparsity"], line["f1"]))
        ranges.setdefault(line["family"], []).append((line["f1_min"], line["f1_max"]))
    return series, ranges


def dense_f1(lines: list[dict[str, Any]]) -> float | None:
    """The mean F1 of the baseline most runs are measured against (the dense line)."""
    baselines = [line["baseline"] for line in lines if line.get("baseline")]
    common = max(set(baselines), key=baselines.count) if baselines else "dense"
    return next((line["f1"] for line in lines if line["name"] == common and "f1" in line), None)


def report(cfg: DictConfig, rows: list[dict[str, Any]], group: str, header: str,
           settings: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """results.csv/json (rows, and the settings of every run), results.md (header and table),
    f1_vs_sparsity.png (error bars: min and max over seeds) and the W&B summary run."""
    out = Path(cfg.out_dir)
    lines = summarize(rows)
    written = reporting.write_results(out, rows, meta={"settings": settings})
    (out / "results.md").write_text(f"{header}\n\n{markdown_table(lines, COLUMNS)}\n")
    series, ranges = f1_series(lines)
    png = reporting.plot_vs_sparsity(out / "f1_vs_sparsity.png", series, metric="F1",
                                     title=title, dense=dense_f1(lines), ranges=ranges)
    print("results: " + ", ".join(map(str, [out / "results.md", *written, png])))
    if cfg.logger == "wandb":
        curve = [[line["family"], line["sparsity"], line["f1"]] for line in lines if "f1" in line]
        reporting.log_summary_run(cfg, group, lines, metric="f1", curve=curve,
                                  title="SQuAD F1 vs sparsity", plot=png,
                                  summary={"dense_f1": dense_f1(lines)})
        if hint := reporting.sync_hint(cfg):
            print(hint)
    return lines


def replay_paths(cfg: DictConfig) -> list[Path]:
    """The results.json files `replay` names: one path or a list."""
    return [Path(cfg.replay)] if isinstance(cfg.replay, str) else [Path(p) for p in cfg.replay]


def replay(cfg: DictConfig, group: str, title: str, rows: list[dict[str, Any]],
           settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows and settings of an earlier sweep's results.json (or of several, merged by
    `merge_results`), logged to W&B as its runs would have been (one run per configuration
    and seed, its row as the summary), then reported under the header line of the
    results.md beside each file."""
    paths = replay_paths(cfg)
    headers = []
    for path in paths:  # the header: the lines above the table
        table = path.parent / "results.md"  # a cut-off sweep leaves none: then a plain header
        headers.append(table.read_text().split("\n\n")[0] if table.is_file()
                       else f"replayed from {path}")
    header = headers[0] if len(paths) == 1 else "\n".join(
        [f"merged from {len(paths)} results files:"]
        + [f"- {path}: " + text.replace("\n", "\n  ")
           for path, text in zip(paths, headers, strict=True)])
    for row in rows:
        logger = reporting.make_logger(cfg, group, f"{row['name']}@seed{row['seed']}",
                                       {"run": row["name"], "family": row["family"],
                                        "seed": row["seed"],
                                        "replayed_from": ", ".join(map(str, paths))})
        reporting.finish_logger(logger, row)
    report(cfg, rows, group, header, settings, title)
    return rows
