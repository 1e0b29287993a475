"""What a fit's start checks and says beside the callback's hooks: the fit's problems (a
fused step that cannot serve, a schedule that does not fit the run, compress=True with
nothing compressed), the schedule's warnings, the products' dtype under a precision, and
the one-line counts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from sparse_training.engine.dynamic import make_updater
from sparse_training.engine.optimizer_hooks import fused_problem
from sparse_training.engine.ownership import shared_tensor
from sparse_training.engine.protocol import CompressedLayer
from sparse_training.pieces.schedules import Gradual
from sparse_training.pieces.training_scores import TrainingScore

if TYPE_CHECKING:
    from sparse_training.config import SparsityConfig
    from sparse_training.engine import SparsityEngine
    from sparse_training.engine.plan import SparsityPlan

# what reading SparsityCallback.engine says where no fit trained with it in this process
NO_ENGINE = ("SparsityCallback has no engine in this process: no fit trained with it here. Add "
             "it to a Trainer and fit; a strategy that starts its processes in fit "
             "(strategy='ddp_spawn', 'ddp_fork', 'ddp_notebook') trains in those processes and "
             "sends back only the model's weights and the logged metrics "
             "(trainer.callback_metrics['sparsity/global']), not the engine nor the masks: use "
             "strategy='ddp', or resume from the fit's checkpoint (docs/distributed.md, "
             "'ddp_spawn')")
MIN_GRADUAL_UPDATES = 3  # fewer and a gradual schedule is a few jumps: warn
# the dtype of the layers' products under each Lightning precision (autocast's for mixed)
PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                    "16-mixed": torch.float16, "16-true": torch.float16,
                    "32-true": torch.float32, "64-true": torch.float64}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype of the products under a Lightning ``precision`` (``trainer.precision``);
    None for others (transformer-engine, bitsandbytes): the weights' dtype then."""
    return PRECISION_DTYPES.get(str(precision))


def fit_problem(config: SparsityConfig, plan: SparsityPlan, optimizers: list[Optimizer],
                total: int | None, restored: dict[str, Any] | None) -> str | None:
    """What this fit's optimizers and length refuse before any mask is made: a fused
    step that cannot serve an optimizer of the sparse weights, a schedule (or regrowth, or
    a training score's update frequency) that does not fit ``total`` steps, found by
    starting a new updater of the settings, which touches no model (a restored schedule
    keeps its checkpoint's steps)."""
    if config.fused is True:
        sparse = {id(t.param) for _, t in plan.masked}
        dense_state = config.parsed_refinement is not None
        for optimizer in optimizers:
            held = (p for group in optimizer.param_groups for p in group["params"])
            if any(id(p) in sparse for p in held) and (
                    reason := fused_problem(dense_state, optimizer)):
                return f"fused=True {reason}"
    learners = {f"score={config.parsed_score.name!r}": "score='magnitude'"} if isinstance(
        config.parsed_score, TrainingScore) else {}
    if config.regrow == "rigl":
        learners["regrow='rigl'"] = "regrow='set'"
    if learners and (frozen := [p.name for p, t in plan.masked if not t.param.requires_grad]):
        return (f"{' and '.join(learners)} {'need' if len(learners) > 1 else 'needs'} the "
                f"gradients of the tensors pruned, but {frozen} are frozen (requires_grad="
                f"False) and get none: deny them, unfreeze them, or use "
                f"{' and '.join(learners.values())}")
    if restored is None:
        try:
            make_updater(config.parsed_schedule, config.parsed_score, config.parsed_regrowth,
                         config.parsed_refinement).start(total)
        except ValueError as error:
            steps = "" if total is None else f" (over the {total} steps of this fit)"
            return f"{error}{steps}"
    return None


