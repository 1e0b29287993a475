"""A compressed fit frees the layers it swapped out: their dense weights (the whole model's
size) are gone once training starts, under every compressed path. A plan that went on
naming the swapped-out modules kept every dense weight alive through the fit (6.5 GiB of
fp32 weights at 1 GPU and on every FSDP2 rank of an 8-layer Llama-3-8B-shaped decoder)."""

from __future__ import annotations

import gc
import weakref

import pytest
import pytorch_lightning as pl
import torch
from tiny_hf import FAMILIES, TinyHF, hf_loader

from sparse_training import SparsityCallback


class AliveAtSteps(pl.Callback):
    """At the start of each training batch: how many of ``refs`` are alive outside the
    model (not one of its parameters), and how many in it."""

    def __init__(self, refs: list[weakref.ref]) -> None:
        self.refs, self.outside, self.inside = refs, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        gc.collect()
        held = {id(p) for p in pl_module.parameters()}
        alive = [ref() for ref in self.refs if ref() is not None]
        self.inside.append(sum(id(w) in held for w in alive))
        self.outside.append(len(alive) - self.inside[-1])


HEADS_AND_NEURONS = dict(pattern="neuron", sparsity=0.5, overrides={
    r"(attention|self_attn)\.": {"pattern": "head"}})


@pytest.mark.parametrize(("family", "settings"), [
    ("llama", dict(pattern="block:16x16", sparsity=0.75)),
    ("bert", dict(pattern="block:16x16", sparsity=0.9)),
    ("llama", HEADS_AND_NEURONS), ("bert", HEADS_AND_NEURONS),
])
def test_swapped_out_dense_weights_are_freed_before_the_first_step(family, settings):
    model = TinyHF(family=family, hidden=64)
    layers = model.model.model.layers if family == "llama" else model.model.bert.encoder.layer
    weights = [m.weight for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    refs = [weakref.ref(w) for w in weights]
    del weights
    callback = SparsityCallback(**settings, compress=True, deny=FAMILIES[family][0])
    probe = AliveAtSteps(refs)
    pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False,
               callbacks=[callback, probe]).fit(model, hf_loader(family, batches=2, batch=2,
                                                                 seq=16))
    swapped = sum(hasattr(m, "trained_weight") for m in layers.modules())
    assert swapped >= len(refs) // 2, "too few layers compressed for the test to prove much"
    assert probe.outside == [0, 0]
    assert probe.inside[0] == len(refs) - swapped  # the Linears left as they were
