"""FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``) over 2 processes: masks of
the whole tensors equal to one process's at every step, exact counts, pruned weights zero
in every local shard, and a sharded (distributed) checkpoint that resumes exactly.

The reference is one process training the same model on the same data: the two ranks'
batches of a step as two micro-batches (``accumulate_grad_batches=2``). That gives the
same gradients bit for bit: FSDP averages the ranks' gradients, (g0 + g1) / 2,
accumulation sums (loss0 / 2)' + (loss1 / 2)', and halving is exact in floating point, so
both are g0 / 2 + g1 / 2. Every process runs one CPU thread (a CPU matmul's rounding
depends on its thread count; Lightning would give rank 0 one thread and rank 1 two), so
masks and weights are compared for equality, not closeness. On CPU the ranks talk over
gloo; the same runs on 2 GPUs (NCCL) are skipped here unless two are visible
(``python tests/fsdp_sharded.py OUT gpu``).

Lightning's FSDPStrategy (FSDP1) refuses ``accelerator="cpu"`` ("The strategy `fsdp`
requires a GPU accelerator"); the callback and the engine refuse FSDP1 everywhere (its
parameters are 1-D shards), which is tested without it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from sparse_training import SparsityCallback
from sparse_training.kernels._triton import interpret_mode
from sparse_training.layers.blocks import dense_state_dict
from sparse_training.layers.slim import SlimLinear
from sparse_training.pieces.units import COLUMNS, ROWS

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import make_loader, two_process_problem  # noqa: E402
from fsdp_sharded import NETS, RUNS, WIDTHS, Recorder, ShardedNet, SlimNet, fit  # noqa: E402

SCRIPT = Path(__file__).parents[1] / "fsdp_sharded.py"
ACCELERATORS = ["cpu", "gpu"]
OUTS: dict[str, Path] = {}  # accelerator -> the folder of its runs' checkpoints


def missing(accelerator: str) -> str | None:
    """Why FSDP2 over 2 processes cannot run here, naming the missing piece, or None."""
    if problem := two_process_problem(accelerator):
        return (problem if accelerator == "cpu" else
                f"{problem}: run `python tests/fsdp_sharded.py OUT gpu` on a 2-GPU machine")
    try:
        from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as error:
        return f"FSDP2 is missing: {error}"
    return None


@pytest.fixture(scope="module", params=ACCELERATORS)
def sharded(request, tmp_path_factory):
    """The two ranks' records of every run, and the accelerator."""
    if reason := missing(request.param):
        pytest.skip(reason)
    out = OUTS[request.param] = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"  # else Lightning gives rank 0 one thread, rank 1 all
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), request.param], env=env,
                          timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, request.param


class TwoRanksInOne(Sampler):
    """The indices the 2 ranks' DistributedSamplers deal (Lightning shuffles a training
    set by (seed, epoch)), in one stream: per step rank 0's batch of 16, then rank 1's."""

    def __init__(self, dataset, batch_size: int = 16) -> None:
        self.ranks = [DistributedSampler(dataset, num_replicas=2, rank=r) for r in (0, 1)]
        self.batch_size = batch_size

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it at every epoch start
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    def __iter__(self):
        rank0, rank1 = (list(sampler) for sampler in self.ranks)
        for start in range(0, len(rank0), self.batch_size):
            yield from rank0[start:start + self.batch_size]
            yield from rank1[start:start + self.batch_size]

    def __len__(self) -> int:
        return sum(map(len, self.ranks))


def reference_loader() -> DataLoader:
    data = make_loader(n=128).dataset
    return DataLoader(data, batch_size=16, sampler=TwoRanksInOne(data))


_REFERENCES: dict[tuple[str, str], Recorder] = {}


def reference(name: str, accelerator: str) -> list[dict]:
    """One process's records of run ``name``."""
    return reference_fit(name, accelerator).rows


def reference_fit(name: str, accelerator: str) -> Recorder:
    """One process's run ``name`` (its records and model)."""
    kernels = RUNS[name].get("fused") or RUNS[name].get("compress")
    if accelerator == "cpu" and kernels and not interpret_mode():
        pytest.skip("the one-process reference runs Triton kernels on CPU tensors: needs "
                    "TRITON_INTERPRET=1 (the default without a CUDA GPU)")
    if (name, accelerator) not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank: a CPU matmul rounds by its thread count
        try:
            _REFERENCES[name, accelerator] = fit(
                RUNS[name], reference_loader(), accelerator=accelerator, strategy="auto",
                devices=1, accumulate_grad_batches=2, net=NETS.get(name, ShardedNet),
                **({"widths": WIDTHS[name]} if name in WIDTHS else {}))
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[name, accelerator]


