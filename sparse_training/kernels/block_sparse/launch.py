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
from weakref import WeakKeyDictionary

import torch
from torch import Tensor
from torch._dynamo.decorators import skip as dynamo_skip
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


def alignment(tensors: tuple[Tensor, ...]) -> int:
    """Which of ``tensors`` start 16-byte aligned, as bits (the first the highest): what
    Triton specializes pointers on."""
    aligned = 0
    for t in tensors:
        aligned = aligned << 1 | (t.data_ptr() % 16 == 0)
    return aligned


class Launch:
    """The direct launch of one tuned and compiled specialization of a kernel: its launcher,
    loaded function and packed metadata, the grid, and the arguments after the tensors (the
    scalars, then the constexprs as the autotuner and the heuristics chose them)."""

    __slots__ = ("compiled", "run", "function", "packed", "grid", "arguments", "device")

    def __init__(self, compiled: Any, grid: tuple[int, ...], arguments: tuple,
                 device: int | None) -> None:
        self.compiled, self.grid, self.arguments, self.device = compiled, grid, arguments, device
        self.run, self.function = compiled.run, compiled.function
        self.packed = compiled.packed_metadata

    @dynamo_skip  # (TunedKernel._launch says why; skip adds no per-call cost)
    def __call__(self, tensors: tuple[Tensor, ...]) -> None:
        """Launch on ``tensors`` (of the dtypes, alignment and device it was built for) on
        torch's current stream, with Triton's launch hooks where a profiler set them."""
        grid, stream = self.grid, current_stream(self.device)
        args = (*tensors, *self.arguments)
        enter, exit_ = _hooks()
        metadata = (None if enter is None and exit_ is None
                    else self.compiled.launch_metadata(grid, stream, *args))
        self.run(*grid, stream, self.function, self.packed, metadata, enter, exit_, *args)


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
        self._launches: dict[tuple, Launch] = {}
        self._owned: WeakKeyDictionary[object, dict[tuple, Launch]] = WeakKeyDictionary()
        self.owned_misses = 0
        """Calls of :meth:`launch_by` that found no launch kept for their owner and key
        and kept one (the interpreter keeps none, and counts none)."""

    @dynamo_skip
    def __call__(self, tensors: tuple[Tensor, ...], scalars: tuple[int, ...],
                 **meta: Any) -> Launch | None:
        """Launch on ``tensors`` and ``scalars`` (in parameter order) with constexprs
        ``meta`` (those the autotuner and the heuristics do not set); the direct launch of
        this call's specialization, which serves later calls of the same key, or None where
        there is none (the interpreter, or a cache hook that skipped compiling)."""
        if not self.fast:
            self._launch(tensors, scalars, meta)
            return None
        device = tensors[0].device.index
        key = (device, alignment(tensors), *scalars, *meta.values(),
               *[t.dtype for t in tensors])
        launch = self._launches.get(key)
        if launch is None:
            compiled = self._launch(tensors, scalars, meta)
            if compiled is not None:
                launch = self._launches[key] = self._remember(compiled, tensors, scalars,
                                                              meta, device)
        else:
            launch(tensors)
        return launch

    @torch.compiler.disable
    def _launch(self, tensors: tuple[Tensor, ...], scalars: tuple[int, ...],
                meta: dict[str, Any]) -> Any:
        """Through the autotuner (tuning and compiling where needed); the compiled kernel
        that ran, or None (the interpreter, or a cache hook that skipped it).

        Never traced by ``torch.compile`` (a compiled graph reaches the kernels through the
        custom ops, whose bodies run outside it): where a graph break leaves the eager
        autograd path to Dynamo's frame conversion, it would trace the autotuner's launch
        and fail (torch 2.11, Triton 3.6: "Can't construct an AttrSource"). The wrapper of
        ``torch.compiler.disable`` costs microseconds a call, so the hot path (the cached
        launches of every step) is kept out by Dynamo's ``skip`` instead, which marks
        the functions' frames and adds nothing to a call."""
        named = {**dict(zip(self._names, tensors + scalars, strict=False)), **meta}
        # the interpreter hands the grid its own tensors for ints: read Python ints here
        return self.kernel[lambda bound: self.grid({**bound, **named})](
            *tensors, *scalars, **meta)

    def _remember(self, compiled: Any, tensors: tuple[Tensor, ...], scalars: tuple[int, ...],
                  meta: dict[str, Any], device: int | None) -> Launch:
        """The direct launch of ``compiled`` with the grid and the constexpr arguments as
        the autotuner and the heuristics chose them."""
        args = tensors + scalars
        named = {**dict(zip(self._names, args, strict=False)),
                 **meta, **self.kernel.best_config.kwargs}
        for name, rule in self._heuristics.items():
            named[name] = rule(named)
        grid = (*self.grid(named), 1, 1)[:3]
        constexprs = tuple(named[name] for name in self._names[len(args):])
        return Launch(compiled, grid, scalars + constexprs, device)

    @dynamo_skip
    def launch_by(self, owner: object, key: tuple, tensors: tuple[Tensor, ...],
                  arguments: Callable[[], tuple[tuple[int, ...], dict[str, Any]]]) -> None:
        """Launch on ``tensors`` by a key of the caller's: directly where ``owner`` (a
        topology) holds a launch of ``key``, else with ``arguments()`` (the scalars and
        the constexprs) as :meth:`__call__` does, keeping its launch for ``owner``.

        ``key`` must determine the arguments and the dtypes, the alignment and the device
        of ``tensors`` wherever ``owner`` does not: what it costs is only the key.
        """
        launches = self._owned.get(owner)
        launch = None if launches is None else launches.get(key)
        if launch is not None:
            launch(tensors)
            return
        scalars, meta = arguments()
        launch = self(tensors, scalars, **meta)
        if launch is not None:  # (None under the interpreter: nothing kept)
            self.owned_misses += 1
            launches = self._owned.setdefault(owner, {})
            if len(launches) >= OWNED_PER_OWNER:  # token counts that vary: the oldest go
                del launches[next(iter(launches))]
            launches[key] = launch


OWNED_PER_OWNER = 8
"""How many launches :meth:`TunedKernel.launch_by` keeps per owner and kernel (one per
token count, stride and alignment met), dropped with the owner."""
