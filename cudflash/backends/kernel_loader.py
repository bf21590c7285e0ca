"""Compiling the CUDA sources (kernel_source.py) with NVRTC through cupy.RawModule, once per process.

CuPy picks `-arch=sm_XX` for the current device itself. Kernels come back as `Kernel`, which launches like a
RawKernel and, while a CUDA graph is being captured, with programmatic dependent launch (pdl.py).
"""
from __future__ import annotations

import functools
import os

import cupy

from cudflash.backends import kernel_source, pdl, trace

_OPTIONS: tuple[str, ...] = ()  # CuPy adds -arch for the device and --std=c++17 (v14) itself
# CUDFLASH_TRACE=1 compiles the step timeline in (common.cuh, trace.py): every module compiled that way is kept for
# scripts/step_timeline.py to read.
TRACE = os.environ.get("CUDFLASH_TRACE") == "1"
traced: list[tuple[str, cupy.RawModule]] = []


@functools.cache
def module(name: str, name_expressions: tuple[str, ...] = ()) -> cupy.RawModule:
    """The compiled module of `kernels/<name>.cu` with the given template instantiations."""
    options = _OPTIONS + (("-DCF_TRACE", f"-DCF_TRACE_MODULE={trace.MODULES.index(name)}") if TRACE else ())
    mod = cupy.RawModule(code=kernel_source.source(name), options=options, name_expressions=name_expressions or None)
    if TRACE:
        traced.append((name, mod))
    return mod


class Kernel:
    """A compiled kernel, called like a RawKernel: `kernel(grid, block, args, shared_mem=0)`."""

    def __init__(self, raw: cupy.RawKernel) -> None:
        self.raw = raw  # the CuPy kernel: attributes, dynamic shared memory opt-in

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing() and pdl.available():
            pdl.launch(self.raw, grid, block, args, shared_mem, stream)
        else:
            self.raw(grid, block, args, shared_mem=shared_mem)


@functools.cache
def function(name: str, kernel: str, name_expressions: tuple[str, ...] = ()) -> Kernel:
    """One kernel of `kernels/<name>.cu`: an `extern "C"` name, or one of `name_expressions` (templates)."""
    return Kernel(module(name, name_expressions).get_function(kernel))
