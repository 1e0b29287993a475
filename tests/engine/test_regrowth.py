"""Regrowth (RigL, SET, SR-STE), ERK, exact counts at every update, AMP skips, resume."""

import copy

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyNet, TwoOptimizerNet, assert_masks_hold, make_loader, make_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.plugins import MixedPrecision
from torch import nn

from sparse_training import SparsityCallback
from sparse_training.pieces.distributions import ERK
from sparse_training.pieces.masks import as_matrix, kept_count
from sparse_training.pieces.patterns import parse_pattern
from sparse_training.pieces.regrowth import cosine_fraction, drop_and_grow


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=st.sampled_from(["unstructured", "2:4", "1:8", "block:2x2",
                                             "vector:2+1:4"]),
       fraction=st.floats(0.01, 1.0))
def test_drop_and_grow_keeps_exact_counts(data, spec, fraction):
    pattern = parse_pattern(spec)
    rows = pattern.block_rows * data.draw(st.integers(1, 4))
    cols = pattern.block_cols * (pattern.m or 1) * data.draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    weight = torch.randn(rows, cols, generator=g)
    from sparse_training import pattern_mask

    mask = pattern_mask(weight, pattern, None if pattern.is_nm else 0.5)
    weight = weight.masked_fill(~mask, 0)
    grad = torch.randn(rows, cols, generator=g)
    (new,) = drop_and_grow([mask], [weight], [grad], pattern, fraction)
    assert int(new.sum()) == int(mask.sum())
    if pattern.is_nm:
        groups = as_matrix(new).reshape(-1, pattern.m * pattern.block_cols)
        assert (groups.sum(-1) == pattern.n * pattern.block_cols).all()
    if pattern.block_rows * pattern.block_cols > 1:
        blocks = new.reshape(rows // pattern.block_rows, pattern.block_rows,
                             cols // pattern.block_cols, pattern.block_cols).sum(dim=(1, 3))
        assert ((blocks == 0) | (blocks == pattern.block_rows * pattern.block_cols)).all()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 12), block=st.integers(2, 5),
       fraction=st.floats(0.01, 1.0), seed=st.integers(0, 2**31))
def test_drop_and_grow_moves_whole_overhanging_blocks(rows, cols, block, fraction, seed):
    """Blocks the weight's edge clips move whole; the block count stays; the swap count is
    the share of kept blocks (not of kept entries, which clipped blocks hold fewer of)."""
    from sparse_training import pattern_mask

    pattern = parse_pattern(f"block:{block}x{block}")
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = pattern_mask(weight, pattern, 0.5)
    # growth prefers every pruned block to a dropped one: exactly the swap count moves
    grad = (torch.rand(rows, cols, generator=g, dtype=torch.float64) + 1).masked_fill(mask, 0)
    (new,) = drop_and_grow([mask], [weight.masked_fill(~mask, 0)], [grad], pattern, fraction)
    blocks = [(slice(i, i + block), slice(j, j + block)) for i in range(0, rows, block)
              for j in range(0, cols, block)]
    assert all(new[b].all() or not new[b].any() for b in blocks)
    kept_before = sum(bool(mask[b].all()) for b in blocks)
    kept_after = [b for b in blocks if new[b].all()]
    assert len(kept_after) == kept_before
    moved = sum(not mask[b].all() for b in kept_after)
    assert moved == int(fraction * kept_before + 0.5)


def test_drop_and_grow_input_first_groups_along_dim_0():
    pattern = parse_pattern("2:4")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 6, generator=g)  # (in, out)
    from sparse_training import pattern_mask

    mask = pattern_mask(weight, pattern, input_dim=0)
    grad = torch.randn(16, 6, generator=g)
    (new,) = drop_and_grow([mask], [weight.masked_fill(~mask, 0)], [grad], pattern, 1.0,
                           input_dims=[0])
    assert (new.T.reshape(6, 4, 4).sum(-1) == 2).all() and not torch.equal(new, mask)


def test_rigl_drops_smallest_and_grows_largest_gradient():
    mask = torch.tensor([[True, True, True, True, False, False, False, False]])
    weight = torch.tensor([[4.0, -3.0, 0.1, 2.0, 0, 0, 0, 0]])
    grad = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.5, -9.0, 0.2, 0.1]])
    new = drop_and_grow([mask], [weight], [grad], parse_pattern("unstructured"), 0.25)[0]
    assert new.tolist() == [[True, True, False, True, False, True, False, False]]


