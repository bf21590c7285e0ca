"""W8A8: the many-row GEMMs over an FP8 weight on the FP8 tensor cores, the activations quantized per row and 128
columns (issue 23 item 3: faster than dequantizing the weight for cuBLAS's bf16 GEMM from ~128 rows on at Qwen3-8B
shapes, BENCHMARKS.md sessions 19 and 20).

    y = (x as E4M3 codes * their scales) @ (w's codes * its scales).T, float32 accumulation, bf16 or float32 out

The activations: fp8_act_quant.cu, whose definition is quant.weight.quantize_fp8_block(x, (1, 128)); so a W8A8
product differs from the exact one by x's FP8 rounding (a relative 2^-4 per element at most), which is why only rows
that no decode is compared with take it (Backend.inexact_rows: prefill chunks, a drafter's rows), and only beyond
quantized_stream_max_rows; a decode's and a verify's rows keep W8A16 and its bits.
The weight's scales, in one of two forms cuBLASLt takes for its operand A:
  - on the 128 x 128 grid (Fp8Weight.block_grid: the Qwen -FP8 layout, random_fp8) with K / 128 a multiple of 4:
    Fp8Weight.scale as it is, [ceil(N / 128), K / 128] row-major, mode BLK128x128_32F (the 1D x 2D form the probe
    measured). At K = 384 (3 scale columns) cuBLASLt read these scales wrongly on the H200 (errors of 45% and more:
    its rows of scales are presumably 16-byte aligned), so such a weight takes the gathered form;
  - any other row map (the interleaved gate_up, a fused qkv off the grid, per-channel scales, a row slice): one
    scale per row and 128 columns, scale[rows[n], b] at [b, n] of a [K / 128, N] array gathered on the device at each
    GEMM (1/32 of the codes' bytes: ~3 MB at a Qwen3-8B gate_up), mode VEC128_32F (1D x 1D). Nothing is decided from
    device data: no sync, legal under graph capture.
Shapes: K % 128 == 0 and N % 16 == 0 (cuBLASLt's FP8 alignment); rows are padded to a multiple of 16 (zero codes).
"""
from __future__ import annotations

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.cublaslt import SCALE_BLK128X128_32F, SCALE_VEC128_32F, CublasLt
from cudflash.backends.cuda_util import cdiv, i32, i64
from cudflash.backends.fp8_weight import SCALE_COLS, Fp8Weight
from cudflash.backends.tuning import CudaTuning

ROW_MULTIPLE = 16  # rows of x per GEMM rounded up to this (the activation scales' rows, 16-byte aligned)


def usable(m: int, n: int, k: int) -> bool:
    """Whether x [m, k] @ w [n, k].T over an FP8 weight can run as W8A8 here."""
    return m >= 1 and k % SCALE_COLS == 0 and n % 16 == 0


def quantize_rows(x: cupy.ndarray, rows: int, tuning: CudaTuning) -> tuple[cupy.ndarray, cupy.ndarray]:
    """x [M, K] bf16 (unit column stride, rows 8-byte aligned) -> (codes [rows, K] uint8, scales [K / 128, rows]
    float32), rows >= M (the padding rows: zero codes, scale 1)."""
    m, k = x.shape
    codes = cupy.empty((rows, k), dtype=cupy.uint8)
    scales = cupy.empty((k // SCALE_COLS, rows), dtype=cupy.float32)
    ldx = x.strides[0] // x.itemsize if m > 1 else k
    kern = kernel_loader.function("fp8_act_quant", "fp8_act_quant", tuning=tuning)
    kern((rows, cdiv(k // SCALE_COLS, 4)), (128,), (x, i64(ldx), codes, scales, i32(m), i32(rows), i32(k)))
    return codes, scales


def weight_scales(w: Fp8Weight, block: bool | None = None) -> tuple[cupy.ndarray, int]:
    """(w's scales for the GEMM, their cuBLASLt mode): the block grid as it is where w is on it (or `block`), else
    the scales gathered per row and 128 columns, scale[rows[n], b] at [b, n] of [K / 128, N]."""
    aligned = w.shape[1] // SCALE_COLS % 4 == 0  # rows of block scales 16 bytes apart: all cuBLASLt reads right
    if (w.block_grid and aligned) if block is None else block:
        if not (w.block_grid and aligned):
            raise ValueError(f"block scales asked of a weight {list(w.shape)} off the 128 x 128 grid or with "
                             "K / 128 not a multiple of 4")
        return w.scale, SCALE_BLK128X128_32F
    return cupy.ascontiguousarray(w.scale[w.rows].T), SCALE_VEC128_32F


def gemm(lt: CublasLt, x: cupy.ndarray, w: Fp8Weight, out_dtype: np.dtype, tuning: CudaTuning,
         block: bool | None = None) -> cupy.ndarray:
    """y [M, N] of out_dtype (bf16 or float32) = W8A8 of x [M, K] bf16 @ w.T (`usable`); `block`: the weight's
    scale form (`weight_scales`; None: the grid's where it is on it)."""
    m = x.shape[0]
    rows = cdiv(m, ROW_MULTIPLE) * ROW_MULTIPLE
    codes, x_scales = quantize_rows(x, rows, tuning)
    y = cupy.empty((rows, w.shape[0]), dtype=out_dtype)
    w_scales, mode = weight_scales(w, block)
    lt.gemm_fp8(codes, x_scales, w.data, w_scales, mode, y)
    return y[:m]
