"""Bad input to the 2:4 kernels' entry points (cuSPARSELt's matmul, search and packing, the
choice of paths): products too small for cuSPARSELt are refused before any call to it,
naming the size and its threshold; an unknown timing names the valid ones. They run on CPU
tensors: each refusal comes before cuSPARSELt or a GPU is needed."""

from __future__ import annotations

import pytest
import torch

from sparse_training.kernels.semi_structured import cusparselt, paths

ROWS_ONLY_2_4 = torch.tensor([True, True, False, False]).repeat(8, 4)  # 2:4 rows, 4:4 columns

ERRORS = [  # (call, error, message)
    (lambda: cusparselt.sparse_mm(torch.zeros(8), torch.randn(128, 2048),
                                  cusparselt.Algorithm()), RuntimeError,
     r"not calling cuSPARSELt \(matmul\): 128 tokens, under 1024 \(SPARSE_MIN_TOKENS"),
    (lambda: cusparselt.sparse_mm(torch.zeros(8), torch.randn(1024, 256),
                                  cusparselt.Algorithm()), RuntimeError,
     r"\(matmul\): in_features 256 under 1024 \(SPARSE_MIN_FEATURES"),
    (lambda: cusparselt.search_algorithm(torch.zeros(8), torch.randn(2048, 1016)), RuntimeError,
     r"\(search\): 1016 tokens, under 1024"),
    (lambda: cusparselt.PackedWeight.pack(torch.randn(256, 128), ROWS_ONLY_2_4, torch.float16),
     RuntimeError, r"\(pack\): out_features 256 and in_features 128 under 1024"),
    (lambda: paths.choose_paths(torch.randn(2048, 2048), torch.float16, 128, "eager", None,
                                False), RuntimeError,
     "not timing cuSPARSELt for a 2048x2048 weight: 128 tokens, under 1024"),
    (lambda: paths.choose_paths(torch.randn(2048, 2048), torch.float16, 2048, "graph", None,
                                False), ValueError,
     r"timing must be one of \('eager', 'cuda_graph'\), got 'graph'"),
]


@pytest.mark.parametrize(("call", "error", "message"), ERRORS,
                         ids=[f"{i}-{m[:28]}" for i, (_, _, m) in enumerate(ERRORS)])
def test_products_too_small_for_cusparselt_are_refused_before_calling_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_table_holds_every_case():
    """Guards against a row lost in an edit."""
    assert len(ERRORS) == 6
