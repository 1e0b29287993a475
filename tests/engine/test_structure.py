"""Heads and FFN neurons found in the model families people fine-tune, selected under the
unit patterns, and pruned consistently across the tensors of one block: a pruned head or
neuron no longer reaches the output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparse_training import SparsityConfig, SparsityEngine
from sparse_training.engine.plan import SparsityPlan
from sparse_training.engine.structure import find_units
from sparse_training.engine.tensors import find_weight_tensors

transformers = pytest.importorskip("transformers")


def family(name: str) -> nn.Module:
    """A one-layer model of ``name`` with 4 query heads of 16 (Llama: 2 key/value heads)."""
    torch.manual_seed(0)
    t = transformers
    if name == "bert":
        return t.BertForQuestionAnswering(t.BertConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
            vocab_size=50))
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=50,
                                              n_inner=96,
                                              bos_token_id=0, eos_token_id=0))
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=50))
    if name == "t5":
        return t.T5EncoderModel(t.T5Config(d_model=64, d_kv=16, d_ff=96, num_layers=1,
                                           num_heads=4, vocab_size=50))
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=1,
                                            num_attention_heads=4, vocab_size=50,
                                            word_embed_proj_dim=64))
    if name == "neox":  # each head's query, key and value in turn in one projection
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            vocab_size=50, rotary_pct=0.5))
    if name == "bigcode":  # a Linear c_attn holding each head's query, key and value in turn
        return t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
            n_embd=64, n_inner=96, n_layer=1, n_head=4, vocab_size=50, multi_query=False,
            bos_token_id=0, eos_token_id=0))
    if name == "distilbert":
        return t.DistilBertModel(t.DistilBertConfig(dim=64, hidden_dim=96, n_layers=1,
                                                    n_heads=4, vocab_size=50))
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 96), 1)


# per family: (the attention's members: name -> (axis, band size, bands), units), and the
# FFN's members (96 neurons each)
FAMILIES = {
    "bert": ({"bert.encoder.layer.0.attention.self.query.weight": (0, 16, 4),
              "bert.encoder.layer.0.attention.self.key.weight": (0, 16, 4),
              "bert.encoder.layer.0.attention.self.value.weight": (0, 16, 4),
              "bert.encoder.layer.0.attention.output.dense.weight": (1, 16, 4)}, 4,
             ["bert.encoder.layer.0.intermediate.dense.weight",
              "bert.encoder.layer.0.output.dense.weight"]),
    "gpt2": ({"transformer.h.0.attn.c_attn.weight": (0, 16, 12),
              "transformer.h.0.attn.c_proj.weight": (1, 16, 4)}, 4,
             ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]),
    "llama": ({"model.layers.0.self_attn.q_proj.weight": (0, 32, 2),  # 2 queries per kv head
               "model.layers.0.self_attn.k_proj.weight": (0, 16, 2),
               "model.layers.0.self_attn.v_proj.weight": (0, 16, 2),
               "model.layers.0.self_attn.o_proj.weight": (1, 32, 2)}, 2,
              ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
               "model.layers.0.mlp.down_proj.weight"]),
    "t5": ({f"encoder.block.0.layer.0.SelfAttention.{p}.weight": (int(p == "o"), 16, 4)
            for p in "qkvo"}, 4,
           ["encoder.block.0.layer.1.DenseReluDense.wi.weight",
            "encoder.block.0.layer.1.DenseReluDense.wo.weight"]),
    "opt": ({f"model.decoder.layers.0.self_attn.{p}.weight": (int(p == "out_proj"), 16, 4)
             for p in ("q_proj", "k_proj", "v_proj", "out_proj")}, 4,
            ["model.decoder.layers.0.fc1.weight", "model.decoder.layers.0.fc2.weight"]),
    "distilbert": ({f"transformer.layer.0.attention.{p}.weight": (int(p == "out_lin"), 16, 4)
                    for p in ("q_lin", "k_lin", "v_lin", "out_lin")}, 4,
                   ["transformer.layer.0.ffn.lin1.weight", "transformer.layer.0.ffn.lin2.weight"]),
    "neox": ({"gpt_neox.layers.0.attention.query_key_value.weight": (0, 48, 4),
              "gpt_neox.layers.0.attention.dense.weight": (1, 16, 4)}, 4,
             ["gpt_neox.layers.0.mlp.dense_h_to_4h.weight",
              "gpt_neox.layers.0.mlp.dense_4h_to_h.weight"]),
    "bigcode": ({"transformer.h.0.attn.c_attn.weight": (0, 48, 4),
                 "transformer.h.0.attn.c_proj.weight": (1, 16, 4)}, 4,
                ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]),
    "torch": ({"layers.0.self_attn.in_proj_weight": (0, 16, 12),
               "layers.0.self_attn.out_proj.weight": (1, 16, 4)}, 4,
              ["layers.0.linear1.weight", "layers.0.linear2.weight"]),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_has_its_heads_and_neurons_found(name):
    model = family(name)
    attention, units, ffn = FAMILIES[name]
    found = find_units(model, find_weight_tensors(model))
    heads = {n: (t.axis, t.size, len(t.of_block)) for n, t in found["head"].items()}
    assert heads == attention
    assert {t.units for t in found["head"].values()} == {units}
    fused = [t for t in found["head"].values() if len(t.of_block) == 3 * units]
    assert all(t.of_block == tuple(range(units)) * 3 for t in fused)  # [Q | K | V]
    neurons = found["neuron"]
    assert sorted(neurons) == sorted(ffn)
    assert all(t.units == 96 and t.size == 1 for t in neurons.values())
    assert [neurons[n].axis for n in ffn] == [0] * (len(ffn) - 1) + [1]


def test_a_given_head_size_is_used_and_one_that_does_not_divide_is_refused():
    model = family("bert")
    tensors = find_weight_tensors(model)
    found = find_units(model, tensors, head_size=8)
    assert {t.units for t in found["head"].values()} == {8}
    with pytest.raises(ValueError, match="pattern 'head:24' does not divide its query "
                                         "projection's 64"):
        find_units(model, tensors, head_size=24)


@pytest.mark.parametrize("name, attention", [
    ("neox", "gpt_neox.layers.0.attention"), ("bigcode", "transformer.h.0.attn")])
@pytest.mark.parametrize("part", [4, 8])
def test_part_heads_of_interleaved_projections_are_parts_of_each_query_key_and_value(
        name, attention, part):
    """'head:D' with D below the head size (16) on a projection holding each head's query,
    key and value in turn: a unit is the same D features of one head's query, key and value
    (and the output's columns reading them), not a slice of the [q k v] run across them."""
    model = family(name)
    engine = SparsityEngine(model, SparsityConfig(pattern=f"head:{part}", sparsity=0.5))
    engine.prune()
    qkv, out = attention + (".query_key_value" if name == "neox" else ".c_attn"), (
        attention + (".dense" if name == "neox" else ".c_proj"))
    rows = model.get_submodule(qkv).weight_mask.all(1).view(4, 3, 16 // part, part)
    columns = model.get_submodule(out).weight_mask.all(0).view(4, 16 // part, part)
    kept = rows[:, 0, :, 0]  # (head, part)
    assert (rows == kept[:, None, :, None]).all() and (columns == kept[..., None]).all()
    assert int(kept.sum()) == 64 // part // 2


def test_an_interleaved_head_size_that_splits_heads_unevenly_is_refused():
    model = transformers.GPTNeoXModel(transformers.GPTNeoXConfig(  # 4 heads of 12
        hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=50))
    with pytest.raises(ValueError, match=r"pattern 'head:8' splits its heads of 12 \(query, "
                                         r"key and value in turn in one projection\) "
                                         r"unevenly; give 'head:D' with D a divisor or a "
                                         r"multiple of 12"):
        find_units(model, find_weight_tensors(model), head_size=8)


def test_an_attention_of_unknown_head_size_asks_for_it():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8)
                                                                  for _ in range(4))

    model = nn.Sequential(Attention())
    with pytest.raises(ValueError, match="cannot read its head size .* give it in the "
                                         "pattern, e.g. 'head:64'"):
        find_units(model, find_weight_tensors(model))
    assert len(find_units(model, find_weight_tensors(model), head_size=2)["head"]) == 4


def test_a_model_without_heads_is_refused_naming_the_layouts():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match="pattern 'head' found no head in the model: no module "
                                         "of a recognized layout"):
        SparsityEngine(model, SparsityConfig(pattern="head", sparsity=0.5))


