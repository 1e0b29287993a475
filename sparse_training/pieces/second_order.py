"""The second-order score: the optimal brain surgeon's saliency under an empirical Fisher,
and its weight update (Hassibi & Stork 1993; Kurtic et al. 2022, "The Optimal BERT
Surgeon", oBERT).

The loss near the trained weights is ``dL = 1/2 dw^T F dw`` with ``F`` the empirical
Fisher, ``F = damp * I + 1/n sum_t g_t g_t^T`` over the ``n`` gradients observed since the
last mask update. Removing weight q at the least cost (the others moving to compensate)
costs ``rho_q = w_q^2 / (2 [F^-1]_qq)`` and moves the rest by
``dw = -w_q F^-1 e_q / [F^-1]_qq``; removing a set Q at once moves them by
``dw = -F^-1 E_Q ([F^-1]_QQ)^-1 w_Q``. As oBERT does, ``F`` is block-diagonal: each
tensor's rows (dim 0; the storage order, so a sharded tensor's rows are whole on every
rank) are cut into blocks of ``B`` consecutive entries, B the largest divisor of the row
length not above ``block_size``, and each block's ``B x B`` Fisher is kept and inverted
(float64). ``damp`` is relative: ``damp * mean(diag F)`` of the block, so that it does not
depend on the scale of the loss. Removing a whole Fisher block leaves nothing to
compensate: it costs ``1/2 w^T F w`` (``joint``: the score of a block pattern aligned with
the Fisher blocks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparse_training.pieces.training_scores import finite, is_finite_number, statistics_dtype

DEFAULT_BLOCK_SIZE = 32
DEFAULT_DAMP = 1e-2


def fisher_block(row_length: int, block_size: int) -> int:
    """B: the largest divisor of ``row_length`` that is at most ``block_size``."""
    return max(d for d in range(1, min(block_size, row_length) + 1) if row_length % d == 0)


def _rows(tensor: Tensor) -> tuple[int, int]:
    """(rows, row length) of a tensor's storage: dim 0, and the rest flattened."""
    rows = tensor.shape[0] if tensor.dim() > 1 else 1
    return rows, tensor.numel() // max(rows, 1)


