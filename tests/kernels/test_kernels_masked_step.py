"""Fused masked optimizer step (Triton's interpreter on CPU) against torch's own optimizers:
``masked_step_reference`` steps a float64 ``torch.optim`` copy on the masked gradient and
zeroes the pruned entries by hand, sharing no code with the fused step."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the kernels are optional")

from sparse_training.kernels import _step_run as sp  # noqa: E402
from sparse_training.kernels import (  # noqa: E402
    fused_masked_step,
    fused_unsupported_reason,
    masked_step_reference,
    pack_mask,
)
from sparse_training.kernels import masked_step as ms  # noqa: E402

pytestmark = pytest.mark.interpreter

SHAPES = [(33, 17), (1300,), (3, 5, 7)]  # odd sizes, one larger than a chunk
OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "dampening": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1}),
]


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    # Small blocks keep the interpreter fast; the arithmetic does not depend on them.
    monkeypatch.setattr(ms, "DEFAULT_CONFIG", ms.StepConfig(block=256, num_warps=4, chunk=1024))
    assert ms.kernels_run_on(torch.device("cpu"))


def _model(opt_cls, kw, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    for p in params:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None
    return params, opt_cls(params, **kw)


def _masks(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(p.shape, generator=gen) > 0.4 for p in params]


def _grads(params, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(dtype) for p in params]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS)
def test_matches_float64_reference(opt_cls, kw, grad_dtype):
    params, opt = _model(opt_cls, kw)
    ref, opt_ref = _model(opt_cls, kw, dtype=torch.float64)
    masks = _masks(params)
    for step in range(3):
        # Poison the state at pruned positions: the kernel must write exact zeros there.
        for p, k in zip(params, masks, strict=True):
            for buf in opt.state[p].values():
                if buf.dim():
                    buf[~k] = float("nan")
        for p, q, g in zip(params, ref, _grads(params, grad_dtype, seed=10 + step), strict=True):
            p.grad, q.grad = g, g.double()
        fused_masked_step(opt, dict(zip(params, masks, strict=True)))
        masked_step_reference(opt_ref, dict(zip(ref, masks, strict=True)))
    for p, q, k in zip(params, ref, masks, strict=True):
        assert p.grad is None
        torch.testing.assert_close(p.double(), q, rtol=2e-6, atol=2e-6)
        assert torch.equal(p[~k], torch.zeros_like(p[~k]))
        for name, buf in opt.state[p].items():
            if buf.dim():
                assert torch.equal(buf[~k], torch.zeros_like(buf[~k])), name
                torch.testing.assert_close(
                    buf.double(), opt_ref.state[q][name], rtol=1e-5, atol=1e-6
                )


def _float64_twin(opt_cls, kw, params, opt):
    """A float64 copy of ``params`` and of ``opt``'s state, for one reference step."""
    twins = [torch.nn.Parameter(p.detach().double()) for p in params]
    twin_opt = opt_cls(twins, **kw)
    for p, q in zip(params, twins, strict=True):
        twin_opt.state[q] = {name: t.double() for name, t in opt.state[p].items()}
    return twins, twin_opt


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS[:4])
def test_half_precision_params_rounded_once_per_step(opt_cls, kw, param_dtype, monkeypatch):
    """bf16/fp16 weights and state: each step equals the float64 step of the same inputs,
    rounded once to the parameter dtype (float32 arithmetic inside, as torch's fused
    optimizers): within eps relative at every step. (The compiled cast rounds to
    nearest, half an eps; Triton's interpreter truncates float32 to bfloat16, a whole
    one.)"""
    params, opt = _model(opt_cls, kw, dtype=param_dtype)
    masks = _masks(params)
    eps = torch.finfo(param_dtype).eps
    monkeypatch.setattr(ms, "apply_batch", _fails)  # the kernel must take every tensor
    for step in range(3):
        for p, k in zip(params, masks, strict=True):
            for buf in opt.state[p].values():
                if buf.dim():
                    assert buf.dtype == param_dtype
                    buf[~k] = float("nan")
        twins, twin_opt = _float64_twin(opt_cls, kw, params, opt)
        for p, q, g in zip(params, twins, _grads(params, param_dtype, seed=50 + step), strict=True):
            p.grad, q.grad = g, g.double()
        fused_masked_step(opt, dict(zip(params, masks, strict=True)))
        masked_step_reference(twin_opt, dict(zip(twins, masks, strict=True)))
        for p, q, k in zip(params, twins, masks, strict=True):
            assert p.dtype == param_dtype and torch.equal(p[~k], torch.zeros_like(p[~k]))
            torch.testing.assert_close(p.double(), q.detach(), rtol=eps, atol=1e-6)
            for name, buf in opt.state[p].items():
                if buf.dim():
                    assert torch.equal(buf[~k], torch.zeros_like(buf[~k])), name
                    torch.testing.assert_close(buf.double(), twin_opt.state[q][name],
                                               rtol=eps, atol=1e-6)


