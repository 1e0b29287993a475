"""Small Hugging Face models as users train them through ``pl.Trainer``, shared by the
compiled-compressed tests on the CPU (``tests/callbacks/test_compiled_compressed.py``) and
on the GPU (``tests/test_gpu.py``)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 512
# per family: (callback's deny list, compressible Linears per layer)
FAMILIES = {"bert": (["embeddings", "qa_outputs"], 6), "llama": (["embed_tokens", "lm_head"], 7)}


class TinyHF(pl.LightningModule):
    """A ``layers``-layer HF model (2 by default): BERT question answering (``family="bert"``) or a Llama causal LM
    (``"llama"``: grouped-query attention, gated MLP), compiled in ``__init__`` where
    ``compile_mode`` is given (with ``backend`` and ``fullgraph``), with the user's AdamW
    built from ``self.parameters()``. Its settings are hyperparameters: a checkpoint loads
    into the model as written with a plain ``load_from_checkpoint(path)``."""

    def __init__(self, compile_mode: str | None = None, hidden: int = 256,
                 family: str = "bert", heads: int = 4, backend: str = "inductor",
                 fullgraph: bool = False, layers: int = 2) -> None:
        super().__init__()
        from transformers import (
            BertConfig,
            BertForQuestionAnswering,
            LlamaConfig,
            LlamaForCausalLM,
        )

        self.save_hyperparameters()
        torch.manual_seed(0)
        if family == "bert":
            config = BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads,
                                intermediate_size=4 * hidden, vocab_size=VOCAB,
                                max_position_embeddings=128, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)
            self.model = BertForQuestionAnswering(config)
        else:
            config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=heads // 2, vocab_size=VOCAB,
                                 max_position_embeddings=128)
            self.model = LlamaForCausalLM(config)
        if compile_mode is not None:
            self.model = torch.compile(self.model, mode=compile_mode, backend=backend,
                                       fullgraph=fullgraph)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead: one graph step a batch
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def hf_loader(family: str = "bert", batches: int = 6, batch: int = 8, seq: int = 64,
              attention_mask: bool = False) -> DataLoader:
    """Random token batches: span labels for BERT QA (with an all-ones attention mask where
    asked), next-token labels for Llama."""
    g = torch.Generator().manual_seed(0)
    n = batches * batch
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    if family == "bert":
        keys = ("input_ids", "start_positions", "end_positions")
        columns = [ids, torch.randint(0, seq, (n,), generator=g),
                   torch.randint(0, seq, (n,), generator=g)]
        if attention_mask:
            keys, columns = (*keys, "attention_mask"), [*columns, torch.ones_like(ids)]
        data = TensorDataset(*columns)
    else:
        keys, data = ("input_ids", "labels"), TensorDataset(ids, ids)
    return DataLoader(data, batch_size=batch, collate_fn=lambda items: dict(zip(
        keys, (torch.stack(t) for t in zip(*items, strict=True)), strict=True)))
