"""Heads and neurons of Hugging Face families compressed (SlimLinear) against the masked-dense
engine in float64: where an attention module cannot lose heads (a tensor sized by all of
them), its heads stay masked-dense, naming that tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_hf import hf_inputs, hf_model

from sparse_training import SlimLinear, SparsityConfig, SparsityEngine, densify
from sparse_training.engine.plan import SparsityPlan
from sparse_training.layers.compress import compress_selected

HEADS_AND_NEURONS = dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                         overrides={"attention|attn": {"pattern": "head"}})


@pytest.mark.parametrize("family", ["bert", "vit", "llama", "bart", "opt", "neox", "bigcode",
                                    "persimmon", "bloom"])
def test_slim_models_compute_what_masked_dense_ones_do(family):
    """float64: the compressed model (heads and neurons removed) against the masked-dense
    engine's model at step 0; OPT's attention reads self.num_heads, which follows the kept
    heads while they are removed and comes back with densify. GPT-NeoX and GPTBigCode hold
    each head's query, key and value in turn in one projection; BLOOM too, but its heads
    stay masked-dense (ALiBi)."""
    config = SparsityConfig(**HEADS_AND_NEURONS, compress=True,
                            deny=["embed|patch|pooler|lm_head|project|wte"])
    model, masked = hf_model(family), hf_model(family)
    SparsityEngine(masked, config).prune()
    rows, plan = compress_selected(model, SparsityPlan.build(model, config))
    SparsityEngine(model, config, plan=plan.bound(model)).prune()  # masks what stays dense
    slimmed, kept = [r for r in rows if r.layer is not None], [r for r in rows if r.layer is None]
    assert slimmed and all(isinstance(r.layer, SlimLinear) for r in slimmed)
    # BLOOM's heads stay masked-dense: the model builds its ALiBi bias for every head
    assert bool(kept) == (family == "bloom") and all("ALiBi" in r.decision for r in kept)
    attention = model.decoder.layers[0].self_attn if family == "opt" else None
    if attention is not None:
        assert attention.num_heads == 2 and attention.dense_head_counts == {"num_heads": 4}
    with torch.no_grad():
        out, expected = model(**hf_inputs(family)), masked(**hf_inputs(family))
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state,
                               rtol=0, atol=1e-10)
    dense = copy.deepcopy(model)
    densify(dense)
    assert not any(isinstance(m, SlimLinear) for m in dense.modules())
    if attention is not None:
        restored = dense.decoder.layers[0].self_attn
        assert restored.num_heads == 4 and not hasattr(restored, "dense_head_counts")
    with torch.no_grad():
        torch.testing.assert_close(dense(**hf_inputs(family)).last_hidden_state,
                                   expected.last_hidden_state, rtol=0, atol=1e-10)
    plain = hf_model(family, seed=5)
    plain.load_state_dict(model.state_dict())  # strict: the original shapes
    with torch.no_grad():
        torch.testing.assert_close(plain(**hf_inputs(family)).last_hidden_state,
                                   expected.last_hidden_state, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family, tensor", [
    ("olmo2", "Olmo2Attention.q_norm.weight"),  # over every head's features
    ("cohere", "CohereAttention.q_norm.weight"),  # (heads, head size)
    ("stablelm", "StableLmAttention.q_layernorm.norms"),  # one LayerNorm a head
    ("deberta", "DisentangledSelfAttention.pos_key_proj.weight"),  # every head's outputs
])
def test_heads_with_a_tensor_sized_by_them_stay_masked_dense(family, tensor):
    """float64: slimmed, these attention modules crashed (OLMo-2, Cohere, DeBERTa) or
    computed another function (StableLM's per-head norms paired with the wrong heads);
    their heads stay masked-dense, saying which tensor, the FFNs shrink, and the model
    computes what the masked-dense one does."""
    config = SparsityConfig(**HEADS_AND_NEURONS, compress=True, deny=["embed|pos_"])
    model, masked = hf_model(family), hf_model(family)
    with torch.no_grad():  # norms of ones would hide which head a norm serves
        for m in (model, masked):
            for name, param in m.named_parameters():
                if "norm" in name:
                    param.copy_(torch.linspace(0.5, 1.5, param.numel()).view_as(param))
    SparsityEngine(masked, config).prune()
    rows, plan = compress_selected(model, SparsityPlan.build(model, config))
    SparsityEngine(model, config, plan=plan.bound(model)).prune()
    heads = [r for r in rows if r.layer is None]
    assert heads and all(f"{tensor} is sized by all its heads" in r.decision for r in heads)
    assert any(isinstance(r.layer, SlimLinear) for r in rows)  # the FFNs
    with torch.no_grad():
        torch.testing.assert_close(model(**hf_inputs(family)).last_hidden_state,
                                   masked(**hf_inputs(family)).last_hidden_state,
                                   rtol=0, atol=1e-10)
