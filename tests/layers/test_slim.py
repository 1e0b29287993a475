"""SlimLinear: heads and neurons trained as physically smaller layers under compress."""


import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_same_fit, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from tiny_hf import hf_inputs, hf_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import SlimLinear, SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.engine.plan import SparsityPlan
from sparse_training.layers.compress import compress_selected
from sparse_training.layers.compress_units import head_counts, heads_problem
from sparse_training.pieces.units import COLUMNS, ROWS

HEADS_AND_NEURONS = dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                         overrides={"attention|attn": {"pattern": "head"}})


def reference(x, weight, bias, axis, kept):
    """float64 ``x W_d^T + b_d`` of the dense layer with the removed bands zero, computed
    from the dense tensors (rows: the removed outputs dropped; columns: ``x`` holds only the
    kept inputs, scattered back to their dense positions)."""
    mask = torch.zeros(weight.shape[axis], dtype=torch.bool)
    mask[kept] = True
    w = weight * (mask[:, None] if axis == ROWS else mask[None, :])
    if axis == COLUMNS:
        dense_x = x.new_zeros(*x.shape[:-1], weight.shape[1])
        dense_x[..., kept] = x
        x = dense_x
    y = x @ w.T + bias
    return y[..., kept] if axis == ROWS else y


@pytest.mark.parametrize("axis", [ROWS, COLUMNS])
@pytest.mark.parametrize("shape,band", [((12, 9), 3), ((7, 15), 1), ((10, 12), 2)])
def test_forward_and_every_gradient_match_the_masked_dense_layer_in_float64(axis, shape, band):
    torch.manual_seed(0)
    out, inp = shape
    linear = nn.Linear(inp, out).double()
    bands = (out if axis == ROWS else inp) // band
    band_mask = torch.rand(bands) < 0.5
    band_mask[0] = True
    layer = SlimLinear.from_dense(linear, axis, band, band_mask)
    kept = band_mask.repeat_interleave(band).nonzero().flatten()
    width = inp if axis == ROWS else len(kept)
    x = torch.randn(width, 5, 3, dtype=torch.float64).transpose(0, 2)  # non-contiguous
    x.requires_grad_(True)
    dense_w = linear.weight.detach().clone().requires_grad_(True)
    dense_b = linear.bias.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), reference(x_ref, dense_w, dense_b, axis, kept)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, dense_w.grad.index_select(axis, kept),
                               rtol=0, atol=1e-12)
    expected_bias = dense_b.grad[kept] if axis == ROWS else dense_b.grad
    torch.testing.assert_close(layer.bias.grad, expected_bias, rtol=0, atol=1e-12)
    assert layer.sparsity == pytest.approx(1 - len(kept) / (out if axis == ROWS else inp))


@pytest.mark.parametrize("axis", [ROWS, COLUMNS])
def test_state_dict_is_the_dense_linears_and_loads_back_its_bands(axis):
    torch.manual_seed(1)
    linear = nn.Linear(8, 6)
    bands = 3 if axis == ROWS else 4
    layer = SlimLinear.from_dense(linear, axis, 2, torch.tensor([True, False, True, False][:bands]))
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"} and state["weight"].shape == (6, 8)
    plain = nn.Linear(8, 6)
    plain.load_state_dict(state)  # strict
    x = torch.randn(4, 8)
    x_in = x if axis == ROWS else x[:, layer.kept_index]
    y = plain(x)
    torch.testing.assert_close(layer(x_in), y[:, layer.kept_index] if axis == ROWS else y)
    torch.testing.assert_close(layer.to_dense()(x), y if axis == COLUMNS else plain(x) * (
        torch.zeros(6).index_fill(0, layer.kept_index, 1)) + plain.bias * 0)
    other = SlimLinear(8, 6, axis, 2, torch.tensor([False, True, True, False][:bands]))
    other.load_state_dict(state)  # takes the bands the weight holds
    assert torch.equal(other.band_mask, layer.band_mask)
    assert torch.equal(other.weight, layer.weight) and torch.equal(other.bias, layer.bias)


