"""Scores: what a mask update ranks. Every score has one signature::

    score(tensor: Scored, step: int, stream: int) -> Tensor | None

``tensor`` is what the score reads of a sparse tensor (:class:`Scored`: the engine's slots
answer it); the result is shaped like ``tensor.dense_shape``, or None for the mask
functions' default, the magnitude ``|w|``. Random draws depend on (seed, step, stream) only,
so every rank, and a tensor whether it trains masked-dense or compressed, draws the same.

- :class:`MagnitudeScore`: keep the largest ``|w|`` (magnitude pruning, the default).
- :class:`RandomScore`: a seeded random ranking (static sparse training; SET's growth,
  Mocanu et al. 2018).
- :class:`GradientScore`: the dense gradient ``|g|`` (RigL's growth, Evci et al. 2020).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class Scored(Protocol):
    """What a score reads of a sparse tensor."""

    @property
    def dense_shape(self) -> torch.Size:
        """The shape of the dense weight (the scores')."""

    @property
    def device(self) -> torch.device:
        """Where the weight lives."""

    @property
    def dense_gradient(self) -> Tensor | None:
        """The gradient at every dense position, pruned ones included, or None."""


class Score(Protocol):
    """A score: ``score(tensor, step, stream) -> Tensor | None`` (module docstring)."""

    def __call__(self, tensor: Scored, step: int, stream: int) -> Tensor | None: ...


@dataclass(frozen=True)
class DenseWeight:
    """A dense weight as a score reads it, before any training step (no gradient)."""

    weight: Tensor

    @property
    def dense_shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dense_gradient(self) -> None:
        return None


@dataclass(frozen=True)
class MagnitudeScore:
    """Keep the largest ``|w|``: None, the mask functions' default."""

    def __call__(self, tensor: Scored, step: int, stream: int) -> None:
        return None


@dataclass(frozen=True)
class RandomScore:
    """Uniform scores from a stream fixed by (``seed``, step, stream): equal on every rank."""

    seed: int = 0

    def __call__(self, tensor: Scored, step: int, stream: int) -> Tensor:
        return random_scores(tensor.dense_shape, self.seed, step, stream, tensor.device)


@dataclass(frozen=True)
class GradientScore:
    """The dense gradient; growth ranks its magnitude ``|g|``."""

    def __call__(self, tensor: Scored, step: int, stream: int) -> Tensor | None:
        return tensor.dense_gradient


def random_scores(shape: torch.Size, seed: int, step: int, stream: int,
                  device: torch.device) -> Tensor:
    """Uniform scores from a stream fixed by (seed, step, stream): equal on every rank."""
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * 1_000_003 + step) * 1_000_033 + stream) % 2**63)
    return torch.rand(shape, generator=generator, device=device)