def _logical(rows: list[dict]) -> list[dict]:
    """What must match one process: steps, whole masks, counts, parameters, zeros."""
    return [{k: v for k, v in row.items() if k not in ("local_shapes", "local_blocks",
                                                       "sharded")}
            for row in rows]


@pytest.mark.parametrize("run, masks_seen", [("2:4", 2), ("gmp", 4), ("block", 3),
                                             ("rigl", 4), ("2:4 fused", 2), ("rigl fused", 4),
                                             ("second-order", 3), ("movement", 3)])
def test_sharded_masks_equal_one_process_at_every_step(sharded, run, masks_seen):
    (rank0, rank1), accelerator = sharded
    rows = rank0[run]
    assert len(rows) == 1 + 8  # before training, then 4 steps x 2 epochs
    assert _logical(rows) == _logical(rank1[run])  # the same whole masks on both ranks
    assert _logical(rows) == _logical(reference(run, accelerator))  # and one process's
    assert all(row["zeros_hold"] for row in rank0[run] + rank1[run])  # in each local shard
    assert len({tuple(row["checksums"]) for row in rows}) == masks_seen  # masks moved
    assert all(rows[0]["sharded"])
    assert all(row["fused"] == run.endswith("fused") for row in rows[1:])  # the kernel's path
    assert set(rows[0]["kinds"]) == {"Linear"}  # the setup table's type, not FSDPLinear
    # each rank holds its shard of each mask: the 5-row head splits 3 + 2 (8-row blocks
    # leave it out: the 24-row layer is the last)
    assert rows[0]["local_shapes"][-1][0] + rank1[run][0]["local_shapes"][-1][0] == (
        24 if run in ("block", "movement") else 5)
    if run.startswith("rigl"):  # drop and grow keeps every tensor's count exactly
        assert all(row["counts"] == rows[1]["counts"] for row in rows[1:])
        assert len({row["parameters"] for row in rows}) == len(rows)


def test_sharded_checkpoint_resumes_exactly(sharded):
    """RigL stopped after the first epoch with a distributed checkpoint (a directory of
    shards and the callback's state), resumed in a new Trainer: the same masks, weights
    and optimizer-driven steps as the run that never stopped."""
    (rank0, rank1), _ = sharded
    for rank in (rank0, rank1):
        for run in ("rigl", "second-order"):  # the second-order Fisher saved between updates
            whole = rank[run]
            assert _logical(rank[f"{run}-stopped"]) == _logical(whole[:5])
            assert _logical(rank[f"{run}-resumed"]) == _logical(whole[4:])


def test_compressed_values_sharded_along_kept_blocks_train_and_resume_exactly(sharded):
    """compress=True under FSDP2: the BlockSparseLinear layers swapped in at setup have
    their values sharded by fully_shard along the kept blocks (1 + 1 and 2 + 2 of 2 and 4),
    train to the same weights as one process at every step, and a sharded checkpoint
    resumes the second epoch exactly."""
    (rank0, rank1), accelerator = sharded
    rows = rank0["compressed"]
    assert len(rows) == 1 + 8
    assert _logical(rows) == _logical(rank1["compressed"])
    assert _logical(rows) == _logical(reference("compressed", accelerator))
    assert len({row["parameters"] for row in rows}) == len(rows)  # the values train
    assert len({tuple(row["block_checksums"]) for row in rows}) == 1  # blocks stay put
    assert rows[0]["local_blocks"] == rank1["compressed"][0]["local_blocks"] == [1, 2]
    assert rows[0]["checksums"] == []  # the head cannot take 16x16 blocks: not selected
    for rank in (rank0, rank1):
        assert _logical(rank["compressed-stopped"]) == _logical(rank["compressed"][:5])
        assert _logical(rank["compressed-resumed"]) == _logical(rank["compressed"][4:])


def test_compressed_training_steps_issue_no_collectives_of_their_own(sharded):
    """After the first step, a training step of compressed layers with fixed blocks
    (forward, backward, optimizer step and the callback's hooks) issues only FSDP2's own
    collectives: none of the c10d or functional-collective ops a TorchDispatchMode sees on
    either rank was issued by sparse_training (its innermost frame outside torch), and
    FSDP2's all-gathers and reduce-scatters show the count works."""
    (rank0, rank1), _ = sharded
    for rank in (rank0, rank1):
        seen = rank["compressed collectives"]
        assert seen["total"] > 0, seen  # FSDP2's all-gathers and reduce-scatters
        assert seen["from_sparse_training"] == [], seen["from_sparse_training"][:5]


