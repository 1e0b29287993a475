"""Distillation: the loss against a float64 KL written out here, its gradient, the hardness's
edge cases and bad inputs (sparse_training.pieces.distillation); the teacher beside a pl.Trainer:
frozen, out of the checkpoint, on the student's device and precision, cached, resumed
(sparse_training.callbacks.DistillationCallback)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import SaveAndStop, make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import (
    DistillationCallback,
    DistillationLoss,
    SparsityCallback,
    TeacherCache,
)

# -- the loss ---------------------------------------------------------------------------------


def reference_kl(student: np.ndarray, teacher: np.ndarray, temperature: float,
                 valid: np.ndarray | None = None) -> float:
    """T² · KL(softmax(t/T) ‖ softmax(s/T)) over the last axis, averaged over the rows that
    have a valid class, in float64, class by class: softmaxes over the valid classes only."""
    s = student.reshape(-1, student.shape[-1]).astype(np.float64)
    t = teacher.reshape(-1, teacher.shape[-1]).astype(np.float64)
    keep = np.ones_like(s, dtype=bool) if valid is None else np.broadcast_to(
        valid, student.shape).reshape(s.shape)
    total, rows = 0.0, 0
    for row in range(s.shape[0]):
        classes = [c for c in range(s.shape[1]) if keep[row, c]]
        if not classes:
            continue
        es = [math.exp(s[row, c] / temperature) for c in classes]
        et = [math.exp(t[row, c] / temperature) for c in classes]
        ps = [e / sum(es) for e in es]
        pt = [e / sum(et) for e in et]
        total += sum(q * (math.log(q) - math.log(p))  # 0 log 0 = 0: KL's definition
                     for p, q in zip(ps, pt, strict=True) if q > 0)
        rows += 1
    return total / rows * temperature ** 2


def softmax64(z: torch.Tensor, temperature: float) -> torch.Tensor:
    e = (z.double() / temperature).exp()
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("shape", [(7,), (5, 3), (3, 4, 11), (2, 1, 3, 6)])
def test_soft_loss_equals_the_float64_kl(shape):
    g = torch.Generator().manual_seed(len(shape))
    temperature = float(torch.empty(1).uniform_(0.5, 6.0, generator=g))
    student = torch.randn(shape, generator=g) * 3
    teacher = torch.randn(shape, generator=g) * 3
    loss = DistillationLoss(temperature, hardness=1.0)(student, teacher)
    expected = reference_kl(student.numpy(), teacher.numpy(), temperature)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_a_teacher_logit_of_minus_infinity_is_a_class_of_probability_zero():
    """A teacher that rules a class out (-inf, e.g. a vocabulary mask applied by the teacher
    model) contributes 0 log 0 = 0 there, not NaN; its gradient stays finite."""
    g = torch.Generator().manual_seed(3)
    student = (torch.randn(4, 6, generator=g) * 2).requires_grad_()
    teacher = torch.randn(4, 6, generator=g) * 2
    teacher[0, 2] = teacher[3, 0] = teacher[3, 5] = -math.inf
    loss = DistillationLoss(2.5, hardness=1.0)(student, teacher)
    expected = reference_kl(student.detach().numpy(), teacher.numpy(), 2.5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.isfinite(student.grad).all()
    both = student.detach().clone()
    both[0, 2] = both[3, 0] = both[3, 5] = -math.inf  # the student rules them out too
    shared = DistillationLoss(2.5, hardness=1.0)(both, teacher)
    assert float(shared) == pytest.approx(reference_kl(both.numpy(), teacher.numpy(), 2.5),
                                          rel=1e-5)


def test_several_heads_average_their_kls_and_low_precision_is_computed_in_float32():
    g = torch.Generator().manual_seed(1)
    start_s, end_s, start_t, end_t = (torch.randn(4, 13, generator=g) for _ in range(4))
    loss = DistillationLoss(3.0)((start_s.bfloat16(), end_s.bfloat16()),
                                 [start_t.bfloat16(), end_t.bfloat16()])
    expected = (reference_kl(start_s.bfloat16().float().numpy(),
                             start_t.bfloat16().float().numpy(), 3.0)
                + reference_kl(end_s.bfloat16().float().numpy(),
                               end_t.bfloat16().float().numpy(), 3.0)) / 2
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_a_mask_excludes_classes_and_rows_without_any():
    """QA logits over tokens with padding: masked tokens take no probability, and a row that
    is all padding does not count in the mean."""
    g = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    lengths = torch.tensor([9, 4, 1, 0, 6])
    valid = torch.arange(9) < lengths[:, None]  # (5, 9); row 3 has no token
    loss = DistillationLoss(1.5)(student, teacher, mask=valid)
    expected = reference_kl(student.numpy(), teacher.numpy(), 1.5, valid.numpy())
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # broadcast: one mask (B, T) for logits (B, heads=2, T)
    both = DistillationLoss(1.5)(student[:, None].expand(5, 2, 9), teacher[:, None].expand(
        5, 2, 9), mask=valid[:, None])
    assert float(both) == pytest.approx(expected, rel=1e-5)


def test_gradient_is_hardness_times_t_times_the_softmax_difference():
    """d/dz_s of h · T² · KL = h · T · (p_s − p_t) / rows; the teacher gets no gradient; the
    task loss's gradient comes in with weight 1 − h."""
    g = torch.Generator().manual_seed(3)
    temperature, hardness, rows, classes = 2.5, 0.7, 6, 5
    student = torch.randn(rows, classes, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(rows, classes, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, classes, (rows,), generator=g)
    task = F.cross_entropy(student, labels)
    (task_grad,) = torch.autograd.grad(task, student, retain_graph=True)
    loss = DistillationLoss(temperature, hardness)(student, teacher, task)
    loss.backward()
    soft_grad = temperature * (softmax64(student.detach(), temperature)
                               - softmax64(teacher.detach(), temperature)) / rows
    torch.testing.assert_close(student.grad, hardness * soft_grad + (1 - hardness) * task_grad,
                               rtol=1e-10, atol=1e-12)
    assert teacher.grad is None


def test_hardness_zero_is_the_task_loss_and_one_the_soft_loss():
    g = torch.Generator().manual_seed(4)
    student, teacher = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    task = torch.tensor(1.234)
    assert DistillationLoss(2.0, hardness=0.0)(student, None, task) is task
    soft = DistillationLoss(2.0, hardness=1.0)
    assert torch.equal(soft(student, teacher), soft(student, teacher, task))  # task ignored
    assert torch.equal(soft(student, teacher), soft.soft_loss(student, teacher))


@pytest.mark.parametrize(("settings", "match"), [
    ({"temperature": 0}, r"temperature must be a finite number > 0, got 0"),
    ({"temperature": -1.5}, r"temperature must be a finite number > 0, got -1.5"),
    ({"temperature": float("inf")}, r"temperature must be a finite number > 0, got inf"),
    ({"temperature": "2"}, r"temperature must be a finite number > 0, got '2'"),
    ({"temperature": True}, r"temperature must be a finite number > 0, got True"),
    ({"hardness": 1.5}, r"hardness must be a number in \[0, 1\], got 1.5"),
    ({"hardness": -0.1}, r"hardness must be a number in \[0, 1\], got -0.1"),
    ({"hardness": float("nan")}, r"hardness must be a number in \[0, 1\], got nan"),
])
def test_bad_settings_name_the_value_and_the_range(settings, match):
    with pytest.raises(ValueError, match=match):
        DistillationLoss(**settings)


def test_bad_inputs_name_what_does_not_match():
    loss = DistillationLoss(2.0, hardness=0.5)
    a, b = torch.randn(3, 5), torch.randn(3, 6)
    with pytest.raises(ValueError, match=r"head 0: student logits \(3, 5\) and teacher logits "
                                         r"\(3, 6\) must have the same shape"):
        loss(a, b, torch.tensor(0.0))
    with pytest.raises(ValueError, match="the student has 2 heads of logits, the teacher 1"):
        loss((a, a), (a,), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"hardness 0.5 < 1 mixes in the task loss: pass "
                                         r"task_loss"):
        loss(a, a)
    with pytest.raises(ValueError, match="hardness 0.5 > 0 needs the teacher's logits"):
        loss(a, None, torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"task_loss must be the batch's loss, a one-element "
                                         r"tensor, got shape \(3,\): reduce it"):
        loss(a, a, torch.zeros(3))
    # an empty batch (no rows) adds nothing, not NaN
    empty = torch.randn(0, 5, requires_grad=True)
    assert loss.soft_loss(empty, torch.randn(0, 5)).item() == 0.0
    with pytest.raises(ValueError, match=r"mask \(3, 4\) must broadcast to head 0's logits "
                                         r"\(3, 5\)"):
        loss(a, a, torch.tensor(0.0), mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        loss(a, a, torch.tensor(0.0), mask=torch.ones(3, 5))
    with pytest.raises(TypeError, match="student logits must be a tensor or a non-empty "
                                        "sequence of tensors"):
        loss([], [], torch.tensor(0.0))
    # a Hugging Face model's output (a dict subclass): the message says how to pick its logits
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(logits=a)
    with pytest.raises(TypeError, match=r"teacher logits .* got CausalLMOutputWithPast; a "
                                        r"model's output with fields \['logits'\]: pass "
                                        r"outputs= .*outputs=lambda out: out.logits"):
        loss(a, output, torch.tensor(0.0))


def test_teacher_cache_fits_rows_to_the_batch_shape():
    """Rows padded to one batch's width come back cut or zero-padded to another's."""
    cache = TeacherCache()
    first = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6)
    cache.put([7, 3], [first, first + 100])
    assert len(cache) == 2 and cache.get([7, 9], [torch.Size([2, 6])] * 2) is None
    narrow, padded = cache.get([3, 7], [torch.Size([2, 4]), torch.Size([2, 8])])
    assert torch.equal(narrow, torch.stack([first[1, :4], first[0, :4]]))
    assert torch.equal(padded[:, :6], torch.stack([first[1], first[0]]) + 100)
    assert not padded[:, 6:].any()
    with pytest.raises(ValueError, match="the cached outputs of example 3 have shapes"):
        cache.get([3], [torch.Size([1, 2, 6]), torch.Size([1, 2, 6])])


# -- the callback ---------------------------------------------------------------------------


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))


