"""What every sweep example shares: progress, threads, W&B runs and result files.

A sweep (examples/mnist_sweep.py, examples/squad_sweep.py) keeps its model, data and metric;
this module knows none of them (its settings: examples/sweep_config.py). The config keys it
reads: out_dir, logger (wandb | none), wandb_project, wandb_mode (auto | online | offline |
disabled). In a sweep's order: quiet_lightning, set_threads, setup_wandb -> per run:
Progress.start, make_logger, finish_logger, Progress.finish -> write_results, markdown_table,
plot_vs_sparsity -> log_summary_run -> print(sync_hint(cfg)). `read_offline_run` reads an
offline W&B run back.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import pickle
import shlex
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

# -- Lightning's messages, and the progress of the whole sweep on stdout -----------------------


def quiet_lightning() -> None:
    """Drop per-Trainer banners and the hints that do not apply to a sweep's runs."""
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    # In-memory tensors need no loader workers.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 asks torch's pytree something torch 2.13 deprecates; not ours to fix.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def environment() -> dict[str, Any]:
    """What a result depends on besides its settings: the software, the CPU and the torch
    threads in use (a JSON-able dict, for results files and cache keys)."""
    import platform

    import pytorch_lightning

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "pytorch_lightning": pytorch_lightning.__version__,
            "python": platform.python_version()}


def set_threads(threads: int) -> int:
    """Set torch's intra-op CPU threads to `threads` (0: keep torch's default, one per core),
    print the count in use and return it.

    Sweeps default to 1: on a busy 2-core machine torch's default of 2 threads made the MNIST
    dense run take 619 s against 108 s with 1, and a fixed count also fixes the order of
    floating-point sums, so a seeded run repeats to the last digit."""
    if threads:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    origin = f"threads={threads}" if threads else "threads=0: torch's default"
    print(f"torch CPU threads: {used} ({origin})", flush=True)
    return used


def _duration(seconds: float, coarse: bool = False) -> str:
    """42s, 2m14s; `coarse`: whole minutes from a minute on (2m)."""
    minutes, rest = divmod(round(seconds), 60)
    if not minutes:
        return f"{rest}s"
    return f"{round(seconds / 60)}m" if coarse else f"{minutes}m{rest:02d}s"


class Progress:
    """Overall progress of a sweep on stdout: 'run 3/24 · gmp @ 0.90 · 2m14s elapsed · ~9m left'.

    Elapsed counts from construction; what is left is the mean seconds of the finished runs
    times the runs not yet finished ('estimating' before any has finished).
    """

    def __init__(self, total: int, *, clock: Callable[[], float] | None = None) -> None:
        self.total, self.done, self.label = total, 0, ""
        self._clock = clock or time.perf_counter
        self._begin = self._run_begin = self._clock()
        self._finished_seconds = 0.0

    @property
    def elapsed(self) -> float:
        """Seconds since construction."""
        return self._clock() - self._begin

    def start(self, label: str) -> None:
        """Print the line for the run that starts now."""
        self.label, self._run_begin = label, self._clock()
        left = "estimating time left"
        if self.done:
            mean = self._finished_seconds / self.done
            left = f"~{_duration(mean * (self.total - self.done), coarse=True)} left"
        elapsed = f"{_duration(self._run_begin - self._begin)} elapsed"
        print(f"run {self.done + 1}/{self.total} · {label} · {elapsed} · {left}", flush=True)

    def finish(self, result: str) -> None:
        """Print the run's one result line with its seconds."""
        seconds = self._clock() - self._run_begin
        self.done, self._finished_seconds = self.done + 1, self._finished_seconds + seconds
        print(f"  {self.label}: {result} · {seconds:.0f}s", flush=True)


# -- Weights & Biases ----------------------------------------------------------------------------


def setup_wandb(cfg: DictConfig) -> None:
    """Quiet W&B and resolve wandb_mode=auto: $WANDB_MODE, else online with an API key, else
    offline. Nothing with logger=none."""
    if cfg.logger == "none":
        return
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")  # the sweep prints its own lines
    if cfg.wandb_mode == "auto":  # $WANDB_MODE decides without asking W&B for a login
        cfg.wandb_mode = os.environ.get("WANDB_MODE") or (
            "online" if wandb.login(prompt=False) else "offline")


def _run_args(cfg: DictConfig, group: str, name: str) -> dict[str, Any]:
    """What every W&B run of a sweep is started with; the job type is `name` up to "@"."""
    sweep = {"project": cfg.wandb_project, "group": group, "mode": cfg.wandb_mode}
    return sweep | {"name": name, "job_type": name.split("@")[0]}


