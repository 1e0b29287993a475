"""cuSPARSELt's algorithm search and product through torch alone (no sparse_training code).

    python3 benchmarks/cusparselt_raw_search.py float16 1024 1024 2048   # dtype out in tokens

One case per process (a failed search can end the CUDA context): packs a 2:4 weight with
``torch._cslt_compress``, runs ``torch._C._cusparselt.mm_search`` and the searched product,
and prints the search result and the relative error against a dense product. On the H100
(torch 2.11.0+cu130, cuSPARSELt 0.8.0) fp16 failed with "internal error when calling
cusparseLtMatmulSearch" at 1024x1024 and 4096x4096 with 2048 tokens while bf16 ran (this is
why the 2:4 layer's sparse route takes bf16 only; benchmarks/NOTES_semi_structured.md).
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    dtype = getattr(torch, sys.argv[1])
    out_features, in_features, tokens = map(int, sys.argv[2:5])
    weight = torch.randn(out_features, in_features, device="cuda", dtype=dtype)
    mask = torch.zeros(out_features, in_features // 4, 4, device="cuda", dtype=torch.bool)
    mask[..., :2] = True  # the first 2 of every 4 inputs
    masked = torch.where(mask.view(out_features, in_features), weight, 0)
    packed = torch._cslt_compress(masked)
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    alg_id, split_k, split_k_mode, _ = torch._C._cusparselt.mm_search(
        packed, x.t(), None, None, None, True)
    y = torch._cslt_sparse_mm(packed, x.t(), None, transpose_result=True, alg_id=alg_id,
                              split_k=split_k, split_k_mode=split_k_mode)
    want = x.float() @ masked.float().T
    torch.cuda.synchronize()
    print(f"ok {sys.argv[1:]} alg_id={alg_id} split_k={split_k} error="
          f"{float((y.float() - want).norm() / want.norm()):.2e}")


if __name__ == "__main__":
    main()
