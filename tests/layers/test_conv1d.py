"""HF ``Conv1D`` (GPT-2): selected by default, trained compressed (blocks, 2:4, neurons)
with its own ``(in, out)`` layout in the state dict."""

import copy

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_same_fit, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine, densify
from sparse_training.engine.plan import SparsityPlan
from sparse_training.layers.blocks import dense_state_dict
from sparse_training.layers.compress import compress_selected
from sparse_training.layers.conv1d import BlockSparseConv1D, as_linear

SETTINGS = {
    "block": dict(pattern="block:16x16", sparsity=0.5),
    "2:4": dict(pattern="2:4"),
    "neurons": dict(pattern="neuron", sparsity=0.5, overrides={"attn": {"pattern": "head"}}),
}


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      vocab_size=128, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_the_default_layer_types_select_conv1d_and_given_ones_are_kept():
    model = gpt2()
    rows = {r.name: r for r in SparsityPlan.build(model, SparsityConfig(pattern="2:4")).rows}
    assert rows["transformer.h.0.mlp.c_fc.weight"].selected
    assert rows["transformer.h.0.attn.c_attn.weight"].input_dim == 0
    only_linear = SparsityConfig(pattern="2:4", layer_types=[nn.Linear, nn.Embedding])
    rows = {r.name: r for r in SparsityPlan.build(model, only_linear).rows}
    assert not rows["transformer.h.0.mlp.c_fc.weight"].selected


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_compressed_gpt2_computes_what_masked_dense_does_and_saves_conv1d_weights(kind):
    """float64: the compressed GPT-2 against the masked-dense engine's at step 0; its state
    dict loads strictly into a plain GPT-2 giving the same logits; densify gives Conv1D
    back."""
    config = SparsityConfig(**SETTINGS[kind], schedule="oneshot", compress=True,
                            deny=["wte|wpe"])
    model, masked = gpt2().double().eval(), gpt2().double().eval()
    SparsityEngine(masked, config).prune()
    rows, plan = compress_selected(model, SparsityPlan.build(model, config))
    SparsityEngine(model, config, plan=plan.bound(model)).prune()
    compressed = [r for r in rows if r.layer is not None]
    assert compressed and all(r.layer.state_dict()["weight"].shape == (r.shape) for r in
                              compressed)  # Conv1D's (in, out)
    assert all(r.layer is not None for r in rows)
    if kind == "neurons":  # GPT-2's attention reads split_size: it follows the kept heads
        assert model.transformer.h[0].attn.split_size == 32
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = masked(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-10)
        plain = gpt2(seed=4).double().eval()
        plain.load_state_dict(model.state_dict())  # strict
        torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=1e-10)
        dense = copy.deepcopy(model)
        densify(dense)
        assert type(dense.transformer.h[0].mlp.c_fc) is Conv1D
        assert dense.transformer.h[0].attn.split_size == 64
        torch.testing.assert_close(dense(ids).logits, expected, rtol=0, atol=1e-10)


def test_a_block_conv1d_layer_and_its_gradients_against_a_float64_reference():
    torch.manual_seed(2)
    conv = Conv1D(48, 32).double()  # nf=48 outputs, nx=32 inputs: weight (32, 48)
    mask = torch.rand(48 // 16, 32 // 16) < 0.5
    mask[0, 0] = True
    layer = BlockSparseConv1D.from_dense(as_linear(conv), (16, 16), mask=mask)
    dense_mask = mask.repeat_interleave(16, 0).repeat_interleave(16, 1).T  # (in, out)
    weight = (conv.weight.detach() * dense_mask).requires_grad_(True)
    bias = conv.bias.detach().clone().requires_grad_(True)
    x = torch.randn(32, 7, 3, dtype=torch.float64).transpose(0, 2)  # non-contiguous
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    y, y_ref = layer(x), x_ref @ weight + bias
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.to_dense().weight.detach(), weight.detach())
    dense_grad = torch.zeros(48, 32, dtype=torch.float64)  # the kept blocks' gradient
    for n, (r, c) in enumerate(mask.nonzero().tolist()):
        dense_grad[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16] = layer.values.grad[n]
    torch.testing.assert_close(dense_grad.T, weight.grad * dense_mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, bias.grad, rtol=0, atol=1e-12)


def test_dense_state_dict_gives_a_plain_gpt2_its_conv1d_weights_input_first():
    """The compact form that block layers with sharded values save (``values``, and the
    ``block_mask`` of the ``(out, in)`` grid), made dense for a plain GPT-2: every Conv1D's
    weight ``(in, out)`` equal to the compressed model's own state dict (the square
    ``attn.c_proj`` too, where a missing transpose keeps the shape), and the same logits."""
    config = SparsityConfig(**SETTINGS["block"], schedule="oneshot", compress=True,
                            deny=["wte|wpe"])
    model = gpt2().double().eval()
    compress_selected(model, SparsityPlan.build(model, config))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BlockSparseConv1D)}
    assert {name.split(".", 3)[-1] for name in layers} == {"attn.c_attn", "attn.c_proj",
                                                          "mlp.c_fc", "mlp.c_proj"}
    compact = model.state_dict()
    for name, layer in layers.items():
        del compact[f"{name}.weight"]
        compact[f"{name}.values"] = layer.values.detach()
        compact[f"{name}.block_mask"] = layer.block_mask
    plain = gpt2(seed=4).double().eval()
    plain.load_state_dict(dense_state_dict(compact, plain))  # strict
    expected = model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), key
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-10)


class TinyGPT2(pl.LightningModule):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.model = gpt2(seed)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(max_epochs, kind, seed=0, ckpt_path=None, callbacks=(), compress=True):
    pl.seed_everything(0, verbose=False)
    model = TinyGPT2(seed)
    sparse = SparsityCallback(**SETTINGS[kind], schedule="oneshot", compress=compress,
                              deny=["wte|wpe"])
    trainer = make_trainer([sparse, *callbacks], max_epochs=max_epochs,
                           enable_checkpointing=bool(callbacks))
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=4), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("kind, resumed_with", [("block", True), ("neurons", True),
                                                ("block", "auto"), ("2:4", "auto")])
def test_a_compressed_gpt2_fit_resumes_exactly(tmp_path, kind, resumed_with):
    """``"auto"`` keeps block and 2:4 layers masked-dense on the CPU: the resume takes the
    checkpoint's compressed Conv1D layers from their saved masks."""
    uninterrupted, trainer = fit(2, kind)
    assert not any(type(m) is Conv1D for m in uninterrupted.model.transformer.h[0].mlp.modules())
    fit(1, kind, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    resumed, resumed_trainer = fit(2, kind, seed=1, ckpt_path=tmp_path / "last.ckpt",
                                   compress=resumed_with)
    assert_same_fit(uninterrupted, trainer, resumed, resumed_trainer)
    TinyGPT2(seed=3).load_state_dict(
        torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"])  # strict