def make_logger(cfg: DictConfig, group: str, name: str, config: dict[str, Any]) -> Any:
    """A WandbLogger for one run (its files under out_dir/wandb), or False with logger=none."""
    if cfg.logger == "none":
        return False
    from pytorch_lightning.loggers import WandbLogger

    return WandbLogger(**_run_args(cfg, group, name), save_dir=cfg.out_dir, config=config)


def finish_logger(logger: Any, summary: dict[str, Any]) -> None:
    """Write the run's result into its W&B summary and close the run."""
    if logger:
        logger.experiment.summary.update(summary)
        logger.experiment.finish()


def log_summary_run(
    cfg: DictConfig,
    group: str,
    rows: list[dict[str, Any]],
    *,
    metric: str,
    curve: list[list[Any]],
    title: str,
    plot: Path,
    summary: dict[str, Any] | None = None,
) -> Path:
    """A W&B run named "summary" logging the rows as the table "results", the line plot
    "{metric}_vs_sparsity" over curve = [[series, sparsity, value], ...] and the PNG as
    "{metric}_vs_sparsity_png"; `summary` goes into its summary. Returns the run directory."""
    import wandb

    config = OmegaConf.to_container(cfg, resolve=True)
    run = wandb.init(**_run_args(cfg, group, "summary"), dir=cfg.out_dir, config=config)
    columns = list(dict.fromkeys(k for r in rows for k in r)) or ["sparsity", metric]
    points = wandb.Table(columns=["series", "sparsity", metric], data=curve)
    run.log(
        {
            "results": wandb.Table(columns, [[r.get(c) for c in columns] for r in rows]),
            f"{metric}_vs_sparsity": wandb.plot.line(
                points, "sparsity", metric, stroke="series", title=title
            ),
            f"{metric}_vs_sparsity_png": wandb.Image(str(plot)),
        }
    )
    run.summary.update(summary or {})
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


def sync_hint(cfg: DictConfig) -> str | None:
    """With W&B offline, the command that uploads the sweep's runs; else None."""
    if cfg.logger == "none" or cfg.wandb_mode != "offline":
        return None
    return f"wandb sync {shlex.quote(str(Path(cfg.out_dir) / 'wandb'))}/offline-run-*"


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """What an offline run logged, read back from its `run-*.wandb` file, for tests.

    Every key given to `run.log` or the summary, with its last value: a table as its metadata
    plus its "columns" and "data", an image as its metadata, a chart (wandb.plot) as its panel
    spec. W&B's own "_" keys are left out; "_name" is the run's name, "_config" its config.
    """
    name, config, logged = None, {}, {}
    for record in _finished_records(next(Path(run_dir).glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":  # wandb.init's config rides in the run record
            name = record.run.display_name
        items = {
            "run": record.run.config.update,
            "config": record.config.update,
            "history": record.history.item,
            "summary": record.summary.update,
        }.get(kind, [])
        for item in items:
            tree = config if kind in ("run", "config") else logged
            *parents, leaf = list(item.nested_key) or [item.key]
            for part in parents:
                if not isinstance(tree.get(part), dict):
                    tree[part] = {}
                tree = tree[part]
            tree[leaf] = json.loads(item.value_json)
    charts = config.pop("_wandb", {}).get("visualize", {})
    run = {k: v for k, v in logged.items() if not k.startswith("_")} | charts
    for value in run.values():
        if isinstance(value, dict) and value.get("_type") == "table-file":
            value.update(json.loads((Path(run_dir) / "files" / value["path"]).read_text()))
    return run | {"_name": name, "_config": config}


def _finished_records(path: Path, wait_s: float = 60.0) -> list[Any]:
    """The records of a run's file once it holds the run's ``exit`` record: W&B's service
    process may still be writing it after ``run.finish()`` returns on a busy machine.

    Raises:
        TimeoutError: no ``exit`` record after ``wait_s`` seconds, naming the file.
    """
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = list(_wandb_records(path))
        except DecodeError:  # a record the service process is still writing
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} holds no exit record after {wait_s:.0f} s: the run "
                               "is unfinished or its file truncated")
        time.sleep(0.5)


