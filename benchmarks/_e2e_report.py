"""The tables of ``e2e_step.py``'s rows: each row's speed-ups and limits against its
dense baseline (:func:`add_limits`), the table (:func:`report`) and the kernel families and
host hotspots of the profiled rows (:func:`print_families`)."""

from __future__ import annotations

import argparse

from _step_profile import FAMILIES, OTHER, amdahl_limit, floor_limit

PROFILED_STEPS = 2  # steps under the torch profiler, then as many under cProfile

def add_limits(rows: list[dict]) -> None:
    """Each successful row gets ``speedup`` (eager dense fused ms / its ms),
    ``speedup_best`` against the fastest ``dense fused`` row (eager or compiled), and a
    compiled row ``speedup_same_mode`` against the dense fused row compiled alike. Where its baseline
    (that row; the eager one for eager rows) measured its shrinkable time, the row gets
    ``amdahl_limit`` at its density from the baseline's step and ``of_limit`` (its speed-up
    against the baseline / the limit), and where the baseline also measured the bandwidth
    floors, ``floor_limit`` and ``of_floor_limit`` alike."""
    done = {r["variant"]: r for r in rows if "error" not in r and r["ms"]}
    eager = done.get("dense fused")
    dense = [r["ms"] for name, r in done.items() if name.partition(" +")[0] == "dense fused"]
    for r in done.values():
        if dense:  # against the faster of eager and compiled dense: what a user would pick
            r["speedup_best"] = min(dense) / r["ms"]
        suffix = r["variant"].partition(" +")[2]
        baseline = done.get("dense fused" + (f" +{suffix}" if suffix else ""))
        if eager is not None:
            r["speedup"] = eager["ms"] / r["ms"]
        if baseline is None:
            continue
        speedup = baseline["ms"] / r["ms"]
        if suffix:
            r["speedup_same_mode"] = speedup
        if "shrinkable" in baseline:
            shrinkable, density = baseline["shrinkable"], 1 - r["sparsity"]
            r["amdahl_limit"] = amdahl_limit(
                baseline["ms"], shrinkable["products_ms"] + shrinkable["optimizer_ms"], density)
            r["of_limit"] = speedup / r["amdahl_limit"] if r["amdahl_limit"] else None
            r["floor_limit"] = floor_limit(baseline["ms"], shrinkable, density)
            r["of_floor_limit"] = speedup / r["floor_limit"] if r["floor_limit"] else None


def cell(value, form: str) -> str:
    """``value`` formatted by ``form``; "-" where a row lacks it (None, or a run saved before
    the script measured it)."""
    return "-" if value is None else form.format(value)


