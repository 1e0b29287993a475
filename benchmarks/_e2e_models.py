"""The models of ``e2e_step.py``: HF models from their configs (random init, no download),
each with one batch, the tensors a user denies and the block size its rows use.

====================  =========================================================  ===========
name                  model                                                       tokens/step
====================  =========================================================  ===========
``bert-base``         ``BertForQuestionAnswering(BertConfig())``                  32 x 384
``vit-base``          ``ViTForImageClassification(ViTConfig())``, 1000 classes    64 images
``gpt2``              ``GPT2LMHeadModel(GPT2Config())`` (124M, ``Conv1D``)         8 x 1024
``opt-350m``          ``OPTForCausalLM``, OPT-350m's shape                        8 x 1024
``t5-base``           ``T5ForConditionalGeneration``, T5-base's shape             16 x (512 + 128)
``decoder-1.5b``      ``LlamaForCausalLM``, Qwen2-1.5B's shape, ``--layers``       4 x 2048
``decoder-2048``      ``LlamaForCausalLM``, ``time_to_quality.py``'s base model    8 x 1024
                      (hidden 2048, vocabulary 8192), ``--layers``
``llama``             ``LlamaForCausalLM``, Llama-3-8B's shape, ``--layers``       4 x 2048
``tiny``, ``tiny-*``  the same families a few features wide, for CPU checks       -
====================  =========================================================  ===========
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _shapes import DECODER_SHAPES


@dataclass(frozen=True)
class E2EModel:
    """A model of the benchmark: ``build(layers, device)`` gives (model, batch)."""

    build: Callable[[int, str], tuple[Any, dict]]
    deny: tuple[str, ...]
    block: int


# decoder shape (:mod:`_shapes`), vocabulary, (batch, sequence) per step
LLAMA_SHAPES = {"llama": (DECODER_SHAPES["llama-3-8b"], 32000, (4, 2048)),
                "decoder-1.5b": (DECODER_SHAPES["qwen2-1.5b"], 32000, (4, 2048)),
                "decoder-2048": (DECODER_SHAPES["hidden-2048"], 8192, (8, 1024)),
                "tiny-llama": (DECODER_SHAPES["tiny"], 256, (2, 32))}


def _ids(vocab: int, batch: int, seq: int):
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def _llama(name: str) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        from transformers import LlamaConfig, LlamaForCausalLM

        shape, vocab, (batch, seq) = LLAMA_SHAPES[name]
        config = LlamaConfig(hidden_size=shape["hidden"],
                             intermediate_size=shape["intermediate"],
                             num_attention_heads=shape["heads"],
                             num_key_value_heads=shape["kv_heads"],
                             num_hidden_layers=layers, vocab_size=vocab,
                             max_position_embeddings=4096)
        ids = _ids(vocab, batch, seq)
        import torch

        with torch.device(device):  # initialized where it trains: fast on a GPU
            return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}
    return build


def _bert(tiny: bool) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        import torch
        from transformers import BertConfig, BertForQuestionAnswering

        config, (batch, seq) = (BertConfig(hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=128), (4, 32)
                                ) if tiny else (BertConfig(), (32, 384))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        with torch.device(device):
            model = BertForQuestionAnswering(config)
        return model, {
            "input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "start_positions": torch.randint(0, seq, (batch,), generator=g),
            "end_positions": torch.randint(0, seq, (batch,), generator=g)}
    return build


def _vit(tiny: bool) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        import torch
        from transformers import ViTConfig, ViTForImageClassification

        config, images = (ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, image_size=32, patch_size=8,
                                    num_labels=10), 4) if tiny else (
            ViTConfig(num_labels=1000), 64)
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(images, 3, config.image_size, config.image_size, generator=g)
        with torch.device(device):
            model = ViTForImageClassification(config)
        return model, {"pixel_values": pixels,
                       "labels": torch.randint(0, config.num_labels, (images,), generator=g)}
    return build


def _gpt2(tiny: bool) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        config, (batch, seq) = (GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           vocab_size=256), (2, 32)) if tiny else (
            GPT2Config(), (8, 1024))
        ids = _ids(config.vocab_size, batch, seq)
        with torch.device(device):
            return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}
    return build


def _opt(tiny: bool) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        import torch
        from transformers import OPTConfig, OPTForCausalLM

        config, (batch, seq) = (OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                          num_attention_heads=4, word_embed_proj_dim=32,
                                          vocab_size=256), (2, 32)) if tiny else (
            OPTConfig(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
                      num_attention_heads=16, word_embed_proj_dim=512, vocab_size=50272),
            (8, 1024))
        ids = _ids(config.vocab_size, batch, seq)
        with torch.device(device):
            return OPTForCausalLM(config), {"input_ids": ids, "labels": ids}
    return build


def _t5(tiny: bool) -> Callable[[int, str], tuple[Any, dict]]:
    def build(layers: int, device: str):
        import torch
        from transformers import T5Config, T5ForConditionalGeneration

        config, (batch, source, target) = (
            T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=256,
                     decoder_start_token_id=0, pad_token_id=0),
            (2, 32, 8)) if tiny else (
            T5Config(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_heads=12,
                     vocab_size=32128, decoder_start_token_id=0, pad_token_id=0),
            (16, 512, 128))
        with torch.device(device):
            model = T5ForConditionalGeneration(config)
        return model, {"input_ids": _ids(config.vocab_size, batch, source),
                       "labels": _ids(config.vocab_size, batch, target)}
    return build


_DECODER_DENY = ("embed_tokens", "lm_head")
MODELS: dict[str, E2EModel] = {
    "bert-base": E2EModel(_bert(False), ("embeddings", "qa_outputs"), 64),
    "tiny": E2EModel(_bert(True), ("embeddings", "qa_outputs"), 16),
    "vit-base": E2EModel(_vit(False), ("embeddings", "classifier"), 64),
    "tiny-vit": E2EModel(_vit(True), ("embeddings", "classifier"), 16),
    "gpt2": E2EModel(_gpt2(False), ("wte", "wpe", "lm_head"), 64),
    "tiny-gpt2": E2EModel(_gpt2(True), ("wte", "wpe", "lm_head"), 16),
    "opt-350m": E2EModel(_opt(False), ("embed", "lm_head", "project"), 64),
    "tiny-opt": E2EModel(_opt(True), ("embed", "lm_head", "project"), 16),
    "t5-base": E2EModel(_t5(False), ("shared", "lm_head"), 64),
    "tiny-t5": E2EModel(_t5(True), ("shared", "lm_head"), 16),
    "decoder-1.5b": E2EModel(_llama("decoder-1.5b"), _DECODER_DENY, 64),
    "decoder-2048": E2EModel(_llama("decoder-2048"), _DECODER_DENY, 128),
    "llama": E2EModel(_llama("llama"), _DECODER_DENY, 128),
    "tiny-llama": E2EModel(_llama("tiny-llama"), _DECODER_DENY, 16),
}
# the attention modules of every family (BERT/ViT "attention", GPT-2 "attn", Llama/OPT
# "self_attn", T5 "SelfAttention"/"EncDecAttention"): the heads override of the
# heads+neurons variants
ATTENTION = "(?i)attention|attn"