HYBRID = dict(pattern="neuron", sparsity=0.5, overrides={"attention": {"pattern": "head"}},
              deny=["qa_outputs"], schedule="oneshot")


def test_the_hybrid_prunes_half_the_heads_and_neurons_and_they_no_longer_count():
    model = family("bert").double().eval()
    engine = SparsityEngine(model, SparsityConfig(**HYBRID))
    engine.prune()
    layer = model.bert.encoder.layer[0]
    query, key, value = (layer.attention.self.query, layer.attention.self.key,
                         layer.attention.self.value)
    out = layer.attention.output.dense
    heads = [query.weight_mask.view(4, 16, 64)[h].all() for h in range(4)]
    assert sum(heads) == 2
    for h in range(4):  # the head's rows in Q, K, V and its columns in O: all or none
        for band in (query.weight_mask.view(4, 16, 64)[h], key.weight_mask.view(4, 16, 64)[h],
                     value.weight_mask.view(4, 16, 64)[h], out.weight_mask.view(64, 4, 16)[:, h]):
            assert bool(band.all()) == bool(band.any()) == bool(heads[h])
    neurons = layer.intermediate.dense.weight_mask.all(1)
    assert int(neurons.sum()) == 48
    assert torch.equal(layer.output.dense.weight_mask.all(0), neurons)
    ids = torch.randint(0, 50, (2, 7))
    before = model(input_ids=ids).start_logits
    with torch.no_grad():  # a pruned head's value rows and a pruned neuron's down weights
        dead = ~torch.stack(heads).repeat_interleave(16)
        value.weight[dead] += 1.0
        value.bias[dead] += 1.0
        layer.intermediate.dense.weight[~neurons] += 1.0
    torch.testing.assert_close(model(input_ids=ids).start_logits, before)


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "bigcode"])
def test_fused_and_grouped_query_attention_prune_whole_units(name):
    model = family(name)
    engine = SparsityEngine(model, SparsityConfig(pattern="head", sparsity=0.5,
                                                  layer_types=[nn.Linear, "transformers."
                                                               "pytorch_utils.Conv1D"]))
    engine.prune()
    attention, units, _ = FAMILIES[name]
    slots = {s.name: s for s in engine.masked}
    assert set(slots) == set(attention)
    for tensor, (axis, size, bands) in attention.items():
        mask = slots[tensor].full_mask()
        view = mask.T if name == "gpt2" else mask  # Conv1D stores (in, out)
        per_band = (view.reshape(bands, size, -1) if axis == 0 else
                    view.reshape(view.shape[0], bands, size).transpose(0, 1)).flatten(1)
        kept = per_band.all(1)
        assert (kept | ~per_band.any(1)).all() and int(kept.sum()) == bands // 2


