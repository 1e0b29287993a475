"""RigL and SET on compressed layers: blocks move inside a fixed count, values and optimizer
state move with them, and the blocks chosen are those masked-dense regrowth chooses."""

import pytest
import pytorch_lightning as pl
import torch
from conftest import BlockNet, assert_same_training, expanded, make_loader, make_trainer
from pytorch_lightning.callbacks import ModelCheckpoint

from sparse_training import BlockSparseLinear, SparsityCallback
from sparse_training.kernels.block_sparse import BlockTopology, values_to_dense
from sparse_training.pieces.masks import pattern_mask

REGROW = dict(pattern="block:16x16", sparsity=0.75, schedule="constant", frequency=2,
              regrow_fraction=0.5, regrow_end=1.0)


def test_a_block_move_carries_values_and_optimizer_state_and_zeroes_new_blocks():
    torch.manual_seed(0)
    # 40 x 48 weight: a 3 x 3 grid whose last block row hangs 8 rows over the edge
    layer = BlockSparseLinear(48, 40, block=(16, 16), density=0.5, dtype=torch.float64)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(7, 48, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    old_mask, old_dense = layer.block_mask.clone(), layer.to_dense().weight.detach()
    old_position = {tuple(rc): i for i, rc in enumerate(old_mask.nonzero().tolist())}
    old_state = {k: v.clone() for k, v in optimizer.state[layer.values].items()
                 if v.shape == layer.values.shape}
    kept, free = old_mask.nonzero().tolist(), (~old_mask).nonzero().tolist()
    new_mask = old_mask.clone()
    for (i, j), (k, m) in zip(kept[:2], free[-2:], strict=True):  # two blocks move
        new_mask[i, j], new_mask[k, m] = False, True

    layer.slot("layer.values").set_mask(new_mask, [optimizer])

    assert torch.equal(layer.block_mask, new_mask)
    expected = BlockTopology.from_block_mask(new_mask, 40, 48, (16, 16), nnz=layer.nnz)
    for field in ("row_offsets", "row_indices", "col_indices", "t_offsets", "t_row_indices",
                  "t_block_ids"):
        assert torch.equal(getattr(layer.topology, field), getattr(expected, field)), field
    for new, (i, j) in enumerate(new_mask.nonzero().tolist()):
        old = old_position.get((i, j))
        for name, state in old_state.items():
            moved = optimizer.state[layer.values][name][new]
            assert torch.equal(moved, state[old] if old is not None else torch.zeros_like(moved))
        if old is None:
            assert not layer.values[new].any()
    # the dense weight: the old one with the dropped blocks zeroed, the grown ones zero
    keep = expanded(layer)[:40, :48]  # the layer's block mask is new_mask (checked above)
    assert torch.equal(values_to_dense(layer.values, layer.topology),
                       torch.where(keep, old_dense, 0))
    x = torch.randn(5, 48, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ torch.where(keep, old_dense, 0).T + layer.bias)
    optimizer.step()  # the moved state fits the parameter


def fit(settings, max_epochs=2, ckpt_path=None, callbacks=(), init_seed=0, samples=128,
        **trainer_kwargs):
    """A fit of a BlockNet initialized from ``init_seed`` on ``samples`` samples in batches
    of 16: (model, callback); the trainer is ``model.trainer``."""
    pl.seed_everything(init_seed, verbose=False)
    model = BlockNet()
    sparse = SparsityCallback(**settings)
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    make_trainer([sparse, *callbacks], max_epochs=max_epochs, enable_checkpointing=saves,
                 **trainer_kwargs).fit(model, make_loader(n=samples), ckpt_path=ckpt_path)
    return model, sparse


@pytest.mark.parametrize("regrow, accumulate", [("rigl", 1), ("rigl", 2), ("set", 1)])
def test_compressed_regrowth_moves_the_blocks_masked_dense_regrowth_moves(regrow, accumulate):
    settings = dict(REGROW, regrow=regrow)
    dense, _ = fit(settings, samples=64, accumulate_grad_batches=accumulate)  # 2 x 4 batches
    # no moves: the first masks' count, set at setup (one step shows it holds)
    static, _ = fit(dict(REGROW, compress=True, regrow_end=0), max_epochs=1,
                    limit_train_batches=1)
    compressed, sparse = fit(dict(settings, compress=True), samples=64,
                             accumulate_grad_batches=accumulate)
    assert sparse.engine.updater.last_regrow is not None
    for i in (0, 2):
        layer = compressed.net[i]
        assert isinstance(layer, BlockSparseLinear)
        assert torch.equal(expanded(layer), dense.net[i].weight_mask)  # the same blocks
        assert layer.nnz == static.net[i].nnz  # the same count
        # the same weights: values and optimizer state followed their blocks
        torch.testing.assert_close(layer.weight, dense.net[i].weight, atol=1e-5, rtol=1e-4)
    assert not torch.equal(compressed.net[2].block_mask, static.net[2].block_mask)  # moved
    # reported: the zeros by structure (a grown block whose gradient is zero, feeding a
    # block column of net.2 with no kept block, holds zeros that are not counted)
    dropped = sum(int((~expanded(compressed.net[i])).sum()) for i in (0, 2))
    assert sparse.engine.sparsity == dropped / (16 * 64 + 64 * 64) == 0.75


class MasksAtFitStart(pl.Callback):
    """The compressed layers' block masks once SparsityCallback's ``on_fit_start`` (it runs
    first) installed the restored state, before the first step."""

    def on_fit_start(self, trainer, pl_module):
        self.masks = [pl_module.net[i].block_mask.clone() for i in (0, 2)]


@pytest.mark.parametrize(("regrow", "resume_from"), [("rigl", "file"), ("set", "file"),
                                                    ("rigl", "last")])
def test_a_compressed_regrowth_checkpoint_resumes_exactly(tmp_path, regrow, resume_from):
    """Stopped mid-regrowth (blocks moved) and resumed from another initialization: the
    layers swapped at setup take the checkpoint's block masks (from its dense weights and
    the callback's state), and the run is the uninterrupted one bit for bit."""
    settings = dict(REGROW, regrow=regrow, compress=True, regrow_end=20)  # steps: any run
    uninterrupted, _ = fit(settings, max_epochs=2, samples=64)  # 2 epochs of 4 steps
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    stopped, _ = fit(settings, max_epochs=1, callbacks=[checkpoint], samples=64)
    pl.seed_everything(0, verbose=False)
    first = pattern_mask(BlockNet().net[2].weight, "block:16x16", 0.75)  # the step-0 blocks
    assert not torch.equal(expanded(stopped.net[2]), first)  # regrowth moved blocks
    at_start = MasksAtFitStart()
    # "last": Lightning finds the checkpoint in its ModelCheckpoint's folder
    ckpt_path, more = ((tmp_path / "last.ckpt", []) if resume_from == "file" else
                       ("last", [ModelCheckpoint(dirpath=tmp_path, save_last=True)]))
    resumed, sparse = fit(settings, max_epochs=2, ckpt_path=ckpt_path,
                          callbacks=[at_start, *more], init_seed=1, samples=64)
    assert all(torch.equal(mask, stopped.net[i].block_mask)
               for mask, i in zip(at_start.masks, (0, 2), strict=True))
    assert sparse.engine.updater.last_regrow == 6  # regrowth went on after the resume
    assert_same_training(uninterrupted, uninterrupted.trainer, resumed, resumed.trainer)


def test_rigl_records_the_dense_gradient_only_at_regrowth_steps_and_frees_it():
    recording, kept = [], []

    class Watch(pl.Callback):  # runs after the sparsity callback's hooks
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            recording.append(all(s.recording for s in trainer.callbacks[0].engine.compressed))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kept.append(any(s.dense_gradient is not None
                            for s in trainer.callbacks[0].engine.compressed))

    fit(dict(REGROW, regrow="rigl", compress=True, frequency=4, regrow_end=12), max_epochs=2,
        callbacks=[Watch()])
    assert recording == [True, False, False, False] * 3 + [False] * 4  # periods of 4 steps
    assert kept == [False] * 16  # the dense-sized buffer is freed at the update


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_recorded_dense_gradient_is_what_a_dense_linear_gets(autocast):
    """RigL's recorded ``dY^T X`` of a compressed layer, summed over two backward passes as
    over micro-batches, against a float64 sum and the weight gradient of an ``nn.Linear`` on
    the same inputs and output gradients: in float32, and under bf16 autocast, where both
    products run in bf16 (the recording costs a bf16 matmul, not an fp32 one)."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 40)
    layer = BlockSparseLinear.from_dense(dense, block=(16, 16), density=0.5)
    slot = layer.slot("net.0.weight")
    slot.recording = True
    want = torch.zeros(40, 48, dtype=torch.float64)
    for _ in range(2):
        x, grad = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            outputs = layer(x), dense(x)
        for out in outputs:
            out.backward(grad.to(out.dtype))
        want += grad.reshape(-1, 40).double().T @ x.reshape(-1, 48).double()
    slot.recording = False
    got = slot.dense_gradient
    assert got.dtype == torch.float32 and got.shape == (40, 48)
    tol = dict(atol=1e-5, rtol=1e-5) if autocast is None else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got, dense.weight.grad, **tol)


def test_the_recording_holds_no_dense_buffer_but_its_gradient_and_skips_frozen_layers():
    """While recording, the layer holds a probe of the dense shape on one element of
    storage (only its gradient is dense), the same one at every recording; a frozen
    layer's output stays out of autograd."""
    layer = BlockSparseLinear(48, 40, block=(16, 16), density=0.5)
    slot = layer.slot("w")
    slot.recording = True
    probe = layer.dense_gradient_probe
    assert probe.shape == (40, 48) and probe.untyped_storage().nbytes() == 4
    x = torch.randn(5, 48)
    layer(x).sum().backward()
    want = torch.ones(5, 40).T @ x
    torch.testing.assert_close(slot.dense_gradient, want)
    slot.clear_gradient()
    layer.requires_grad_(False)
    assert not layer(x).requires_grad  # no probe on a frozen layer's output
    assert slot.dense_gradient is None
    slot.recording = False
    assert layer.dense_gradient_probe is None
    slot.recording = True  # the same probe again: a compiled graph finds it where it was
    assert layer.dense_gradient_probe is probe and probe.grad is None
