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

from sparse_training import BlockSparseLinear, SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.engine.plan import SparsityPlan
from sparse_training.layers.compress import compress_selected

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


class GPT2(nn.Module):
    """HF GPT-2 from a config: its attention and MLP are ``Conv1D`` (weights stored (in,
    out), y = x W + b), its LM head is tied to the token embedding."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.gpt2 = GPT2LMHeadModel(GPT2Config(
            n_layer=1, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, tokens):
        return self.gpt2(input_ids=tokens).logits[:, -1]


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
    "hf-gpt2": lambda: Zoo(GPT2(), "tokens"),
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
CONV1D_TYPES = ["Linear", "transformers.pytorch_utils.Conv1D"]
SETTINGS = {"hf-bert": dict(deny=["pooler"]),  # unused by the loss: no gradient
            "hf-gpt2": dict(layer_types=CONV1D_TYPES)}


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
                              **SETTINGS.get(model_name, {}))
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


def _groups(mask: torch.Tensor, reduction_dim: int, m: int) -> torch.Tensor:
    """Kept entries in each group of m consecutive entries along the reduction dimension."""
    return mask.movedim(reduction_dim, -1).reshape(-1, m).sum(-1)


class GroupAudit(pl.Callback):
    """After every step: each selected tensor keeps exactly 2 of every 4 consecutive weights
    along the dimension its layer reduces over (Conv1D's first, the others' second), its
    pruned weights are zero, and its mask is the one set at step 0."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.first, self.steps = sparse, {}, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        for slot in self.sparse.engine.slots:
            reduction = 0 if slot.plan.kind == "Conv1D" else 1
            assert (_groups(slot.mask, reduction, 4) == 2).all(), slot.name
            assert not slot.forward_weight()[~slot.mask].any(), slot.name
            first = self.first.setdefault(slot.name, slot.mask.clone())
            assert torch.equal(first, slot.mask), slot.name


def test_gpt2_conv1d_keeps_2_of_4_along_its_inputs_while_training():
    """GPT-2's Conv1D weights are stored (in, out): 2:4 groups run along dim 0, the inputs
    the forward's ``x @ W`` reduces over, not along the outputs."""
    model = Zoo(GPT2(), "tokens")
    sparse = SparsityCallback("2:4", layer_types=CONV1D_TYPES)
    audit = GroupAudit(sparse)
    make_trainer([sparse, audit], max_steps=3).fit(model, loader("tokens"))
    kinds = {s.name: s.plan.kind for s in sparse.engine.slots}
    assert sorted(kinds.values()) == ["Conv1D"] * 4 + ["Embedding"]  # wte, tied to lm_head
    assert audit.steps == 3
    c_attn = model.body.gpt2.transformer.h[0].attn.c_attn.weight  # (64 in, 192 out)
    assert c_attn.shape == (64, 192)
    assert ((c_attn != 0).T.reshape(192, 16, 4).sum(-1) <= 2).all()


class Overhung(nn.Module):
    """Linear layers whose weights 16x16 blocks overhang: 40x30 and 4x40 (a head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 30)
        self.hidden = nn.Linear(30, 40)
        self.head = nn.Linear(40, CLASSES)

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.embed(tokens).mean(1))))


def _clipped(mask: torch.Tensor) -> list[torch.Tensor]:
    rows, cols = mask.shape
    return [mask[i:i + 16, j:j + 16] for i in range(0, rows, 16) for j in range(0, cols, 16)]


class BlockAudit(pl.Callback):
    """After every step: whole clipped 16x16 blocks, the set count, pruned weights zero."""

    def __init__(self, sparse: SparsityCallback, kept: dict[str, int]) -> None:
        self.sparse, self.kept, self.steps, self.moves = sparse, kept, 0, 0
        self.last: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        for slot in self.sparse.engine.slots:
            blocks = _clipped(slot.mask)
            assert all(b.all() or not b.any() for b in blocks), slot.name
            assert sum(bool(b.all()) for b in blocks) == self.kept[slot.name], slot.name
            assert not slot.param[~slot.mask].any(), slot.name
            last = self.last.get(slot.name)
            self.moves += last is not None and not torch.equal(last, slot.mask)
            self.last[slot.name] = slot.mask.clone()


OVERHUNG = dict(pattern="block:16x16", sparsity=0.5, overrides={"head": {"sparsity": 0.5}})
OVERHUNG_KEPT = {"body.hidden.weight": 3, "body.head.weight": 1}  # 6 - 3 and 3 - round(1.5)


def test_overhanging_blocks_compress_to_the_blocks_masked_dense_keeps():
    """block:16x16 on a 40x30 weight (3 x 2 blocks, the last row and column clipped) and,
    named, a 4x40 head (1 x 3): compress=True swaps in BlockSparseLinear layers holding
    exactly the blocks the masked-dense engine keeps."""
    torch.manual_seed(0)
    masked, compressed = Zoo(Overhung(), "tokens"), Zoo(Overhung(), "tokens")
    compressed.load_state_dict(masked.state_dict())
    engine = SparsityEngine(masked, SparsityConfig(**OVERHUNG))
    engine.prune()
    rows, _ = compress_selected(compressed, SparsityPlan.build(
        compressed, SparsityConfig(**OVERHUNG, compress=True)))
    assert [r.decision for r in rows] == ["compressed", "compressed"]
    for slot in engine.slots:
        layer = compressed.get_submodule(slot.name.removesuffix(".weight"))
        assert isinstance(layer, BlockSparseLinear), slot.name
        assert torch.equal(layer.to_dense().weight != 0, slot.mask), slot.name
        assert layer.nnz == OVERHUNG_KEPT[slot.name]
    # the engine the callback builds next takes the compressed layers (the override that
    # named the head now matches its compressed values)
    after = SparsityEngine(compressed, SparsityConfig(**OVERHUNG, compress=True))
    assert [s.name for s in after.compressed] == ["body.hidden.values", "body.head.values"]


@pytest.mark.parametrize("regrow", [None, "set"])
def test_overhanging_blocks_stay_whole_while_training(regrow):
    """Masked-dense training (and SET moving blocks every 2 steps) on weights the blocks
    overhang: whole clipped blocks and the same count at every step."""
    settings = dict(OVERHUNG, schedule="constant", regrow=regrow, frequency=2,
                    regrow_end=1.0, regrow_fraction=0.5)
    sparse = SparsityCallback(**settings)
    audit = BlockAudit(sparse, OVERHUNG_KEPT)
    torch.manual_seed(0)
    model = Zoo(Overhung(), "tokens")
    make_trainer([sparse, audit], max_steps=6).fit(model, loader("tokens"))
    assert audit.steps == 6
    assert (audit.moves > 0) == (regrow is not None)  # SET swapped blocks at step 2