@pytest.mark.parametrize("axis", [ROWS, COLUMNS])
def test_a_bias_loads_alone_with_strict_false_beside_the_weight_kept(axis):
    """As nn.Linear's: the missing weight is reported and kept, the given bias loaded."""
    bands = torch.tensor([True, False, True, False][:3 if axis == ROWS else 4])
    layer = SlimLinear.from_dense(nn.Linear(8, 6), axis, 2, bands)
    weight = layer.dense_weight().detach().clone()
    bias = torch.arange(1.0, 7.0) * (layer.dense_bias() != 0)  # zero where rows are removed
    result = layer.load_state_dict({"bias": bias}, strict=False)
    assert result.missing_keys == ["weight"] and not result.unexpected_keys
    assert torch.equal(layer.dense_bias(), bias) and torch.equal(layer.dense_weight(), weight)


def test_loading_a_weight_nonzero_in_more_bands_than_kept_names_the_layer():
    layer = SlimLinear(8, 6, ROWS, 2, torch.tensor([True, False, False]))
    with pytest.raises(RuntimeError, match="nonzero in 3 bands of 2 rows, the layer keeps 1"):
        layer.load_state_dict(nn.Linear(8, 6).state_dict())
    held = nn.Sequential(layer)
    with pytest.raises(RuntimeError, match=r"\t0: the loaded weight is nonzero in 3 bands"):
        held.load_state_dict(nn.Sequential(nn.Linear(8, 6)).state_dict())  # the layer's name


@pytest.mark.parametrize("args,message", [
    ((8, 6, 2, 2, torch.ones(3, dtype=torch.bool)), "axis must be ROWS"),
    ((8, 6, ROWS, 4, torch.ones(2, dtype=torch.bool)), "bands of 4 do not tile the 6 rows"),
    ((8, 6, ROWS, 2, torch.ones(4, dtype=torch.bool)), r"band_mask must be bool of shape \(3,\)"),
    ((8, 6, ROWS, 2, torch.zeros(3, dtype=torch.bool)), "keeps no band"),
])
def test_bad_layers_are_refused_naming_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        SlimLinear(*args)


@pytest.mark.parametrize("head_size", [4, 16])
def test_units_of_part_heads_stay_masked_dense_and_of_several_heads_shrink(head_size):
    """``"head:D"`` on BERT's heads of 8: D = 4 would leave the slimmer attention grouping
    half-heads of different heads into one, so those layers stay masked-dense, saying why;
    D = 16 (two heads a unit) shrinks, and computes what the masked-dense model does."""
    config = SparsityConfig(pattern="neuron", sparsity=0.5, schedule="oneshot",
                            overrides={"attention": {"pattern": f"head:{head_size}"}},
                            compress="auto", deny=["embed", "pooler"])
    model, masked = hf_model("bert"), hf_model("bert")
    SparsityEngine(masked, config).prune()
    rows, plan = compress_selected(model, SparsityPlan.build(model, config))
    SparsityEngine(model, config, plan=plan.bound(model)).prune()
    query = {r.name: r for r in rows}["encoder.layer.0.attention.self.query"]
    if head_size == 4:
        assert query.layer is None
        assert "units of 4 features split BertSelfAttention's heads of 8" in query.decision
    else:
        assert isinstance(query.layer, SlimLinear)
    with torch.no_grad():
        torch.testing.assert_close(model(**hf_inputs("bert")).last_hidden_state,
                                   masked(**hf_inputs("bert")).last_hidden_state,
                                   rtol=0, atol=1e-10)


