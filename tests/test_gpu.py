"""GPU-only checks: compiled Triton kernels, cuSPARSELt and ``torch.compile`` on CUDA, and
the compressed path through ``pl.Trainer`` the way a user trains (bf16-mixed, the user's
``AdamW``). Marked ``gpu``; skipped with the reason where no CUDA GPU is visible or the
Triton interpreter is on (the conftest turns it on only where no CUDA GPU is visible). On a
GPU machine::

    python -m pytest -m gpu -q

Each check compares against a float64 reference built here (explicit loops over the kept
blocks, not the package's conversions) or against the same model trained eagerly.
"""

from __future__ import annotations

import copy
import re

import pytest
import pytorch_lightning as pl
import torch
from tiny_hf import FAMILIES, TinyHF, hf_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparse_training import (
    BlockSparseLinear,
    SemiStructuredLinear,
    SlimLinear,
    SparsityCallback,
    SparsityConfig,
    SparsityEngine,
)
from sparse_training.kernels._triton import interpret_mode
from sparse_training.kernels.block_sparse import BlockTopology, block_sparse_linear
from sparse_training.layers import auto_paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(interpret_mode(), reason="compiled kernels: run with TRITON_INTERPRET=0"),
]

COMPILE_MODES = ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]


def dense_reference(values: torch.Tensor, block_mask: torch.Tensor, shape: tuple[int, int]
                    ) -> torch.Tensor:
    """The float64 dense weight of ``values`` under ``block_mask``: explicit block loops,
    padded tails cropped (never read)."""
    (r, c), (out_features, in_features) = values.shape[1:], shape
    weight = torch.zeros(out_features, in_features, dtype=torch.float64)
    for kept, (i, j) in enumerate(block_mask.nonzero().tolist()):
        rows, cols = min(r, out_features - i * r), min(c, in_features - j * c)
        weight[i * r:i * r + rows, j * c:j * c + cols] = values[kept, :rows, :cols].double()
    return weight


def strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous layout."""
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "every_other":
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


@pytest.mark.parametrize("dtype, block, shape, tokens", [
    (torch.float32, (64, 64), (128, 128), 128),
    (torch.float16, (16, 16), (72, 40), 33),
    (torch.bfloat16, (128, 128), (300, 200), 257),
    (torch.bfloat16, (32, 64), (96, 130), 1000),
])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every_other"])
def test_block_sparse_op_any_strides_and_poisoned_tails(dtype, block, shape, tokens, layout):
    """Outputs and every gradient equal the float64 reference for strided x, values and
    bias, with NaN in the padded tails of values (never read) and an empty block row."""
    torch.manual_seed(0)
    out_features, in_features = shape
    grid = (-(-out_features // block[0]), -(-in_features // block[1]))
    block_mask = torch.rand(grid) < 0.5
    block_mask[0] = False  # an empty block row: its outputs are the bias
    block_mask[-1, -1] = True  # a tail block in both dimensions
    topology = BlockTopology.from_block_mask(block_mask.cuda(), out_features, in_features, block)
    values = torch.randn(int(block_mask.sum()), *block, dtype=dtype)
    rows_in = torch.arange(block[0])[:, None] + block_mask.nonzero()[:, 0, None, None] * block[0]
    cols_in = torch.arange(block[1])[None, :] + block_mask.nonzero()[:, 1, None, None] * block[1]
    tail = (rows_in >= out_features) | (cols_in >= in_features)
    values[tail] = float("nan")
    x = torch.randn(3, tokens, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype)
    grad = torch.randn(3, tokens, out_features, dtype=dtype)

    x_gpu = strided(x.cuda(), layout).requires_grad_()
    values_gpu = strided(values.cuda(), layout).requires_grad_()
    bias_gpu = strided(bias.cuda(), layout).requires_grad_()
    y = block_sparse_linear(x_gpu, values_gpu, topology, bias_gpu)
    y.backward(grad.cuda())

    weight = dense_reference(values, block_mask, shape).requires_grad_()
    x64, bias64 = x.double().requires_grad_(), bias.double().requires_grad_()
    y64 = x64 @ weight.T + bias64
    y64.backward(grad.double())
    tol = 2e-2 if dtype != torch.float32 else 2e-3  # bf16/fp16 operands, fp32 (tf32) sums
    for got, want in [(y, y64), (x_gpu.grad, x64.grad), (bias_gpu.grad, bias64.grad)]:
        got = got.double().cpu()
        assert torch.isfinite(got).all()
        assert (got - want).norm() <= tol * want.norm(), (got - want).abs().max()
    assert torch.equal(y[..., :block[0]].double().cpu(),
                       bias.double().expand(3, tokens, -1)[..., :block[0]].to(y.dtype).double())
    grad_values = values_gpu.grad.double().cpu()
    assert not grad_values[tail].any()  # tails get no gradient
    (r, c) = block
    for p, (i, j) in enumerate(block_mask.nonzero().tolist()):
        rows, cols = min(r, out_features - i * r), min(c, in_features - j * c)
        want = weight.grad[i * r:i * r + rows, j * c:j * c + cols]
        got = grad_values[p, :rows, :cols]
        assert (got - want).norm() <= tol * want.norm() + 1e-6


def fresh_compiler() -> None:
    """Forget the compiled graphs and CUDA-graph trees of earlier tests (a failed
    reduce-overhead test must not leave its graphs' memory pool to the next)."""
    import torch._inductor.cudagraph_trees

    torch._dynamo.reset()
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compiled_block_sparse_layer_matches_eager(mode):
    """A model of BlockSparseLinear layers (tails in both dimensions) under torch.compile
    gives eager's outputs and gradients, including a non-contiguous input, also after a
    new block mask (regrowth's ``set_block_mask``: a CUDA graph reads the new topology)."""
    fresh_compiler()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(200, 136), nn.GELU(), nn.Linear(136, 72)).cuda()
    eager = nn.Sequential(BlockSparseLinear.from_dense(dense[0], (64, 64), density=0.5),
                          nn.GELU(),
                          BlockSparseLinear.from_dense(dense[2], (32, 32), density=0.5)).cuda()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, mode=mode)
    for step in range(4):
        if step == 2:  # the same new masks in both models
            for index in (0, 2):
                mask = eager[index].block_mask.roll(1, 1)
                eager[index].set_block_mask(mask)
                compiled_model[index].set_block_mask(mask)
        torch.compiler.cudagraph_mark_step_begin()  # reduce-overhead: a new step's outputs
        x = torch.randn(64, 2, 200, device="cuda").transpose(0, 1)  # non-contiguous
        with torch.autocast("cuda", torch.bfloat16):
            want = eager(x)
            got = compiled(x).clone()  # reduce-overhead: outlive the graph's output buffer
        want.float().square().mean().backward()
        got.float().square().mean().backward()
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), step
        for a, b in zip(eager.parameters(), compiled_model.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=5e-2, atol=1e-3), step
            a.grad = b.grad = None


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compiled_semi_structured_layer_matches_eager(mode):
    fresh_compiler()
    torch.manual_seed(0)
    layer = SemiStructuredLinear.from_dense(nn.Linear(256, 128)).cuda()
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, mode=mode)
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(96, 256, device="cuda")
        with torch.autocast("cuda", torch.bfloat16):
            want, got = layer(x), compiled(x).clone()
        want.float().sum().backward()
        got.float().sum().backward()
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), step
        assert torch.allclose(twin.weight.grad, layer.weight.grad, rtol=5e-2, atol=1e-2)
        assert not twin.weight.grad[~twin.mask].any()
        # every gradient dropped, as zero_grad does: a .grad kept across steps under
        # reduce-overhead is a CUDA-graph output that the next replay overwrites
        for p in (*layer.parameters(), *twin.parameters()):
            p.grad = None


@pytest.mark.parametrize("shape", [(128, 256), (256, 128), (64, 64), (1024, 1024),
                                   (4096, 1024)])
@pytest.mark.parametrize("tokens", [8, 16, 128, 136, 1000, 2048])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_semi_structured_never_crashes(shape, tokens, dtype):
    """Whatever route the layer picks for small and odd token counts and small shapes,
    the call returns the masked product (a crash in cuSPARSELt kills the CUDA context, and
    every later test in this process would fail with it)."""
    torch.manual_seed(0)
    out_features, in_features = shape
    layer = SemiStructuredLinear(in_features, out_features, device="cuda", dtype=dtype)
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    y = layer(x)
    want = x.double() @ (layer.weight.double() * layer.mask).T + layer.bias.double()
    assert (y.double() - want).norm() <= 1e-2 * want.norm()
    torch.cuda.synchronize()


