"""The plan of a fit: built once, followed through swaps, kept in the checkpoint, compared
on resume."""

import pytest
import torch
from conftest import BlockNet, make_loader, make_trainer
from torch import nn

from sparse_training import BlockSparseLinear, SparsityCallback, SparsityConfig, SparsityPlan
from sparse_training.engine import SparsityEngine
from sparse_training.engine.plan import plan_differences
from sparse_training.layers.compress import compress_selected

BLOCKS = dict(pattern="block:16x16", sparsity=0.75)


@pytest.mark.parametrize("compress", [False, True])
def test_a_fit_builds_each_callbacks_plan_once(monkeypatch, compress):
    built = []
    original = SparsityPlan.build.__func__

    def counting(cls, model, config):
        built.append(config)
        return original(cls, model, config)

    monkeypatch.setattr(SparsityPlan, "build", classmethod(counting))
    first = SparsityCallback(**BLOCKS, compress=compress, allow=[r"net\.0"])
    second = SparsityCallback("unstructured", sparsity=0.5, allow=[r"net\.2"])
    make_trainer([first, second], max_epochs=1).fit(BlockNet(), make_loader(32))
    assert [c is first.config for c in built] == [True, False]
    assert built[1] is second.config
    assert first.engine.plan.rows[0].path == ("compressed" if compress else "masked-dense")


def test_bound_follows_a_swap_to_the_compressed_layer_and_another_selections():
    model = BlockNet()
    mine = SparsityPlan.build(model, SparsityConfig(**BLOCKS, compress=True,
                                                    allow=[r"net\.0"]))
    other = SparsityPlan.build(model, SparsityConfig("unstructured", sparsity=0.5,
                                                     allow=[r"net\.2"]))
    rows, noted = compress_selected(model, mine)
    assert [r.decision for r in rows] == ["compressed"]
    assert isinstance(model.net[0], BlockSparseLinear)
    after = noted.bound(model)
    assert after.rows[0].names == ("net.0.values",) and after.rows[0].path == "compressed"
    assert after.tensors[0].param is model.net[0].values
    assert [r.path for r in after.rows[1:]] == ["dense", "dense"]
    theirs = other.bound(model)
    assert theirs.rows[0].path == "dense" and theirs.rows[0].names == ("net.0.values",)
    assert theirs.rows[0].reason == "compressed, another selection's: matches no allow regex"
    assert [r.path for r in theirs.rows] == ["dense", "masked-dense", "dense"]
    again = after.bound(model)  # bound once, bound for good
    assert again.rows == after.rows
    assert [t.param for t in again.tensors] == [t.param for t in after.tensors]


def test_bound_is_none_where_the_model_gained_or_lost_a_weight():
    model = BlockNet()
    plan = SparsityPlan.build(model, SparsityConfig(**BLOCKS))
    model.net[4] = nn.Linear(64, 8)  # another shape
    assert plan.bound(model) is None
    model.net.append(nn.Linear(8, 8))
    assert plan.bound(model) is None
    with pytest.raises(ValueError, match="the plan's weight tensors are not the model's"):
        SparsityEngine(model, plan.config, plan=plan)


def test_an_engine_takes_only_its_configs_plan():
    model = BlockNet()
    plan = SparsityPlan.build(model, SparsityConfig(**BLOCKS))
    with pytest.raises(ValueError, match="the plan was built under another config"):
        SparsityEngine(model, SparsityConfig(**BLOCKS), plan=plan)


