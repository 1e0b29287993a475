"""The one Slot protocol over its three storages: masked-dense, block-sparse and 2:4.

Each slot is read and written only through the protocol here, and checked against what the
layer or the parameter itself holds."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from sparse_training import BlockSparseLinear, SemiStructuredLinear, SparsityConfig, SparsityEngine
from sparse_training.engine.protocol import Slot
from sparse_training.pieces.masks import pattern_mask

OUT, IN = 48, 40  # odd block tails for 16x16 blocks: 3 x 3 blocks, the last column 8 wide
BLOCK = (16, 16)


def _masked() -> Slot:
    model = nn.Sequential(nn.Linear(IN, OUT))
    (slot,) = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5)).slots
    return slot


def _block() -> Slot:
    layer = BlockSparseLinear(IN, OUT, BLOCK, density=0.5)
    return layer.slot("layer.values")


def _two_four() -> Slot:
    return SemiStructuredLinear(IN, OUT).slot("layer.weight")


STORAGES = {"masked-dense": _masked, "block-sparse": _block, "2:4": _two_four}


def _new_mask(slot: Slot) -> torch.Tensor:
    """Another valid mask for the slot: the same count, other positions."""
    if slot.grid_pattern.is_nm:
        return pattern_mask(torch.randn(slot.dense_shape), slot.grid_pattern.spec)
    old = slot.full_mask()
    return old.flatten()[torch.randperm(old.numel())].view_as(old)


def _dense_mask(grid: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The mask of the dense weight: ``grid`` itself, or a block grid's blocks, cropped."""
    if grid.shape == shape:
        return grid
    expanded = grid.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return expanded[:shape[0], :shape[1]]


@pytest.fixture(params=sorted(STORAGES))
def slot(request) -> Slot:
    torch.manual_seed(0)
    return STORAGES[request.param]()


def test_every_storage_answers_the_whole_protocol(slot):
    members = [name for name in dir(Slot) if not name.startswith("_")]
    members += list(inspect.get_annotations(Slot))
    assert [m for m in members if not hasattr(slot, m)] == []
    for method in ("set_mask", "attach", "sparsity", "grow_scores"):
        assert (list(inspect.signature(getattr(slot, method)).parameters)
                == list(inspect.signature(getattr(Slot, method)).parameters)[1:])


def test_regrowth_sees_one_grid_per_slot(slot):
    grid = slot.full_mask()
    assert grid.dtype == torch.bool
    assert slot.drop_scores().shape == grid.shape
    assert slot.grow_scores(torch.randn(slot.dense_shape)).shape == grid.shape


def test_set_mask_writes_the_weight_and_restarts_the_optimizer_state(slot):
    optimizer = torch.optim.Adam([slot.param], lr=0.1)
    slot.param.grad = torch.randn_like(slot.param)
    optimizer.step()
    slot.attach(optimizer, dense_state=False)
    before = slot.full_mask().clone()
    new = _new_mask(slot)
    slot.set_mask(new, [optimizer])
    assert torch.equal(slot.full_mask(), new)
    forward = slot.forward_weight().detach()
    assert forward.shape == slot.dense_shape
    dense = _dense_mask(new, slot.dense_shape)
    assert not forward[~dense].any()  # pruned entries are zero in the forward weight
    assert slot.sparsity(int(new.sum())) == pytest.approx(1 - float(dense.float().mean()))
    grown = new & ~before
    for state in optimizer.state[slot.param].values():
        if state.shape != slot.param.shape:
            continue
        if slot.grid_pattern.block_rows * slot.grid_pattern.block_cols == 1 and not (
                slot.compressed and slot.movable):  # a mask of the weight's own entries
            assert not state[grown].any() and not state[~new].any()
        else:  # the block grid: a grown block's values and state start at zero
            assert int((state.flatten(1).abs().sum(1) == 0).sum()) >= int(grown.sum())


def test_attach_and_detach_hand_the_gradient_mask_to_the_step_and_back():
    layer = SemiStructuredLinear(IN, OUT)
    slot = layer.slot("layer.weight")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    slot.attach(optimizer, dense_state=False)
    assert slot.enforced and layer.masks_gradient is False
    slot.detach()
    assert layer.masks_gradient is True


def test_the_engine_keeps_one_list_of_slots_in_model_order():
    model = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, IN))
    model[2] = BlockSparseLinear.from_dense(model[2], (16, 16), density=0.5)
    engine = SparsityEngine(model, SparsityConfig("unstructured", sparsity=0.5))
    assert [s.name for s in engine.slots] == ["0.weight", "2.values"]
    assert engine.masked == engine.slots[:1] and engine.compressed == engine.slots[1:]
    assert engine.tensor_sparsity["2.values"] == pytest.approx(model[2].sparsity)
