"""Programmatic dependent launch (PDL): let a kernel start while the previous kernel in the stream drains.

A captured decode step is a chain of hundreds of small dependent kernels, and every boundary costs a launch and
a ramp-up during which SMs idle. Launched with the programmatic-stream-serialization attribute (Hopper and
later), a kernel's CTAs may be scheduled once every CTA of the previous kernel has started and signalled
(`griddepcontrol.launch_dependents`; a kernel that never signals, such as cuBLAS's, does so as its CTAs exit).
They then wait in `griddepcontrol.wait` until the previous kernel has finished and its writes are visible, so
the launch overlaps the predecessor's tail instead of following it. Every cudflash kernel begins with both
(`pdl_entry` in kernels/common.cuh): with a normal launch they are no-ops.

CuPy's RawKernel cannot set launch attributes, so this calls cuLaunchKernelEx on the driver library through
ctypes. `kernel_loader.Kernel` uses it only while a stream is capturing a CUDA graph and the tuning's `pdl` is on:
that is where the gaps show, and eager launches gain nothing worth the extra Python work per call.
"""
from __future__ import annotations

import ctypes
import functools

import cupy
import numpy as np

from cudflash.errors import BackendError

_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_SCALARS = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.float32: ctypes.c_float}


@functools.cache
def _driver() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """(cuLaunchKernelEx, cuGetErrorName), or None where the driver or the device cannot do PDL."""
    major, _ = divmod(int(cupy.cuda.Device().compute_capability), 10)
    if major < 9:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        launch, name = lib.cuLaunchKernelEx, lib.cuGetErrorName
    except (OSError, AttributeError):  # no driver library, or one older than CUDA 12
        return None
    launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p]
    launch.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    name.restype = ctypes.c_int
    return launch, name


def available() -> bool:
    """Whether this device and driver can launch programmatically."""
    return _driver() is not None


def _ctype(arg: object) -> ctypes._SimpleCData | ctypes.Structure:
    if isinstance(arg, cupy.ndarray):
        return ctypes.c_void_p(arg.data.ptr)
    if isinstance(arg, ctypes.Structure):  # passed by value (a CUtensorMap)
        return arg
    conv = _SCALARS.get(type(arg))
    if conv is None:
        raise BackendError(f"pdl launch: kernel argument of type {type(arg).__name__} (pass cupy arrays and "
                           "numpy int32 / int64 / float32 scalars)")
    return conv(arg.item())


def launch(kernel: cupy.RawKernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int,
           stream: cupy.cuda.Stream, programmatic: bool = True, cluster: tuple[int, int, int] | None = None) -> None:
    """kernel<<<grid, block, shared_mem, stream>>>(*args), allowed to overlap the previous kernel's tail if
    `programmatic` (else a plain launch, for arguments CuPy cannot pass: structures by value), in thread block
    clusters of `cluster` CTAs (x, y, z) if given."""
    if _driver() is None:
        raise BackendError("cuLaunchKernelEx is not available (a driver older than CUDA 12, or a GPU before Hopper)")
    launch_ex, error_name = _driver()
    values = [_ctype(a) for a in args]  # alive until the call returns; the driver copies them
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if programmatic:
        attrs[n].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value[0] = 1  # programmaticStreamSerializationAllowed
        n += 1
    if cluster is not None:
        attrs[n].id = _CLUSTER_DIMENSION
        attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster
        n += 1
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, stream.ptr,
                           ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), n)
    status = launch_ex(ctypes.byref(config), kernel.kernel.ptr, params, None)
    if status != 0:
        text = ctypes.c_char_p()
        error_name(status, ctypes.byref(text))
        raise BackendError(f"cuLaunchKernelEx failed: {(text.value or b'?').decode()} ({status})")