def test_one_block_with_two_targets_is_refused():
    config = SparsityConfig(pattern="head", sparsity=0.5, deny=["qa_outputs"],
                            overrides={r"\.query\.": {"sparsity": 0.25}})
    with pytest.raises(ValueError, match="block 'bert.encoder.layer.0.attention.self' prunes "
                                         "whole units across its tensors, which need one "
                                         "target"):
        SparsityEngine(family("bert"), config)


@pytest.mark.parametrize("settings, message", [
    (dict(distribution="erk"), "distribution 'erk' would give the tensors of one block"),
    (dict(regrow="rigl", schedule="constant"), "regrow='rigl' moves entries of single "
                                               "tensors, not whole units"),
    (dict(pattern="unstructured", overrides={"attention": {"pattern": "head"}},
          distribution="global"), r"overrides\['attention'\] 'head' prunes the same share"),
])
def test_unit_patterns_refuse_what_would_split_a_block(settings, message):
    with pytest.raises(ValueError, match=message):
        SparsityConfig(**{"pattern": "head", "sparsity": 0.5, **settings})


def test_the_setup_table_names_the_unit_and_a_non_member_says_why():
    model = family("bert")
    plan = SparsityPlan.build(model, SparsityConfig(pattern="head", sparsity=0.5))
    table, plans = plan.table(), plan.rows
    assert "head (block:16x64)" in table and "head (block:64x16)" in table
    reasons = {p.name: p.reason for p in plans}
    assert "not a query, key, value or output projection" in reasons[
        "bert.encoder.layer.0.intermediate.dense.weight"]
    with pytest.raises(ValueError, match="'bert.encoder.layer.0.intermediate.dense.weight' was "
                                         "asked for by name but pattern 'head' prunes whole"):
        SparsityPlan.build(model, SparsityConfig(pattern="head", sparsity=0.5,
                                                 allow=["intermediate"]))


def test_a_head_override_that_keeps_no_head_names_the_unit_not_its_block():
    """Llama with 2 key/value heads (2 units) at 90% keeps none: the error names the
    pattern the user wrote ('head'), not the block pattern of its share, and asks for a
    lower sparsity only (smaller blocks do not apply to whole heads)."""
    with pytest.raises(ValueError, match=r"pattern 'head' at sparsity 0.9 keeps none of its 2 "
                                         r"heads .*; lower its sparsity$"):
        SparsityPlan.build(family("llama"), SparsityConfig(
            pattern="unstructured", sparsity=0.5,
            overrides={"self_attn": {"pattern": "head", "sparsity": 0.9}}))


def test_unit_masks_resume_into_a_fresh_engine():
    model = family("bert")
    engine = SparsityEngine(model, SparsityConfig(**HYBRID))
    engine.prune()
    state = engine.state_dict()
    engine.detach()
    other = family("bert")
    other.load_state_dict(model.state_dict())
    resumed = SparsityEngine(other, SparsityConfig(**HYBRID), state=state)
    for a, b in zip(engine.masked, resumed.masked, strict=True):
        assert torch.equal(a.mask, b.mask), a.name
