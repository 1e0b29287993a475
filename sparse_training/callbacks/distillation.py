"""DistillationCallback: a frozen teacher beside any LightningModule, and the loss against it."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor, nn

from sparse_training.callbacks.sparsity import compute_dtype
from sparse_training.config import unknown_setting
from sparse_training.pieces.distillation import DistillationLoss, Logits, TeacherCache, as_heads


def _as_logits(output: Any) -> Logits:
    return output


def weight_dtype(precision: str) -> torch.dtype | None:
    """The dtype of the model's weights under a Lightning ``precision``: float32 under mixed
    precision (autocast computes in the lower one); None where the plugin alone knows
    (transformer-engine, bitsandbytes)."""
    return torch.float32 if str(precision).endswith("-mixed") else compute_dtype(precision)


def _example_keys(index: Sequence[int] | Tensor, batch: int) -> list[int]:
    """The cache keys of a batch: one integer example index per example.

    Raises:
        ValueError: not a 1-D sequence of ``batch`` integers.
    """
    values = index.tolist() if isinstance(index, Tensor) else list(index)
    try:  # ints, numpy ints and integer 0-d tensors; not floats, bools or nested lists
        keys = [operator.index(v) for v in values if not isinstance(v, bool)]
    except TypeError:
        keys = []
    if len(values) != batch or len(keys) != batch:
        shown = f"{type(index).__name__} of {len(values)}" + (
            f" {index.dtype}" if isinstance(index, Tensor) else "")
        raise ValueError(f"index must hold one integer example index per example of the "
                         f"batch ({batch}), got a {shown} entries: {values[:4]}")
    return keys


class DistillationCallback(Callback):
    """Train a LightningModule against a frozen teacher's outputs (knowledge distillation:
    :mod:`sparse_training.pieces.distillation` has the loss and its formula).

    The callback holds the teacher, outside the LightningModule: the teacher is in no
    optimizer, out of the student's ``state_dict`` and checkpoint (unless ``save_teacher``),
    out of what ``SparsityCallback`` selects, and never put in train mode by the Trainer. At
    ``setup`` it is moved to the strategy's device and cast to the dtype the precision gives
    the student's weights, whatever its own (``32-true`` and mixed precision: float32, mixed
    running under the training step's autocast; ``bf16-true``: bfloat16; ``64-true``:
    float64; other precisions: the plugin converts it as it does the student), so a bfloat16
    teacher serves a float32 student. The student's ``training_step`` asks for the loss::

        logits = self.net(x)
        distillation = DistillationCallback.of(self.trainer)
        return distillation.loss(logits, F.cross_entropy(logits, y), x)

    ``loss`` runs the teacher on the arguments after the task loss, without gradients, in
    eval mode (or reads its outputs from the cache), and returns
    ``h · T² · KL + (1 − h) · task_loss``; ``distillation/soft`` and ``distillation/task``
    go to the loggers at their cadence.

    Args:
        teacher: the trained model to imitate; frozen here (``eval()``, no gradients).
        temperature: T > 0 of the softmaxes (Hinton et al. 2015; oBERT uses 2.0).
        hardness: h in [0, 1], the weight of the soft term (1: the teacher only, 0: the
            labels only, and the teacher does not run).
        outputs: picks the logits out of a model's output, the student's and the teacher's
            alike; default: the output itself (a tensor, or a tuple of tensors for several
            heads). Hugging Face QA: ``lambda out: (out.start_logits, out.end_logits)``.
        cache: keep the teacher's outputs per example index (``loss(..., index=...)``) and
            reuse them from the second time an example comes: True for a cache of this
            callback, or a :class:`~sparse_training.pieces.distillation.TeacherCache` shared by the
            runs that distill from the same teacher on the same data. Only for data that
            does not change between epochs (no augmentation).
        save_teacher: also save the teacher's weights in the callback's checkpoint state
            (restored on resume); by default the checkpoint holds the settings only.

    Raises:
        TypeError: a teacher that is not an ``nn.Module``, an unknown setting (the nearest
            valid one named), or an ``outputs`` that is not a function.
        ValueError: a bad temperature or hardness (at construction); a teacher on the meta
            device or part of the LightningModule (at setup) or held by one of its
            optimizers (at fit start); ``outputs`` failing on the teacher's output or the
            student's (naming which, at the step).
    """

    def __init__(self, teacher: nn.Module, *, temperature: float = 2.0, hardness: float = 1.0,
                 outputs: Callable[[Any], Logits] | None = None,
                 cache: bool | TeacherCache = False, save_teacher: bool = False,
                 **unknown: Any) -> None:
        if message := unknown_setting(unknown, ("temperature", "hardness", "outputs", "cache",
                                                "save_teacher")):
            raise TypeError(f"DistillationCallback got an {message}")
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be a torch.nn.Module, got {type(teacher).__name__}")
        if not isinstance(cache, bool | TeacherCache):
            raise TypeError(f"cache must be True, False or a TeacherCache, got {cache!r}")
        if outputs is not None and not callable(outputs):
            raise TypeError(f"outputs must be a function from a model's output to its logits "
                            f"(e.g. lambda out: out.logits), got {outputs!r}")
        self.settings = DistillationLoss(temperature, hardness)
        self.teacher = teacher.eval().requires_grad_(False)
        self.outputs = outputs or _as_logits
        self.cache = cache if isinstance(cache, TeacherCache) else TeacherCache() if cache else None
        self.save_teacher = bool(save_teacher)
        self._terms: dict[str, Tensor] = {}  # the last loss's two terms, logged at batch end

    @staticmethod
    def of(trainer: pl.Trainer) -> DistillationCallback:
        """The trainer's DistillationCallback (for ``training_step``).

        Raises:
            LookupError: none or several among ``trainer.callbacks``.
        """
        found = [c for c in trainer.callbacks if isinstance(c, DistillationCallback)]
        if len(found) != 1:
            raise LookupError(f"expected one DistillationCallback in trainer.callbacks, found "
                              f"{len(found)}")
        return found[0]

    # -- the loss -----------------------------------------------------------------------------
    def loss(self, student_output: Any, task_loss: Tensor | None, *teacher_args: Any,
             index: Sequence[int] | Tensor | None = None, mask: Tensor | None = None,
             **teacher_kwargs: Any) -> Tensor:
        """The distillation loss of this batch.

        Args:
            student_output: the student's output (``outputs`` picks its logits).
            task_loss: the student's loss on the labels; None where hardness is 1.
            *teacher_args, **teacher_kwargs: what the teacher's forward takes (the same
                inputs as the student's, as a rule).
            index: the batch's example indices (a list, or a CPU tensor: a CUDA one costs a
                synchronization), for the cache.
            mask: True where a class counts (``DistillationLoss``).
        """
        self.settings.check_task_loss(task_loss)  # before the teacher runs
        student = self._logits(student_output, "student")
        soft = None
        if self.settings.hardness > 0.0:  # hardness 0: the teacher does not run
            teacher = self.teacher_logits(student, *teacher_args, index=index,
                                          **teacher_kwargs)
            soft = self.settings.soft_loss(student, teacher, mask=mask)
            self._terms = {"distillation/soft": soft.detach()}
        if task_loss is not None:
            self._terms["distillation/task"] = task_loss.detach()
        return self.settings.combine(soft, task_loss)

    def teacher_logits(self, student: tuple[Tensor, ...], *args: Any,
                       index: Sequence[int] | Tensor | None = None, **kwargs: Any
                       ) -> tuple[Tensor, ...]:
        """The teacher's logits for this batch (one tensor per head, the student's shapes),
        from the cache where every example of the batch is in it."""
        keys = None
        if self.cache is not None and index is not None:
            keys = _example_keys(index, len(student[0]))
            cached = self.cache.get(keys, [s.shape for s in student])
            if cached is not None:
                return cached
        if self.teacher.training:  # someone called .train() on it
            self.teacher.eval()
        with torch.no_grad():
            heads = self._logits(self.teacher(*args, **kwargs), "teacher")
        if keys is not None:
            self.cache.put(keys, heads)
        return heads

    def _logits(self, output: Any, side: str) -> tuple[Tensor, ...]:
        """``outputs`` applied to the ``side`` ("student", "teacher") model's output, as heads.

        Raises:
            ValueError: ``outputs`` failed on that output, naming the side and what it got.
        """
        try:
            logits = self.outputs(output)
        except Exception as error:
            shown = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, Tensor)
                     else f"a {type(output).__name__}")
            raise ValueError(f"DistillationCallback: outputs= failed on the {side}'s output "
                             f"({shown}): {type(error).__name__}: {error}. It picks the logits "
                             f"out of the student's and the teacher's outputs alike: give both "
                             f"models outputs of one form, or an outputs that takes both") from error
        return as_heads(logits, side)

    # -- the Trainer's hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a teacher on the meta device or inside the student; move it to the
        student's device and cast it to its weights' dtype (class doc)."""
        teacher = type(self.teacher).__name__
        if meta := [n for n, t in [*self.teacher.named_parameters(),
                                   *self.teacher.named_buffers()] if t.is_meta]:
            raise ValueError(f"DistillationCallback: the teacher ({teacher}) has {len(meta)} "
                             f"tensors on the meta device ({meta[0]}, ...): no weights to "
                             f"imitate. Load its trained weights first (from_pretrained, or "
                             f"load_state_dict(..., assign=True)); to_empty() would give it "
                             f"uninitialized ones")
        if problem := _shared(self.teacher, pl_module):
            raise ValueError(f"DistillationCallback: {problem}; keep the teacher only in the "
                             f"callback (it would be saved, trained or pruned with the student)")
        self.teacher.to(trainer.strategy.root_device)
        dtype = weight_dtype(trainer.precision)
        if dtype is not None:  # nn.Module.to(dtype) casts floating-point tensors only
            self.teacher.to(dtype)
        trainer.precision_plugin.convert_module(self.teacher)
        self.teacher.eval()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        teacher = {id(p) for p in self.teacher.parameters()}
        for number, optimizer in enumerate(trainer.optimizers):
            held = sum(id(p) in teacher for g in optimizer.param_groups for p in g["params"])
            if held:
                raise ValueError(f"DistillationCallback: optimizer {number} "
                                 f"({type(optimizer).__name__}) holds {held} of the teacher's "
                                 f"parameters; the teacher stays frozen: build the optimizer "
                                 f"from the student's parameters only")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._terms:  # the loggers write it at their cadence (log_every_n_steps)
            pl_module.log_dict(self._terms, on_step=True, on_epoch=False)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"temperature": self.settings.temperature,
                                 "hardness": self.settings.hardness}
        if self.save_teacher:
            state["teacher"] = self.teacher.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved teacher where it was saved; a warning naming each setting the resumed
        run changes (the run goes on with the new one, as the user asked)."""
        changed = [f"{name} {state_dict[name]!r} -> {now!r}" for name, now in
                   (("temperature", self.settings.temperature),
                    ("hardness", self.settings.hardness))
                   if name in state_dict and state_dict[name] != now]
        if changed:
            rank_zero_warn(f"DistillationCallback: the checkpoint was trained with other "
                           f"settings; resuming with {', '.join(changed)}")
        if "teacher" in state_dict:
            self.teacher.load_state_dict(state_dict["teacher"])


def _shared(teacher: nn.Module, student: nn.Module) -> str | None:
    """How the teacher is part of the student (a submodule, or shared parameters), or None."""
    for name, module in student.named_modules():
        if module is teacher:
            return f"the teacher is the LightningModule's submodule {name or '(itself)'!r}"
    teacher_params = {id(p) for p in teacher.parameters()}
    shared = [name for name, p in student.named_parameters() if id(p) in teacher_params]
    if shared:
        return f"the teacher shares {len(shared)} parameters with the student ({shared[0]}, ...)"
    return None
