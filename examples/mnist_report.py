"""The MNIST sweep's tables, from its results (the content of results.json).

    content = json.loads(Path("outputs/mnist/results.json").read_text())
    print(results_markdown(content))      # the results.md the sweep writes
    print(by_sparsity_table(content))     # accuracy per sparsity and method, beside the reference

Used by examples/mnist_sweep.py (results.md) and examples/results_pages.py (the tables of
docs/results/mnist.md), so a page and its JSON cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from reporting import markdown_table

# The reference table of the issue (a small FC net): sparsity -> (original, prune, finetune).
REFERENCE = {
    0.70: (0.9604, 0.9566, 0.9682),
    0.80: (0.9545, 0.9460, 0.9656),
    0.90: (0.9534, 0.8845, 0.9615),
    0.95: (0.9569, 0.4923, 0.9395),
    0.98: (0.9570, 0.2158, 0.8074),
    0.99: (0.9565, 0.0982, 0.3052),
}
# The goal for the best fine-tuned method of each row, on the full test set.
GOAL = {0.70: 0.98, 0.80: 0.98, 0.90: 0.98, 0.95: 0.98, 0.98: 0.975, 0.99: 0.96}

RESULTS_MD = """\
# MNIST sparsity sweep: LeNet-300-100

{about}

{by_sparsity}

## Every run

{every_run}

{environment}
"""
RUN_COLUMNS = [  # the table of every run: key, header, format
    ("method", "method", ""),
    ("sparsity", "target", ".0%"),
    ("sparsity_layers", "sparsity (pruned layers)", ".4%"),
    ("sparsity_all", "sparsity (all)", ".4%"),
    ("weights", "weights kept", ""),
    ("params", "params kept", ""),
    ("per_layer", "per layer", ""),
    ("accuracy", "accuracy", ".4f"),
    ("seconds", "seconds", ".1f"),
]


def about(content: dict[str, Any]) -> str:
    """What the accuracy columns are, in one paragraph."""
    cfg = content["config"]
    return (f"Accuracy on {cfg['test_size'] or 10000:,} test images. original = the dense net "
            f"(dense_epochs={cfg['dense_epochs']}); each method's column is its accuracy at "
            f"that sparsity (fine-tuning runs: epochs={cfg['epochs']}). ref = the issue's "
            f"reference table (a small FC net). Goal: the best fine-tuned method of each row "
            f"reaches the goal.")


def by_sparsity_table(content: dict[str, Any]) -> str:
    """One line per sparsity: the dense accuracy, each method's, the reference's three
    columns and whether the best fine-tuned method meets the goal."""
    rows, cfg = content["rows"], content["config"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    refs = ["ref original", "ref prune", "ref finetune"]
    lines = []
    for s in cfg["sparsities"]:
        line = {"sparsity": s, "original": content["dense"]["accuracy"]}
        line |= {r["method"]: r["accuracy"] for r in rows if r["sparsity"] == s}
        line |= dict(zip(refs, REFERENCE.get(s, ()), strict=False))
        # The goal is about fine-tuned nets: the best of them at this sparsity.
        tuned = [r for r in rows
                 if r["sparsity"] == s and cfg["method_specs"][r["method"]]["train"]]
        if (best := max(tuned, key=lambda r: r["accuracy"], default=None)) and s in GOAL:
            verdict = "meets" if best["accuracy"] >= GOAL[s] else "MISSES"
            line["goal"] = f"{best['method']} {best['accuracy']:.4f} {verdict} {GOAL[s]}"
        lines.append(line)
    columns = [("sparsity", "sparsity", ".0%"), ("original", "original", ".4f")]
    columns += [(key, key, ".4f") for key in methods + refs]
    columns += [("goal", "best fine-tuned vs goal", "")]
    return markdown_table(lines, columns)


def every_run_table(content: dict[str, Any]) -> str:
    """Every run: the sparsity reached over the pruned layers and over every parameter, the
    kept counts, where the zeros went, accuracy and seconds."""
    rows = [
        r
        | {"weights": f"{r['weights_kept']:,} / {r['weights_total']:,}"}
        | {"params": f"{r['params_kept']:,} / {r['params_total']:,}"}
        for r in content["rows"]
    ]
    return ("sparsity (pruned layers) = zeros among the weights the callback masks; sparsity "
            "(all) = zeros among every parameter, biases included.\n\n"
            + markdown_table(rows, RUN_COLUMNS))


def environment(content: dict[str, Any]) -> str:
    """Where and how long it ran: the dense run, the whole sweep, the software and CPU."""
    dense, env = content["dense"], content["environment"]
    return (f"Dense run: {dense['seconds']:.1f} s; sweep total {dense['sweep_seconds']:.0f} s "
            f"(wall time, including the dense run unless it came from the cache). "
            f"{env['cpu']}, {env['threads']} torch thread(s); torch {env['torch']}, "
            f"pytorch-lightning {env['pytorch_lightning']}, Python {env['python']}.")


def results_markdown(content: dict[str, Any]) -> str:
    """results.md: the table by sparsity, every run in detail, the environment."""
    return RESULTS_MD.format(about=about(content), by_sparsity=by_sparsity_table(content),
                             every_run=every_run_table(content),
                             environment=environment(content))


def accuracy_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(sparsity, accuracy) points per method, then the reference's finetune column."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(r["method"], []).append((r["sparsity"], r["accuracy"]))
    return series | {"reference finetune": [(s, ref[2]) for s, ref in REFERENCE.items()]}
