"""Training scores in the engine and through ``pl.Trainer``: what they observe, the masks
they make (against hand computations in float64), the optimal-brain-surgeon update, exact
resume of their statistics (masked-dense and compressed), and the errors of settings that
would leave them nothing to rank."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, TinyNet, assert_same_training, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.pieces.second_order import SecondOrderScore


def train(model, engine, steps, optimizer=None, lr=0.05, record=None):
    """A plain training loop over fixed random batches; ``record`` gets each step's
    (weights, gradients) of the model's Linear weights before the optimizer step."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    engine.attach(optimizer)
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        engine.on_step_start(step)
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        model(x).square().mean().backward()
        if record is not None:
            record.append({n: (p.detach().clone(), p.grad.clone())
                           for n, p in model.named_parameters() if p.dim() == 2})
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).double()


def test_movement_masks_are_the_top_k_of_the_hand_accumulated_movement():
    model = mlp()
    config = SparsityConfig(pattern="unstructured", sparsity=0.5, schedule="oneshot", start=5,
                            score="movement")
    engine = SparsityEngine(model, config)
    engine.start(6)
    record = []
    train(model, engine, 6, record=record)
    for name in ("0.weight", "2.weight"):
        movement = torch.zeros_like(record[0][name][0])
        for step in record[:5]:  # the update at step 5 reads steps 0-4
            weight, gradient = step[name]
            movement -= weight * gradient
        kept = movement.flatten().argsort(descending=True)[: movement.numel() // 2]
        expected = torch.zeros(movement.numel(), dtype=torch.bool)
        expected[kept] = True
        mask = dict(model.named_modules())[name[0]].weight_mask
        assert torch.equal(mask.flatten(), expected), name


def test_gradual_updates_prune_monotonically_whatever_the_score_says():
    """A weight pruned by an earlier update ranks below every kept one: its movement (zero
    from then on, weight and score) cannot bring it back."""
    model = mlp()
    config = SparsityConfig(pattern="unstructured", sparsity=0.8, schedule="gmp", start=0,
                            end=9, frequency=3, score="movement")
    engine = SparsityEngine(model, config)
    engine.start(12)
    masks = []

    class Watch(torch.optim.SGD):
        def step(self, closure=None):
            masks.append(model[0].weight_mask.clone())
            return super().step(closure)

    train(model, engine, 12, optimizer=Watch(model.parameters(), lr=0.05))
    for earlier, later in zip(masks, masks[1:], strict=False):
        assert not (later & ~earlier).any()
    assert masks[-1].sum() == round(0.2 * 60)


def test_the_second_order_update_moves_the_kept_weights_by_the_obs_step():
    model = mlp()
    score = SecondOrderScore(block_size=10, damp=0.1)
    config = SparsityConfig(pattern="unstructured", sparsity=0.5, schedule="oneshot", start=4,
                            score=score)
    engine = SparsityEngine(model, config)
    engine.start(5)
    record = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine.attach(optimizer)
    generator = torch.Generator().manual_seed(3)
    for step in range(4):
        engine.on_step_start(step)
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        model(x).square().mean().backward()
        record.append(model[2].weight.grad.clone())
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
    before = model[2].weight.detach().clone()
    engine.on_step_start(4)  # the one update: ranks, moves the kept weights, prunes
    after, mask = model[2].weight.detach(), model[2].weight_mask
    ranks = []
    for row in range(4):
        grads = [g[row] for g in record]
        fisher = sum(torch.outer(g, g) for g in grads) / 4
        fisher += 0.1 * fisher.diagonal().mean() * torch.eye(10, dtype=torch.float64)
        inverse = torch.linalg.inv(fisher)
        pruned = (~mask[row]).nonzero().squeeze(1)
        w = before[row]
        step = -inverse[:, pruned] @ torch.linalg.solve(inverse[pruned][:, pruned], w[pruned])
        torch.testing.assert_close(after[row], torch.where(mask[row], w + step, 0.0),
                                   rtol=1e-9, atol=1e-12)
        ranks.append(w ** 2 / (2 * inverse.diagonal()))
    expected = torch.zeros(40, dtype=torch.bool)  # the top half of the whole tensor's ranks
    expected[torch.cat(ranks).argsort(descending=True)[:20]] = True
    assert torch.equal(mask.flatten(), expected)


def test_a_later_obs_update_keeps_the_earlier_pruned_weights_at_zero():
    """At a gradual schedule's second pruning update, the weights an earlier update pruned
    are zero and must stay so: the OBS step removes Q = every weight the new mask prunes
    (those already zero with w_q = 0), dw = -F^-1 E_Q ([F^-1]_QQ)^-1 w_Q, the constrained
    optimum of 1/2 dw^T F dw (Hassibi & Stork 1993), not moved with the new ones and
    re-masked after."""
    model = mlp()
    config = SparsityConfig(pattern="unstructured", sparsity=0.8, schedule="gmp", start=0,
                            end=8, frequency=4, score=SecondOrderScore(block_size=10, damp=0.1))
    engine = SparsityEngine(model, config)
    engine.start(9)
    record = []
    train(model, engine, 8, record=record)  # updates at 0 (nothing pruned) and 4
    earlier = model[2].weight_mask.clone()
    before = model[2].weight.detach().clone()
    engine.on_step_start(8)  # the last update reads steps 4-7
    after, mask = model[2].weight.detach(), model[2].weight_mask
    assert (~earlier).any() and (earlier & ~mask).any()
    for row in range(4):
        grads = [step["2.weight"][1][row] for step in record[4:]]
        fisher = sum(torch.outer(g, g) for g in grads) / 4
        fisher += 0.1 * fisher.diagonal().mean() * torch.eye(10, dtype=torch.float64)
        inverse = torch.linalg.inv(fisher)
        pruned = (~mask[row]).nonzero().squeeze(1)
        w = before[row]
        if not (earlier[row] & ~mask[row]).any():
            torch.testing.assert_close(after[row], w, rtol=0, atol=0)
            continue
        step = -inverse[:, pruned] @ torch.linalg.solve(inverse[pruned][:, pruned], w[pruned])
        torch.testing.assert_close(after[row], w + step, rtol=1e-9, atol=1e-12)


def test_a_training_score_before_any_step_is_refused_before_anything_changes():
    model = mlp()
    engine = SparsityEngine(model, SparsityConfig(pattern="unstructured", sparsity=0.5,
                                                  schedule="gmp", score="second-order"))
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="'second-order' ranks what training observed, but "
                                         "tensor '0.weight' has had no gradient"):
        engine.prune()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert model[0].weight_mask.all()


