"""Lightning callbacks that time and profile the steps of a ``pl.Trainer`` fit, for
``e2e_step.py``: step times, a ``torch.profiler`` trace by kernel family, and the host's
Python by function (``cProfile``), each over a window of global steps."""

from __future__ import annotations

import cProfile
import pstats
import time

from _step_profile import kernel_families


def step_times(warmup: int, until: int, synchronize: bool):
    """A Lightning callback that records in its ``ms`` list the milliseconds of every step
    after the first ``warmup`` up to global step ``until`` (step end to step end; the GPU
    synchronized at each step end when ``synchronize``)."""
    import torch
    from pytorch_lightning.callbacks import Callback

    class StepTimes(Callback):
        def __init__(self):
            self.ms: list[float] = []
            self.last = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if synchronize:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.last is not None and warmup < trainer.global_step <= until:
                self.ms.append((now - self.last) * 1e3)
            self.last = now

    return StepTimes()


def step_profiler(after: int, steps: int, gpu: bool, trace: str | None = None):
    """A Lightning callback that profiles (``torch.profiler``: CPU, and CUDA when ``gpu``)
    ``steps`` steps from the end of global step ``after``; then its ``row`` holds
    :func:`kernel_families` and the profiled wall ms per step (profiler overhead in it).
    ``trace``: a path to write the profile's Chrome trace to (gzipped where it ends in
    ``.gz``; open it in Perfetto)."""
    import torch
    from pytorch_lightning.callbacks import Callback
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu

    class StepProfiler(Callback):
        def __init__(self):
            self.row: dict = {}
            self.profiler = profile(activities=activities)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (after, after + steps) and gpu:
                torch.cuda.synchronize()
            if trainer.global_step == after:
                self.profiler.__enter__()
                self.began = time.perf_counter()
            elif trainer.global_step == after + steps:
                self.profiler.__exit__(None, None, None)
                if trace:
                    self.profiler.export_chrome_trace(trace)
                self.row = {"profiled_wall_ms": (time.perf_counter() - self.began) * 1e3 / steps,
                            **kernel_families(self.profiler.events(), steps)}

    return StepProfiler()


def python_profiler(after: int, steps: int, gpu: bool, top: int = 12):
    """A Lightning callback that runs ``cProfile`` over ``steps`` steps from the end of
    global step ``after``; then its ``row`` holds ``python_ms`` (the profiled wall ms per
    step, cProfile's overhead in it) and ``python_top``: the ``top`` functions by their own
    time per step, ``[function, own ms, cumulative ms, calls, caller]`` per step (the caller
    that spent the most cumulative time in it): where the host's time goes outside the GPU's
    kernels (launchers, autograd, CUDA-graph replays, the loop)."""
    import torch
    from pytorch_lightning.callbacks import Callback

    class PythonProfiler(Callback):
        def __init__(self):
            self.row: dict = {}
            self.profile = cProfile.Profile()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (after, after + steps) and gpu:
                torch.cuda.synchronize()  # the window holds its steps' GPU work, no more
            if trainer.global_step == after:
                self.began = time.perf_counter()
                self.profile.enable()
            elif trainer.global_step == after + steps:
                self.profile.disable()
                wall = (time.perf_counter() - self.began) * 1e3 / steps
                self.row = {"python_ms": wall, "python_top": hotspots(self.profile, steps, top)}

    return PythonProfiler()


def _function(key: tuple[str, int, str]) -> str:
    """``dir/file.py:line(name)`` of a pstats key ``(file, line, name)``."""
    file, line, name = key
    return f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}({name})"


def hotspots(profile: cProfile.Profile, steps: int, top: int) -> list[list]:
    """The ``top`` functions of ``profile`` by own time: ``[file:line(name), own ms, cumulative
    ms, calls, caller]``, each per step of ``steps``; ``caller`` is the one that spent the most
    cumulative time in the function (None where cProfile saw no Python caller)."""
    # key -> (primitive calls, calls, own s, cumulative s, {caller key: (.., .., own, cum)})
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [[_function(key), own * 1e3 / steps, cumulative * 1e3 / steps, calls // steps,
             _function(max(callers, key=lambda c: callers[c][3])) if callers else None]
            for key, (_, calls, own, cumulative, callers) in rows]
