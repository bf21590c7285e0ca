"""cuBLASLt through ctypes: the few calls needed to list a GEMM's candidate algorithms and run a chosen one.

cublasGemmEx takes the first algorithm cuBLAS's heuristic ranks for a shape. For the skinny GEMMs of decoding
(a few rows against a weight of tens of MB, purely bandwidth-bound) that choice is sometimes 10-20% slower than
another candidate of the same heuristic list; `Cublas` (cublas.py) times the candidates once per shape and keeps
the fastest. This module only binds the library: descriptors, the heuristic query and cublasLtMatmul.

Layout convention (column-major, as cuBLAS sees our row-major arrays): y^T [N, M] = op_T(w^T [K, N]) @ x^T [K, M].
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from cudflash.errors import BackendError

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_16BF, CUDA_R_32F = 14, 0
CUBLAS_COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
MAX_CANDIDATES = 8


class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t: opaque, 8 x uint64
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass(slots=True)
class LtPlan:
    """Descriptors of one GEMM shape and its candidate algorithms (heuristic order; `chosen` indexes them)."""

    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # w, x, y
    candidates: list[Algo]
    chosen: int = 0


class CublasLt:
    def __init__(self, path: str, workspace_bytes: int):
        self.lib = lib = ctypes.CDLL(path)
        vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        sigs = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(HeuristicResult),
                                               ctypes.POINTER(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(Algo), vp, sz, vp],
        }
        for name, args in sigs.items():
            if not hasattr(lib, name):
                raise BackendError(f"libcublasLt lacks {name}")
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i
        self.handle = vp()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace_bytes = workspace_bytes
        self.pref = vp()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                             ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise BackendError(f"{what} failed with cuBLAS status {status}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def plan(self, m: int, n: int, k: int, ldx: int, y_dtype: int) -> LtPlan | None:
        """y[M, N] = x[M, K] @ w[N, K].T with bf16 x, w; None when the heuristic offers nothing for the shape."""
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), 4),
                        "cublasLtMatmulDescSetAttribute")
        layouts = (self._layout(CUDA_R_16BF, k, n, k), self._layout(CUDA_R_16BF, k, m, ldx),
                   self._layout(y_dtype, n, m, n))
        results = (HeuristicResult * MAX_CANDIDATES)()
        found = ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2],
                                                         layouts[2], self.pref, MAX_CANDIDATES, results,
                                                         ctypes.byref(found))
        algos = [results[j].algo for j in range(found.value)
                 if results[j].state == 0 and results[j].workspace_size <= self.workspace_bytes]
        if status != 0 or not algos:
            return None
        return LtPlan(desc, layouts, algos)

    def matmul(self, plan: LtPlan, algo: int, x_ptr: int, w_ptr: int, y_ptr: int, alpha: ctypes.c_float,
               beta: ctypes.c_float, workspace_ptr: int, stream_ptr: int) -> None:
        wl, xl, yl = plan.layouts
        status = self.lib.cublasLtMatmul(self.handle, plan.desc, ctypes.byref(alpha), w_ptr, wl, x_ptr, xl,
                                         ctypes.byref(beta), y_ptr, yl, y_ptr, yl,
                                         ctypes.byref(plan.candidates[algo]), workspace_ptr, self.workspace_bytes,
                                         stream_ptr)
        self._check(status, "cublasLtMatmul")
