"""Where cuSPARSELt's 2:4 product runs without error: shapes x token counts x dtypes.

    python3 benchmarks/cusparselt_envelope.py          # on a GPU: one table, JSON under $OUT

A forced sparse route at 128 tokens (fp16, 128->256 and 256->128) once raised "internal
error when calling cusparseLtMatmulSearch" and then "an illegal instruction", which kills
the CUDA context. This probes, for each case, what the 2:4 layer's sparse route calls: pack
(``torch._cslt_compress``), the algorithm search, and the product, checked against a dense
product. Cases run in a child process that stops at the first failure; the parent records
it and starts a new child at the next case, so one crash costs one case; a child that
makes no progress for ``--stall`` seconds is killed and its case recorded as hung. Rows are
printed and the JSON rewritten as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

SHAPES = [(128, 256), (256, 128), (256, 256), (128, 1024), (1024, 128), (512, 512),
          (768, 768), (1024, 1024), (3072, 768), (768, 3072), (4096, 4096)]
TOKENS = [8, 16, 32, 64, 128, 256, 512, 1024, 4096]
DTYPES = ["float16", "bfloat16"]


def cases() -> list[tuple[int, int, int, str]]:
    return [(o, i, t, d) for d in DTYPES for (o, i) in SHAPES for t in TOKENS]


def child(start: int) -> None:
    """Run cases from ``start``; print one JSON line per case; exit 1 at a failure."""
    import torch

    from sparse_training.kernels.semi_structured import cusparselt
    from sparse_training.kernels.semi_structured.cusparselt import (
        PackedWeight,
        search_algorithm,
        sparse_mm,
    )
    from sparse_training.pieces.masks import pattern_mask

    # probe outside the layer's envelope: what it guards is what is measured here
    cusparselt.SPARSE_MIN_FEATURES, cusparselt.SPARSE_MIN_TOKENS = 16, 8
    for index, (out_f, in_f, tokens, dtype_name) in enumerate(cases()[start:], start):
        dtype = getattr(torch, dtype_name)
        row = {"index": index, "out": out_f, "in": in_f, "tokens": tokens, "dtype": dtype_name}
        try:
            weight = torch.randn(out_f, in_f, device="cuda", dtype=dtype)
            mask = pattern_mask(weight, "2:4")
            packed = PackedWeight.pack(weight, mask, dtype)
            x = torch.randn(tokens, in_f, device="cuda", dtype=dtype)
            algorithm = search_algorithm(packed.packed, x.t())
            y = sparse_mm(packed.packed, x, algorithm)
            want = x.float() @ (weight * mask).float().T
            torch.cuda.synchronize()
            row["error"] = float((y.float() - want).norm() / want.norm())
            row["ok"] = row["error"] < 1e-2
        except Exception as err:  # noqa: BLE001 - the failure is the finding
            row.update(ok=False, failure=f"{type(err).__name__}: {str(err)[:200]}")
        print(json.dumps(row), flush=True)
        if not row["ok"]:
            sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=int, default=None)
    parser.add_argument("--stall", type=float, default=30.0)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    rows, start, total = {}, 0, len(cases())
    while start < total:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        while selector.select(timeout=args.stall):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                row = json.loads(line)
                rows[row["index"]] = row
                print(line.strip(), flush=True)
        hung = proc.poll() is None
        proc.kill()
        proc.wait()
        done = max(rows, default=start - 1)
        if done < start or (rows[done]["ok"] and done < total - 1):  # the next case broke
            done = max(done + 1, start)
            out_f, in_f, tokens, dtype = cases()[done]
            why = "hung" if hung else f"process died: {proc.stderr.read().strip()[-200:]}"
            rows[done] = {"index": done, "out": out_f, "in": in_f, "tokens": tokens,
                          "dtype": dtype, "ok": False, "failure": why}
            print(json.dumps(rows[done]), flush=True)
        start = done + 1
        (out / "cusparselt_envelope.json").write_text(json.dumps(
            {"cases": list(rows.values())}, indent=1))
    failures = [r for r in rows.values() if not r["ok"]]
    print(f"{len(rows)} cases, {len(failures)} failed")
    for r in failures:
        print(f"  {r['dtype']:9s} {r['out']:5d}x{r['in']:<5d} {r['tokens']:5d} tokens: "
              f"{r.get('failure') or r.get('error')}")


if __name__ == "__main__":
    main()