def gpu_trainer(callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False)
    return pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})


SETTINGS = {
    "block 64x64 90%": dict(pattern="block:64x64", sparsity=0.9),
    "block 32x32 50%": dict(pattern="block:32x32", sparsity=0.5),
    "2:4": dict(pattern="2:4"),
    "heads+neurons 50%": dict(pattern="neuron", sparsity=0.5, schedule="oneshot",
                              overrides={"attention|attn": {"pattern": "head"}}),
}


@pytest.mark.parametrize("family, name, compile_mode", [
    *[("bert", "block 64x64 90%", mode) for mode in (None, *COMPILE_MODES)],
    ("bert", "block 32x32 50%", None), ("bert", "2:4", None), ("bert", "2:4", "default"),
    ("bert", "2:4", "reduce-overhead"),
    *[("llama", "block 64x64 90%", mode) for mode in ("default", "reduce-overhead")],
    ("llama", "2:4", "default"), ("bert", "heads+neurons 50%", "reduce-overhead"),
    ("llama", "heads+neurons 50%", "default")])
def test_trainer_compressed_hf_model_trains_and_matches_eager(family, name, compile_mode,
                                                              tmp_path):
    """compress=True on HF BERT and Llama through pl.Trainer (bf16-mixed), eager and
    compiled: the swapped layers are there, the losses are finite and a compiled run
    follows the eager one; its checkpoint loads with the plain, strict
    load_from_checkpoint."""
    fresh_compiler()
    deny, per_layer = FAMILIES[family]
    runs = {}
    for mode in dict.fromkeys([None, compile_mode]):
        model = TinyHF(mode, family=family)
        sparse = SparsityCallback(**SETTINGS[name], compress=True, deny=deny)
        trainer = gpu_trainer([sparse])
        trainer.fit(model, hf_loader(family))
        layers = [m for m in model.modules() if isinstance(m, (
            BlockSparseLinear, SemiStructuredLinear, SlimLinear))]
        assert len(layers) == 2 * per_layer, name  # every Linear of the 2 layers
        assert all(torch.isfinite(torch.tensor(model.losses)))
        runs[mode] = model.losses
        path = tmp_path / f"{mode}.ckpt"
        trainer.save_checkpoint(path)
    eager, compiled = runs[None], runs[compile_mode]
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 0.05 * max(eager)
    plain = TinyHF.load_from_checkpoint(path)  # strict: the model class as written
    assert not any(isinstance(m, (BlockSparseLinear, SemiStructuredLinear, SlimLinear))
                   for m in plain.modules())
    dense = dict(plain.model.named_parameters())
    for name_, layer in model.model.named_modules():
        if isinstance(layer, (BlockSparseLinear, SemiStructuredLinear, SlimLinear)):
            want = (layer.weight * layer.mask if isinstance(layer, SemiStructuredLinear)
                    else layer.to_dense().weight)
            # the Trainer hands the model back on the CPU after fit
            assert torch.equal(dense[f"{name_}.weight"], want.detach().cpu())


def test_auto_measures_on_the_gpu_trainer_and_takes_the_faster_path(lightning_log):
    """compress='auto' decides for the Trainer's GPU (the model is still on the CPU at
    setup): it times a 4096x4096 weight at 90% 128x128 blocks both ways on that GPU and
    trains the path its own measurement found faster (which one wins is the GPU's answer,
    not the test's: a GPU shared with other processes can turn it)."""

    class Wide(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 8))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    model = Wide()
    data = TensorDataset(torch.randn(64, 4096), torch.randint(0, 8, (64,)))
    sparse = SparsityCallback(pattern="block:128x128", sparsity=0.9, compress="auto",
                              deny=["net.2"])
    gpu_trainer([sparse]).fit(model, DataLoader(data, batch_size=16))
    assert f"on {torch.cuda.get_device_name()}" in lightning_log.text
    first, first_ms, second, second_ms = re.search(
        r"auto: (compressed|masked-dense) measured ([\d.]+) ms, (compressed|masked-dense) "
        r"([\d.]+) ms per step at \d+ tokens", lightning_log.text).groups()
    times = {first: float(first_ms), second: float(second_ms)}
    compresses = times["compressed"] <= (1 - auto_paths.MARGIN) * times["masked-dense"]
    assert first == ("compressed" if compresses else "masked-dense")
    assert isinstance(model.net[0], BlockSparseLinear) == compresses


