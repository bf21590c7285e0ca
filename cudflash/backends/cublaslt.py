"""A cuBLASLt handle owned by cudflash, driven through ctypes: the FP8 x FP8 GEMMs of W8A8 (w8a8.py) with block
scales, legal inside CUDA graph capture like cublas.Cublas's bf16 GEMMs.

One GEMM: y [M, N] (bf16 or float32) = x [M, K] @ w [N, K].T, with x and w E4M3 codes and float32 scales. In cuBLAS's
column-major terms A = w (K x N, ld K, transposed), B = x (K x M, ld K), D = y^T (N x M, ld N): the "TN" form the
FP8 tensor cores take. The scales (Hopper, cuBLAS >= 12.9): the activations' per row and 128 columns
(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F), the weight's per 128 x 128 block (BLK128x128_32F) or per row and 128
columns (VEC128_32F); cuBLASLt takes 1D x 1D, 1D x 2D and 2D x 1D, not 2D x 2D. Their memory layouts are w8a8.py's.
The descriptors and the heuristic's algorithm are made once per (M, N, K, weight scale mode) and kept; the
workspace is ours, so a captured GEMM never asks cuBLASLt for memory.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import cupy

from cudflash.backends.cublas import CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_32F
from cudflash.errors import BackendError

CUDA_R_8F_E4M3 = 28
# cublasLtMatmulDescAttributes_t
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 3, 4, 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t
SCALE_VEC128_32F, SCALE_BLK128X128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20
_HEURISTIC_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo (64), workspaceSize, state, wavesCount, reserved[4]

_LIB_RE = re.compile(r"/libcublasLt\.so(\.\d+)*$")


def _find_cublaslt() -> str:
    """libcublasLt beside the libcublas this process uses (cuBLAS loads it), else by name."""
    from cudflash.backends.cublas import _find_cublas

    _find_cublas()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and _LIB_RE.search(fields[5].strip()):
                    return fields[5].strip()
    except OSError:
        pass
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise BackendError("cannot find libcublasLt (it comes with libcublas: the nvidia-cublas wheel or the toolkit)")


def library_version() -> int:
    """cublasLtGetVersion of the library CublasLt loads (120900 for 12.9: the first with the 128-column scales)."""
    lib = ctypes.CDLL(_find_cublaslt())
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return int(lib.cublasLtGetVersion())


@dataclass
class _Plan:
    desc: ctypes.c_void_p  # cublasLtMatmulDesc_t
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A (w), B (x), C = D (y)
    algo: ctypes.Array  # the heuristic's cublasLtMatmulAlgo_t, 64 bytes


class CublasLt:
    """One handle, one workspace; `gemm_fp8` computes y = (x scaled) @ (w scaled).T on the current CuPy stream."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.lib = ctypes.CDLL(_find_cublaslt())
        vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        sig = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, vp, ctypes.POINTER(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        self.fn = {}
        for name, args in sig.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, i
            self.fn[name] = f
        self.handle = vp()
        self._check(self.fn["cublasLtCreate"](ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)  # [workspace_bytes] cuBLASLt scratch
        self.pref = vp()
        self._check(self.fn["cublasLtMatmulPreferenceCreate"](ctypes.byref(self.pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        self._check(self.fn["cublasLtMatmulPreferenceSetAttribute"](
            self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)), "PreferenceSetAttribute")
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)  # host-pointer-mode scalars
        self._plans: dict[tuple[int, int, int, int, int], _Plan] = {}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise BackendError(f"cuBLASLt {what} failed with status {status}")

    def _set(self, desc: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData) -> None:
        self._check(self.fn["cublasLtMatmulDescSetAttribute"](desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    f"MatmulDescSetAttribute({attr})")

    def _point(self, desc: ctypes.c_void_p, scales: tuple[int, int]) -> None:
        """The descriptor's scale pointers: A's (the weight's) and B's (x's), device addresses."""
        self._set(desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(scales[0]))
        self._set(desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(scales[1]))

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self._check(self.fn["cublasLtMatrixLayoutCreate"](ctypes.byref(out), dtype, rows, cols, ld),
                    "MatrixLayoutCreate")
        return out

    def _plan(self, m: int, n: int, k: int, w_mode: int, y_type: int, scales: tuple[int, int]) -> _Plan:
        """The descriptors and algorithm of one GEMM shape. `scales` (A's, B's device pointers) are set before the
        heuristic: with block scale modes it refuses a descriptor whose scale pointers are null (status 7)."""
        key = (m, n, k, w_mode, y_type)
        if key in self._plans:
            return self._plans[key]
        desc = ctypes.c_void_p()
        self._check(self.fn["cublasLtMatmulDescCreate"](ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "MatmulDescCreate")
        self._set(desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        self._set(desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        self._set(desc, DESC_A_SCALE_MODE, ctypes.c_int32(w_mode))
        self._set(desc, DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_VEC128_32F))
        self._point(desc, scales)
        layouts = (self._layout(CUDA_R_8F_E4M3, k, n, k), self._layout(CUDA_R_8F_E4M3, k, m, k),
                   self._layout(y_type, n, m, n))
        vp = ctypes.c_void_p
        result = (ctypes.c_ubyte * _HEURISTIC_BYTES)()
        found = ctypes.c_int(0)
        self._check(self.fn["cublasLtMatmulAlgoGetHeuristic"](
            self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], self.pref, 1, ctypes.cast(result, vp),
            ctypes.byref(found)), "MatmulAlgoGetHeuristic")
        if found.value < 1:
            raise BackendError(f"cuBLASLt has no FP8 algorithm for M {m}, N {n}, K {k}, weight scale mode {w_mode}")
        plan = _Plan(desc, layouts, (ctypes.c_ubyte * 64).from_buffer_copy(bytes(result)[:64]))
        self._plans[key] = plan
        return plan

    def gemm_fp8(self, x_codes: cupy.ndarray, x_scales: cupy.ndarray, w_codes: cupy.ndarray,
                 w_scales: cupy.ndarray, w_mode: int, y: cupy.ndarray) -> None:
        """y [M, N] (bf16 or float32, contiguous) = x @ w.T: x_codes [M, K] and w_codes [N, K] uint8 E4M3
        contiguous, x_scales in VEC128_32F's layout, w_scales in w_mode's (w8a8.py makes both); K % 128 == 0."""
        (m, k), n = x_codes.shape, w_codes.shape[0]
        scales = (w_scales.data.ptr, x_scales.data.ptr)
        plan = self._plan(m, n, k, w_mode, CUDA_R_32F if y.dtype == cupy.float32 else CUDA_R_16BF, scales)
        self._point(plan.desc, scales)
        a, b, c = plan.layouts
        self._check(self.fn["cublasLtMatmul"](
            self.handle, plan.desc, ctypes.byref(self._alpha), w_codes.data.ptr, a, x_codes.data.ptr, b,
            ctypes.byref(self._beta), y.data.ptr, c, y.data.ptr, c, ctypes.cast(plan.algo, ctypes.c_void_p),
            self.workspace.data.ptr,
            self.workspace.nbytes, cupy.cuda.get_current_stream().ptr), "Matmul")