class Student(pl.LightningModule):
    """Distills with whatever DistillationCallback the trainer has; the batch carries each
    example's index for the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(seed=1)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        logits = self.net(x)
        distillation = DistillationCallback.of(self.trainer)
        return distillation.loss(logits, F.cross_entropy(logits, y), x, index=index)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def loader(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g),
                         torch.arange(n))
    return DataLoader(data, batch_size=16, shuffle=True, generator=g)


def frozen_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


class CountCalls:
    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1


def test_trainer_run_keeps_the_teacher_frozen_and_out_of_the_checkpoint(tmp_path):
    teacher = mlp(seed=0)
    before = frozen_copy(teacher)
    distillation = DistillationCallback(teacher, temperature=2.0, hardness=0.8)
    sparsity = SparsityCallback(pattern="unstructured", sparsity=0.5)
    student = Student()
    ckpt = tmp_path / "epoch1.ckpt"
    make_trainer([distillation, sparsity, SaveAndStop(ckpt)], max_epochs=3).fit(
        student, loader())
    checkpoint = torch.load(ckpt, weights_only=False)
    assert set(checkpoint["state_dict"]) == set(student.state_dict())  # the student's only
    assert not any(k.startswith("teacher") for k in checkpoint["state_dict"])
    assert checkpoint["callbacks"]["DistillationCallback"] == {"temperature": 2.0,
                                                               "hardness": 0.8}
    # resume: the fit goes on from the checkpoint, the teacher still untouched
    make_trainer([distillation, SparsityCallback(pattern="unstructured", sparsity=0.5)],
                 max_epochs=3).fit(Student(), loader(), ckpt_path=ckpt)
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert [s.name for s in sparsity.engine.slots] == ["net.0.weight", "net.2.weight"]


def test_the_student_learns_the_teacher():
    """Hardness 1 on random labels: the student's soft loss against the teacher falls."""
    teacher, student = mlp(seed=0), Student()
    data = loader(96)
    x = torch.cat([batch[0] for batch in data])
    settings = DistillationLoss(2.0)
    before = float(settings(student.net(x), teacher(x)))
    make_trainer([DistillationCallback(teacher, temperature=2.0)], max_epochs=8).fit(
        student, data)
    assert float(settings(student.net(x), teacher(x))) < 0.5 * before