def uncompressed_problem(config: SparsityConfig, plan: SparsityPlan, model: nn.Module,
                         compress_ran: bool) -> str | None:
    """``compress=True`` where nothing was compressed: the model had no weights at setup
    and its ``configure_model`` did not call :meth:`SparsityCallback.compress
    <sparse_training.SparsityCallback.compress>`."""
    if config.compress is not True or compress_ran or not plan.masked or any(
            isinstance(m, CompressedLayer) for m in model.modules()):
        return None
    return ("compress=True but the model had no weights at setup and configure_model "
            "compressed none of the layers it built: call SparsityCallback.compress(self) "
            "there, before fully_shard (or use compress='auto' or False)")


def schedule_warnings(config: SparsityConfig, updater: Any, total: int | None
                      ) -> Iterator[str]:
    """What a fit of ``total`` steps should hear about the resolved schedule: regrowth
    that never runs, a last update after the last step, a gradual ramp of too few
    updates."""
    schedule = updater.schedule
    regrowth = getattr(updater, "regrowth", None)  # resolved to steps by the updater
    if (regrowth is not None and isinstance(regrowth.end, int)
            and regrowth.end <= schedule.start):
        yield (f"regrow={config.regrow!r} drops and grows from step {schedule.start} until "
               f"step {regrowth.end} (regrow_end={config.regrow_end!r}), so never; give a "
               f"later regrow_end")
    updates = schedule.updates()
    if total is not None and updates[-1] >= total:
        yield (f"the schedule's last update (step {updates[-1]}) comes after the last "
               f"training step ({total - 1}); the final sparsity will not be reached")
    elif isinstance(schedule, Gradual) and len(updates) < MIN_GRADUAL_UPDATES:
        yield (f"only {len(updates)} mask updates fit between start={schedule.start} and "
               f"end={schedule.end} at frequency={schedule.frequency}: the "
               f"{schedule.name!r} schedule is a jump; lower frequency for a gradual ramp")


def placeholder(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is Lightning's stand-in for ``configure_optimizers`` returning
    None: it holds plain tensors, no ``nn.Parameter``."""
    return not any(isinstance(p, nn.Parameter) for group in optimizer.param_groups
                   for p in group["params"])


def counts(engine: SparsityEngine) -> str:
    """``"4 masked-dense and 13 compressed"``: the tensors the engine keeps sparse."""
    return f"{len(engine.masked)} masked-dense and {len(engine.compressed)} compressed"


def summary(engine: SparsityEngine) -> str:
    """The end-of-fit line: the share pruned, of how many weights, the targets, the last
    mask update."""
    return (f"{engine.sparsity:.2%} of {engine.weights:,} weights in {counts(engine)} tensors are "
            f"pruned (target now {engine.target:.2%}, final {engine.final_sparsity:.2%}); "
            f"last mask update at step {engine.updater.last_update}")


def unused_warning(engine: SparsityEngine, optimizer: Optimizer) -> str | None:
    """After the first backward: the selected tensors of ``optimizer`` that got no gradient
    (unused by the loss, like a pooler), or None."""
    unused = [s.name for s in engine.slots_of(optimizer)
              if not s.compressed and s.param.grad is None]
    if not unused:
        return None
    return (f"{len(unused)} selected tensors got no gradient in the first step (unused by the "
            f"loss, like a pooler?): {unused}; deny them to keep them dense and out of the "
            f"sparsity figures")


def overlap_problem(callbacks: Sequence[object],
                    plans: Sequence[SparsityPlan | None]) -> str | None:
    """One owner per tensor: the first tensor two of ``callbacks`` (the SparsityCallbacks
    of one Trainer, with their ``plans`` of its module) would both hold, naming both, or
    None."""
    shared = shared_tensor(plans)
    if shared is None:
        return None
    name, i, j = shared
    return (f"tensor {name!r} is selected by two callbacks, {callbacks[i]!r} and "
            f"{callbacks[j]!r} (SparsityCallbacks {i + 1} and {j + 1} of the Trainer); a "
            f"tensor has one owner: give them disjoint selections (allow/deny)")