def test_dropped_and_regrown_position_keeps_its_value():
    mask = torch.tensor([[True, True, False, False]])
    weight = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    grad = torch.tensor([[50.0, 0.0, 1.0, 1.0]])  # the dropped weight has the largest gradient
    new = drop_and_grow([mask], [weight], [grad], parse_pattern("unstructured"), 0.5)[0]
    assert torch.equal(new, mask)


def test_nan_gradients_are_never_grown():
    mask = torch.tensor([[True, True, False, False]])
    weight = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    grad = torch.tensor([[0.0, 0.0, float("nan"), 1.0]])
    new = drop_and_grow([mask], [weight], [grad], parse_pattern("unstructured"), 0.5)[0]
    assert new.tolist() == [[False, True, False, True]]


def test_cosine_fraction():
    assert cosine_fraction(0, 100, 0.3) == pytest.approx(0.3)
    assert cosine_fraction(50, 100, 0.3) == pytest.approx(0.15)
    assert cosine_fraction(100, 100, 0.3) == 0.0


@settings(max_examples=50, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1,
                       max_size=6), sparsity=st.floats(0.0, 0.99))
def test_erk_meets_the_target_within_one_weight_per_layer(shapes, sparsity):
    targets = ERK()(shapes, sparsity)
    sizes = [a * b for a, b in shapes]
    kept = sum(kept_count(n, s) for n, s in zip(sizes, targets, strict=True))
    assert all(0.0 <= s < 1.0 or s == 0.0 for s in targets)
    assert abs(kept - (1 - sparsity) * sum(sizes)) <= len(shapes) * 0.5 + 1e-6
    dense_by_erk = [s == 0.0 for s in targets]
    if not all(dense_by_erk):  # small layers are denser (Σ shape / Π shape is larger)
        ratios = [(a + b) / (a * b) for a, b in shapes]
        order = sorted(range(len(shapes)), key=lambda i: ratios[i])
        densities = [1 - targets[i] for i in order]
        assert densities == sorted(densities)


class CountAudit(Callback):
    """Counts per layer fixed after creation; exact at every step; zeros hold."""

    def __init__(self, sparse):
        self.sparse, self.counts, self.changes = sparse, None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = self.sparse.engine
        if engine.updater.last_update is None:
            return
        counts = {layer.name: int(layer.mask.sum()) for layer in engine.slots}
        masks = {layer.name: layer.mask.clone() for layer in engine.slots}
        if self.counts is None:
            self.counts, self.masks = counts, masks
        assert counts == self.counts  # regrowth never drifts
        self.changes += any(not torch.equal(masks[k], self.masks[k]) for k in masks)
        self.masks = masks
        # SR-STE keeps dense optimizer state; the others zero it at pruned positions
        assert_masks_hold(engine, [] if engine.updater.dense_state else trainer.optimizers)
        for layer in engine.slots:
            if layer.plan.pattern.is_nm:
                groups = as_matrix(layer.mask).reshape(-1, layer.plan.pattern.m)
                assert (groups.sum(-1) == layer.plan.pattern.n).all()


def teacher_loader(n=512, seed=0, batch_size=32):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (torch.tanh(x) @ teacher).argmax(1)),
        batch_size=batch_size)


def accuracy(model, loader):
    x, y = loader.dataset.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@pytest.mark.parametrize("regrow", ["rigl", "set"])
def test_mlp_trains_from_scratch_at_90_percent(regrow):
    sparse = SparsityCallback("unstructured", sparsity=0.9, schedule="constant", score="random",
                              distribution="erk", regrow=regrow, frequency=5)
    audit = CountAudit(sparse)
    model = TinyNet(lr=3e-2)
    trainer = make_trainer([sparse, audit], max_epochs=6)
    trainer.fit(model, teacher_loader())
    assert sparse.engine.sparsity == pytest.approx(0.9, abs=0.005)
    assert audit.changes >= 5  # the masks moved
    assert accuracy(model, teacher_loader(seed=1)) > 0.6  # chance is 0.25


def test_regrowth_with_gmp_graNet_style():
    sparse = SparsityCallback("unstructured", sparsity=0.8, schedule="gmp", regrow="rigl",
                              frequency=4, end=0.5)
    trainer = make_trainer([sparse], max_epochs=4)
    trainer.fit(TinyNet(), teacher_loader(n=256))
    assert sparse.engine.sparsity == pytest.approx(0.8, abs=0.005)
    assert sparse.engine.updater.last_regrow is not None


class ResBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1, self.norm2 = nn.BatchNorm2d(channels), nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))


class TinyResNet(TinyNet):
    def __init__(self):
        super().__init__(lr=1e-2)
        self.net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), ResBlock(8), ResBlock(8),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