def test_cache_runs_the_teacher_once_per_example_and_changes_nothing():
    results = {}
    for cache in (False, True):
        teacher = mlp(seed=0)
        counter = CountCalls(teacher)
        student = Student()
        callback = DistillationCallback(teacher, hardness=0.5, cache=cache)
        make_trainer([callback], max_epochs=3).fit(student, loader())
        results[cache] = (counter.calls, frozen_copy(student))
    assert results[False][0] == 9 and results[True][0] == 3  # 3 batches a epoch
    for name, value in results[False][1].items():
        assert torch.equal(value, results[True][1][name]), name


def test_a_shared_cache_serves_the_next_run_from_its_first_epoch():
    """Two runs distilling from one teacher on the same data: the second never runs it."""
    teacher, cache = mlp(seed=0), TeacherCache()
    counter = CountCalls(teacher)
    for _ in range(2):
        make_trainer([DistillationCallback(teacher, cache=cache)], max_epochs=2).fit(
            Student(), loader())
    assert counter.calls == 3 and len(cache) == 48


def test_hardness_zero_never_runs_the_teacher():
    teacher = mlp(seed=0)
    counter = CountCalls(teacher)
    make_trainer([DistillationCallback(teacher, hardness=0.0)], max_epochs=1).fit(
        Student(), loader())
    assert counter.calls == 0


