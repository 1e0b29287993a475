"""One set of selection settings selects the same tensors whether they train masked-dense or
compressed: the callback plans once at the swap and again when its engine starts, on the
swapped model, and the two plans must agree (``dense_ratio`` blocks, regexes written
against the dense weight names)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from tiny_hf import FAMILIES, TinyHF, hf_loader
from torch import nn

from sparse_training import BlockSparseLinear, SparsityCallback


def fit(family: str, compress: bool, layers: int = 2, deny: list[str] | None = None,
        **settings) -> TinyHF:
    model = TinyHF(family=family, hidden=64, layers=layers)
    callback = SparsityCallback(pattern="block:16x16", sparsity=0.75, compress=compress,
                                deny=FAMILIES[family][0] if deny is None else deny, **settings)
    pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False,
               callbacks=[callback]).fit(model, hf_loader(family, batches=1, batch=2, seq=16))
    return model


def densities(model: nn.Module) -> dict[str, float]:
    """Per Linear of the decoder/encoder layers: the fraction of its weight kept (nonzero)."""
    out = {}
    for name, module in model.named_modules():
        if ".layers." not in name and ".layer." not in name:
            continue
        if isinstance(module, BlockSparseLinear):
            out[name] = float((module.to_dense().weight != 0).float().mean())
        elif isinstance(module, nn.Linear):
            out[name] = float((module.weight != 0).float().mean())
    return out


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_dense_ratio_keeps_the_same_layers_dense_when_compressed(family):
    """dense_ratio 0.5 of four layers: layers 0 and 1 dense, 2 and 3 pruned, in both modes
    (the engine plans again on the swapped model: it must count the compressed blocks)."""
    settings = dict(layers=4, dense_ratio=0.5)
    masked, compressed = fit(family, False, **settings), fit(family, True, **settings)
    expected = densities(masked)
    first_two = {n: any(f".{i}." in n for i in (0, 1)) for n in expected}
    assert {n: d == 1.0 for n, d in expected.items()} == first_two, expected
    assert densities(compressed) == pytest.approx(expected, abs=1e-6)
    kinds = {n: type(m).__name__ for n, m in compressed.named_modules() if n in expected}
    assert {n: k == "Linear" for n, k in kinds.items()} == first_two, kinds


@pytest.mark.parametrize("settings", [
    dict(allow=[r"query\.weight$"]),
    dict(overrides={r"query\.weight$": {"sparsity": 0.5}}),
])
def test_regexes_on_the_dense_weight_names_select_compressed_layers(settings):
    """allow / overrides regexes written against ``...query.weight`` (the names the setup
    table and the docs show) select the same tensors after the swap made them
    ``...query.values``."""
    masked, compressed = fit("bert", False, **settings), fit("bert", True, **settings)
    assert densities(compressed) == pytest.approx(densities(masked), abs=1e-6)
    queries = [m for n, m in compressed.named_modules() if n.endswith("query")]
    assert len(queries) == 2 and all(isinstance(m, BlockSparseLinear) for m in queries)
    expected_density = 0.5 if "overrides" in settings else 0.25
    assert all(m.nnz / torch.Size(m.block_mask.shape).numel() == expected_density
               for m in queries)
