"""Compiling the CUDA sources in `kernels/` with NVRTC (through cupy.RawModule), once per process.

Sources are found in the installed wheel (`cudflash.kernels`) or, in a source checkout, in the top-level
`kernels/` directory. Local `#include "x.cuh"` lines are inlined here rather than passed as `-I`: CuPy's
on-disk kernel cache is keyed by the source text, so an inlined header that changes also changes the key
(with `-I`, an edited header would silently reuse a stale cubin). `#line` directives keep NVRTC's error
messages pointing at the real file and line. CuPy picks `-arch=sm_XX` for the current device itself.
Kernels come back as `Kernel`, which launches like a RawKernel and, while a CUDA graph is being captured,
with programmatic dependent launch (pdl.py).
"""
from __future__ import annotations

import functools
import importlib.resources
import os
import re
from pathlib import Path

import cupy

from cudflash.backends import pdl, trace

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_OPTIONS: tuple[str, ...] = ()  # CuPy adds -arch for the device and --std=c++17 (v14) itself
# CUDFLASH_TRACE=1 compiles the step timeline in (common.cuh, trace.py): every module compiled that way is kept for
# scripts/step_timeline.py to read.
TRACE = os.environ.get("CUDFLASH_TRACE") == "1"
traced: list[tuple[str, cupy.RawModule]] = []


@functools.cache
def kernel_dir() -> Path:
    try:
        root = importlib.resources.files("cudflash.kernels")
        path = Path(str(root))
        if (path / "common.cuh").is_file():
            return path
    except Exception:  # not installed as a wheel (source checkout) or a namespace path without a file system
        pass
    return Path(__file__).resolve().parents[2] / "kernels"


def _expand(path: Path, seen: set[Path]) -> str:
    """The file's text with its local includes inlined (each at most once, like #pragma once)."""
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip() == "#pragma once":  # inlined once by construction; NVRTC warns about it in the main file
            out.append("")
            continue
        m = _INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        dep = (path.parent / m.group(1)).resolve()
        if dep not in seen:
            seen.add(dep)
            out.append(_expand(dep, seen))
        out.append(f'#line {lineno + 1} "{path}"')
    return "\n".join(out) + "\n"


@functools.cache
def source(name: str) -> str:
    """Full NVRTC source of `kernels/<name>.cu`."""
    path = kernel_dir() / f"{name}.cu"
    return _expand(path.resolve(), set())


@functools.cache
def module(name: str, name_expressions: tuple[str, ...] = ()) -> cupy.RawModule:
    """The compiled module of `kernels/<name>.cu` with the given template instantiations."""
    options = _OPTIONS + (("-DCF_TRACE", f"-DCF_TRACE_MODULE={trace.MODULES.index(name)}") if TRACE else ())
    mod = cupy.RawModule(code=source(name), options=options, name_expressions=name_expressions or None)
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
