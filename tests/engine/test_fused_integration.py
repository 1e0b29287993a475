"""SparsityCallback(fused=...) drives the Triton masked step (interpreter on CPU)."""

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback

from sparse_training import SparsityCallback

pytestmark = pytest.mark.interpreter


class FusedSpy(Callback):
    """Records, while training, whether the fused step serves the optimizer."""

    def __init__(self, sparse):
        self.sparse, self.fused = sparse, None

    def on_train_end(self, trainer, pl_module):
        self.fused = bool(self.sparse.engine.fused_optimizers)


def train(optimizer: str, fused, max_steps=6, **trainer_options):
    pl.seed_everything(0)
    model = TinyNet(optimizer)
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="gmp", frequency=2,
                              end=4, fused=fused)
    spy = FusedSpy(sparse)
    make_trainer([sparse, spy], max_epochs=1, max_steps=max_steps,
                 **trainer_options).fit(model, make_loader(n=96))
    return model, sparse, spy.fused


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_fused_matches_the_hook_path(optimizer):
    reference, _, _ = train(optimizer, fused=False)
    fused, sparse, served = train(optimizer, fused=True)
    assert served  # the kernels served this run
    for (name, a), (_, b) in zip(reference.state_dict().items(), fused.state_dict().items(),
                                 strict=True):
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)  # fp32 rounding
    for layer in sparse.engine.slots:
        assert not layer.param[~layer.mask].any()


def test_fused_serves_bf16_weights(monkeypatch):
    """bf16-true: the kernel (never the pure-torch fallback) updates bf16 weights and their
    bf16 state in place, pruned entries exact zeros (its arithmetic: test_kernels_masked_step)."""
    from sparse_training.kernels import masked_step

    def fallback(*args):
        raise AssertionError("the pure-torch reference ran instead of the kernel")
    monkeypatch.setattr(masked_step, "apply_batch", fallback)
    model, sparse, served = train("adamw-fused", fused=True, precision="bf16-true")
    assert served
    (optimizer,) = model.trainer.optimizers
    for layer in sparse.engine.slots:
        assert layer.param.dtype == torch.bfloat16
        assert not layer.param[~layer.mask].any()
        state = optimizer.state[layer.param]
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name].dtype == torch.bfloat16
            assert not state[name][~layer.mask].any() and state[name][layer.mask].any()


def test_fused_with_clipping_masks_gradients_first():
    reference, _, _ = train("adamw", fused=False, gradient_clip_val=0.1)
    fused, _, served = train("adamw", fused=True, gradient_clip_val=0.1)
    assert served
    torch.testing.assert_close(fused.net[0].weight, reference.net[0].weight, rtol=1e-5,
                               atol=1e-6)


def test_auto_stays_on_the_hook_path_on_cpu():
    assert train("adamw", fused="auto", max_steps=2)[2] is False


def test_fused_true_names_why_it_cannot_serve():
    class RMSNet(TinyNet):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    sparse = SparsityCallback("2:4", fused=True)
    with pytest.raises(ValueError, match="fused=True cannot serve RMSprop: .*use fused='auto'"):
        make_trainer([sparse], max_epochs=1).fit(RMSNet(), make_loader())


def test_fused_setting_is_validated():
    with pytest.raises(ValueError, match="unknown fused 'yes'; valid: 'auto', True, False"):
        SparsityCallback("2:4", fused="yes")


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.SGD])
def test_torch_fused_optimizers_under_grad_scaling(optimizer_class):
    """torch's fused optimizers step on scaled gradients (GradScaler passes its scale and
    overflow flag as optimizer attributes): the masked kernel must read them too."""
    from sparse_training import SparsityConfig, SparsityEngine

    results = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        engine = SparsityEngine(model, SparsityConfig("2:4", fused=fused))
        engine.start(10)
        optimizer = optimizer_class(model.parameters(), lr=1e-2, fused=True)
        engine.attach(optimizer)
        assert (optimizer in engine.fused_optimizers) is fused
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        engine.on_step_start(0)
        for step, x in enumerate([torch.ones(2, 8), torch.full((2, 8), float("inf"))]):
            before = model[0].weight.detach().clone()
            scaler.scale(model(x).sum()).backward()
            engine.before_optimizer_step(optimizer, step, clipping=False)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert torch.equal(model[0].weight, before)  # the overflow step changed nothing
        results[fused] = model[0].weight.detach().clone()
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-7)
