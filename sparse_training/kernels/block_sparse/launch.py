"""Launches of the autotuned kernels that skip Triton's Python layers once tuned.

``kernel[grid](...)`` pays at every call for the autotuner's and the heuristics' wrappers
and the JIT's argument binding, specialization and cache key: tens of microseconds on the
host, while the kernels of a BERT-sized layer run for tens of microseconds on the GPU.
:class:`TunedKernel` sends the first call of each argument signature through that path,
so tuning and compilation happen as before, keeps the compiled kernel that ran with its
grid and constexpr arguments, and from then on calls its launcher directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from triton import knobs
from triton.runtime import Autotuner, Heuristics, driver

from sparse_training.kernels._triton import interpret_mode

Grid = Callable[[dict[str, Any]], tuple[int, ...]]


def current_stream(device: int | None) -> int:
    """The raw CUDA stream Triton would launch on (torch's current stream of ``device``)."""
    return driver.active.get_current_stream(device)


def _hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (a profiler's) as its launcher takes them: the enter and exit
    hooks, each None where its chain is empty (Triton's default)."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (enter if getattr(enter, "calls", enter) else None,
            exit_ if getattr(exit_, "calls", exit_) else None)


class TunedKernel:
    """An ``@triton.autotune`` kernel (over optional ``@triton.heuristics``) whose
    parameters are its tensors, then its runtime integers, then its constexprs.

    ``grid`` maps the named arguments (Python values, the chosen config's included) to
    the launch grid. The cache key holds everything Triton specializes on (integer values,
    dtypes, 16-byte alignment of the tensors, the constexprs) and the device. The direct
    launch serves on the GPU; the interpreter (``fast`` false) goes through
    ``kernel[grid]`` every time.
    """

    def __init__(self, kernel: Autotuner, grid: Grid) -> None:
        self.kernel, self.grid = kernel, grid
        self.fast = not interpret_mode()
        self._names: list[str] = kernel.arg_names
        self._heuristics: dict[str, Callable] = {}
        fn = kernel.fn
        while isinstance(fn, Heuristics):
            self._heuristics.update(fn.values)
            fn = fn.fn
        self._launches: dict[tuple, tuple] = {}

    def __call__(self, tensors: tuple[Tensor, ...], scalars: tuple[int, ...],
                 **meta: Any) -> None:
        """Launch on ``tensors`` and ``scalars`` (in parameter order) with constexprs
        ``meta`` (those the autotuner and the heuristics do not set)."""
        if not self.fast:
            self._launch(tensors, scalars, meta)
            return
        aligned = 0  # Triton specializes pointers on 16-byte alignment
        for t in tensors:
            aligned = aligned << 1 | (t.data_ptr() % 16 == 0)
        device = tensors[0].device.index
        key = (device, aligned, *scalars, *meta.values(), *[t.dtype for t in tensors])
        launch = self._launches.get(key)
        if launch is None:
            compiled = self._launch(tensors, scalars, meta)
            if compiled is not None:
                self._launches[key] = self._remember(compiled, tensors + scalars, meta)
            return
        compiled, run, function, packed, grid, constexprs = launch
        stream, args = current_stream(device), (*tensors, *scalars, *constexprs)
        enter, exit_ = _hooks()
        metadata = (None if enter is None and exit_ is None
                    else compiled.launch_metadata(grid, stream, *args))
        run(*grid, stream, function, packed, metadata, enter, exit_, *args)

    def _launch(self, tensors: tuple[Tensor, ...], scalars: tuple[int, ...],
                meta: dict[str, Any]) -> Any:
        """Through the autotuner (tuning and compiling where needed); the compiled kernel
        that ran, or None (the interpreter, or a cache hook that skipped it)."""
        named = {**dict(zip(self._names, tensors + scalars, strict=False)), **meta}
        # the interpreter hands the grid its own tensors for ints: read Python ints here
        return self.kernel[lambda bound: self.grid({**bound, **named})](
            *tensors, *scalars, **meta)

    def _remember(self, compiled: Any, args: tuple, meta: dict[str, Any]) -> tuple:
        """What the direct launch needs: the compiled kernel, its launcher, loaded function
        and packed metadata, the grid and the constexpr arguments as the autotuner chose
        them."""
        named = {**dict(zip(self._names, args, strict=False)),
                 **meta, **self.kernel.best_config.kwargs}
        for name, rule in self._heuristics.items():
            named[name] = rule(named)
        grid = (*self.grid(named), 1, 1)[:3]
        constexprs = tuple(named[name] for name in self._names[len(args):])
        return (compiled, compiled.run, compiled.function, compiled.packed_metadata, grid,
                constexprs)
