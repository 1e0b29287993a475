"""Pruned weights and their optimizer state stay exactly zero under any optimizer: those whose
update keeps zeros take no extra pass, the others have their state zeroed after every step."""

import pytest
import torch
from conftest import TinyNet, assert_masks_hold, make_loader, make_trainer
from pytorch_lightning.callbacks import Callback
from torch import nn

from sparse_training import SparsityCallback, SparsityConfig, SparsityEngine
from sparse_training.engine import optimizer_hooks


class ConstantStateSGD(torch.optim.Optimizer):
    """A user's optimizer whose state gains a constant every step, at every position:
    ``b = mu b + g + c``, ``w = w - lr b``."""

    def __init__(self, params, lr: float = 1e-2, mu: float = 0.9, c: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr, mu=mu, c=c))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buffer", torch.zeros_like(p))
                buf.mul_(group["mu"]).add_(p.grad).add_(group["c"])
                p.sub_(buf, alpha=group["lr"])
        return loss


OPTIMIZERS = {
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=2),
    "adagrad-initial": lambda p: torch.optim.Adagrad(p, lr=1e-2, initial_accumulator_value=0.5),
    "constant-state": lambda p: ConstantStateSGD(p),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}
# which take the extra pass: the others' updates keep zero state (KEEPS_ZERO_STATE)
ZEROES_STATE = {"adamax", "rprop", "constant-state"}
SETTINGS = {
    "unstructured": dict(pattern="unstructured", sparsity=0.8, schedule="gmp", start=0, end=8,
                         frequency=2),
    "rigl": dict(pattern="unstructured", sparsity=0.8, schedule="constant", regrow="rigl",
                 frequency=2, regrow_end=1.0),
    "2:4 compressed": dict(pattern="2:4", compress=True),
}


class StateAudit(Callback):
    """After every step: pruned weights and weight-shaped optimizer state exactly zero (the
    2:4 layers' too: their dense weights are masked as masked-dense ones)."""

    def __init__(self, sparse: SparsityCallback) -> None:
        self.sparse, self.steps = sparse, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert_masks_hold(self.sparse.engine, trainer.optimizers)
        self.steps += 1


class Net(TinyNet):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.make_optimizer = OPTIMIZERS[optimizer]

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_state_at_pruned_positions_stays_zero(optimizer, settings, monkeypatch):
    """Weights and every weight-shaped state tensor are zero at pruned positions after every
    step; only optimizers outside KEEPS_ZERO_STATE have their state read at a step."""
    reads = []
    state_tensors = optimizer_hooks.state_tensors
    monkeypatch.setattr(optimizer_hooks, "state_tensors",
                        lambda *args: reads.append(1) or state_tensors(*args))
    sparse = SparsityCallback(**SETTINGS[settings], fused=False)
    audit = StateAudit(sparse)
    model = Net(optimizer)
    trainer = make_trainer([sparse, audit], max_epochs=2)
    trainer.fit(model, make_loader())
    assert audit.steps == 16 and sparse.engine.updater.last_update is not None
    torch_optimizer = trainer.optimizers[0]
    state = [value for slot in sparse.engine.slots
             for value in torch_optimizer.state[slot.param].values()
             if torch.is_tensor(value) and value.shape == slot.param.shape]
    assert state  # weight-shaped state exists, and the audit found it zero where pruned
    assert bool(reads) == (optimizer in ZEROES_STATE)


@pytest.mark.parametrize("optimizer", sorted(ZEROES_STATE))
def test_without_the_pass_state_would_not_stay_zero(optimizer):
    """The optimizers that take the pass need it: one step on zero gradients at zero weights
    and zero state leaves their state nonzero."""
    param = torch.nn.Parameter(torch.zeros(4, 4))
    torch_optimizer = OPTIMIZERS[optimizer]([param])
    param.grad = torch.zeros_like(param)
    torch_optimizer.step()
    assert type(torch_optimizer) not in optimizer_hooks.KEEPS_ZERO_STATE
    assert any(value.abs().sum() > 0 for value in torch_optimizer.state[param].values()
               if torch.is_tensor(value) and value.shape == param.shape)


KEEPS_ZERO_VARIANTS = [
    (torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
    (torch.optim.SGD, dict(momentum=0.9, dampening=0.5)),
    (torch.optim.Adam, dict(amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(amsgrad=True)),
    (torch.optim.NAdam, dict(decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.RAdam, dict(weight_decay=0.1)),
    (torch.optim.RMSprop, dict(momentum=0.5, centered=True, weight_decay=0.1)),
    (torch.optim.Adagrad, dict(initial_accumulator_value=0.5, lr_decay=0.1)),
    (torch.optim.Adadelta, dict(weight_decay=0.1)),
    (torch.optim.ASGD, dict(t0=2, weight_decay=0.1)),
]


def test_keeps_zero_state_is_every_class_checked_here():
    assert {cls for cls, _ in KEEPS_ZERO_VARIANTS} == optimizer_hooks.KEEPS_ZERO_STATE


@pytest.mark.parametrize(("cls", "options"), KEEPS_ZERO_VARIANTS,
                         ids=[f"{c.__name__}-{'-'.join(o)}" for c, o in KEEPS_ZERO_VARIANTS])
def test_keeps_zero_state_without_the_pass(cls, options):
    """Each class of KEEPS_ZERO_STATE, with the options that add state or terms, keeps its
    state zero at pruned positions with no pass over it, through mask changes (RigL)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.8, regrow="rigl",
                                                  schedule="constant", frequency=2,
                                                  regrow_end=1.0, fused=False))
    engine.start(12)
    torch_optimizer = cls(model.parameters(), lr=1e-2, **options)
    engine.attach(torch_optimizer)
    assert not engine._attached[torch_optimizer].zeroes_state
    for step in range(12):
        engine.on_step_start(step)
        model(torch.randn(8, 16)).square().mean().backward()
        engine.before_optimizer_step(torch_optimizer, step)
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        assert_masks_hold(engine, [torch_optimizer])
    assert engine.updater.last_regrow is not None
