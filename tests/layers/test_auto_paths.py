"""compress="auto" measures: decisions follow each distinct layer's times, which are cached
on disk per device and software versions (fake measures here; one real timing on the CPU)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from sparse_training import BlockSparseLinear, SparsityConfig
from sparse_training.engine.plan import SparsityPlan
from sparse_training.engine.state import check_settings
from sparse_training.layers import auto_paths
from sparse_training.layers.auto_paths import PathCache, PathKey, Timing, measure_step
from sparse_training.layers.compress import compress_selected, follow_checkpoint

CUDA = torch.device("cuda", 0)
BLOCKS = dict(pattern="block:16x16", sparsity=0.75, compress="auto")


class Layers(nn.Module):
    """Two 64x64 Linears (one key) and a 128x64 one (another)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 128)


class FakeMeasure:
    """Times by output size, counting the calls: 64 outputs train faster compressed, 128
    slower."""

    def __init__(self, compressed_ms: dict[int, float] | None = None) -> None:
        self.compressed_ms = compressed_ms or {64: 0.5, 128: 1.5}
        self.keys: list[PathKey] = []

    def __call__(self, key: PathKey, device: torch.device) -> Timing:
        self.keys.append(key)
        return Timing(masked_dense_ms=1.0, compressed_ms=self.compressed_ms[key.shape[0]])


def decide(cache: PathCache, measure, model: nn.Module | None = None, dtype=torch.bfloat16,
           mode: str = auto_paths.EAGER, **settings):
    model = model or Layers()
    plan = SparsityPlan.build(model, SparsityConfig(**{**BLOCKS, **settings}))
    rows, plan = compress_selected(model, plan, CUDA, dtype, measure=measure, cache=cache,
                                   mode=mode)
    return model, {r.name: r.decision for r in rows}, plan


def test_each_distinct_layer_is_measured_once_and_decides_by_its_times(tmp_path):
    measure = FakeMeasure()
    model, decisions, plan = decide(PathCache(tmp_path / "t.json"), measure)
    assert [k.shape for k in measure.keys] == [(64, 64), (128, 64)]
    key = measure.keys[0]
    assert (key.pattern, key.density, key.dtype, key.tokens) == ("block:16x16", 0.25, "bf16",
                                                                 8192)
    assert isinstance(model.a, BlockSparseLinear) and isinstance(model.b, BlockSparseLinear)
    assert type(model.c) is nn.Linear
    assert decisions["a"] == ("compressed: auto: compressed measured 0.500 ms, masked-dense "
                              "1.000 ms per step at 8192 tokens")
    assert decisions["c"] == ("masked-dense: auto: masked-dense measured 1.000 ms, "
                              "compressed 1.500 ms per step at 8192 tokens")
    table = plan.bound(model).table()  # the setup table says both, per tensor
    assert "compressed: swapped at setup; auto: compressed measured 0.500 ms" in table
    assert "; masked-dense: auto: masked-dense measured 1.000 ms, compressed 1.500" in table


def test_compressed_must_be_faster_by_the_margin(tmp_path):
    """Within 3% of masked-dense is not worth the switch: 0.98 ms stays masked-dense."""
    measure = FakeMeasure({64: 0.98, 128: 0.96})
    model, decisions, _ = decide(PathCache(tmp_path / "t.json"), measure)
    assert type(model.a) is nn.Linear and isinstance(model.c, BlockSparseLinear)
    assert decisions["a"].startswith("masked-dense: auto: masked-dense measured 1.000 ms")


def test_auto_tokens_and_the_compute_dtype_make_the_key(tmp_path):
    measure = FakeMeasure()
    _, decisions, _ = decide(PathCache(tmp_path / "t.json"), measure, dtype=torch.float32,
                             auto_tokens=512)
    assert {(k.tokens, k.dtype) for k in measure.keys} == {(512, "fp32")}
    assert decisions["c"].endswith("per step at 512 tokens")