def _fails(*args):
    raise AssertionError("the pure-torch reference ran instead of the kernel")


def test_state_of_another_shape_is_refused_before_any_write():
    """State loaded for another shape (or sharding) would be written with the parameter's
    element count: refused, naming the tensor, and nothing changes."""
    params, opt = _model(torch.optim.AdamW, {"lr": 1e-2})
    for p in params:
        p.grad = torch.randn_like(p)
    opt.state[params[0]].update(step=torch.tensor(0.0), exp_avg=torch.zeros(10),
                                exp_avg_sq=torch.zeros(10))
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"exp_avg is a plain tensor of local shape \(10,\)"):
        fused_masked_step(opt, dict(zip(params, _masks(params), strict=True)))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_half_precision_params_with_float32_state_take_the_reference():
    """bf16 weights whose state was made float32 by hand: not the kernel's layout, so the
    float32 reference updates them, as it would float32 ones (rounded once)."""
    params, opt = _model(torch.optim.AdamW, {"lr": 1e-2}, dtype=torch.bfloat16)
    twins, twin_opt = _model(torch.optim.AdamW, {"lr": 1e-2}, dtype=torch.float32)
    for p, q in zip(params, twins, strict=True):
        q.data.copy_(p.float())
        opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros(p.shape),
                            exp_avg_sq=torch.zeros(p.shape))
    masks = _masks(params)
    for p, q, g in zip(params, twins, _grads(params, torch.bfloat16, 60), strict=True):
        p.grad, q.grad = g, g.float()
    fused_masked_step(opt, dict(zip(params, masks, strict=True)))
    masked_step_reference(twin_opt, dict(zip(twins, masks, strict=True)))
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q.bfloat16())
        assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS[:1] + OPTIMIZERS[2:3])
def test_kept_weights_match_torch_optimizer(opt_cls, kw):
    """The ASP way (mask grads, torch step, mask weights) agrees on kept weights."""
    params, opt = _model(opt_cls, kw)
    ref, opt_ref = _model(opt_cls, kw)
    masks = _masks(params)
    for step in range(3):
        for p, q, g, k in zip(
            params, ref, _grads(params, torch.float32, 20 + step), masks, strict=True
        ):
            p.grad, q.grad = g.clone(), g * k
        fused_masked_step(opt, dict(zip(params, masks, strict=True)))
        opt_ref.step()
        with torch.no_grad():
            for q, k in zip(ref, masks, strict=True):
                q.mul_(k)
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    # torch's layout: a later plain step() continues from the same state.
    assert set(opt.state[params[0]]) == set(opt_ref.state[ref[0]])
    opt.load_state_dict(opt_ref.state_dict())