def test_a_group_shrinks_only_whole_and_says_which_member_cannot():
    config = SparsityConfig(**HEADS_AND_NEURONS, compress="auto",
                            deny=["embed", "pooler", r"layer\.0\.attention\.output"])
    model = hf_model("bert")
    rows, _ = compress_selected(model, SparsityPlan.build(model, config))
    by_name = {r.name: r for r in rows}
    query = by_name["encoder.layer.0.attention.self.query"]
    assert "output.dense.weight is not selected" in query.decision
    assert isinstance(by_name["encoder.layer.1.attention.self.query"].layer, SlimLinear)
    assert isinstance(by_name["encoder.layer.0.intermediate.dense"].layer, SlimLinear)


def test_the_training_paths_table_gives_a_slim_layers_pattern_and_kept_share():
    """At 75% a slim layer keeps a quarter of its bands: the swap table's density says 0.25
    (not 2:4's 0.5) and its rule names the unit, as the setup table does."""
    config = SparsityConfig(**dict(HEADS_AND_NEURONS, sparsity=0.75), compress=True,
                            deny=["embed", "pooler"])
    model = hf_model("bert")
    rows, _ = compress_selected(model, SparsityPlan.build(model, config))
    by_name = {r.name: r.as_dict() for r in rows}
    query, up = (by_name["encoder.layer.0.attention.self.query"],
                 by_name["encoder.layer.0.intermediate.dense"])
    assert (query["rule"], query["density"]) == ("head (block:8x32)", 0.25)
    assert (up["rule"], up["density"]) == ("neuron (block:1x32)", 0.25)


def test_heads_problem_reads_the_forward_for_head_counts():
    class ReadsCount(nn.Module):
        num_heads = 4

        def forward(self, x):
            return x.view(2, self.num_heads, -1)

    class ReadsOther(ReadsCount):
        n_heads = "four"

        def forward(self, x):
            return x.view(2, self.n_heads, -1)

    class RelativeBias(ReadsCount):
        has_relative_attention_bias = False

    class StatesItsSize(ReadsCount):
        head_dim = 8

    assert heads_problem(ReadsCount(), 2, 4, 8, 32) is None
    assert head_counts(ReadsCount()) == {"num_heads": 4}
    assert "does not scale to 1 of 3 heads" in heads_problem(StatesItsSize(), 1, 3, 8, 24)
    assert "units of 4 features split ReadsCount's heads of 8" in heads_problem(
        ReadsCount(), 4, 8, 4, 32)
    assert "own head size cannot be read" in heads_problem(nn.Identity(), 2, 4, 8, 32)
    assert "reads self.n_heads, which is not an int head count" in heads_problem(
        ReadsOther(), 2, 4, 8, 32)
    assert "relative attention bias per head" in heads_problem(RelativeBias(), 2, 4, 8, 32)


class TinyBert(pl.LightningModule):
    """BERT QA from a config, initialized from ``seed``, with the user's AdamW."""

    def __init__(self, seed: int = 0):
        super().__init__()
        from transformers import BertConfig, BertForQuestionAnswering

        torch.manual_seed(seed)
        self.model = BertForQuestionAnswering(BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            vocab_size=40, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))

    def training_step(self, batch, batch_idx):
        ids, start, end = batch
        return self.model(input_ids=ids, start_positions=start, end_positions=end).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def bert_loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, 40, (12, 16), generator=g),
                                    torch.randint(0, 16, (12,), generator=g),
                                    torch.randint(0, 16, (12,), generator=g)), batch_size=4)


def fit_bert(max_epochs, seed=0, ckpt_path=None, callbacks=()):
    pl.seed_everything(0, verbose=False)
    model = TinyBert(seed)
    callback = SparsityCallback(**HEADS_AND_NEURONS, compress=True, deny=["embeddings", "qa"])
    trainer = make_trainer([callback, *callbacks], max_epochs=max_epochs,
                           enable_checkpointing=bool(callbacks))
    trainer.fit(model, bert_loader(), ckpt_path=ckpt_path)
    return model, trainer


