"""Compiling the CUDA sources (kernel_source.py) with NVRTC through cupy.RawModule, once per process for each source
folder and set of options a tuning asks for.

CuPy picks `-arch=sm_XX` for the current device itself. Kernels come back as `Kernel`, which launches like a
RawKernel and, while a CUDA graph is being captured and the tuning allows it, with programmatic dependent launch
(pdl.py).
"""
from __future__ import annotations

import functools

import cupy

from cudflash.backends import kernel_source, pdl
from cudflash.backends.tuning import CudaTuning

_OPTIONS: tuple[str, ...] = ()  # CuPy adds -arch for the device and --std=c++17 (v14) itself
# Every module compiled in this process, in order: (name, the tuning's extra NVRTC options, module). Tools that read
# a module's device globals (scripts/step_timeline.py) find their modules here.
loaded: list[tuple[str, tuple[str, ...], cupy.RawModule]] = []


@functools.cache
def _module(name: str, name_expressions: tuple[str, ...], kernel_dir: str | None,
            options: tuple[str, ...]) -> cupy.RawModule:
    mod = cupy.RawModule(code=kernel_source.source(name, kernel_dir), options=_OPTIONS + options,
                         name_expressions=name_expressions or None)
    loaded.append((name, options, mod))
    return mod


def module(name: str, name_expressions: tuple[str, ...] = (), *, tuning: CudaTuning) -> cupy.RawModule:
    """The compiled module of `<name>.cu` with the given template instantiations."""
    return _module(name, tuple(name_expressions), tuning.kernel_dir, tuning.nvrtc_options)


class Kernel:
    """A compiled kernel, called like a RawKernel: `kernel(grid, block, args, shared_mem=0)`."""

    def __init__(self, raw: cupy.RawKernel, use_pdl: bool, carveout: int = -1) -> None:
        self.raw = raw  # the CuPy kernel: attributes, dynamic shared memory opt-in
        if carveout >= 0:
            raw.preferred_shared_memory_carveout = carveout  # the tuning's shared_memory_carveout
        self.use_pdl = use_pdl  # the tuning's `pdl`
        self._shared = 0  # the dynamic shared memory opted in to so far (bytes)

    def programmatic(self, stream: cupy.cuda.Stream) -> bool:
        """Whether a launch on `stream` now goes with programmatic dependent launch: only inside a capture, where
        the gaps show (eager launches gain nothing worth the extra Python work per call)."""
        return self.use_pdl and stream.is_capturing() and pdl.available()

    def reserve_shared(self, nbytes: int) -> None:
        """Opt in to `nbytes` of dynamic shared memory per CTA (above the default 48 KiB)."""
        if nbytes > self._shared:
            self.raw.max_dynamic_shared_size_bytes = nbytes
            self._shared = nbytes

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
                 cluster: tuple[int, int, int] | None = None) -> None:
        """cluster: the CTAs of a thread block cluster (x, y, z dividing the grid's), which only cuLaunchKernelEx
        can ask for: such a launch always goes through pdl.launch, programmatic or not."""
        stream = cupy.cuda.get_current_stream()
        if self.programmatic(stream) or cluster is not None:
            pdl.launch(self.raw, grid, block, args, shared_mem, stream, self.programmatic(stream), cluster)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)


@functools.cache
def _function(name: str, kernel: str, name_expressions: tuple[str, ...], kernel_dir: str | None,
              options: tuple[str, ...], use_pdl: bool, carveout: int) -> Kernel:
    return Kernel(_module(name, name_expressions, kernel_dir, options).get_function(kernel), use_pdl, carveout)


def function(name: str, kernel: str, name_expressions: tuple[str, ...] = (), *, tuning: CudaTuning) -> Kernel:
    """One kernel of `<name>.cu`: an `extern "C"` name, or one of `name_expressions` (templates)."""
    return _function(name, kernel, tuple(name_expressions), tuning.kernel_dir, tuning.nvrtc_options, tuning.pdl,
                     tuning.carveout(kernel))