def test_the_teacher_takes_the_students_precision_and_can_be_saved(tmp_path):
    teacher = mlp(seed=0)
    ckpt = tmp_path / "last.ckpt"
    trainer = make_trainer([DistillationCallback(teacher, save_teacher=True)], max_epochs=1,
                           precision="64-true")
    trainer.fit(Student(), loader())
    assert {p.dtype for p in teacher.parameters()} == {torch.float64}
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["DistillationCallback"]
    assert saved["teacher"].keys() == teacher.state_dict().keys()
    other = mlp(seed=9).double()
    DistillationCallback(other, save_teacher=True).load_state_dict(saved)
    for name, value in other.state_dict().items():
        assert torch.equal(value, teacher.state_dict()[name]), name


@pytest.mark.parametrize(("teacher_dtype", "precision"), [
    (torch.bfloat16, "32-true"), (torch.bfloat16, "bf16-mixed"), (torch.float64, "32-true"),
    (torch.float64, "bf16-mixed"), (torch.float32, "bf16-true"),
])
def test_a_teacher_of_another_dtype_is_cast_to_the_students_weights(teacher_dtype, precision):
    """A bfloat16 (HF) or float64 teacher beside a float32 student: cast at setup to the
    dtype the precision gives the student's weights (float32 under mixed precision, which
    autocasts both), so its forward takes the student's inputs."""
    teacher = mlp(seed=0).to(teacher_dtype)
    student = Student()
    make_trainer([DistillationCallback(teacher, hardness=0.5)], max_epochs=1,
                 precision=precision).fit(student, loader())
    weights = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in teacher.parameters()} == {weights}
    assert {p.dtype for p in student.parameters()} == {weights}


def test_a_teacher_on_the_meta_device_is_refused_by_name():
    with torch.device("meta"):
        teacher = mlp(seed=0)
    with pytest.raises(ValueError, match=r"the teacher \(Sequential\) has 4 tensors on the meta "
                                         r"device \(0.weight, ...\): no weights to imitate. Load "
                                         r"its trained weights first"):
        make_trainer([DistillationCallback(teacher)], max_epochs=1).fit(Student(), loader())
    assert all(p.is_meta for p in teacher.parameters())


class Output(dict):
    """A model output with fields, as Hugging Face returns (``out.logits``)."""

    __getattr__ = dict.__getitem__


class FieldsStudent(Student):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self.net(x)
        return DistillationCallback.of(self.trainer).loss(Output(logits=logits), None, x)


@pytest.mark.parametrize(("student", "teacher", "side", "got"), [
    (FieldsStudent, lambda: mlp(seed=0), "teacher", r"a tensor of shape \(16, 5\)"),
    (Student, lambda: mlp(seed=0), "student", r"a tensor of shape \(16, 5\)"),
])
def test_outputs_failing_on_one_side_says_which(student, teacher, side, got):
    callback = DistillationCallback(teacher(), outputs=lambda out: out.logits)
    with pytest.raises(ValueError, match=rf"outputs= failed on the {side}'s output \({got}\): "
                                         rf"AttributeError: .*logits.* It picks the logits out "
                                         rf"of the student's and the teacher's outputs alike"):
        make_trainer([callback], max_epochs=1).fit(student(), loader())