def test_a_slim_fit_trains_the_smaller_layers_and_resumes_exactly(tmp_path):
    uninterrupted, trainer = fit_bert(2)
    slim = [m for m in uninterrupted.modules() if isinstance(m, SlimLinear)]
    assert len(slim) == 12  # q, k, v, out, up, down of 2 layers
    shapes = {tuple(p.shape) for group in trainer.optimizers[0].param_groups
              for p in group["params"]}
    assert (16, 32) in shapes and (24, 32) in shapes and (32, 24) in shapes  # half of each
    assert (32, 32) not in shapes and (48, 32) not in shapes
    fit_bert(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    resumed, resumed_trainer = fit_bert(2, seed=1, ckpt_path=tmp_path / "last.ckpt")
    assert_same_fit(uninterrupted, trainer, resumed, resumed_trainer)
    plain = TinyBert(seed=3)
    plain.load_state_dict(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"])


def test_moving_bands_keeps_what_stays_and_zeroes_what_is_new():
    torch.manual_seed(4)
    layer = SlimLinear.from_dense(nn.Linear(6, 8), ROWS, 2, torch.tensor([1, 1, 0, 0]).bool())
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    moment = optimizer.state[layer.bias]["exp_avg"].clone()
    slot = layer.slot("w")
    slot.set_mask(torch.tensor([[False], [True], [True], [False]]), [optimizer])
    assert layer.band_mask.tolist() == [False, True, True, False]
    # band 1 was the second kept band (rows 2-3 of the values) and is now the first
    torch.testing.assert_close(layer.weight[:2], weight[2:])
    torch.testing.assert_close(layer.bias[:2], bias[2:])
    torch.testing.assert_close(optimizer.state[layer.bias]["exp_avg"][:2], moment[2:])
    assert not layer.weight[2:].any() and not layer.bias[2:].any()
    assert not optimizer.state[layer.weight]["exp_avg"][2:].any()
    with pytest.raises(ValueError, match="a mask of 1 bands for a layer of 2"):
        slot.set_mask(torch.tensor([[True], [False], [False], [False]]))


@pytest.mark.skipif(not (torch.distributed.is_available()
                         and torch.distributed.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("axis", [ROWS, COLUMNS])
def test_moving_the_bands_of_a_sharded_layer_moves_what_the_plain_layer_moves(tmp_path, axis):
    """FSDP2 (a world of 1 over gloo: the weights are DTensors): weights, bias, gradients,
    optimizer state and a carried tensor move as the unsharded layer's do."""
    from torch.distributed.fsdp import fully_shard

    from sparse_training.engine.sharding import full

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        layers, optimizers, carried = [], [], []
        for sharded in (False, True):
            torch.manual_seed(4)
            layer = SlimLinear.from_dense(nn.Linear(6, 8), axis, 2,
                                          torch.tensor([1, 1, 0] if axis == COLUMNS
                                                       else [1, 1, 0, 0]).bool())
            if sharded:
                fully_shard(layer)
            optimizer = torch.optim.Adam(layer.parameters())
            layer(torch.randn(3, 4 if axis == COLUMNS else 6)).sum().backward()
            optimizer.step()
            local = layer.weight.to_local() if sharded else layer.weight
            value = torch.arange(float(local.numel())).view_as(local)  # carried: local rows
            layer.slot("w").set_mask(torch.tensor([[False, True, True]] if axis == COLUMNS
                                                  else [[False], [True], [True], [False]]),
                                     [optimizer], carried=[value])
            layers.append(layer)
            optimizers.append(optimizer)
            carried.append(value)
        plain, sharded = layers
        assert plain.band_mask.tolist() == sharded.band_mask.tolist()
        for a, b in ((plain.weight, sharded.weight), (plain.bias, sharded.bias),
                     (plain.weight.grad, sharded.weight.grad)):
            torch.testing.assert_close(full(b), a)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full(optimizers[1].state[sharded.weight][key]),
                                       optimizers[0].state[plain.weight][key])
        torch.testing.assert_close(carried[1], carried[0])
        assert plain.weight[2:].abs().sum() == 0 if axis == ROWS else \
            plain.weight[:, 2:].abs().sum() == 0
    finally:
        dist.destroy_process_group()
