"""The test zoo: the model types people train x the patterns people use. At every step the
reported sparsity (per tensor, global, and what reaches the logger) must equal the zero
fraction of the weights the forward pass uses (``conftest.MaskAudit``)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import MaskAudit, make_trainer
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import SparsityCallback

VOCAB, CLASSES = 32, 4


class Zoo(pl.LightningModule):
    """A classifier around ``body``; ``kind`` says what the inputs are."""

    def __init__(self, body: nn.Module | None, kind: str) -> None:
        super().__init__()
        self.body, self.kind = body, kind

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            32, 4, dim_feedforward=64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, images):
        return self.head(self.features(images))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0][:, -1])


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        self.bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=16))
        self.head = nn.Linear(32, CLASSES)

    def forward(self, tokens):
        return self.head(self.bert(input_ids=tokens).last_hidden_state[:, 0])


class Normed(nn.Module):
    """Linear layers under weight norm (w = g v / ||v||, the mask on v) or spectral norm."""

    def __init__(self, norm):
        super().__init__()
        self.net = nn.Sequential(norm(nn.Linear(16, 32)), nn.ReLU(), norm(nn.Linear(32, 32)),
                                 nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x):
        return self.net(x)


class TiedLM(nn.Module):
    """Next-token prediction with the output layer sharing the embedding's tensor."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.mix(self.embed(tokens))).mean(1))


class MetaBuilt(Zoo):
    """Layers made in configure_model on the meta device, then materialized."""

    def __init__(self):
        super().__init__(None, "vector")

    def configure_model(self):
        if self.body is not None:
            return
        with torch.device("meta"):
            body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, CLASSES))
        body.to_empty(device="cpu")
        for layer in body:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        self.body = body


MODELS = {
    "transformer-encoder": lambda: Zoo(Transformer(), "tokens"),
    "cnn-batchnorm": lambda: Zoo(ConvBN(), "images"),
    "lstm": lambda: Zoo(Recurrent(), "tokens"),
    "hf-bert": lambda: Zoo(Bert(), "tokens"),
    "weight-norm": lambda: Zoo(Normed(weight_norm), "vector"),
    "spectral-norm": lambda: Zoo(Normed(spectral_norm), "vector"),
    "tied-lm": lambda: Zoo(TiedLM(), "tokens"),
    "configure-model-meta": MetaBuilt,
}
PATTERNS = {
    "2:4": dict(pattern="2:4"),
    "gmp": dict(pattern="unstructured", sparsity=0.8, schedule="gmp", end=0.75, frequency=2),
    "block": dict(pattern="block:4x4", sparsity=0.5),
    "rigl": dict(pattern="unstructured", sparsity=0.8, schedule="constant", score="random",
                 regrow="rigl", frequency=2, regrow_end=1.0),
}
DENY = {"hf-bert": ["pooler"]}  # unused by the loss: no gradient


def loader(kind: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = {"tokens": lambda: torch.randint(0, VOCAB, (48, 8), generator=g),
         "images": lambda: torch.randn(48, 4, 6, 6, generator=g),
         "vector": lambda: torch.randn(48, 16, generator=g)}[kind]()
    y = torch.randint(0, CLASSES, (48,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("model_name", MODELS)
def test_reported_sparsity_is_the_forward_weights_sparsity(model_name, pattern):
    model = MODELS[model_name]()
    sparse = SparsityCallback(**PATTERNS[pattern], log_layers=True,
                              deny=DENY.get(model_name))
    audit = MaskAudit(sparse)
    if model_name == "weight-norm" and pattern != "2:4":
        # a pruned whole row would make weight norm divide by zero: refused, named
        with pytest.raises(ValueError, match=r"'body.net.0.weight' \(Linear\) is "
                                             r"parametrized \(_WeightNorm\) so that a whole "
                                             r"row of zeros"):
            make_trainer([sparse, audit], max_epochs=1).fit(model, loader(model.kind))
        return
    make_trainer([sparse, audit], max_epochs=2, log_every_n_steps=1).fit(
        model, loader(model.kind))
    engine = sparse.engine
    assert audit.updates >= 1 and audit.steps == 12 and audit.logged_checks >= 12
    assert len(engine.slots) >= 2
    target = 0.5 if pattern in ("2:4", "block") else 0.8
    assert engine.sparsity == pytest.approx(target, abs=0.02)


def test_the_zoo_masks_every_kind_of_weight_tensor():
    """What the zoo's models select: in-projections, LSTM weights, parametrized originals,
    the tied embedding once under both names, conv weights next to BatchNorm."""
    def selected(model):
        sparse = SparsityCallback("2:4")
        make_trainer([sparse], max_steps=1).fit(model, loader(model.kind))
        return [s.name for s in sparse.engine.slots], sparse.engine

    names, _ = selected(MODELS["transformer-encoder"]())
    assert "body.encoder.layers.0.self_attn.in_proj_weight" in names
    names, _ = selected(MODELS["lstm"]())
    assert {"body.lstm.weight_ih_l0", "body.lstm.weight_hh_l1"} <= set(names)
    names, engine = selected(MODELS["weight-norm"]())
    assert names[:2] == ["body.net.0.weight", "body.net.2.weight"]
    assert engine.slots[0].tensor.store[1] == "original1"  # weight norm's direction v
    names, engine = selected(MODELS["tied-lm"]())
    tied = next(s for s in engine.slots if s.name == "body.embed.weight")
    assert tied.plan.names == ("body.embed.weight", "body.lm_head.weight")
    names, _ = selected(MODELS["cnn-batchnorm"]())
    assert names == ["body.features.0.weight", "body.features.3.weight", "body.head.weight"]


def test_a_compiled_inner_module():
    """torch.compile of the inner module (AOTAutograd, without code generation to keep CI
    fast): names gain ``_orig_mod.``, masks hold at every step (docs/transformers.md)."""
    model = Zoo(torch.compile(Transformer(), backend="aot_eager"), "tokens")
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", end=0.75,
                              frequency=2, deny=["embed"])
    audit = MaskAudit(sparse)
    make_trainer([sparse, audit], max_epochs=2, log_every_n_steps=1).fit(model, loader("tokens"))
    assert sparse.engine.slots[0].name == "body._orig_mod.encoder.layers.0.self_attn.in_proj_weight"
    assert audit.updates >= 3 and sparse.engine.sparsity == pytest.approx(0.8, abs=0.01)
