"""Small helpers of the CUDA backend: the bf16 storage dtype, host-side bf16 rounding, launch arithmetic and
the layout checks every 16-byte-vector kernel relies on."""
from __future__ import annotations

import functools

import cupy
import numpy as np

from cudflash.errors import BackendError

THREADS = 256  # default block size of the flat element-wise kernels


@functools.cache
def act_dtype() -> np.dtype:
    """CuPy's bfloat16 (CuPy >= 14 with ml_dtypes) when it works, else raw uint16 bits.

    Kernels only see pointers, so both behave the same; the bf16 dtype merely makes arrays print and convert
    sensibly outside cudflash. Data movement (cat, take_rows, copies) always goes through uint16 views, which
    never needs CuPy's own bf16 kernels.
    """
    try:
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
        cupy.empty((1,), dtype=dt)
        return dt
    except Exception:
        return np.dtype(np.uint16)


def bits(x: cupy.ndarray) -> cupy.ndarray:
    """The same memory as uint16 (a free view)."""
    return x.view(cupy.uint16)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Host float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def as_rows(x: cupy.ndarray) -> cupy.ndarray:
    """A 2-D view [rows, last dim] of x (1-D becomes one row)."""
    if x.ndim == 2:
        return x
    if x.ndim == 1:
        return x[None, :]
    if not x.flags.c_contiguous:
        x = cupy.ascontiguousarray(bits(x)).view(x.dtype)
    return x.reshape(-1, x.shape[-1])


def vec_rows(x: cupy.ndarray, what: str) -> tuple[cupy.ndarray, int]:
    """(x or a contiguous copy, row stride in elements) such that every row starts 16-byte aligned.

    Column slices of fused GEMM outputs (the usual strided input) satisfy this as they are, so the copy is a
    fallback for odd views only.
    """
    if x.dtype != act_dtype():
        raise BackendError(f"cuda backend: {what} must be bf16 ('act'), got {x.dtype}")
    if x.ndim != 2:
        raise BackendError(f"cuda backend: {what} must be 2-D, got shape {x.shape}")
    if x.shape[1] % 8:
        raise BackendError(f"cuda backend: {what} width {x.shape[1]} is not a multiple of 8")
    stride = x.strides[0] // 2 if x.shape[0] > 1 else x.shape[1]
    aligned = x.strides[1] == 2 and x.strides[0] % 2 == 0 and stride % 8 == 0 and x.data.ptr % 16 == 0
    if aligned and stride >= x.shape[1]:
        return x, stride
    y = cupy.ascontiguousarray(bits(x)).view(x.dtype)
    return y, y.shape[1]


def rows_any(x: cupy.ndarray, what: str) -> tuple[cupy.ndarray, int]:
    """vec_rows for bf16 rows, and the same 16-byte row alignment for float32 rows (the residual stream)."""
    if x.dtype != cupy.float32:
        return vec_rows(x, what)
    if x.ndim != 2 or x.shape[1] % 8:
        raise BackendError(f"cuda backend: {what} must be 2-D with a width that is a multiple of 8, got {x.shape}")
    stride = x.strides[0] // 4 if x.shape[0] > 1 else x.shape[1]
    if x.strides[1] == 4 and x.strides[0] % 4 == 0 and stride % 4 == 0 and x.data.ptr % 16 == 0 \
            and stride >= x.shape[1]:
        return x, stride
    return cupy.ascontiguousarray(x), x.shape[1]


def interleave_groups_of_8(a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
    """Rows of a and b (the same shape [N, ...], N % 8 == 0) in groups of 8: a's rows 8 j .. 8 j + 7, then b's, for
    j = 0, 1, ...: [2 N, ...]. The row order of CudaBackend.gate_up_weight (gate, up) for every weight format."""
    n, rest = a.shape[0], a.shape[1:]
    out = cupy.empty((n // 8, 2, 8) + rest, dtype=a.dtype)  # [groups, a | b, 8 rows, ...]
    out[:, 0] = a.reshape((n // 8, 8) + rest)
    out[:, 1] = b.reshape((n // 8, 8) + rest)
    return out.reshape((2 * n,) + rest)


def device_i32(x) -> cupy.ndarray:
    """An int32 device array (uploading host arrays; device arrays of another int type are converted)."""
    if isinstance(x, cupy.ndarray):
        return x if x.dtype == np.int32 else x.astype(np.int32)
    return cupy.asarray(np.asarray(x, dtype=np.int32))


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)


def f32(v: float) -> np.float32:
    return np.float32(v)
