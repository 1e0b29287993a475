"""Knowledge distillation: a student's loss against a teacher's logits, and a cache of a
teacher's outputs per example.

Hinton, Vinyals & Dean 2015 ("Distilling the Knowledge in a Neural Network"), with the
hardness h of oBERT (Kurtic et al. 2022) weighing the soft term against the task's loss:

    L = h · T² · KL(softmax(z_t / T) ‖ softmax(z_s / T)) + (1 − h) · L_task

z_s and z_t are the student's and the teacher's logits over their last dimension (the
classes; for extractive QA the tokens), T the temperature. T² keeps the soft term's gradient,
T · (p_s − p_t) per logit, on the scale of the task loss's as T changes. The KL is summed
over the classes and averaged over every other position (the batch, tokens): PyTorch's
``"batchmean"`` for 2-D logits. Several heads (QA's start and end logits) average their KLs.

Torch only (no Lightning); :class:`sparse_training.callbacks.DistillationCallback` holds the
teacher for a ``pl.Trainer``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Logits = Tensor | Sequence[Tensor]  # one head, or several (QA: start and end logits)
MASKED = -1e30  # the logit of an excluded class: exp() is 0, and no inf to make NaN gradients


def as_heads(logits: Logits, name: str) -> tuple[Tensor, ...]:
    """``logits`` as a tuple of tensors, one per head.

    Raises:
        TypeError: anything but a tensor or a non-empty sequence of tensors.
    """
    heads = (logits,) if isinstance(logits, Tensor) else tuple(logits) if isinstance(
        logits, Sequence) else ()
    if not heads or not all(isinstance(h, Tensor) for h in heads):
        fields = list(logits) if isinstance(logits, Mapping) else [
            f for f in ("logits", "start_logits", "end_logits") if hasattr(logits, f)]
        hint = (f"; a model's output with fields {fields}: pass outputs= a function that picks "
                f"the logits, e.g. outputs=lambda out: out.{fields[0]}" if fields else "")
        raise TypeError(f"{name} logits must be a tensor or a non-empty sequence of tensors "
                        f"(one per head), got {type(logits).__name__}{hint}")
    return heads


@dataclass(frozen=True)
class DistillationLoss:
    """The distillation loss (module doc) with its two settings checked once.

    Args:
        temperature: T > 0; 1 compares the plain softmaxes, larger values soften both.
        hardness: h in [0, 1], the weight of the soft term; 1 ignores the task loss, 0 the
            teacher.

    Raises:
        ValueError: naming the bad value and the valid range.
    """

    temperature: float = 2.0
    hardness: float = 1.0

    def __post_init__(self) -> None:
        t, h = self.temperature, self.hardness
        if not _is_real(t) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        if not _is_real(h) or not 0.0 <= h <= 1.0:
            raise ValueError(f"hardness must be a number in [0, 1], got {h!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "hardness", float(h))

    def __call__(self, student: Logits, teacher: Logits | None, task_loss: Tensor | None = None,
                 *, mask: Tensor | None = None) -> Tensor:
        """h · soft + (1 − h) · task_loss; the teacher may be None where h is 0 and the task
        loss None where h is 1.

        Args:
            student, teacher: logits of the same shapes, one tensor per head.
            task_loss: the student's loss on the labels (a scalar).
            mask: True where a class counts, broadcastable to every head's logits (QA: the
                attention mask, so padding tokens take no probability).

        Raises:
            ValueError: a missing term the hardness needs, or shapes that do not match.
        """
        soft = None
        if self.hardness > 0.0:
            if teacher is None:
                raise ValueError(f"hardness {self.hardness:g} > 0 needs the teacher's logits")
            soft = self.soft_loss(student, teacher, mask=mask)
        return self.combine(soft, task_loss)

    def combine(self, soft: Tensor | None, task_loss: Tensor | None) -> Tensor:
        """h · soft + (1 − h) · task_loss; the term that a hardness of 0 or 1 drops may be
        None.

        Raises:
            ValueError: the task loss missing where the hardness is below 1, or not one
                element.
        """
        self.check_task_loss(task_loss)
        if self.hardness == 0.0:
            return task_loss
        if self.hardness == 1.0:
            return soft
        return self.hardness * soft + (1.0 - self.hardness) * task_loss

    def check_task_loss(self, task_loss: Tensor | None) -> None:
        """Raises ValueError unless ``task_loss`` is a one-element tensor, or None where the
        hardness is 1 (the soft loss alone)."""
        if self.hardness < 1.0 and task_loss is None:
            raise ValueError(f"hardness {self.hardness:g} < 1 mixes in the task loss: pass "
                             f"task_loss")
        if task_loss is not None and (not isinstance(task_loss, Tensor) or task_loss.numel() != 1):
            shown = (f"shape {tuple(task_loss.shape)}" if isinstance(task_loss, Tensor)
                     else type(task_loss).__name__)
            raise ValueError(f"task_loss must be the batch's loss, a one-element tensor, got "
                             f"{shown}: reduce it (e.g. .mean()) first")

    def soft_loss(self, student: Logits, teacher: Logits, *, mask: Tensor | None = None
                  ) -> Tensor:
        """T² · KL(teacher ‖ student) at temperature T, the mean over heads (module doc).
        Computed in float32 at least; the teacher's side carries no gradient."""
        pairs = _pairs(as_heads(student, "student"), as_heads(teacher, "teacher"), mask)
        return torch.stack([self._head(s, t, mask) for s, t in pairs]).mean()

    def _head(self, student: Tensor, teacher: Tensor, mask: Tensor | None) -> Tensor:
        dtype = torch.promote_types(student.dtype, torch.float32)
        # a class ruled out (-inf, by the teacher or by both, e.g. a shared vocabulary mask)
        # holds probability 0 there: 0 log 0 = 0, not NaN
        s = (student.to(dtype) / self.temperature).clamp_min(MASKED)
        t = (teacher.detach().to(dtype) / self.temperature).clamp_min(MASKED)
        if mask is not None:
            s, t = s.masked_fill(~mask, MASKED), t.masked_fill(~mask, MASKED)
        log_p_t = F.log_softmax(t, dim=-1)
        per_row = (log_p_t.exp() * (log_p_t - F.log_softmax(s, dim=-1))).sum(-1)
        # rows without any class (all padding) hold two equal uniform softmaxes: KL 0; they
        # do not count in the mean
        rows = (max(per_row.numel(), 1) if mask is None
                else mask.expand_as(s).any(-1).sum().clamp_min(1))  # an empty batch: 0
        return per_row.sum() / rows * self.temperature ** 2


