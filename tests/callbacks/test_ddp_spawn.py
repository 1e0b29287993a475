"""``strategy="ddp_spawn"`` on 2 CPU processes (gloo): the fit trains in the spawned
processes, which send back the model's weights and the logged metrics only. Reading the
callback's engine in the main process is None; a later fit's masks are its score's."""

import copy

import pytest
import torch
from conftest import TinyNet, make_loader, make_trainer, two_process_problem
from pytorch_lightning.callbacks import ModelCheckpoint

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """A TinyNet fit under ddp_spawn over 2 gloo processes, saving a checkpoint: (model,
    callback, trainer)."""
    if reason := two_process_problem("cpu"):
        pytest.skip(reason)
    sparse = SparsityCallback(pattern="unstructured", sparsity=0.8, schedule="gmp", end=2,
                              frequency=1)
    saves = ModelCheckpoint(dirpath=tmp_path_factory.mktemp("spawn"))
    trainer = make_trainer([sparse, saves], max_epochs=1, strategy="ddp_spawn", devices=2,
                           enable_checkpointing=True)
    model = TinyNet()
    trainer.fit(model, make_loader())
    return model, sparse, trainer


def test_the_engine_stays_in_the_spawned_processes(spawned):
    model, sparse, trainer = spawned
    assert sparse.engine is None  # it lived in the spawned processes
    assert not any(name.endswith("_mask") for name, _ in model.named_buffers())
    # what comes back: the metrics, and the trained weights, zero where they were pruned
    assert float(trainer.callback_metrics["sparsity/global"]) == pytest.approx(0.8, abs=0.01)
    for layer in model.net[:3:2]:
        assert float((layer.weight == 0).float().mean()) == pytest.approx(0.8, abs=0.01)


@pytest.mark.parametrize(("score", "same"), [("magnitude", True), ("random", False)])
def test_a_later_fit_makes_masks_from_its_score_not_from_the_zeros(spawned, score, same):
    """No mask comes back: new masks at the same sparsity find the zeros again by
    magnitude (they are the smallest weights); a random score prunes trained weights."""
    model = copy.deepcopy(spawned[0])  # the returned model as it came back, every time
    zeros = {f"{i}.weight": model.net[i].weight == 0 for i in (0, 2)}
    engine = SparsityEngine(model.net, SparsityConfig("unstructured", sparsity=0.8, score=score))
    engine.prune()
    for slot in engine.slots:
        if slot.name in zeros:
            assert torch.equal(~slot.mask, zeros[slot.name]) is same, slot.name


def test_the_checkpoint_puts_the_masks_back(spawned):
    """The spawned fit's checkpoint holds the callback's state: an engine built on it puts
    the masks back on the returned model (a later fit then starts from them, as after a
    fit in this process)."""
    model, sparse, trainer = copy.deepcopy(spawned[0]), spawned[1], spawned[2]
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)
    engine = SparsityEngine(model, sparse.config, state=checkpoint["callbacks"][sparse.state_key])
    engine.detach()  # the masks stay on the model
    for i in (0, 2):
        assert torch.equal(~model.net[i].weight_mask, model.net[i].weight == 0)