def test_packed_masks_and_grad_scale():
    params, opt = _model(torch.optim.AdamW, {"lr": 1e-2})
    ref, opt_ref = _model(torch.optim.AdamW, {"lr": 1e-2}, dtype=torch.float64)
    masks = _masks(params)
    scale = torch.tensor(1024.0)
    for p, q, g in zip(params, ref, _grads(params, torch.float16, 3), strict=True):
        p.grad, q.grad = g * 1024, g.double()
    fused_masked_step(
        opt, {p: pack_mask(k) for p, k in zip(params, masks, strict=True)}, grad_scale=scale
    )
    masked_step_reference(opt_ref, dict(zip(ref, masks, strict=True)))
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p.double(), q, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_found_inf_writes_nothing(fused):
    kw = {"lr": 1e-2, "fused": True} if fused else {"lr": 1e-2}
    params, opt = _model(torch.optim.AdamW, {"lr": 1e-2})
    if fused:  # device-resident step counters, as torch's fused optimizers keep them
        for p in params:
            opt.state[p].update(
                step=torch.zeros((), dtype=torch.float32, device=p.device),
                exp_avg=torch.randn(p.shape),
                exp_avg_sq=torch.rand(p.shape),
            )
        opt.param_groups[0]["fused"] = kw["fused"]
    masks = dict(zip(params, _masks(params), strict=True))
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p, g in zip(params, _grads(params, torch.float32, 4), strict=True):
        p.grad = g
    fused_masked_step(opt, masks, found_inf=torch.tensor(1.0))
    for p, b, s in zip(params, before, state, strict=True):
        assert p.grad is None
        assert torch.equal(p, b)
        for k, v in s.items():
            assert torch.equal(opt.state[p][k], v), k
    for p, g in zip(params, _grads(params, torch.float32, 5), strict=True):
        p.grad = g
    fused_masked_step(opt, masks, found_inf=torch.tensor(0.0))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_unmasked_params_left_to_optimizer_step():
    params, opt = _model(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    masks = {params[0]: _masks(params)[0]}
    for p, g in zip(params, _grads(params, torch.float32, 6), strict=True):
        p.grad = g
    before = params[1].detach().clone()
    fused_masked_step(opt, masks)
    assert params[0].grad is None and params[1].grad is not None
    assert torch.equal(params[1], before) and "momentum_buffer" not in opt.state[params[1]]
    opt.step()
    assert not torch.equal(params[1], before)


def test_lr_scheduler_is_read_each_step():
    params, opt = _model(torch.optim.SGD, {"lr": 1.0})
    masks = dict(zip(params, [torch.ones(p.shape, dtype=torch.bool) for p in params], strict=True))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(params, torch.float32, 7), strict=True):
        p.grad = g
    fused_masked_step(opt, masks)
    assert sched.get_last_lr() == [0.0]
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)


@pytest.mark.parametrize("steps_read_by_kernel", [False, True])
def test_capturable_adamw_matches_float64_reference(steps_read_by_kernel, monkeypatch):
    """``capturable=True`` (the CUDA-graph option) runs the same math, also with the bias
    corrections computed in the kernel from the step counters (what CUDA step tensors get;
    forced here on CPU tensors, which the interpreter reads alike). Under capture a step
    that would plan (create state, stack the step counters) is refused; a tensor lr, which
    the kernel cannot read at replay, is refused with the reason."""
    if steps_read_by_kernel:
        monkeypatch.setattr(ms, "_steps_on_device", bool)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "capturable": True}
    params, opt = _model(torch.optim.AdamW, kw)
    ref, opt_ref = _model(torch.optim.AdamW, kw, dtype=torch.float64)
    masks = _masks(params)
    for step in range(3):
        for p, q, g in zip(params, ref, _grads(params, torch.float32, seed=30 + step),
                           strict=True):
            p.grad, q.grad = g, g.double()
        fused_masked_step(opt, dict(zip(params, masks, strict=True)))
        masked_step_reference(opt_ref, dict(zip(ref, masks, strict=True)))
    for p, q, k in zip(params, ref, masks, strict=True):
        torch.testing.assert_close(p.double(), q, rtol=2e-6, atol=2e-6)
        assert torch.equal(p[~k], torch.zeros_like(p[~k]))
        assert float(opt.state[p]["step"]) == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _set_grads(params, torch.float32, 40)
    fused_masked_step(opt, dict(zip(params, masks, strict=True)))  # planned: captured as is
    assert all(float(opt.state[p]["step"]) == 4 for p in params)
    _set_grads(params, torch.float32, 41)
    with pytest.raises(RuntimeError, match="run one step before capturing"):
        fused_masked_step(opt, dict(zip(params, [m.clone() for m in masks], strict=True)))
    monkeypatch.undo()
    tensor_lr = torch.optim.AdamW(params, lr=torch.tensor(1e-2), capturable=True)
    assert "tensor lr" in fused_unsupported_reason(tensor_lr)
    with pytest.raises(ValueError, match="tensor lr"):
        fused_masked_step(tensor_lr, dict(zip(params, masks, strict=True)))


