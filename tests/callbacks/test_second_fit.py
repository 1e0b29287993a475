"""A fit without ckpt_path on a model that carries masks (an earlier fit's, by the same
callback or another): the masks are the start and never get less sparse."""

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet, forward_sparsity, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine, make_permanent

CARRIED = [
    dict(pattern="unstructured", sparsity=0.8, schedule="gmp", frequency=2),
    dict(pattern="unstructured", sparsity=0.7, schedule="gmp", distribution="global",
         frequency=2),
    dict(pattern="2:8", schedule="gmp", regrow="sr-ste", frequency=2),
]


class Sparsities(Callback):
    """The forward weights' zero fraction of every masked tensor at every step, once the
    step's mask update ran (the SparsityCallback comes first in the Trainer)."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.seen = sparse, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(forward_sparsity(self.sparse.engine))


def masks_of(model) -> dict[str, torch.Tensor]:
    """The mask buffers on ``model``, by tensor name."""
    return {name.removesuffix("_mask"): mask.clone() for name, mask in model.named_buffers()
            if name.endswith("_mask")}


def carried_model(settings: dict, epochs: int = 2, n: int = 128) -> tuple[TinyNet,
                                                                          SparsityCallback]:
    model, sparse = TinyNet(), SparsityCallback(**settings)
    make_trainer([sparse], max_epochs=epochs).fit(model, make_loader(n=n))
    return model, sparse


@pytest.mark.parametrize("reuse", [True, False], ids=["same-callback", "new-callback"])
@pytest.mark.parametrize("settings", CARRIED, ids=lambda s: f"{s['pattern']}-"
                         f"{s.get('distribution', 'uniform')}-{s.get('regrow', 'masks')}")
def test_a_new_trainer_starts_from_the_carried_masks_of_a_gmp_fit(settings, reuse):
    model, first = carried_model(settings)
    carried, before = masks_of(model), forward_sparsity(first.engine)
    sparse = first if reuse else SparsityCallback(**settings)
    spy = Sparsities(sparse)
    make_trainer([sparse, spy], max_epochs=2).fit(model, make_loader())
    assert len(spy.seen) == 16  # GMP's ramp runs again (0, 2, ..., 12) but prunes no less
    for seen in spy.seen:
        if settings.get("distribution") == "global":
            assert seen["global"] >= before["global"]
        else:
            assert all(seen[name] >= before[name] for name in carried), seen
    assert sparse.engine.updater.held == set()  # released by the final update
    if settings.get("regrow") is None:  # magnitude of the same weights: the same masks
        assert masks_of(model).keys() == carried.keys()
        assert all(torch.equal(masks_of(model)[name], mask) for name, mask in carried.items())


def test_a_sparser_gmp_fit_prunes_on_from_the_carried_masks():
    model, _ = carried_model(dict(pattern="unstructured", sparsity=0.5, schedule="gmp",
                                  frequency=2))
    carried = masks_of(model)
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", frequency=2)
    spy = Sparsities(sparse)
    make_trainer([sparse, spy], max_epochs=2).fit(model, make_loader())
    # held while GMP's target is below 0.5: updates at 0 and 2 (0.8 * (1 - (1 - 2/12)^3)
    # = 0.34), then the ramp prunes on from them
    assert [round(s["net.2.weight"], 4) for s in spy.seen[:4]] == [0.5] * 4
    assert all(s["net.2.weight"] >= 0.5 for s in spy.seen)
    assert spy.seen[-1]["net.2.weight"] == pytest.approx(0.8, abs=0.01)
    for name, mask in masks_of(model).items():
        assert not (mask & ~carried[name]).any(), name  # nothing pruned came back


@pytest.mark.parametrize("reuse", [True, False], ids=["same-callback", "new-callback"])
def test_a_oneshot_second_fit_keeps_the_masks(reuse):
    settings = dict(pattern="unstructured", sparsity=0.8)
    model, first = carried_model(settings)
    carried = masks_of(model)
    sparse = first if reuse else SparsityCallback(**settings)
    make_trainer([sparse], max_epochs=1).fit(model, make_loader())
    assert sparse.engine.updater.last_update == 0  # pruned again at step 0: the same masks
    assert all(torch.equal(masks_of(model)[name], mask) for name, mask in carried.items())


@pytest.mark.parametrize(("settings", "message"), [
    (dict(pattern="unstructured", sparsity=0.5),
     r"^tensor 'net.0.weight' carries a mask 80.08% sparse, sparser than these settings' "
     r"final 50.00% \(pattern 'unstructured'\); tensor 'net.2.weight' carries a mask 79.98%"),
    (dict(pattern="2:4"), r"final 50.00% \(pattern '2:4'\)"),
    (dict(pattern="unstructured", sparsity=0.5, schedule="gmp"), r"80.08% sparse"),
])
def test_a_second_fit_less_sparse_than_the_carried_masks_is_refused(settings, message):
    model, _ = carried_model(dict(pattern="unstructured", sparsity=0.8))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    carried = masks_of(model)
    with pytest.raises(ValueError, match=message + r".*never makes them less sparse.*"
                                                   r"make_permanent\(model\)"):
        make_trainer([SparsityCallback(**settings)], max_epochs=1).fit(model, make_loader())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(masks_of(model)[name], mask) for name, mask in carried.items())
    make_permanent(model)  # the way to less sparse masks: the zeros may grow back
    sparse = SparsityCallback(**settings)
    make_trainer([sparse], max_epochs=1).fit(model, make_loader())
    assert sparse.engine.sparsity == pytest.approx(0.5, abs=0.01)


def test_a_reused_callback_refuses_masks_another_callback_made_sparser():
    model, first = carried_model(dict(pattern="unstructured", sparsity=0.5))
    make_trainer([SparsityCallback("unstructured", sparsity=0.9)], max_epochs=1).fit(
        model, make_loader())
    with pytest.raises(ValueError, match=r"'net.2.weight' carries a mask 90.04% sparse, "
                                         r"sparser than these settings' final 50.00%"):
        make_trainer([first], max_epochs=1).fit(model, make_loader())
    assert (model.net[2].weight == 0).float().mean() == pytest.approx(0.9, abs=0.001)


def test_resume_in_the_middle_of_a_hold_is_bit_exact(tmp_path):
    """Carried masks at 0.7, a second fit's GMP to 0.8 from step 1 to 10 holds them at its
    updates 1, 3, 5 (0.66 at step 5) and prunes on at 7: a checkpoint at step 6 resumes
    the hold, and the final state_dict equals the uninterrupted run's."""
    first = dict(pattern="unstructured", sparsity=0.7, schedule="gmp", frequency=1)
    second = dict(pattern="unstructured", sparsity=0.8, schedule="gmp", start=1, end=10,
                  frequency=2)
    pl.seed_everything(0)
    straight, _ = carried_model(first, epochs=1, n=96)
    make_trainer([SparsityCallback(**second)], max_epochs=2).fit(straight, make_loader(n=96))

    pl.seed_everything(0)
    interrupted, _ = carried_model(first, epochs=1, n=96)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([SparsityCallback(**second), checkpoint], max_epochs=1,
                 enable_checkpointing=True).fit(interrupted, make_loader(n=96))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("SparsityCallback")]
    assert state["updater"]["held"] == ["net.0.weight", "net.2.weight", "net.4.weight"]
    resumed, sparse = TinyNet(), SparsityCallback(**second)
    make_trainer([sparse], max_epochs=2).fit(resumed, make_loader(n=96),
                                             ckpt_path=tmp_path / "last.ckpt")
    assert sparse.engine.updater.held == set()
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    state["updater"]["held"] = "net.0.weight"
    torch.save(saved, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=r"held must be a list of tensor names, got "
                                         r"'net.0.weight'"):
        make_trainer([SparsityCallback(**second)], max_epochs=2).fit(
            TinyNet(), make_loader(n=96), ckpt_path=tmp_path / "bad.ckpt")