@dataclass(frozen=True)
class SecondOrderScore:
    """``rho_q = w_q^2 / (2 [F^-1]_qq)`` under a block-diagonal empirical Fisher (module
    docstring); with ``update_weights``, the weights a scheduled update keeps move by the
    optimal brain surgeon's ``dw`` to make up for the ones it prunes.

    Attributes:
        block_size: the most entries of one Fisher block (oBERT: 50); memory is
            ``B`` times the weights' (float32).
        damp: the dampening, relative to each block's mean diagonal.
        update_weights: apply the OBS update at scheduled mask updates.
        joint: rank by ``1/2 w_q (F w)_q`` instead: summed over whole Fisher blocks it is
            ``1/2 w^T F w``, the exact cost of removing them together (nothing left in them
            to compensate). For block patterns whose block columns are ``block_size``: a
            block's rows are whole Fisher blocks, and the sum over the block is its cost.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    damp: float = DEFAULT_DAMP
    update_weights: bool = True
    joint: bool = False
    name: ClassVar[str] = "second-order"
    window: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or (
                self.block_size < 1):
            raise ValueError(f"SecondOrderScore.block_size must be an int >= 1, got "
                             f"{self.block_size!r}")
        if not (is_finite_number(self.damp) and self.damp > 0):
            raise ValueError(f"SecondOrderScore.damp must be a finite number > 0 (relative to "
                             f"the Fisher's mean diagonal), got {self.damp!r}")
        for flag in ("update_weights", "joint"):  # a string such as "false" would read True
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"SecondOrderScore.{flag} must be True or False, got "
                                 f"{getattr(self, flag)!r}")

    def statistics(self, param: Tensor) -> dict[str, Tensor]:
        rows, length = _rows(param)
        size = fisher_block(length, self.block_size)
        return {"fisher": torch.zeros(rows, length // size, size, size,
                                      dtype=statistics_dtype(param), device=param.device)}

    @torch.no_grad()
    def observe(self, statistics: dict[str, Tensor], weight: Tensor, gradient: Tensor,
                count: int) -> None:
        fisher = statistics["fisher"]
        size = fisher.shape[-1]
        blocks = finite(gradient.to(fisher.dtype)).reshape(-1, size)  # (blocks, B)
        fisher.view(-1, size, size).baddbmm_(blocks[:, :, None], blocks[:, None, :])

    def damped(self, statistics: dict[str, Tensor], count: int,
               blocks: Tensor | None = None) -> Tensor:
        """``F`` per block, float64, ``(blocks, B, B)`` (all of them, or the flat indices
        ``blocks``): the mean of the observed outer products plus ``damp`` times the block's
        mean diagonal (a block whose gradients were all zero, a dead neuron's, takes the
        tensor's mean, else 1)."""
        if count < 1:
            raise ValueError("the second-order score needs at least one observed gradient")
        fisher = statistics["fisher"]
        size = fisher.shape[-1]
        fisher = fisher.view(-1, size, size)
        scale = fisher.diagonal(dim1=-2, dim2=-1).to(torch.float64).mean(-1) / count
        positive = scale > 0
        fallback = scale[positive].mean() if bool(positive.any()) else scale.new_tensor(1.0)
        scale = torch.where(positive, scale, fallback)
        if blocks is not None:
            fisher, scale = fisher[blocks], scale[blocks]
        damped = fisher.to(torch.float64) / count
        damped.diagonal(dim1=-2, dim2=-1).add_((self.damp * scale)[:, None])
        return damped

    def inverse(self, statistics: dict[str, Tensor], count: int,
                blocks: Tensor | None = None) -> Tensor:
        """``F^-1`` per block, float64, ``(blocks, B, B)`` (:meth:`damped`'s)."""
        damped = self.damped(statistics, count, blocks)
        factor, info = torch.linalg.cholesky_ex(damped)
        if bool((info != 0).any()):  # not positive definite in float64: a larger damp
            damped.diagonal(dim1=-2, dim2=-1).add_(
                damped.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True))
            factor = torch.linalg.cholesky(damped)
        return torch.cholesky_inverse(factor)

    def __call__(self, statistics: dict[str, Tensor], weight: Tensor, count: int) -> Tensor:
        w = weight.to(torch.float64).reshape(-1, statistics["fisher"].shape[-1])
        if self.joint:  # 1/2 w_q (F w)_q: summed over whole Fisher blocks, 1/2 w^T F w
            saliency = 0.5 * w * (self.damped(statistics, count) @ w[:, :, None]).squeeze(2)
        else:
            diagonal = self.inverse(statistics, count).diagonal(dim1=-2, dim2=-1)
            saliency = w.square() / (2 * diagonal)
        return saliency.reshape(weight.shape).to(statistics_dtype(weight))

    @torch.no_grad()
    def compensate(self, statistics: dict[str, Tensor], weight: Tensor, pruned: Tensor,
                   count: int) -> Tensor:
        """The weights after the OBS update for removing the entries ``pruned`` (bool, like
        ``weight``): ``w - F^-1 E_Q ([F^-1]_QQ)^-1 w_Q`` per Fisher block, so the pruned
        entries become zero and the others make up for them. ``pruned`` is every entry
        that is zero afterwards: one an earlier update pruned (w_q = 0) is in Q so that it
        stays at zero (the optimum of 1/2 dw^T F dw under every constraint dw_q = -w_q)."""
        size = statistics["fisher"].shape[-1]
        chosen = pruned.reshape(-1, size)
        w = weight.to(torch.float64).reshape(-1, size)
        touched = (chosen & (w != 0)).any(1).nonzero().squeeze(1)  # blocks that remove some w
        if len(touched) == 0:
            return weight.clone()
        if count < size:
            warnings.warn(f"SecondOrderScore: an OBS weight update from {count} gradients, "
                          f"fewer than the {size} entries of a Fisher block: the empirical "
                          f"Fisher is rank-deficient there, and the update can cost more than "
                          f"none; observe at least {size} steps between mask updates "
                          f"(frequency), or set block_size <= {count} or update_weights=False",
                          stacklevel=2)
        block_inverse = self.inverse(statistics, count, touched)
        q = chosen[touched].to(torch.float64)
        # [F^-1]_QQ on Q, identity elsewhere: the solve gives x_Q = ([F^-1]_QQ)^-1 w_Q, 0 off Q
        system = block_inverse * (q[:, :, None] * q[:, None, :]) + torch.diag_embed(1 - q)
        x = torch.linalg.solve(system, (w[touched] * q)[:, :, None])
        updated = w.clone()
        updated[touched] -= (block_inverse @ x).squeeze(2)
        updated[touched] = torch.where(q.bool(), 0.0, updated[touched])
        return updated.view(weight.shape).to(weight.dtype)