def _wandb_records(path: Path) -> Iterator[Any]:
    """Records of a `run-*.wandb` file: W&B's LevelDB-style log of protobuf `Record`s.

    Layout: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a
    7-byte header (crc32c, little-endian length, type: 1 full, 2 first, 3 middle, 4 last); a
    block tail shorter than a chunk header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written: the file ends here
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def cached_training(cache_dir: str | Path, prefix: str, settings: dict[str, Any],
                    train: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """``train()``'s state dict and its seconds: from ``cache_dir/prefix-<hash>.pt`` when
    trained before with the same ``settings`` (a JSON-able dict of everything the result
    depends on; a line says so), else trained now and saved there. The file is written
    under a temporary name in the same folder, then renamed, so a sweep killed mid-save
    leaves none; a file that does not load as such a cache (torn, or another program's) is
    named, trained again and replaced."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"{prefix}-{key}.pt"
    if path.is_file():
        try:
            cached = torch.load(path)
            state, seconds = cached["state_dict"], float(cached["seconds"])
            if not isinstance(state, dict):
                raise TypeError(f"its state_dict is a {type(state).__name__}, not a dict")
        except (OSError, EOFError, RuntimeError, ValueError, KeyError, TypeError,
                pickle.UnpicklingError) as error:
            print(f"dense net: the cache file {path} (cache_dir={cache_dir}) does not load "
                  f"({type(error).__name__}: {str(error)[:160]}); training again to replace it")
        else:
            print(f"dense net: cached {path}")
            return state, seconds
    start = time.perf_counter()
    state = train()
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save({"state_dict": state, "seconds": seconds}, partial)
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)
    return state, seconds


# -- result files: results.csv and results.json, markdown tables, the plot ----------------------


def write_results(
    out_dir: Path, rows: list[dict[str, Any]], *, meta: dict[str, Any] | None = None
) -> list[Path]:
    """results.csv (one line a row; a key missing from a row is left blank) and results.json
    (the rows; with `meta`, {**meta, "rows": rows}). Returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / "results.csv", out_dir / "results.json"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    content = rows if meta is None else {**meta, "rows": rows}
    # a sweep killed while writing (a device call's time limit) keeps the previous file whole
    partial = json_path.with_name(json_path.name + ".partial")
    partial.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(partial, json_path)
    return [csv_path, json_path]


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (key, header, format spec such as ".4f" or ""), and a
    value missing from a row (or None) is shown as "–"."""

    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        value = row.get(key)
        return "–" if value is None else format(value, spec).replace("|", "\\|")

    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(cell(r, k, spec) for k, _, spec in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_vs_sparsity(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    *,
    metric: str,
    title: str,
    dense: float | None = None,
    ylim: tuple[float, float] | None = None,
    zoom: tuple[float, float] | None = None,
    dashed: Iterable[str] = (),
    ranges: Mapping[str, list[tuple[float, float]]] | None = None,
) -> Path:
    """A PNG (matplotlib Agg): one line with markers per series (x sparsity, y metric), a dashed
    horizontal line at `dense`, a legend. The x axis is logit-scaled when every sparsity lies
    in (0, 1), spreading 0.9 .. 0.99; `zoom` adds a panel with those y limits; series named in
    `dashed` (a reference) are drawn black and dashed. `ranges[name]` gives each point of
    that series (in its order) a (low, high) error bar, e.g. the min and max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [ylim, zoom] if zoom else [ylim]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    xs = sorted({x for points in series.values() for x, _ in points})
    for ax, limits in zip(axes[0], panels, strict=True):
        for name, points in series.items():
            style = {"color": "k", "ls": "--", "marker": "x"} if name in dashed else {"marker": "o"}
            if len({x for x, _ in points}) == 1:  # points at one sparsity: no line through them
                style["ls"] = "none"
            bounds = (ranges or {}).get(name) or [None] * len(points)
            ordered = sorted(zip(points, bounds, strict=True), key=lambda pair: pair[0])
            x, y = zip(*(point for point, _ in ordered), strict=True)
            errors = None
            if ranges and name in ranges:  # (below, above) each point
                errors = [[yy - low for yy, (_, (low, _)) in zip(y, ordered, strict=True)],
                          [high - yy for yy, (_, (_, high)) in zip(y, ordered, strict=True)]]
            ax.errorbar(x, y, yerr=errors, capsize=3, label=name, **style)
        if dense is not None:
            ax.axhline(dense, color="grey", ls="--", lw=0.8, label="dense")
        if xs and xs[0] > 0 and xs[-1] < 1:
            ax.set_xscale("logit")
        ax.set_xticks(xs, [f"{x:.0%}" for x in xs])
        ax.minorticks_off()
        ax.set(xlabel="sparsity", ylabel=metric, ylim=limits)
        ax.grid(alpha=0.3)
        ax.set_title(title if ax is axes[0][0] else f"zoom: {limits[0]:g} - {limits[1]:g}")
    if axes[0][-1].get_legend_handles_labels()[0]:  # nothing to name where no run scored
        axes[0][-1].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