def test_an_engine_on_carried_masks_holds_them_but_prune_sets_them():
    model = TinyNet()
    config = SparsityConfig(pattern="unstructured", sparsity=0.8, schedule="gmp", end=10,
                            frequency=2)
    earlier = SparsityEngine(model, config)
    earlier.prune()
    earlier.detach()  # its masks stay on the model
    carried = masks_of(model)
    engine = SparsityEngine(model, config)
    engine.start(20)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not engine.on_step_start(0)  # GMP's first update (0%) holds the 80% masks
    assert engine.updater.held == set(carried)
    assert all(torch.equal(masks_of(model)[name], mask) for name, mask in carried.items())
    engine.prune(0.5)  # asked for: set as asked
    assert engine.sparsity == pytest.approx(0.4, abs=0.01)
    engine.detach()


def test_masks_pruned_before_the_schedule_ran_hold_in_a_new_trainer():
    """ASP's flow on a callback whose first fit stopped before its schedule's start: prune()
    sets 80% masks, and a new Trainer's GMP (0% at step 4) holds them."""
    model = TinyNet()
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", start=4, end=12,
                              frequency=2)
    make_trainer([sparse], max_steps=2).fit(model, make_loader())
    assert sparse.engine.updater.last_update is None
    sparse.engine.prune()
    carried = masks_of(model)
    spy = Sparsities(sparse)
    make_trainer([sparse, spy], max_epochs=2).fit(model, make_loader())
    assert all(s["net.2.weight"] >= 0.79 for s in spy.seen), [s["net.2.weight"] for s in spy.seen]
    for name, mask in masks_of(model).items():
        assert not (mask & ~carried[name]).any(), name


class Targets(Callback):
    """The engine's target and forward sparsity once each step's update ran."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.seen = sparse, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        engine = self.sparse.engine
        self.seen.append((engine.target, forward_sparsity(engine)["global"]))


def test_the_target_of_held_masks_is_their_sparsity():
    """GMP to 0.8 from carried 0.5 masks: while they hold (steps 0 to 3) the target is
    their 0.5, not GMP's 0 and 0.34; from then on the schedule's; and never below."""
    model, _ = carried_model(dict(pattern="unstructured", sparsity=0.5, schedule="gmp",
                                  frequency=2))
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", frequency=2)
    spy = Targets(sparse)
    make_trainer([sparse, spy], max_epochs=2).fit(model, make_loader())
    assert [round(target, 3) for target, _ in spy.seen[:4]] == [0.5] * 4
    assert all(target == pytest.approx(sparsity, abs=0.002) for target, sparsity in spy.seen)