@pytest.mark.parametrize("block", [64, 128])
def test_auto_times_cuda_graph_replays_of_both_paths(block):
    """A graphed key captures each path's training step (forward, backward, capturable
    fused AdamW) in a CUDA graph and times its replays."""
    key = auto_paths.PathKey((1024, 768), f"block:{block}x{block}", 0.25, "bf16",
                             auto_paths.device_name(torch.device("cuda")), 4096, graphed=True)
    timing = auto_paths.measure_step(key, torch.device("cuda"), budget_ms=5.0)
    assert 0 < timing.compressed_ms < 1e3 and 0 < timing.masked_dense_ms < 1e3


@pytest.mark.parametrize("compressed", [False, True])
def test_a_replayed_step_trains(compressed):
    """What auto times under CUDA graphs is a whole step: each replay moves the weights by
    AdamW and gives the input its gradient."""
    layer = nn.Linear(256, 128, bias=False, device="cuda")
    if compressed:
        layer = BlockSparseLinear.from_dense(layer, (64, 64), density=0.5)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    replay = auto_paths._replayed(
        auto_paths._train_step(layer, x, grad, torch.bfloat16, capturable=True),
        torch.device("cuda"))
    for _ in range(2):
        before = [p.detach().clone() for p in layer.parameters()]
        replay()
        torch.cuda.synchronize()
        assert all(not torch.equal(b, p) for b, p in zip(before, layer.parameters(), strict=True))
        assert x.grad is not None and bool(x.grad.abs().sum() > 0)


def test_auto_under_reduce_overhead_times_replays_and_trains(lightning_log, tmp_path,
                                                            monkeypatch):
    """compress='auto' on a model compiled with mode='reduce-overhead' times CUDA-graph
    replays (the rows say so) and the model trains on the paths it chose."""
    monkeypatch.setenv("SPARSE_TRAINING_CACHE", str(tmp_path))
    fresh_compiler()
    deny, _ = FAMILIES["bert"]
    model = TinyHF("reduce-overhead", family="bert")
    sparse = SparsityCallback(**{**SETTINGS["block 64x64 90%"], "compress": "auto"}, deny=deny)
    gpu_trainer([sparse]).fit(model, hf_loader("bert"))
    assert "as CUDA-graph replays" in lightning_log.text
    assert all(torch.isfinite(torch.tensor(model.losses)))


def engine_steps(model: nn.Module, engine, optimizer, x: torch.Tensor, steps: range) -> None:
    """Training steps as Lightning runs them: the engine's step start, a closure (zero_grad,
    forward under bf16 autocast, backward, the engine before the optimizer step) that the
    optimizer's step runs, the step end."""
    for step in steps:
        engine.on_step_start(step)

        def closure(step=step):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            engine.before_optimizer_step(optimizer, step, clipping=False)
            return loss

        optimizer.step(closure)
        engine.on_step_end()


@pytest.mark.parametrize("masked", [False, True],
                         ids=["compressed", "compressed and masked-dense"])
def test_training_steps_of_compressed_layers_never_synchronize(masked):
    """After two warm-up steps (autotuning, first launches and the mask update synchronize
    there), training steps of compressed block layers (64x64 and 128x128, tensor
    descriptors; the weight gradient split over token chunks) and, with ``masked``, a
    masked-dense Linear (the fused optimizer step) make no host-device synchronization:
    torch.cuda.set_sync_debug_mode("error") raises at the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(256),
                          BlockSparseLinear(256, 512, (64, 64), density=0.1), nn.GELU(),
                          BlockSparseLinear(512, 256, (128, 128), density=0.5),
                          nn.Linear(256, 256)).cuda()
    engine = SparsityEngine(model, SparsityConfig("block:64x64", sparsity=0.5,
                                                  deny=[] if masked else [r"^4\."]))
    assert (len(engine.compressed), len(engine.masked)) == (2, int(masked))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.start(10)
    engine.attach(optimizer)
    x = torch.randn(2048, 256, device="cuda")
    engine_steps(model, engine, optimizer, x, range(2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine_steps(model, engine, optimizer, x, range(2, 5))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.detach()