def test_resuming_with_other_settings_warns_naming_them(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    trainer = make_trainer([DistillationCallback(mlp(seed=0), temperature=2.0, hardness=0.7)],
                           max_epochs=1)
    trainer.fit(Student(), loader())
    trainer.save_checkpoint(ckpt)
    resumed = make_trainer([DistillationCallback(mlp(seed=0), temperature=9.0, hardness=0.7)],
                           max_epochs=2)
    with pytest.warns(UserWarning, match=r"temperature 2\.0 -> 9\.0") as caught:
        resumed.fit(Student(), loader(), ckpt_path=ckpt)
    assert not any("hardness" in str(w.message) for w in caught)


class HoldsTeacher(Student):
    def __init__(self, teacher: nn.Module, in_optimizer: bool) -> None:
        super().__init__()
        self.in_optimizer = in_optimizer
        if in_optimizer:
            self.outside = [teacher]  # a list: not a submodule, but its parameters optimized
        else:
            self.teacher = teacher

    def configure_optimizers(self):
        params = list(self.net.parameters())
        if self.in_optimizer:
            params += list(self.outside[0].parameters())
        return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize(("in_optimizer", "match"), [
    (False, r"the teacher is the LightningModule's submodule 'teacher'"),
    (True, r"optimizer 0 \(AdamW\) holds 4 of the teacher's parameters"),
])
def test_a_teacher_inside_the_student_or_its_optimizer_is_refused(in_optimizer, match):
    teacher = mlp(seed=0)
    before = frozen_copy(teacher)
    with pytest.raises(ValueError, match=match):
        make_trainer([DistillationCallback(teacher)], max_epochs=1).fit(
            HoldsTeacher(teacher, in_optimizer), loader())
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_bad_callback_arguments():
    with pytest.raises(TypeError, match="teacher must be a torch.nn.Module, got dict"):
        DistillationCallback({})
    with pytest.raises(TypeError, match=r"DistillationCallback got an unknown setting "
                                        r"'temprature'; did you mean 'temperature'\? valid "
                                        r"settings: temperature, hardness"):
        DistillationCallback(mlp(0), temprature=2.0)
    with pytest.raises(TypeError, match="cache must be True, False or a TeacherCache"):
        DistillationCallback(mlp(0), cache="yes")
    with pytest.raises(ValueError, match=r"hardness must be a number in \[0, 1\], got 2"):
        DistillationCallback(mlp(0), hardness=2)
    with pytest.raises(TypeError, match=r"outputs must be a function from a model's output to "
                                        r"its logits \(e.g. lambda out: out.logits\), got "
                                        r"'logits'"):
        DistillationCallback(mlp(0), outputs="logits")
    # the cache's keys: one integer per example of the batch, else named before any lookup
    callback, student = DistillationCallback(mlp(0), cache=True), (torch.randn(3, 5),)
    x = torch.randn(3, 12)
    for index, got in ([0, 1], "list of 2 entries"), (torch.arange(6).view(3, 2), "Tensor of 3"), (
            torch.tensor([0.0, 1.5, 2.0]), "Tensor of 3 torch.float32"):
        with pytest.raises(ValueError, match=r"index must hold one integer example index per "
                                             rf"example of the batch \(3\), got a {got}"):
            callback.teacher_logits(student, x, index=index)
    assert len(callback.cache) == 0
    # integer 0-d tensors are indices too; a task loss that is no tensor is refused before
    # the teacher runs
    callback.teacher_logits(student, x, index=[torch.tensor(0), torch.tensor(1), 2])
    assert len(callback.cache) == 3
    mixed = DistillationCallback(mlp(0), hardness=0.5)
    mixed.teacher = None  # would fail if it ran
    with pytest.raises(ValueError, match=r"task_loss must be the batch's loss, a one-element "
                                         r"tensor, got float"):
        mixed.loss(student[0], 1.0, x)
    trainer = make_trainer([], max_epochs=1)
    with pytest.raises(LookupError, match="expected one DistillationCallback"):
        DistillationCallback.of(trainer)


def test_both_terms_reach_the_logger(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    make_trainer([DistillationCallback(mlp(seed=0), hardness=0.5)], max_epochs=1, logger=logger,
                 log_every_n_steps=1).fit(Student(), loader())
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    assert {"distillation/soft", "distillation/task"} <= set(metrics[0].split(","))
    assert len(metrics) == 1 + 3  # a line per step