def test_erk_targets_decided_before_a_swap_hold_after_it():
    """The compressed layer keeps the ERK target the plan gave it, and the masked-dense
    tensors keep theirs (a new selection after the swap would share ERK's budget among
    the masked-dense tensors only)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                          nn.Conv1d(4, 8, 3))
    config = SparsityConfig(**BLOCKS, distribution="erk", compress=True)
    plan = SparsityPlan.build(model, config)
    targets = {p.name: p.sparsity for p in plan.rows if p.selected}
    rows, noted = compress_selected(model, plan)
    engine = SparsityEngine(model, config, plan=noted)
    assert {r.name: r.decision for r in rows}["0"] == "compressed"
    masked = {s.name: s.plan.sparsity for s in engine.masked}
    assert masked and all(masked[name] == targets[name] for name in masked)
    assert sum(isinstance(m, BlockSparseLinear) for m in model) >= 1
    engine.detach()


def test_plan_differences_name_each_tensor_on_another_path():
    model = BlockNet()
    compressed = SparsityPlan.build(model, SparsityConfig(**BLOCKS, compress=True))
    saved = compress_selected(model, compressed)[1].bound(model).as_state()
    masked = SparsityPlan.build(BlockNet(), SparsityConfig(**BLOCKS, compress="auto"))
    said = plan_differences(saved, masked)
    assert said == [f"'net.{i}.weight': path 'compressed' in the checkpoint, 'masked-dense' now"
                    for i in (0, 2)]
    assert plan_differences(saved, compressed.bound(model)) == []
    assert plan_differences(None, masked) == []  # a state saved without a plan


def test_a_resume_on_another_path_is_refused_naming_the_tensors(tmp_path):
    """Where Lightning restores after the optimizers are built (FSDP2), the plans are
    compared: here, a state of compressed layers given to a masked-dense engine."""
    model = BlockNet()
    config = SparsityConfig(**BLOCKS, compress=True)
    rows, plan = compress_selected(model, SparsityPlan.build(model, config))
    state = SparsityEngine(model, config, plan=plan).state_dict()
    fresh = BlockNet()
    with pytest.raises(ValueError, match=r"cannot resume: the checkpoint's plan differs from "
                                         r"this fit's: 'net.0.weight': path 'compressed' in "
                                         r"the checkpoint, 'masked-dense' now"):
        SparsityEngine(fresh, SparsityConfig(**BLOCKS, compress="auto"), state=state)
    assert not any(name.endswith("_mask") for name, _ in fresh.named_buffers())
    assert torch.is_tensor(state["compressed"]["net.0.values"]["bits"])


def test_a_bias_is_no_weight_whatever_its_shape():
    """nn.MultiheadAttention's bias_k and bias_v are (1, 1, E): not pruned like weights."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(32, 4, add_bias_kv=True)})
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5))
    engine.prune()
    assert [s.name for s in engine.slots] == ["attn.in_proj_weight", "attn.out_proj.weight"]
    assert model["attn"].bias_k.count_nonzero() == model["attn"].bias_v.count_nonzero() == 32


def tied_lm(family: str) -> tuple[nn.Module, str, str]:
    """A four-layer LM whose head shares the embedding's weight: the model, its first
    layer's block and the tied tensor's (the head's) block."""
    torch.manual_seed(0)
    if family == "torch":
        model = nn.ModuleDict(dict(embed=nn.Embedding(16, 8), layers=nn.Sequential(
            *(nn.Linear(8, 8) for _ in range(4))), head=nn.Linear(8, 16, bias=False)))
        model["head"].weight = model["embed"].weight
        return model, "layers.0", "head"
    t = pytest.importorskip("transformers")
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0,
            eos_token_id=0)), "transformer.h.0", "lm_head"
    return t.BertForMaskedLM(t.BertConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16)), "bert.encoder.layer.0", \
        "cls.predictions.decoder"


@pytest.mark.parametrize("family", ["torch", "gpt2", "bert"])
def test_dense_ratio_counts_a_tied_lm_head_after_the_layers(family):
    """The embedding tied to the LM head comes first in model order but counts as the head,
    a block after the layers: dense_ratio 0.2 of 5 blocks (BERT's 6, with its head's
    transform) keeps the first layer dense, 0.8 every block but the head."""
    model, first_layer, head = tied_lm(family)
    count = 6 if family == "bert" else 5
    plan = SparsityPlan.build(model, SparsityConfig("unstructured", sparsity=0.8,
                                                    dense_ratio=0.2))
    tied = next(row for row in plan.rows if len(row.names) > 1)
    assert tied.selected, tied.reason
    dense = [row for row in plan.rows if not row.selected and "dense_ratio" in row.reason]
    assert dense and all(row.name.startswith(first_layer + ".") for row in dense)
    assert f"block {first_layer!r} is one of the first 1 of {count} blocks" in dense[0].reason
    plan = SparsityPlan.build(model, SparsityConfig("unstructured", sparsity=0.8,
                                                    dense_ratio=0.8))
    tied = next(row for row in plan.rows if len(row.names) > 1)
    assert tied.selected and not any(row.selected for row in plan.rows if row is not tied)
    plan = SparsityPlan.build(model, SparsityConfig("unstructured", sparsity=0.8,
                                                    dense_ratio=0.95))
    tied = next(row for row in plan.rows if len(row.names) > 1)
    assert f"block {head!r} is one of the first {count} of {count} blocks" in tied.reason
