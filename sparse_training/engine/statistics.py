"""What a training score has observed of each slot
(:mod:`sparse_training.pieces.training_scores`).

:class:`Statistics` keeps, per slot, the score's statistics of the tensor the optimizer
steps on (a sharded parameter's local shard; a block layer's kept blocks) and how many
steps it observed. The updater calls :meth:`Statistics.observe` between backward and the
optimizer step (gradients dense, reduced over ranks and unscaled: the same on every rank
for a replicated tensor, each rank's own shard for a sharded one), asks for ranks at mask
updates (computed on the local shard, then gathered: :meth:`Slot.drop_scores
<sparse_training.engine.protocol.Slot.drop_scores>`), and after every mask change either
restarts them (window scores) or lets them follow the mask as optimizer state does
(:meth:`carried`). The checkpoint keeps them whole (gathered rows of sharded tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from sparse_training.engine.protocol import Slot
from sparse_training.engine.sharding import gather_rows, local, shard_rows
from sparse_training.pieces.training_scores import TrainingScore


class Statistics:
    """Per-slot statistics of one training score.

    Args:
        score: the training score.
    """

    def __init__(self, score: TrainingScore) -> None:
        self.score = score
        self.tensors: dict[str, dict[str, Tensor]] = {}
        self.counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"Statistics({self.score!r}, {len(self.tensors)} tensors)"

    @torch.no_grad()
    def observe(self, slots: Iterable[Slot]) -> None:
        """One optimizer step of every slot with a gradient."""
        for slot in slots:
            gradient = slot.param.grad
            if gradient is None:
                continue
            weight = local(slot.param).detach()
            statistics = self._of(slot.name, weight)
            count = self.counts.get(slot.name, 0) + 1
            self.score.observe(statistics, weight, local(gradient), count)
            self.counts[slot.name] = count

    def _of(self, name: str, weight: Tensor) -> dict[str, Tensor]:
        """The statistics of ``name``, on ``weight``'s device and rows."""
        statistics = self.tensors.get(name)
        first = None if statistics is None else next(iter(statistics.values()))
        if first is None or first.shape[:1] != weight.shape[:1] or first.device != (
                weight.device):
            statistics = self._place(name, weight)
        return statistics

    def _place(self, name: str, weight: Tensor) -> dict[str, Tensor]:
        """The statistics of ``name`` on ``weight``'s device (restored ones moved there),
        or fresh ones for it."""
        restored = self.tensors.get(name)
        fresh = self.score.statistics(weight)
        if restored is not None and all(
                restored.get(k) is not None and restored[k].shape == v.shape
                for k, v in fresh.items()):
            fresh = {k: restored[k].to(v.device) for k, v in fresh.items()}
        else:
            self.counts[name] = 0
        self.tensors[name] = fresh
        return fresh

    def observed(self, slot: Slot) -> int:
        """Steps observed of ``slot`` since its statistics (re)started."""
        return self.counts.get(slot.name, 0)

    def ranks(self, slot: Slot) -> Tensor:
        """The score's ranks of ``slot``'s local tensor (larger kept).

        Raises:
            ValueError: nothing observed yet (no backward since the statistics started).
        """
        count = self.observed(slot)
        if count == 0:
            raise ValueError(
                f"score {self.score.name!r} ranks what training observed, but tensor "
                f"{slot.name!r} has had no gradient since its statistics started: the first "
                f"mask update must come after some training steps (start > 0, or a gradual "
                f"schedule); magnitude pruning needs none")
        weight = local(slot.param).detach()
        return self.score(self._of(slot.name, weight), weight, count)

    def compensate(self, slot: Slot, pruned: Tensor) -> None:
        """Move ``slot``'s local weights by the score's update for pruning ``pruned``
        (bool, like the local tensor), where the score has one (the second-order score's
        optimal-brain-surgeon update)."""
        compensate = getattr(self.score, "compensate", None)
        if compensate is None or not getattr(self.score, "update_weights", False) or (
                self.observed(slot) == 0):
            return
        with torch.no_grad():
            weight = local(slot.param)
            weight.copy_(compensate(self._of(slot.name, weight.detach()), weight, pruned,
                                    self.observed(slot)))

    def carried(self, slots: Iterable[Slot]) -> dict[str, list[Tensor]]:
        """The statistics that follow the masks of ``slots`` through a mask change, as
        optimizer state does (a run-long score's; a window score's restart instead:
        :meth:`changed`), on their weights' devices (restored or moved ones too)."""
        if self.score.window:
            return {}
        return {s.name: list(self._of(s.name, local(s.param).detach()).values())
                for s in slots if s.name in self.tensors}

    def changed(self, names: Iterable[str]) -> None:
        """After the masks of ``names`` changed: a window score's statistics restart."""
        if self.score.window:
            for name in names:
                self.tensors.pop(name, None)
                self.counts.pop(name, None)

    def restart(self) -> None:
        """Forget everything (a new run)."""
        self.tensors, self.counts = {}, {}

    def to(self, device: torch.device | str) -> None:
        """Move the statistics to ``device``; they go back to their weights' device at the
        next step that reads them, as restored ones do."""
        self.tensors = {name: {k: v.to(device) for k, v in stats.items()}
                        for name, stats in self.tensors.items()}

    # -- state ------------------------------------------------------------------------------
    def state_dict(self, slots: Sequence[Slot]) -> dict[str, Any]:
        """Every slot's statistics, whole (a sharded tensor's rows gathered: a collective),
        and counts."""
        by_name = {s.name: s for s in slots}
        tensors = {name: {k: gather_rows(v, by_name[name].param) for k, v in stats.items()}
                   for name, stats in self.tensors.items() if name in by_name}
        return {"score": self.score.name, "tensors": tensors, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any], slots: Sequence[Slot]) -> None:
        """Statistics of a :meth:`state_dict`: each rank keeps its rows of a sharded
        tensor's; they move to the weights' devices at the next step.

        Raises:
            ValueError: statistics of another score.
        """
        if state.get("score") != self.score.name:
            raise ValueError(f"the checkpoint's score statistics are of score "
                             f"{state.get('score')!r}, this run's score is "
                             f"{self.score.name!r}")
        by_name = {s.name: s for s in slots}
        self.tensors = {name: {k: shard_rows(v, by_name[name].param) for k, v in stats.items()}
                        for name, stats in state["tensors"].items() if name in by_name}
        self.counts = {k: v for k, v in state["counts"].items() if k in self.tensors}