def report(args: argparse.Namespace, rows: list[dict], device: str) -> None:
    """The table of ``rows`` (each given its limits by :func:`add_limits`), then the
    profiled rows' kernel families."""
    add_limits(rows)
    layered = args.model in ("llama", "decoder-1.5b")
    print(f"\n{args.model}{f' ({args.layers} layers)' if layered else ''}, "
          f"bf16-mixed, {device}")
    print(f"{'variant':34s} {'ms/step':>8s} {'vs dense':>8s} {'vs best':>7s} {'vs mode':>7s} "
          f"{'limit':>6s} "
          f"{'of lim':>6s} {'floor':>6s} {'of fl':>6s} "
          f"{'busy':>7s} {'host':>7s} {'peak GiB':>8s} {'tokens/s':>9s} {'trainable':>10s} "
          f"{'compressed':>22s} {'masked':>6s} {'loss first->last':>17s}")
    for r in rows:
        if "error" in r or not r.get("ms"):
            print(f"{r['variant']:34s} FAILED: {r.get('error', 'no step timed')[:200]}")
            continue
        profile = r.get("profile", {})
        kinds = ", ".join(f"{n} {k.replace('Linear', '')}" for k, n in
                          r.get("compressed_layers", {}).items()) or "none"
        tokens, trainable = r.get("tokens"), r.get("trainable_parameters")
        cells = [cell(r.get("speedup"), "{:.2f}x"), cell(r.get("speedup_best"), "{:.2f}x"),
                 cell(r.get("speedup_same_mode"), "{:.2f}x"),
                 cell(r.get("amdahl_limit"), "{:.2f}x"), cell(r.get("of_limit"), "{:.2f}"),
                 cell(r.get("floor_limit"), "{:.2f}x"), cell(r.get("of_floor_limit"), "{:.2f}"),
                 cell(profile.get("busy_ms"), "{:.1f}"),
                 cell(profile.get("exposed_host_ms"), "{:.1f}"),
                 cell(r.get("peak_gib"), "{:.1f}"),
                 cell(tokens and tokens / r["ms"] * 1e3, "{:,.0f}"),
                 cell(trainable and trainable / 1e6, "{:.1f}M"),
                 cell(r.get("masked_dense_tensors"), "{:d}"),
                 cell(r.get("loss_first"), "{:.3f}") + "->" + cell(r.get("loss_last"), "{:.3f}")]
        widths = (8, 7, 7, 6, 6, 6, 6, 7, 7, 8, 9, 10)
        print(f"{r['variant']:34s} {r['ms']:8.1f} "
              + " ".join(f"{c:>{w}s}" for c, w in zip(cells, widths, strict=False))
              + f" {kinds:>22s} {cells[12]:>6s} {cells[13]:>17s}")
    print_families(rows)


def _hotspot(entry: list) -> str:
    """``function own-ms <- caller`` of a ``python_top`` entry (older files: no caller)."""
    name, own, caller = entry[0], entry[1], entry[4] if len(entry) > 4 else None
    return f"{name[-50:]} {own:.2f}" + (f" <- {caller[-40:]}" if caller else "")


def print_families(rows: list[dict]) -> None:
    """The profiled rows' ms per step by kernel family, then their largest "other" kernels."""
    profiled = [r for r in rows if "profile" in r]
    if not profiled:
        return
    families = [family for family, _ in FAMILIES] + [OTHER]
    print(f"\nms per step by kernel family (profiled: {PROFILED_STEPS} steps)")
    print(f"{'variant':34s} " + " ".join(f"{f[:14]:>14s}" for f in families))
    for r in profiled:
        print(f"{r['variant']:34s} " + " ".join(f"{r['profile']['family_ms'][f]:14.2f}"
                                               for f in families))
    for r in profiled:
        print(f"{r['variant']}: largest other: " + "; ".join(
            f"{name[:60]} {ms:.2f}" for name, ms in r["profile"]["top_other"]))
    for r in (r for r in profiled if "python_top" in r["profile"]):
        print(f"{r['variant']}: host Python {r['profile']['python_ms']:.1f} ms a step under "
              f"cProfile; most own time: " + "; ".join(
                  map(_hotspot, r["profile"]["python_top"][:6])))
    for r in (r for r in profiled if r["profile"].get("graphs")):
        graphs = r["profile"]["cuda_graphs"]
        print(f"{r['variant']}: {r['profile']['graphs']} compiled graphs, "
              f"{r['profile']['graph_breaks']} graph breaks" + "".join(
                  f"; CUDA graph {g['inputs']} inputs, {g['static']} static, {g['n_copied']} "
                  f"copied per replay ({', '.join(g['copied'][:4])})" for g in graphs))
    dense = next((r for r in rows if "shrinkable" in r), None)
    if dense:
        shrinkable = dense["shrinkable"]
        print(f"dense shrinkable ms: Linear products {shrinkable['products_ms']:.2f}, AdamW "
              f"{shrinkable['optimizer_ms']:.2f}" + (
                  f"; their bandwidth floor {sum(shrinkable['floor_by_shape_ms']):.2f} at "
                  f"{shrinkable['bandwidth_gbs']:.0f} GB/s" if "floor_by_shape_ms" in shrinkable
                  else ""))