def test_a_model_replaying_cuda_graphs_is_timed_as_replays_cached_apart(tmp_path):
    """Under CUDA graphs the host's time between kernels is gone: the keys ask for graph
    replays, the rows say so, and the cache keeps those times apart from eager ones."""
    path = tmp_path / "t.json"
    graphed = FakeMeasure()
    _, decisions, _ = decide(PathCache(path), graphed, mode=auto_paths.CUDA_GRAPHS)
    assert [k.graphed for k in graphed.keys] == [True, True]
    assert decisions["a"].endswith("per step at 8192 tokens as CUDA-graph replays")
    assert all(entry.endswith("|8192|cuda graph")
               for entry in json.loads(path.read_text())["timings"])
    eager = FakeMeasure()
    _, decisions, _ = decide(PathCache(path), eager)
    assert [k.graphed for k in eager.keys] == [False, False]  # measured again, eagerly
    assert decisions["a"].endswith("per step at 8192 tokens")


def _compiled(how: str) -> nn.Module:
    """A model holding a Linear compiled the way ``how`` names (nothing runs: compiling is
    lazy)."""
    model = Layers()
    if how == "plain":
        return model
    if how == "module.compile(reduce-overhead)":
        model.a.compile(mode="reduce-overhead")
        return model
    kwargs = {"torch.compile(reduce-overhead)": dict(mode="reduce-overhead"),
              "torch.compile(max-autotune)": dict(mode="max-autotune"),
              "torch.compile(default)": {}, "torch.compile(aot_eager)": dict(backend="aot_eager"),
              "torch.compile(max-autotune-no-cudagraphs)": dict(mode="max-autotune-no-cudagraphs"),
              "torch.compile(options cudagraphs)": dict(options={"triton.cudagraphs": True})}[how]
    model.a = torch.compile(model.a, **kwargs)
    return model


@pytest.mark.parametrize("how, mode", [
    ("plain", "eager"), ("torch.compile(default)", "compiled"),
    ("torch.compile(aot_eager)", "compiled"),
    ("torch.compile(max-autotune-no-cudagraphs)", "compiled"),
    ("torch.compile(max-autotune)", "cuda graphs"),
    ("torch.compile(reduce-overhead)", "cuda graphs"),
    ("module.compile(reduce-overhead)", "cuda graphs"),
    ("torch.compile(options cudagraphs)", "cuda graphs")])
def test_compile_mode_reads_how_the_model_was_compiled(how, mode):
    assert auto_paths.compile_mode(_compiled(how)) == mode


@pytest.mark.parametrize("mode, said", [("reduce-overhead", "cuda graphs"),
                                        ("default", "compiled")])
def test_a_compiled_lightning_module_lightning_unwrapped_says_its_mode(mode, said):
    """``trainer.fit(torch.compile(module, mode=...))``: Lightning unwraps the module before
    the callback's setup and keeps the compile context on it."""
    from conftest import TinyNet
    from pytorch_lightning.utilities.compile import from_compiled

    module = from_compiled(torch.compile(TinyNet(), mode=mode))
    assert auto_paths.compile_mode(module) == said


@pytest.mark.parametrize("mode", ["compiled", "cuda graphs"])
def test_compiled_2to4_stays_masked_dense_unmeasured(tmp_path, mode):
    """Compiled, a 2:4 layer's forward is cuBLAS on its dense weight: nothing to time."""
    measure = FakeMeasure()
    model, decisions, _ = decide(PathCache(tmp_path / "t.json"), measure, pattern="2:4",
                                 sparsity=None, mode=mode)
    assert measure.keys == [] and type(model.a) is nn.Linear
    assert decisions["a"] == ("masked-dense: auto: compiled, a 2:4 layer multiplies its dense "
                              "weight (cuBLAS), as masked-dense does")


def test_2to4_is_measured_too(tmp_path):
    measure = FakeMeasure()
    model, decisions, _ = decide(PathCache(tmp_path / "t.json"), measure, pattern="2:4",
                                 sparsity=None)
    assert [(k.pattern, k.density) for k in measure.keys] == [("2:4", 0.5)] * 2
    assert type(model.a).__name__ == "SemiStructuredLinear" and type(model.c) is nn.Linear


