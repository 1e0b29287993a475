"""``torch.compile`` of an HF model whose Linears the callback compresses, through
``pl.Trainer`` on the CPU (bf16 autocast, the kernels under the Triton interpreter): the
compiled model traces one graph per step shape (``fullgraph=True`` raises at any graph
break) after the Trainer has moved it, and trains as the eager model does. The GPU test of
the same path is ``tests/test_gpu.py::test_trainer_compressed_hf_model_trains_and_matches_eager``.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from tiny_hf import FAMILIES, TinyHF, hf_loader
from torch.utils.data import DataLoader

from sparse_training import BlockSparseLinear, SlimLinear, SparsityCallback

SMALL = dict(hidden=32, heads=2)  # TinyHF's widths for the CPU
# (settings, compressed layer type, TinyHF's widths): heads and neurons want 2 key/value heads
COMPRESSED = {
    "block": (dict(pattern="block:16x16", sparsity=0.5), BlockSparseLinear, SMALL),
    "heads+neurons": (dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                           overrides={"attention|attn": {"pattern": "head"}}), SlimLinear,
                      dict(hidden=32, heads=4)),
}


def loader(family: str, batches: int = 3) -> DataLoader:
    return hf_loader(family, batches=batches, batch=2, seq=16, attention_mask=True)


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("kind", list(COMPRESSED))
def test_a_compiled_compressed_hf_model_is_one_graph_and_trains_as_eager(kind, family,
                                                                         accelerator, tmp_path):
    """Compiled with ``fullgraph=True``, the compressed model trains as the eager one, and
    its Lightning checkpoint loads strictly into the plain model as written (compiled in
    ``__init__``, never compressed): each weight is the compressed layer's dense form. On
    the GPU (``-m gpu``) with the compiled kernels and the GPU machine's own torch, whose
    compiler may break graphs where this machine's does not (at a compressed layer's
    autocast check, say). Blocks (``BlockSparseLinear``) and removed heads and neurons
    (``SlimLinear``)."""
    torch._dynamo.reset()
    settings, layer_type, widths = COMPRESSED[kind]
    losses = {}
    for compiled in (False, True):
        model = TinyHF("default" if compiled else None, family=family, backend="aot_eager",
                       fullgraph=True, **widths)
        sparse = SparsityCallback(**settings, compress=True, deny=FAMILIES[family][0])
        trainer = pl.Trainer(accelerator=accelerator, devices=1, precision="bf16-mixed",
                             max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[sparse])
        trainer.fit(model, loader(family))
        layers = [m for m in model.modules() if isinstance(m, layer_type)]
        assert len(layers) == 2 * FAMILIES[family][1]
        losses[compiled] = model.losses
    assert len(losses[True]) == 3 and all(map(torch.isfinite, torch.tensor(losses[True])))
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               atol=0.05, rtol=0.02)
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    plain = TinyHF.load_from_checkpoint(tmp_path / "compiled.ckpt")  # strict, compiled
    weights = dict(plain.named_parameters())
    for name, layer in model.named_modules():
        if isinstance(layer, layer_type):
            assert torch.equal(weights[f"{name}.weight"], layer.to_dense().weight.detach())


class GraphCount(pl.Callback):
    """torch._dynamo's count of distinct compiled graphs at the end of every step, and the
    compressed layers' block masks when training starts."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.first_masks: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        self.first_masks = [m.block_mask.to("cpu", copy=True)  # fit ends on the CPU
                            for m in pl_module.modules()
                            if isinstance(m, BlockSparseLinear)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch._dynamo.utils import counters

        self.counts.append(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("accelerator, compile_kwargs", [
    ("cpu", dict(backend="aot_eager")),
    pytest.param("gpu", dict(mode="reduce-overhead"), marks=[  # CUDA graphs: the probe is
        pytest.mark.gpu,                                        # an input at one address
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_compiled_rigl_on_compressed_layers_regrows_without_piling_up_graphs(
        accelerator, compile_kwargs):
    """RigL on compressed layers records the dense gradient at its update steps through an
    autograd function that ``torch.compile`` traces into the graph: regrowing at every
    step, nothing breaks the graph, the graphs stop growing once each kind of step has
    compiled, and blocks move."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TinyHF(family="llama", **SMALL)
    model.model = torch.compile(model.model, **compile_kwargs)
    sparse = SparsityCallback(pattern="block:16x16", sparsity=0.5, compress=True,
                              deny=FAMILIES["llama"][0], regrow="rigl", frequency=1, regrow_end=1.0)
    counter, data = GraphCount(), loader("llama", batches=9)
    pl.Trainer(accelerator=accelerator, devices=1, precision="bf16-mixed", max_epochs=1,
               logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, callbacks=[sparse, counter]).fit(model, data)
    assert sparse.engine.updater.last_regrow == 8 and len(counter.counts) == 9
    assert counter.counts[4] == counter.counts[-1] > 0  # none after the first steps
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    last = [m.block_mask for m in model.modules() if isinstance(m, BlockSparseLinear)]
    assert len(last) == 14
    assert any(not torch.equal(a, b) for a, b in zip(counter.first_masks, last, strict=True))
    assert all(map(torch.isfinite, torch.tensor(model.losses)))