@pytest.mark.parametrize("regrow", ["rigl", "set", "sr-ste"])
def test_resnet_with_nm_regrowth(regrow):
    sparse = SparsityCallback("2:4", schedule="constant", regrow=regrow, frequency=2,
                              dense_ratio=0.2, deny=[r"net\.5"])
    audit = CountAudit(sparse)
    model = TinyResNet()
    trainer = make_trainer([sparse, audit], max_epochs=3)
    trainer.fit(model, make_loader(conv=True, n=96))
    names = [slot.name for slot in sparse.engine.slots]
    assert names == ["net.1.conv1.weight", "net.1.conv2.weight", "net.2.conv1.weight",
                     "net.2.conv2.weight"]  # the stem block stays dense
    assert audit.changes >= 1


def test_sr_ste_keeps_dense_weights_and_remasks_every_step():
    sparse = SparsityCallback("2:4", schedule="constant", regrow="sr-ste")
    audit = CountAudit(sparse)
    model = TinyNet(lr=3e-2)
    trainer = make_trainer([sparse, audit], max_epochs=4)
    trainer.fit(model, teacher_loader(n=256))
    slot = sparse.engine.slots[0]
    dense = sparse.engine.updater.dense[slot.name]
    assert dense[~slot.mask].ne(0).float().mean() > 0.9  # pruned weights live on, densely
    assert torch.equal(slot.param, dense.masked_fill(~slot.mask, 0))
    assert audit.changes >= 2  # masks follow the dense weights
    assert accuracy(model, teacher_loader(seed=1)) > 0.5


def test_no_mask_update_on_non_finite_gradients():
    class Overflow(TinyNet):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.global_step == 4 else loss

    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="constant",
                              regrow="rigl", frequency=2, regrow_end=100)
    regrown = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            regrown.append(sparse.engine.updater.last_regrow)

    amp = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))  # skips inf steps
    trainer = make_trainer([sparse, Spy()], max_epochs=1, max_steps=7, plugins=[amp])
    trainer.fit(Overflow(), make_loader())
    # regrowth from the first step; step 4 overflowed: no update there, the period's update
    # runs at the next step
    assert regrown[0] == 0 and regrown[2] == 2 and regrown[4] == 2 and regrown[5] == 5
    assert regrown[6] == 6


RESUMABLE = {
    "set": dict(pattern="unstructured", sparsity=0.8, schedule="constant", regrow="set",
                frequency=2, score="random", seed=7, regrow_end=11),
    "sr-ste": dict(pattern="2:4", schedule="constant", regrow="sr-ste"),
}


@pytest.mark.parametrize("algorithm", RESUMABLE)
def test_resume_restores_regrowth_exactly(tmp_path, algorithm):
    settings = RESUMABLE[algorithm]
    pl.seed_everything(0)
    straight = TinyNet("adam")
    straight_sparse = SparsityCallback(**settings)
    make_trainer([straight_sparse], max_epochs=2).fit(straight, make_loader(n=96))
    pl.seed_everything(0)
    first = TinyNet("adam")
    make_trainer([SparsityCallback(**settings),
                  ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1,
                 enable_checkpointing=True).fit(first, make_loader(n=96))
    resumed = TinyNet("adam")
    sparse = SparsityCallback(**settings)
    make_trainer([sparse], max_epochs=2).fit(resumed, make_loader(n=96),
                                             ckpt_path=tmp_path / "last.ckpt")
    if algorithm == "set":
        assert sparse.engine.updater.last_regrow == 10
    else:  # the dense weights kept aside came back from the checkpoint too
        for name, dense in sparse.engine.updater.dense.items():
            assert torch.equal(dense, straight_sparse.engine.updater.dense[name]), name
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_rigl_skips_tensors_without_gradient():
    class WithUnusedHead(TinyNet):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(16, 16)

    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="constant", regrow="rigl",
                              frequency=2)
    masks = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            masks.append({s.name: s.mask.clone() for s in sparse.engine.slots})

    model = WithUnusedHead()
    with pytest.warns(UserWarning, match="got no gradient in the first step"):
        make_trainer([sparse, Spy()], max_epochs=1).fit(model, make_loader())
    assert all(torch.equal(m["unused.weight"], masks[0]["unused.weight"]) for m in masks)
    assert not all(torch.equal(m["net.0.weight"], masks[0]["net.0.weight"]) for m in masks)
    assert sparse.engine.updater.regrown_period["net.0.weight"] == 2  # steps 0, 2, 4 < 6


