"""A cuBLAS handle owned by cudflash, driven through ctypes: bf16 GEMMs that are legal inside CUDA graph capture.

CuPy's own cuBLAS wrappers call `cublasSetStream` with a capture check and refuse to run while a stream is
capturing, so cudflash keeps its own handle on the same shared library CuPy loaded. The handle follows the
current CuPy stream (re-bound only when the stream changes; `cublasSetStream` is host-side bookkeeping and
legal during capture) and always uses a workspace we allocated, so a captured GEMM never asks cuBLAS for
memory of its own. Scalars are host-pointer-mode float32 constants, baked into a graph at capture time.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import re

import cupy

from cudflash.errors import BackendError

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_16BF = 14
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper

_LIB_RE = re.compile(r"/libcublas\.so(\.\d+)*$")


def _loaded_cublas() -> str | None:
    """Path of a libcublas.so already mapped into this process (CuPy's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and _LIB_RE.search(fields[5].strip()):
                    return fields[5].strip()
    except OSError:
        pass
    return None


def _find_cublas() -> str:
    path = _loaded_cublas()
    if path:
        return path
    try:  # CuPy's binding pulls the library in; then it is the one we want to share
        import cupy_backends.cuda.libs.cublas  # noqa: F401
        path = _loaded_cublas()
        if path:
            return path
    except Exception:
        pass
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        return load_nvidia_dynamic_lib("cublas").abs_path
    except Exception:
        pass
    candidates = [ctypes.util.find_library("cublas"), "libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for name in candidates:
        if not name:
            continue
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise BackendError("cannot find libcublas (install the nvidia-cublas wheel or the CUDA toolkit)")


def _symbol(lib: ctypes.CDLL, *names: str):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise BackendError(f"libcublas lacks {names[0]}")


class Cublas:
    """One handle, one workspace; `gemm_bf16` computes y = x @ w.T on the current CuPy stream."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.path = _find_cublas()
        self.lib = ctypes.CDLL(self.path)  # dlopen of an already-loaded library returns that same copy
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._create = _symbol(self.lib, "cublasCreate_v2", "cublasCreate")
        self._destroy = _symbol(self.lib, "cublasDestroy_v2", "cublasDestroy")
        self._set_stream = _symbol(self.lib, "cublasSetStream_v2", "cublasSetStream")
        self._set_workspace = _symbol(self.lib, "cublasSetWorkspace_v2", "cublasSetWorkspace")
        self._gemm = _symbol(self.lib, "cublasGemmEx")
        self._create.argtypes = [ctypes.POINTER(vp)]
        self._destroy.argtypes = [vp]
        self._set_stream.argtypes = [vp, vp]
        self._set_workspace.argtypes = [vp, vp, ctypes.c_size_t]
        self._gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for fn in (self._create, self._destroy, self._set_stream, self._set_workspace, self._gemm):
            fn.restype = i

        handle = vp()
        self._check(self._create(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)  # [workspace_bytes] cuBLAS scratch
        self._alpha = ctypes.c_float(1.0)  # host-pointer-mode scalars, alive as long as the handle
        self._beta = ctypes.c_float(0.0)
        self._stream: int | None = None

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise BackendError(f"{what} failed with cuBLAS status {status}")

    def bind(self, stream_ptr: int) -> None:
        """Point the handle at a stream; cublasSetStream resets the workspace, so set ours again after it."""
        if stream_ptr == self._stream:
            return
        self._check(self._set_stream(self.handle, stream_ptr), "cublasSetStream")
        self._check(self._set_workspace(self.handle, self.workspace.data.ptr, self.workspace.nbytes),
                    "cublasSetWorkspace")
        self._stream = stream_ptr

    def gemm_bf16(self, x: cupy.ndarray, w: cupy.ndarray, y: cupy.ndarray) -> None:
        """y[M, N] = x[M, K] @ w[N, K].T; x may be row-strided, w and y are contiguous; x and w bf16, y bf16 or
        float32 (logits), float32 accumulation either way.

        Column-major view: y^T (N x M, ld N) = op_T(w as K x N, ld K) @ (x^T as K x M, ld = x's row stride).
        """
        m, k = x.shape
        n = w.shape[0]
        ldx = x.strides[0] // x.itemsize if m > 1 else k  # a one-row view may report any row stride
        self.bind(cupy.cuda.get_current_stream().ptr)
        ytype = CUDA_R_32F if y.dtype == cupy.float32 else CUDA_R_16BF
        status = self._gemm(self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._alpha),
                            w.data.ptr, CUDA_R_16BF, k, x.data.ptr, CUDA_R_16BF, ldx, ctypes.byref(self._beta),
                            y.data.ptr, ytype, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        self._check(status, "cublasGemmEx")

    def __del__(self) -> None:
        try:
            if getattr(self, "handle", None) is not None:
                self._destroy(self.handle)
        except Exception:
            pass