@pytest.mark.parametrize("settings, message", [
    (dict(schedule="oneshot", score="movement"), "start later .* use a gradual schedule"),
    (dict(schedule="constant", start=0.0, score="soft-movement"), "makes its only mask before"),
    (dict(pattern="2:4", sparsity=None, schedule="constant", regrow="sr-ste",
          score="second-order"), "SR-STE re-derives its N:M masks"),
    (dict(score="fisher"), "unknown score 'fisher'; valid: 'magnitude', 'random', 'movement'"),
    (dict(score={"name": "movement", "lr": 1}), r"score 'movement' takes the options \[\]"),
    (dict(score=3), "unknown score 3"),
])
def test_scores_that_cannot_rank_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        SparsityConfig(**{"pattern": "unstructured", "sparsity": 0.5, **settings})


def test_frequency_beyond_the_run_is_refused_at_fit_start():
    sparse = SparsityCallback(pattern="unstructured", sparsity=0.5, schedule="gmp",
                              frequency=100, score="movement")
    with pytest.raises(ValueError, match="frequency=100 is more than the run's 16 optimizer "
                                         "steps"):
        make_trainer([sparse]).fit(TinyNet(), make_loader())


def test_regrowth_starts_from_magnitude_and_drops_by_the_score():
    """RigL from step 0 with a training score: the first mask keeps the largest |w|
    (nothing observed yet), later drops rank by movement."""
    settings = dict(pattern="unstructured", sparsity=0.75, schedule="constant", frequency=2,
                    regrow="rigl", regrow_end=12, score="movement")
    pl.seed_everything(0)
    model = TinyNet()
    first = {n: p.detach().abs().flatten() for n, p in model.named_parameters() if p.dim() == 2
             and not n.startswith("net.4")}
    sparse = SparsityCallback(**settings, deny=["net\\.4"])

    checked = []

    class FirstMask(pl.Callback):  # before the sparsity callback: the mask before any drop
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step:
                return
            checked.append(True)
            for slot in sparse.engine.masked:
                keep = first[slot.name].argsort(descending=True)[: slot.mask.numel() // 4]
                assert set(slot.mask.flatten().nonzero().squeeze(1).tolist()) == set(
                    keep.tolist()), slot.name

    make_trainer([FirstMask(), sparse]).fit(model, make_loader())
    assert checked and sparse.engine.updater.last_regrow == 12 - 2


RESUMED = {
    "second-order gmp": dict(pattern="unstructured", sparsity=0.8, schedule="gmp", start=0,
                             end=14, frequency=3, score="second-order", distribution="global"),
    "movement block gmp": dict(pattern="block:4x4", sparsity=0.5, schedule="gmp", start=0,
                               end=12, frequency=5, score="movement"),
    "soft movement rigl": dict(pattern="unstructured", sparsity=0.8, schedule="constant",
                               regrow="rigl", frequency=3, regrow_end=14,
                               score="soft-movement"),
}


@pytest.mark.parametrize("name", RESUMED)
def test_a_checkpoint_between_updates_resumes_the_statistics_exactly(tmp_path, name):
    """Stopped after the first epoch (8 steps: statistics half way to the next update) and
    resumed: the run is the uninterrupted one bit for bit, and the statistics came back."""
    settings = RESUMED[name]
    pl.seed_everything(0)
    straight = TinyNet("adam")
    make_trainer([SparsityCallback(**settings)]).fit(straight, make_loader())
    pl.seed_everything(0)
    first = TinyNet("adam")
    stopped = SparsityCallback(**settings)
    make_trainer([stopped, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1,
                 enable_checkpointing=True).fit(first, make_loader())
    assert stopped.state_dict()["statistics"]["counts"]  # something observed was saved
    pl.seed_everything(5)
    resumed = TinyNet("adam")
    sparse = SparsityCallback(**settings)
    make_trainer([sparse]).fit(resumed, make_loader(), ckpt_path=tmp_path / "last.ckpt")
    for (key, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(),
                                strict=True):
        assert torch.equal(a, b), key


def test_movement_drops_compressed_blocks_and_resumes_exactly(tmp_path):
    """RigL on compressed layers with a movement drop score: the statistics live in the
    layout of the kept blocks, move with them, and a resume is the uninterrupted run."""
    settings = dict(pattern="block:16x16", sparsity=0.75, schedule="constant", frequency=2,
                    regrow="rigl", regrow_fraction=0.5, regrow_end=20, compress=True,
                    score="movement")

    def fit(max_epochs, **kwargs):
        pl.seed_everything(0, verbose=False)
        model = BlockNet()
        sparse = SparsityCallback(**settings)
        callbacks = [sparse, *kwargs.pop("callbacks", [])]
        trainer = make_trainer(callbacks, max_epochs=max_epochs, **kwargs)
        trainer.fit(model, make_loader(n=64), ckpt_path=kwargs.get("ckpt_path"))
        return model, sparse

    straight, sparse = fit(2)  # 2 epochs of 4 steps, regrowth every 2: before and after
    statistics = sparse.engine.updater.statistics
    slot = sparse.engine.compressed[0]
    assert statistics.tensors[slot.name]["movement"].shape == slot.param.shape
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(1, callbacks=[checkpoint], enable_checkpointing=True)
    pl.seed_everything(0, verbose=False)
    resumed = BlockNet()
    again = SparsityCallback(**settings)
    trainer = make_trainer([again], max_epochs=2)
    trainer.fit(resumed, make_loader(n=64), ckpt_path=tmp_path / "last.ckpt")
    assert_same_training(straight, straight.trainer, resumed, trainer)


def test_a_block_move_carries_the_movement_of_kept_blocks_and_zeroes_grown_ones():
    from sparse_training import BlockSparseLinear

    torch.manual_seed(0)
    layer = BlockSparseLinear(32, 32, block=(16, 16), density=0.5, dtype=torch.float64)
    slot = layer.slot("layer.values")
    movement = torch.arange(layer.values.numel(), dtype=torch.float64).view_as(layer.values)
    old = {tuple(rc): movement[i].clone() for i, rc in enumerate(
        layer.block_mask.nonzero().tolist())}
    new_mask = ~layer.block_mask
    new_mask[tuple(layer.block_mask.nonzero()[0].tolist())] = True
    new_mask[tuple(new_mask.nonzero()[-1].tolist())] = False
    slot.set_mask(new_mask, carried=[movement])
    for i, rc in enumerate(layer.block_mask.nonzero().tolist()):
        expected = old.get(tuple(rc), torch.zeros(16, 16, dtype=torch.float64))
        assert torch.equal(movement[i], expected)
