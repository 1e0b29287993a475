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
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import BlockSparseLinear, SparsityCallback

VOCAB, SEQ = 96, 16
DENY = {"bert": ["embeddings", "qa_outputs"], "llama": ["embed_tokens", "lm_head"]}
LINEARS_PER_LAYER = {"bert": 6, "llama": 7}


class TinyHF(pl.LightningModule):
    """A 2-layer HF BERT QA or Llama LM, compiled in ``__init__`` when ``compiled``."""

    def __init__(self, family: str, compiled: bool) -> None:
        super().__init__()
        from transformers import (
            BertConfig,
            BertForQuestionAnswering,
            LlamaConfig,
            LlamaForCausalLM,
        )

        torch.manual_seed(0)
        if family == "bert":
            self.model = BertForQuestionAnswering(BertConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0))
        else:
            self.model = LlamaForCausalLM(LlamaConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                max_position_embeddings=SEQ))
        if compiled:
            self.model = torch.compile(self.model, backend="aot_eager", fullgraph=True)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(family: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (6, SEQ), generator=g)
    if family == "bert":
        keys = ("input_ids", "attention_mask", "start_positions", "end_positions")
        data = TensorDataset(ids, torch.ones_like(ids), torch.randint(0, SEQ, (6,), generator=g),
                             torch.randint(0, SEQ, (6,), generator=g))
    else:
        keys, data = ("input_ids", "labels"), TensorDataset(ids, ids)
    return DataLoader(data, batch_size=2, collate_fn=lambda items: dict(zip(
        keys, (torch.stack(t) for t in zip(*items, strict=True)), strict=True)))


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_compiled_compressed_hf_model_is_one_graph_and_trains_as_eager(family, accelerator,
                                                                         tmp_path):
    """Compiled with ``fullgraph=True``, the compressed model trains as the eager one, and
    its Lightning checkpoint loads strictly into the plain model as written (compiled in
    ``__init__``, never compressed): each weight is the compressed layer's dense form. On
    the GPU (``-m gpu``) with the compiled kernels and the GPU machine's own torch, whose
    compiler may break graphs where this machine's does not (torch 2.11 broke every
    compressed layer at its autocast check)."""
    torch._dynamo.reset()
    losses = {}
    for compiled in (False, True):
        model = TinyHF(family, compiled)
        sparse = SparsityCallback(pattern="block:16x16", sparsity=0.5, compress=True,
                                  deny=DENY[family])
        trainer = pl.Trainer(accelerator=accelerator, devices=1, precision="bf16-mixed",
                             max_epochs=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[sparse])
        trainer.fit(model, loader(family))
        layers = [m for m in model.modules() if isinstance(m, BlockSparseLinear)]
        assert len(layers) == 2 * LINEARS_PER_LAYER[family]
        losses[compiled] = model.losses
    assert len(losses[True]) == 3 and all(map(torch.isfinite, torch.tensor(losses[True])))
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               atol=0.05, rtol=0.02)
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    plain = TinyHF.load_from_checkpoint(tmp_path / "compiled.ckpt", family=family,
                                        compiled=True)  # strict
    weights = dict(plain.named_parameters())
    for name, layer in model.named_modules():
        if isinstance(layer, BlockSparseLinear):
            assert torch.equal(weights[f"{name}.weight"], layer.to_dense().weight.detach())


class GraphCount(pl.Callback):
    """torch._dynamo's count of distinct compiled graphs at the end of every step, and the
    compressed layers' block masks when training starts."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.first_masks: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        self.first_masks = [m.block_mask.clone() for m in pl_module.modules()
                            if isinstance(m, BlockSparseLinear)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch._dynamo.utils import counters

        self.counts.append(counters["stats"]["unique_graphs"])


def test_compiled_rigl_on_compressed_layers_regrows_without_piling_up_graphs():
    """RigL on compressed layers records the dense gradient by hooks at its update steps,
    which ``torch.compile`` (default, not ``fullgraph``) traces apart: regrowing at every
    step, the graphs stop growing once each kind of step has compiled, and blocks move."""
    torch._dynamo.reset()
    model = TinyHF("llama", compiled=False)
    model.model = torch.compile(model.model, backend="aot_eager")
    sparse = SparsityCallback(pattern="block:16x16", sparsity=0.5, compress=True,
                              deny=DENY["llama"], regrow="rigl", frequency=1, regrow_end=1.0)
    counter, base = GraphCount(), loader("llama")
    data = DataLoader(list(base.dataset) * 3, batch_size=2, collate_fn=base.collate_fn)
    pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_epochs=1, logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, callbacks=[sparse, counter]).fit(model, data)
    assert sparse.engine.updater.last_regrow == 8 and len(counter.counts) == 9
    assert counter.counts[4] == counter.counts[-1] > 0  # none after the first steps
    last = [m.block_mask for m in model.modules() if isinstance(m, BlockSparseLinear)]
    assert len(last) == 14
    assert any(not torch.equal(a, b) for a, b in zip(counter.first_masks, last, strict=True))
    assert all(map(torch.isfinite, torch.tensor(model.losses)))