def test_unsupported_reasons():
    p = torch.nn.Parameter(torch.randn(4))
    assert fused_unsupported_reason(torch.optim.AdamW([p])) is None  # CPU ok under the interpreter
    assert "amsgrad" in fused_unsupported_reason(torch.optim.AdamW([p], amsgrad=True))
    assert "RMSprop" in fused_unsupported_reason(torch.optim.RMSprop([p]))

    class MyAdam(torch.optim.Adam):
        pass

    assert "MyAdam" in fused_unsupported_reason(MyAdam([p]))
    assert "float64" in fused_unsupported_reason(
        torch.optim.SGD([torch.nn.Parameter(torch.randn(3).double())])
    )
    with pytest.raises(ValueError, match="amsgrad"):
        fused_masked_step(torch.optim.AdamW([p], amsgrad=True), {})
    p.grad = torch.randn(4)
    with pytest.raises(ValueError, match="shape"):
        fused_masked_step(torch.optim.SGD([p]), {p: torch.ones(5, dtype=torch.bool)})


def _set_grads(params, dtype, seed, skip=()):
    for i, (p, g) in enumerate(zip(params, _grads(params, dtype, seed), strict=True)):
        p.grad = None if i in skip else g


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS[:3])
def test_cached_plan_follows_lr_masks_and_state_dict(opt_cls, kw):
    """Steps through the cached plan: LR schedule, in-place mask changes, a new mask
    object, load_state_dict, a missing gradient, then a plain step() continues."""

    params, opt = _model(opt_cls, kw)
    ref, opt_ref = _model(opt_cls, kw, dtype=torch.float64)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)) for o in (opt, opt_ref)]
    masks = _masks(params)
    mask_map = dict(zip(params, masks, strict=True))
    plans = []
    for step in range(6):
        if step == 2:  # masks change values in place (same objects): same plan
            masks[0].copy_(_masks(params, seed=5)[0])
        if step == 3:  # a new mask object: a new plan
            masks[1] = _masks(params, seed=6)[1].clone()
            mask_map = dict(zip(params, masks, strict=True))
        if step == 4:  # checkpoint round trip: new state dicts, a new plan
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        skip = (2,) if step == 5 else ()  # a parameter without gradient: slow path
        _set_grads(params, torch.float32, 30 + step, skip)
        _set_grads(ref, torch.float64, 30 + step, skip)
        fused_masked_step(opt, mask_map)
        masked_step_reference(opt_ref, dict(zip(ref, masks, strict=True)))
        for s in scheds:
            s.step()
        plans.append(sp._PLANS.get(opt))
    assert plans[2] is plans[1] and plans[3] is not plans[2] and plans[4] is not plans[3]
    if opt_cls is not torch.optim.SGD:
        assert plans[0] is not None and plans[1] is plans[0]
        assert [float(opt.state[p]["step"]) for p in params] == [6.0, 6.0, 5.0]
        assert [float(opt_ref.state[q]["step"]) for q in ref] == [6.0, 6.0, 5.0]
    for p, q, k in zip(params, ref, masks, strict=True):
        torch.testing.assert_close(p.double(), q, rtol=2e-6, atol=2e-6)
        assert torch.equal(p[~k], torch.zeros_like(p[~k]))
    # A plain (unmasked) torch step continues from the same state on both sides.
    _set_grads(params, torch.float32, 40)
    _set_grads(ref, torch.float64, 40)
    opt.step()
    opt_ref.step()
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p.double(), q, rtol=1e-5, atol=1e-6)
    if opt_cls is not torch.optim.SGD:
        assert [float(opt.state[p]["step"]) for p in params] == [7.0, 7.0, 6.0]
    sd = opt.state_dict()
    assert set(sd["state"][0]) == set(opt_ref.state_dict()["state"][0])


def test_cached_plan_rebuilt_for_new_param_groups_and_momentum():

    params, opt = _model(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    masks = dict(zip(params, _masks(params), strict=True))
    for step in range(3):
        _set_grads(params, torch.float32, 50 + step)
        fused_masked_step(opt, masks)
    plan = sp._PLANS[opt]
    extra = torch.nn.Parameter(torch.randn(5))
    opt.add_param_group({"params": [extra]})
    _set_grads(params, torch.float32, 60)
    extra.grad = torch.randn(5)
    fused_masked_step(opt, masks)
    assert sp._PLANS[opt] is not plan
    assert extra.grad is not None  # not masked: left to optimizer.step()
