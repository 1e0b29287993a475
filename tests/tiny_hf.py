"""Small Hugging Face models as users train them through ``pl.Trainer``, shared by the
compiled-compressed tests on the CPU (``tests/callbacks/test_compiled_compressed.py``) and
on the GPU (``tests/test_gpu.py``); and float64 models of many families
(:func:`hf_model`) for the heads and neurons of ``tests/layers/test_slim*.py``."""

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


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer float64 HF model of ``family`` in eval mode (4 heads of 8), for heads and
    neurons compressed against masked-dense."""
    from transformers import (
        BartConfig,
        BartModel,
        BertConfig,
        BertModel,
        BloomConfig,
        BloomModel,
        CohereConfig,
        CohereModel,
        DebertaV2Config,
        DebertaV2Model,
        GPTBigCodeConfig,
        GPTBigCodeModel,
        GPTNeoXConfig,
        GPTNeoXModel,
        LlamaConfig,
        LlamaModel,
        Olmo2Config,
        Olmo2Model,
        OPTConfig,
        OPTModel,
        PersimmonConfig,
        PersimmonModel,
        StableLmConfig,
        StableLmModel,
        ViTConfig,
        ViTModel,
    )

    torch.manual_seed(seed)
    small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    config = {
        "bert": lambda: BertModel(BertConfig(hidden_size=32, vocab_size=40, **small)),
        "vit": lambda: ViTModel(ViTConfig(hidden_size=32, image_size=8, patch_size=4, **small)),
        "llama": lambda: LlamaModel(LlamaConfig(hidden_size=32, vocab_size=40,
                                                num_key_value_heads=2, **small)),
        "bart": lambda: BartModel(BartConfig(d_model=32, vocab_size=40, encoder_layers=1,
                                             decoder_layers=1, encoder_attention_heads=4,
                                             decoder_attention_heads=4, encoder_ffn_dim=48,
                                             decoder_ffn_dim=48)),
        "opt": lambda: OPTModel(OPTConfig(hidden_size=32, vocab_size=40, ffn_dim=48,
                                          word_embed_proj_dim=32, num_hidden_layers=2,
                                          num_attention_heads=4)),
        # each head's query, key and value in turn in one query_key_value projection
        "neox": lambda: GPTNeoXModel(GPTNeoXConfig(hidden_size=32, vocab_size=40,
                                                   rotary_pct=0.5, **small)),
        # GPTBigCode's Linear c_attn holds them in turn too, where GPT-2's are side by side
        "bigcode": lambda: GPTBigCodeModel(GPTBigCodeConfig(n_embd=32, vocab_size=40, n_layer=2,
                                                            n_head=4, n_inner=48,
                                                            multi_query=False,
                                                            bos_token_id=0, eos_token_id=0)),
        "bloom": lambda: BloomModel(BloomConfig(hidden_size=32, vocab_size=40, n_layer=2,
                                                n_head=4)),
        # its forward reads the head count in a helper method (self._split_heads)
        "persimmon": lambda: PersimmonModel(PersimmonConfig(hidden_size=32, vocab_size=40,
                                                                qk_layernorm=True, **small)),
        # tensors sized by all the heads: they keep the heads masked-dense
        "olmo2": lambda: Olmo2Model(Olmo2Config(hidden_size=32, vocab_size=40,
                                                    num_key_value_heads=2, **small)),
        "cohere": lambda: CohereModel(CohereConfig(hidden_size=32, vocab_size=40,
                                                       use_qk_norm=True, **small)),
        "stablelm": lambda: StableLmModel(StableLmConfig(hidden_size=32, vocab_size=40,
                                                             qk_layernorm=True,
                                                             num_key_value_heads=4, **small)),
        "deberta": lambda: DebertaV2Model(DebertaV2Config(
            hidden_size=32, vocab_size=40, relative_attention=True, share_att_key=False,
            pos_att_type=["p2c", "c2p"], position_buckets=8, **small)),
    }[family]
    return config().double().eval()


def hf_inputs(family: str) -> dict[str, torch.Tensor]:
    """Inputs of a :func:`hf_model`."""
    g = torch.Generator().manual_seed(3)
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)}
    return {"input_ids": torch.randint(4, 40, (2, 7), generator=g)}
