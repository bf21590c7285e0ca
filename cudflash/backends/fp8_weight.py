"""An FP8 linear weight as the CUDA backend holds it: E4M3 codes with float32 scales per 128 columns, on the device.

    w[n, k] = e4m3(data[n, k]) * scale[rows[n], k // 128]

This is the layout of the Qwen -FP8 releases (128x128 blocks: rows[n] = n // 128) and of `quantize="fp8"`, and it
holds the other FP8 layouts exactly too: per-channel scales are 1-row blocks (rows[n] = n), a per-tensor scale one
block, and a fused or interleaved weight (qkv off the block grid, CudaBackend.gate_up_weight) maps each row to its
own part's scale row. The streaming GEMM (stream_gemm.py, W8) reads these bytes as they are; the many-row path
dequantizes them to bf16 for cuBLAS (`dequantize_bf16`). A checkpoint layout whose scale blocks are narrower than
128 columns (or not a multiple of 128 wide) does not fit: `fits` says so and the backend keeps its bf16 path.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.cuda_util import THREADS, cdiv, i32, interleave_groups_of_8
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError
from cudflash.quant.numerics import encode_e4m3
from cudflash.quant.weight import QuantizedWeight

SCALE_COLS = 128  # weight columns per scale: SG_W8_BLOCK in stream_gemm.cu, the 128 in fp8_dequant.cu
_DEQUANT_NAMES = ("fp8_dequant_bf16<1>", "fp8_dequant_bf16<4>")


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    data: cupy.ndarray  # [N, K] uint8 E4M3 codes, contiguous
    scale: cupy.ndarray  # [S, ceil(K / 128)] float32, contiguous
    rows: cupy.ndarray  # [N] int32: the scale row of each weight row
    # rows[n] = n // 128 with the scales' first rows one per 128-row block: the scales are the 128 x 128 grid as
    # cuBLASLt's BLK128x128 mode reads them (w8a8.py); set where a weight is made so (known on the host).
    block_grid: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def size(self) -> int:
        """Elements of the logical [N, K] weight (as an array's size: what a GEMM multiplies)."""
        return int(self.data.size)

    @property
    def nbytes(self) -> int:
        """The bytes a GEMM over this weight reads: codes, scales and the row map."""
        return int(self.data.nbytes + self.scale.nbytes + self.rows.nbytes)

    def __getitem__(self, rows: slice) -> Fp8Weight:
        """Rows lo:hi as a weight of their own, sharing the codes and the scales (a view: a layer's rows of the
        drafter's fused K/V weight). The row map keeps pointing into the whole scale array."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"an Fp8Weight takes a slice of rows, got {rows!r}")
        return Fp8Weight(self.data[rows], self.scale, self.rows[rows], self.block_grid and rows.start in (None, 0))


def fits(w: QuantizedWeight) -> bool:
    """Whether an fp8 QuantizedWeight has a scale per 128-column block (or wider blocks that are multiples of 128,
    or one block across all of K): then every 128 columns of a row share one scale."""
    cols = w.block[1]
    return w.format == "fp8" and (cols % SCALE_COLS == 0 or cols >= w.shape[1])


def upload(w: QuantizedWeight) -> Fp8Weight:
    """The weight on the device, its scales re-indexed per 128 columns (exact: only copies of the same float32
    values). The caller checks `fits`."""
    n, k = w.shape
    if not fits(w):
        raise BackendError(f"{w.source}: fp8 scale blocks {w.block} do not cover whole 128-column blocks")
    scale = np.asarray(w.scale, dtype=np.float32)
    col_of_block = np.minimum(np.arange(cdiv(k, SCALE_COLS)) * SCALE_COLS // w.block[1], scale.shape[1] - 1)
    rows = w.row_scales().astype(np.int32)
    grid = scale.shape[0] == cdiv(n, 128) and np.array_equal(rows, np.arange(n) // 128)
    return Fp8Weight(cupy.asarray(np.ascontiguousarray(w.data, dtype=np.uint8)),
                     cupy.asarray(np.ascontiguousarray(scale[:, col_of_block])), cupy.asarray(rows), bool(grid))


def take_rows(w: Fp8Weight, rows: cupy.ndarray) -> Fp8Weight:
    """The weight rows `rows` (int32 on the device), in that order: a new code array, each row keeping its scale row
    (a hybrid's q_proj split into query and gate channels, permuted within heads)."""
    return Fp8Weight(cupy.take(w.data, rows, axis=0), w.scale, cupy.take(w.rows, rows))


def concat(parts: list[Fp8Weight]) -> Fp8Weight:
    """Parts stacked along the rows, every row keeping its own scales: the scale arrays end to end, each part's row
    map offset by the scale rows in front of it."""
    if len({p.shape[1] for p in parts}) != 1 or len({p.scale.shape[1] for p in parts}) != 1:
        raise BackendError(f"cuda cat: FP8 parts {[p.shape for p in parts]} differ in K or scale columns")
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + p.scale.shape[0])
    grid = all(p.block_grid and p.scale.shape[0] == cdiv(p.shape[0], 128) for p in parts) and all(
        p.shape[0] % 128 == 0 for p in parts[:-1])  # every part on the grid, the seams on block boundaries
    return Fp8Weight(cupy.concatenate([p.data for p in parts]), cupy.concatenate([p.scale for p in parts]),
                     cupy.concatenate([p.rows + off for p, off in zip(parts, offsets)]).astype(cupy.int32), grid)


def interleave_gate_up(gate: Fp8Weight, up: Fp8Weight) -> Fp8Weight:
    """The gate_up weight of CudaBackend.gate_up_weight (rows in groups of 8: gate 8 j .. 8 j + 7, then up's), each
    row keeping its own scale row: up's scale rows follow gate's."""
    inter = gate.shape[0]
    if up.shape != gate.shape or inter % 8 or up.scale.shape[1] != gate.scale.shape[1]:
        raise BackendError(f"cuda gate_up: gate {gate.shape} and up {up.shape} must match, rows a multiple of 8")
    return Fp8Weight(interleave_groups_of_8(gate.data, up.data), cupy.concatenate([gate.scale, up.scale]),
                     interleave_groups_of_8(gate.rows, up.rows + gate.scale.shape[0]))


def dequantize_bf16(w: Fp8Weight, act: np.dtype, tuning: CudaTuning) -> cupy.ndarray:
    """The weight as a new bf16 [N, K] array (fp8_dequant.cu): the numpy backend's float32 values rounded once."""
    n, k = w.shape
    out = cupy.empty((n, k), dtype=act)
    vec = 4 if k % 4 == 0 else 1
    if n * k:
        kern = kernel_loader.function("fp8_dequant", f"fp8_dequant_bf16<{vec}>", _DEQUANT_NAMES, tuning=tuning)
        blocks = min(cdiv(n * k // vec, THREADS), 65535 * 8)
        kern((blocks,), (THREADS,), (w.data, w.scale, w.rows, i32(w.scale.shape[1]), out, i32(n), i32(k)))
    return out


def random_fp8(shape: tuple[int, int], std: float, seed: int) -> Fp8Weight:
    """A synthetic weight made on the device with the shape's 128x128 block grid: values ~ N(0, std^2) as E4M3
    codes of N(0, 1) * 448 / 5 (so 5 sigma is the largest code) with every block's scale 5 std / 448, the value
    spread a block-scaled quantization of such a weight gives. For timing (bench --synthetic --weights fp8)."""
    n, k = shape
    gen = cupy.random.RandomState(seed)
    data = cupy.empty((n, k), dtype=cupy.uint8)
    step = max(1, (1 << 26) // max(k, 1))  # rows per chunk: at most 64M float32 values at a time
    for lo in range(0, n, step):
        x = gen.standard_normal((min(step, n - lo), k), dtype=cupy.float32) * cupy.float32(448.0 / 5.0)
        data[lo:lo + x.shape[0]] = encode_e4m3(x, xp=cupy)
    scale = cupy.full((cdiv(n, 128), cdiv(k, SCALE_COLS)), 5.0 * std / 448.0, dtype=cupy.float32)
    return Fp8Weight(data, scale, cupy.arange(n, dtype=cupy.int32) // 128, True)