def test_the_cache_is_reused_across_fits_and_measured_again_for_other_versions(
        tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    first = FakeMeasure()
    decide(PathCache(path), first)
    assert len(first.keys) == 2
    stored = json.loads(path.read_text())
    assert stored["version"] == 1 and len(stored["timings"]) == 2
    entry = next(iter(stored["timings"]))
    assert entry.startswith(f"torch {torch.__version__}|triton ")
    assert entry.endswith(f"|{auto_paths.device_name(CUDA)}|128x64|block:16x16|0.25|bf16|8192")
    again = FakeMeasure()  # another fit: a new cache object reads the file
    _, decisions, _ = decide(PathCache(path), again)
    assert again.keys == [] and decisions["a"].startswith("compressed: auto:")
    monkeypatch.setattr(auto_paths, "versions", lambda: "torch 99.0|triton 9.9")
    upgraded = FakeMeasure()
    decide(PathCache(path), upgraded)
    assert len(upgraded.keys) == 2
    assert len(json.loads(path.read_text())["timings"]) == 4  # the older entries kept


def test_a_corrupt_cache_is_said_measured_again_and_rewritten(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"version": 1, "timings": ')
    with pytest.warns(UserWarning, match=r"compress='auto': ignoring the unreadable cache "
                                         r".*t\.json .*; measuring again"):
        cache = PathCache(path)
    measure = FakeMeasure()
    decide(cache, measure)
    assert len(measure.keys) == 2 and len(json.loads(path.read_text())["timings"]) == 2
    path.write_text('["not", "a", "cache"]')
    with pytest.warns(UserWarning, match="not a version 1 cache of timings"):
        PathCache(path)


def test_an_unwritable_cache_is_said_once_and_auto_still_decides(tmp_path):
    (tmp_path / "file").write_text("")
    cache = PathCache(tmp_path / "file" / "t.json")  # its folder is a file: no write works
    with pytest.warns(UserWarning, match=r"compress='auto': cannot write the timing cache "
                                         r".*t\.json .*set SPARSE_TRAINING_CACHE") as said:
        model, _, _ = decide(cache, FakeMeasure())
    assert len(said) == 1  # two keys measured, one warning
    assert isinstance(model.a, BlockSparseLinear) and type(model.c) is nn.Linear
    measure = FakeMeasure()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        decide(cache, measure)
    assert measure.keys == []  # the times stayed in memory


def test_the_default_cache_lives_under_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_TRAINING_CACHE", str(tmp_path))
    assert PathCache().path == tmp_path / "auto_paths.json"
    monkeypatch.delenv("SPARSE_TRAINING_CACHE")
    assert auto_paths.cache_path().parts[-3:] == (".cache", "sparse_training", "auto_paths.json")


def test_a_measurement_that_fails_keeps_the_layer_masked_dense_uncached(tmp_path):
    def fails(key, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    path = tmp_path / "t.json"
    model, decisions, _ = decide(PathCache(path), fails)
    assert type(model.a) is nn.Linear
    assert decisions["a"] == ("masked-dense: auto: could not measure on cuda:0 "
                              "(OutOfMemoryError: CUDA out of memory)")
    assert not path.exists()


def test_progress_says_each_measurement_and_ranks_take_rank_zeros_times(tmp_path):
    said = []
    plan = SparsityPlan.build(model := Layers(), SparsityConfig(**BLOCKS))
    rank0 = [Timing(1.0, 2.0), Timing(1.0, 0.5)]  # the other way round from FakeMeasure
    compress_selected(model, plan, CUDA, torch.float16, measure=FakeMeasure(),
                      cache=PathCache(tmp_path / "t.json"), progress=said.append,
                      agree=lambda found: rank0)
    assert type(model.a) is nn.Linear and isinstance(model.c, BlockSparseLinear)
    gpu = auto_paths.device_name(CUDA)  # "cuda" where none is visible
    assert said == [f"compress='auto': measuring 1/2: 64x64 block:16x16 density 0.25, fp16 "
                    f"at 8192 tokens on {gpu}",
                    f"compress='auto': measuring 2/2: 128x64 block:16x16 density 0.25, fp16 "
                    f"at 8192 tokens on {gpu}"]


@pytest.mark.parametrize("device, dtype, reason", [
    (torch.device("cpu"), torch.bfloat16, "auto: on cpu the compressed layer multiplies a "
                                          "dense copy"),
    (CUDA, torch.float64, "auto: fp64 compute; the compressed kernels take bf16, fp16 and fp32"),
])
def test_cpu_and_fp64_decide_without_measuring(tmp_path, device, dtype, reason):
    measure = FakeMeasure()
    plan = SparsityPlan.build(model := Layers(), SparsityConfig(**BLOCKS))
    rows, _ = compress_selected(model, plan, device, dtype, measure=measure,
                                cache=PathCache(tmp_path / "t.json"))
    assert measure.keys == [] and {r.decision for r in rows} == {f"masked-dense: {reason}"}


@pytest.mark.interpreter  # the block kernels on CPU tensors
@pytest.mark.parametrize("pattern, density", [("block:16x16", 0.25), ("2:4", 0.5)])
def test_the_real_timing_runs_on_the_cpu_and_its_times_round_trip(tmp_path, pattern, density):
    """Both candidates timed for real (tiny shapes; which is faster is not asserted), with
    the global random state left as it was."""
    key = PathKey((32, 32), pattern, density, "fp32", "cpu", 8)
    state = torch.random.get_rng_state()
    timing = measure_step(key, torch.device("cpu"), budget_ms=1.0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert timing.masked_dense_ms > 0 and timing.compressed_ms > 0
    PathCache(tmp_path / "t.json").put(key, timing)
    assert PathCache(tmp_path / "t.json").get(key) == timing


def test_a_resume_with_another_auto_tokens_says_nothing(recwarn):
    """A resume keeps the checkpoint's compressed layers: the token count of the
    measurements changes nothing then, and a checkpoint from before the setting fits."""
    saved = SparsityConfig(**BLOCKS).as_dict()
    del saved["auto_tokens"]
    check_settings(saved, SparsityConfig(**BLOCKS, auto_tokens=512).as_dict())
    assert not recwarn.list


def test_a_resume_takes_the_checkpoints_paths_and_says_so(tmp_path):
    """A layer "auto" compressed here that the checkpoint trained masked-dense goes back to
    its Linear; the table says the checkpoint decided, not this fit's times."""
    model = Layers()
    originals = dict(model.named_children())
    plan = SparsityPlan.build(model, SparsityConfig(**BLOCKS))
    _, plan = compress_selected(model, plan, CUDA, torch.bfloat16, measure=FakeMeasure(),
                                cache=PathCache(tmp_path / "t.json"))
    swapped = [(name, originals[name]) for name in ("a", "b")]
    plan = follow_checkpoint(model, plan, {}, swapped)  # a checkpoint of no compressed layer
    assert type(model.a) is nn.Linear and swapped == []
    assert "; masked-dense: the checkpoint trained it masked-dense" in plan.bound(model).table()


def test_entries_another_process_wrote_meanwhile_are_kept(tmp_path):
    path = tmp_path / "t.json"
    mine, theirs = PathCache(path), PathCache(path)
    keys = [PathKey((64, 64), "2:4", 0.5, "bf16", "gpu", tokens) for tokens in (1, 2)]
    theirs.put(keys[0], Timing(1.0, 2.0))
    mine.put(keys[1], Timing(3.0, 4.0))
    again = PathCache(path)
    assert again.get(keys[0]) == Timing(1.0, 2.0) and again.get(keys[1]) == Timing(3.0, 4.0)


@pytest.mark.parametrize("mode", ["reduce-overhead", None])
def test_the_callback_decides_for_how_the_module_runs(monkeypatch, mode):
    """The callback hands ``compile_mode`` of the LightningModule it sets up to the swap:
    a network compiled in ``__init__`` with CUDA graphs is timed as replays."""
    from conftest import TinyNet, make_loader, make_trainer

    from sparse_training import SparsityCallback
    from sparse_training.callbacks import sparsity

    seen = []

    class Decided(Exception):
        """Stops the fit at the swap: the decision is all this test reads."""

    def recording(*args, **kwargs):
        seen.append(kwargs["mode"])
        raise Decided

    monkeypatch.setattr(sparsity, "compress_selected", recording)
    module = TinyNet()
    if mode:
        module.net = torch.compile(module.net, mode=mode)
    trainer = make_trainer([SparsityCallback("block:16x16", sparsity=0.5, compress="auto")],
                           max_steps=1)
    with pytest.raises(Decided):
        trainer.fit(module, make_loader())
    assert seen == ["cuda graphs" if mode else "eager"]