def _pairs(student: tuple[Tensor, ...], teacher: tuple[Tensor, ...], mask: Tensor | None
           ) -> Iterable[tuple[Tensor, Tensor]]:
    """The (student, teacher) logits of each head, shapes checked."""
    if len(student) != len(teacher):
        raise ValueError(f"the student has {len(student)} heads of logits, the teacher "
                         f"{len(teacher)}; give both the same heads in the same order")
    for index, (s, t) in enumerate(zip(student, teacher, strict=True)):
        if s.shape != t.shape or s.dim() == 0:
            raise ValueError(f"head {index}: student logits {tuple(s.shape)} and teacher "
                             f"logits {tuple(t.shape)} must have the same shape, at least 1-D "
                             f"(classes last)")
        if mask is not None:
            if mask.dtype != torch.bool:
                raise ValueError(f"mask must be a bool tensor (True where a class counts), got "
                                 f"{mask.dtype}")
            try:
                if torch.broadcast_shapes(mask.shape, s.shape) != s.shape:
                    raise RuntimeError
            except RuntimeError:
                raise ValueError(f"mask {tuple(mask.shape)} must broadcast to head {index}'s "
                                 f"logits {tuple(s.shape)}") from None
    return zip(student, teacher, strict=True)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class TeacherCache:
    """A teacher's outputs per example index, for a dataset whose examples never change (no
    augmentation; the teacher in eval mode): each example's outputs are computed the first
    time its index comes and read back after, saving the teacher's forward pass.

    Rows are kept as given (their device and dtype), one per example and head. A batch read
    back is fitted to the shapes asked for, each dimension cut or zero-padded: examples padded
    to their batch's longest (token logits) then line up; the positions an example does not
    have must be excluded by the loss's mask.
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Tensor, ...]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, indices: Sequence[int], shapes: Sequence[torch.Size]
            ) -> tuple[Tensor, ...] | None:
        """The cached outputs of these examples, one (batch, ...) tensor per head of the
        given shapes, or None unless every example is cached."""
        rows = [self._rows.get(i) for i in indices]
        if any(row is None for row in rows):
            return None
        for index, row in zip(indices, rows, strict=True):
            if [r.dim() + 1 for r in row] != [len(shape) for shape in shapes]:
                raise ValueError(f"the cached outputs of example {index} have shapes "
                                 f"{[tuple(r.shape) for r in row]} per example, which cannot "
                                 f"line up with the student's {[tuple(s) for s in shapes]}")
        return tuple(torch.stack([_fit(row[head], shape[1:]) for row in rows])
                     for head, shape in enumerate(shapes))

    def put(self, indices: Sequence[int], heads: Sequence[Tensor]) -> None:
        """Keep each example's row of every head (detached)."""
        for position, index in enumerate(indices):
            self._rows[index] = tuple(head[position].detach() for head in heads)


def _fit(row: Tensor, shape: torch.Size) -> Tensor:
    """``row`` cut or zero-padded to ``shape`` along every dimension."""
    row = row[tuple(slice(0, n) for n in shape)]
    padding = [p for have, want in zip(reversed(row.shape), reversed(shape), strict=True)
               for p in (0, want - have)]
    return F.pad(row, padding) if any(padding) else row