def test_compressed_blocks_moved_by_rigl_across_shards_as_in_one_process(sharded):
    """RigL on compressed layers whose values are sharded: at each update every rank gathers
    the values, gradients and AdamW moments, moves the blocks alike and keeps its slice. The
    whole block grids and parameters equal one process's at every step, on both ranks, and
    a sharded checkpoint after the first epoch resumes the second exactly."""
    (rank0, rank1), accelerator = sharded
    rows = rank0["compressed rigl"]
    assert _logical(rows) == _logical(rank1["compressed rigl"])
    assert _logical(rows) == _logical(reference("compressed rigl", accelerator))
    assert len({tuple(row["block_checksums"]) for row in rows}) > 2  # blocks moved, twice+
    assert rows[0]["local_blocks"] == [2, 5]  # of 3 and 9 blocks: 2 + 1 and 5 + 4
    assert rank1["compressed rigl"][0]["local_blocks"] == [1, 4]
    assert all(row["counts"] == [] for row in rows)  # nothing trains masked-dense
    for rank in (rank0, rank1):
        assert _logical(rank["compressed rigl-stopped"]) == _logical(rank["compressed rigl"][:5])
        assert _logical(rank["compressed rigl-resumed"]) == _logical(rank["compressed rigl"][4:])


def test_sharded_compressed_checkpoint_consolidates_and_loads_into_the_plain_model(sharded):
    """The distributed checkpoint the compressed run saved after its first epoch,
    consolidated by torch's ``dcp_to_torch_save`` (Lightning's consolidate_checkpoint reads
    FSDPStrategy's layout only), holds exactly the parameters the run had then (their
    hash), and ``dense_state_dict`` loads it strictly into the model with plain Linear
    layers: zeros outside the kept blocks."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (rank0, _), accelerator = sharded
    folder = OUTS[accelerator]
    dcp_to_torch_save(folder / "compressed.ckpt", folder / "consolidated.pt")
    state = torch.load(folder / "consolidated.pt", map_location="cpu",
                       weights_only=False)["state_dict"]
    digest = hashlib.sha256()  # as the runs hash their parameters, in the module's order
    for key in ("net.0.values", "net.0.bias", "net.2.values", "net.2.bias", "net.4.weight",
                "net.4.bias"):
        digest.update(state[key].contiguous().numpy().tobytes())
    assert digest.hexdigest() == rank0["compressed-stopped"][-1]["parameters"]
    plain = ShardedNet(WIDTHS["compressed"])
    plain.load_state_dict(dense_state_dict(state, plain))  # strict
    for i in (0, 2):
        kept = state[f"net.{i}.block_mask"].repeat_interleave(16, 0).repeat_interleave(16, 1)
        weight = plain.net[i].weight
        assert not weight[~kept].any() and weight[kept].count_nonzero() == kept.sum()


def test_compressed_layers_built_in_configure_model_train_as_those_built_before(sharded):
    """Layers that join the model in configure_model, compressed there before fully_shard
    (SparsityCallback.compress), train exactly as the layers setup swapped: the same
    whole masks, weights and local blocks at every step, on both ranks."""
    (rank0, rank1), _ = sharded
    for rank in (rank0, rank1):
        assert rank["compressed in configure_model"] == rank["compressed"]


def test_slim_layers_train_sharded_as_in_one_process_and_resume_exactly(sharded):
    """Heads and FFN neurons compressed into SlimLinear layers (q, k, v and fc1 keep their
    kept rows, o and fc2 their kept columns), each sharded by fully_shard along its kept
    rows: the same weights as one process at every step on both ranks, and a sharded
    checkpoint after the first epoch resumes the second exactly."""
    (rank0, rank1), accelerator = sharded
    rows = rank0["slim"]
    assert len(rows) == 1 + 8
    assert _logical(rows) == _logical(rank1["slim"])
    assert _logical(rows) == _logical(reference("slim", accelerator))
    assert len({row["parameters"] for row in rows}) == len(rows)  # the kept weights train
    assert len({tuple(row["block_checksums"]) for row in rows}) == 1  # the bands stay put
    # q, k, v (2 of 4 heads of 4: 8 rows), o (8 rows), fc1 (9 of 18 neurons), fc2 (8 rows)
    assert rows[0]["local_blocks"] == [4, 4, 4, 4, 5, 4]
    assert rank1["slim"][0]["local_blocks"] == [4, 4, 4, 4, 4, 4]
    for rank in (rank0, rank1):
        assert _logical(rank["slim-stopped"]) == _logical(rank["slim"][:5])
        assert _logical(rank["slim-resumed"]) == _logical(rank["slim"][4:])


def test_slim_full_state_dict_is_dense_with_zeros_and_loads_back(sharded):
    """The full state dict of the sharded slim model (get_model_state_dict,
    full_state_dict=True) equals one process's: every SlimLinear's weight and bias in the
    dense shape, zero exactly at the removed rows or columns; it loads strictly into the
    plain model, which computes the same; and set_model_state_dict of it into the sharded
    model, after every weight and kept band there was changed, restores the parameters,
    the bands and the state dict on every rank."""
    (rank0, rank1), accelerator = sharded
    for rank in (rank0, rank1):
        assert rank["slim round trip"] == {"changed": True, "parameters": True,
                                           "bands": True, "state_dict": True}
    state = torch.load(OUTS[accelerator] / "slim-full.pt", weights_only=True)
    one_process = reference_fit("slim", accelerator).model.cpu()
    expected = one_process.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) for key in state), "not one process's"
    slim = {name: m for name, m in one_process.named_modules() if isinstance(m, SlimLinear)}
    assert {m.axis for m in slim.values()} == {ROWS, COLUMNS}
    for name, layer in slim.items():
        weight, bias = state[f"{name}.weight"], state[f"{name}.bias"]
        assert weight.shape == (layer.out_features, layer.in_features)
        kept = torch.zeros(weight.shape[layer.axis], dtype=torch.bool)
        kept[layer.kept_index] = True
        kept = kept[:, None] if layer.axis == ROWS else kept[None, :]
        assert not weight[~kept.expand_as(weight)].any(), name
        assert weight[kept.expand_as(weight)].count_nonzero() == kept.sum() * weight.shape[
            1 - layer.axis], name
        if layer.axis == ROWS:
            assert not bias[~kept.flatten()].any() and bias[kept.flatten()].all(), name
    plain = SlimNet(WIDTHS["slim"])
    plain.load_state_dict(state)  # strict
    assert not any(isinstance(m, SlimLinear) for m in plain.modules())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), one_process(x))


def test_sharded_masks_checked_across_ranks_and_made_permanent(sharded):
    """A rank computing another whole mask is caught on every rank; ``make_permanent``
    removes the mask buffers of sharded tensors (shaped like their local shards)."""
    (rank0, rank1), _ = sharded
    for after in (rank0["after"], rank1["after"]):
        assert after == {"mismatch_caught": True, "masks_left": []}


def test_sharding_refuses_what_it_cannot_serve(sharded):
    (rank0, rank1), _ = sharded
    for refused in (rank0["refused"], rank1["refused"]):
        assert "SR-STE keeps dense weights" in refused["sr-ste"]
        # SemiStructuredLinear: its whole dense mask (SlimLinear layers train sharded)
        assert "2:4 layers ['net.0.weight', 'net.2.weight'] have sharded (FSDP2)" in (
            refused["2:4 compressed"])
        assert "exp_avg is a plain tensor of local shape (32, 16) for a parameter sharded" in (
            refused["plain state"])
        assert "FSDP1 (FullyShardedDataParallel" in refused["fsdp1"]


def test_callback_refuses_lightning_fsdp1_strategy():
    """FSDPStrategy (FSDP1) flattens parameters; the callback says to use FSDP2 before it
    touches the model. Lightning refuses FSDPStrategy on CPU, so it is checked here
    without a Trainer."""
    from pytorch_lightning.strategies import FSDPStrategy

    sparse = SparsityCallback(pattern="2:4")
    with pytest.raises(ValueError, match="ModelParallelStrategy with fully_shard"):
        sparse.on_fit_start(SimpleNamespace(strategy=FSDPStrategy()), torch.nn.Linear(8, 8))
    assert sparse.engine is None


def test_setup_table_type_undoes_fsdp_and_parametrize_in_either_order():
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.utils import parametrize

    from sparse_training.engine.tensors import original_class

    layer = nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", nn.Identity())
    parametrized = type(layer)  # ParametrizedLinear(Linear), as torch builds it
    sharded_after = type("FSDPParametrizedLinear", (FSDPModule, parametrized), {})
    fsdp_linear = type("FSDPLinear", (FSDPModule, nn.Linear), {})
    parametrized_after = type("ParametrizedFSDPLinear", (fsdp_linear,), {})
    for cls in (parametrized, sharded_after, fsdp_linear, parametrized_after):
        assert original_class(cls) is nn.Linear, cls.__name__
    assert original_class(nn.Linear) is nn.Linear