def test_every_optimizer_regrows_once_per_period():
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="constant", regrow="rigl",
                              frequency=3, regrow_end=10_000)
    regrowths: dict[str, int] = {}

    class Count(Callback):
        def on_train_start(self, trainer, pl_module):
            updater = sparse.engine.updater
            inner = updater.regrow

            def counted(engine, slots, step, kept=None):
                for slot in slots:
                    regrowths[slot.name] = regrowths.get(slot.name, 0) + 1
                inner(engine, slots, step, kept)

            updater.regrow = counted

    make_trainer([sparse, Count()], max_epochs=1).fit(TwoOptimizerNet(), make_loader())
    # 8 batches, each stepping both optimizers: periods of 3 batches start at batches 0, 3
    # and 6, and each optimizer's tensors regrow once in each
    assert regrowths == {"net.0.weight": 3, "net.2.weight": 3, "net.4.weight": 3}


def test_sr_ste_masks_weights_after_a_skipped_step():
    from sparse_training import SparsityConfig, SparsityEngine

    model = nn.Sequential(nn.Linear(8, 8))
    engine = SparsityEngine(model, SparsityConfig("2:4", schedule="constant", regrow="sr-ste"))
    engine.start(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    engine.on_step_start(0)
    model(torch.randn(2, 8)).sum().backward()
    engine.before_optimizer_step(optimizer, 0)  # dense weights back for the update...
    assert (model[0].weight != 0).all()
    engine.on_step_end()  # ...but the grad scaler skipped the step: masked again
    assert (model[0].weight == 0).sum() == 32


def test_sr_ste_under_gmp_changes_its_n_at_the_update_steps_only():
    """A gradual schedule's N':M stage is s_t at the latest update step (every `frequency`
    steps), as for magnitude masks; SR-STE re-derives the mask every step at that stage."""
    from sparse_training import SparsityConfig, SparsityEngine

    model = nn.Sequential(nn.Linear(16, 8))
    engine = SparsityEngine(model, SparsityConfig("2:8", schedule="gmp", start=0, end=10,
                                                  frequency=5, regrow="sr-ste"))
    engine.start(20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    kept = []
    for step in range(12):
        engine.on_step_start(step)
        kept.append(int(model[0].weight_mask[0].sum()))
        model(torch.randn(2, 16)).sum().backward()
        engine.before_optimizer_step(optimizer, step)
        optimizer.step()
        optimizer.zero_grad()
        engine.on_step_end()
        if step == 7:  # between two updates: a resume checks the counts of step 5's stage
            SparsityEngine(copy.deepcopy(model), engine.config, state=engine.state_dict())
    # s_0 = 0: 8 of 8; s_5 = 0.75 (1 - 0.5^3): round(8 * 0.34375) = 3 of 8; s_10: 2 of 8
    assert kept == [16] * 5 + [6] * 5 + [4] * 2


def test_checksum_tells_masks_with_equal_index_sums_apart():
    from sparse_training.engine.distributed import mask_checksum

    a, b = torch.tensor([1, 0, 0, 1], dtype=torch.bool), torch.tensor([0, 1, 1, 0],
                                                                      dtype=torch.bool)
    assert mask_checksum(a) != mask_checksum(b)
    assert mask_checksum(a) == mask_checksum(a.clone())


def test_drop_and_grow_of_several_tensors_equals_one_by_one():
    g = torch.Generator().manual_seed(0)
    pattern = parse_pattern("unstructured")
    weights = [torch.randn(8, 16, generator=g) for _ in range(4)]
    from sparse_training import pattern_mask

    masks = [pattern_mask(w, pattern, 0.75) for w in weights[:3]]  # one count: ranked together
    masks.append(pattern_mask(weights[3], pattern, 0.5))  # another count: its own group
    weights = [w.masked_fill(~m, 0) for w, m in zip(weights, masks, strict=True)]
    grads = [torch.randn(8, 16, generator=g) for _ in range(4)]
    together = drop_and_grow(masks, weights, grads, pattern, 0.3)
    for m, w, gr, new in zip(masks, weights, grads, together, strict=True):
        assert torch.equal(new, drop_and_grow([m], [w], [gr], pattern, 0.3)[0])
        assert int(new.sum()) == int(m.sum())


@pytest.mark.parametrize(("frequency", "every"), [(2, "every 2 steps"), (1, "every step")])
def test_fit_start_says_when_masks_move(lightning_log, frequency, every):
    sparse = SparsityCallback("unstructured", sparsity=0.5, schedule="constant", regrow="set",
                              frequency=frequency)
    make_trainer([sparse], max_epochs=1).fit(TinyNet(), make_loader())
    assert (f"mask updates at steps 0 (one update); drop and grow {every} from step 0 "
            f"until step 6") in lightning_log.text
