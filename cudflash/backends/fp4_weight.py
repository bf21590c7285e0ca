"""An NVFP4 linear weight as the CUDA backend holds it: 4-bit codes, a byte per 16-column scale and a global scale
per row, on the device, in the layout of w4_layout.py:

    w[n, k] = code(data, n, k) * scale(scale[n, k // 16]) * 2^-7 * gscale[n]

the same float32 values as the checkpoint's (quant.weight.dequantize). The streaming GEMM (stream_gemm.py, W4) reads
these bytes as they are, 0.5625 bytes per weight; the many-row path dequantizes them to bf16 for cuBLAS
(`dequantize_bf16`). Any NVFP4 layout fits (K % 16 == 0 is the format's own rule); the streaming GEMM wants
K % 512 == 0 and the many-row path takes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from cudflash.backends import kernel_loader, w4_layout
from cudflash.backends.cuda_util import THREADS, cdiv, i32, interleave_groups_of_8
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError
from cudflash.quant.weight import NVFP4_GROUP, QuantizedWeight


@dataclass(frozen=True, eq=False)
class Fp4Weight:
    data: cupy.ndarray  # [N, K / 2] uint8: code words, 8 codes per 32 bits (w4_layout.pack_codes)
    scale: cupy.ndarray  # [N, K / 16] uint8: scale bytes (w4_layout.encode_scales)
    gscale: cupy.ndarray  # [N] float32: each row's global scale * 2^7

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.data.shape[0]), 2 * int(self.data.shape[1])

    @property
    def size(self) -> int:
        """Elements of the logical [N, K] weight (as an array's size: what a GEMM multiplies)."""
        n, k = self.shape
        return n * k

    @property
    def nbytes(self) -> int:
        """The bytes a GEMM over this weight reads: codes, scale bytes and the global scales."""
        return int(self.data.nbytes + self.scale.nbytes + self.gscale.nbytes)

    def __getitem__(self, rows: slice) -> Fp4Weight:
        """Rows lo:hi as a weight of their own (views of the codes, scales and global scales: a layer's rows of the
        drafter's fused K/V weight)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"an Fp4Weight takes a slice of rows, got {rows!r}")
        return Fp4Weight(self.data[rows], self.scale[rows], self.gscale[rows])

    def any_nonzero(self) -> bool:
        words = self.data.view(cupy.uint32)
        magnitudes = cupy.uint32(~w4_layout.SIGN_BITS & 0xFFFFFFFF)
        return bool(cupy.any(words & magnitudes)) and bool(cupy.any(self.gscale != 0))


def fits(w: QuantizedWeight) -> bool:
    return w.format == "nvfp4" and w.shape[1] % NVFP4_GROUP == 0


def upload(w: QuantizedWeight) -> Fp4Weight:
    """The weight on the device in the kernel's layout (exact: the same values, see w4_layout). A NaN scale or a
    non-finite global scale is refused here, by the tensor's name."""
    n, k = w.shape
    if not fits(w):
        raise BackendError(f"{w.source}: NVFP4 weight [{n}, {k}] needs K % {NVFP4_GROUP} == 0")
    g = np.asarray(w.global_scale, dtype=np.float32).reshape(-1)
    if g.size not in (1, n) or not np.all(np.isfinite(g)):
        raise BackendError(f"{w.source}: the NVFP4 global scale must be finite, one per tensor or per row "
                           f"(got {g.size} values)")
    try:
        data, scale, gscale = w4_layout.device_layout(cupy.asarray(w.data), cupy.asarray(w.scale), cupy.asarray(g),
                                                      xp=cupy)
    except ValueError as e:
        raise BackendError(f"{w.source}: NVFP4 weight has a {e}") from None
    return Fp4Weight(data, scale, gscale)


def take_rows(w: Fp4Weight, rows: cupy.ndarray) -> Fp4Weight:
    """The weight rows `rows` (int32 on the device), in that order, with their scales."""
    return Fp4Weight(cupy.take(w.data, rows, axis=0), cupy.take(w.scale, rows, axis=0), cupy.take(w.gscale, rows))


def concat(parts: list[Fp4Weight]) -> Fp4Weight:
    """Parts stacked along the rows, with their scales."""
    if len({p.shape[1] for p in parts}) != 1:
        raise BackendError(f"cuda cat: NVFP4 parts {[p.shape for p in parts]} differ in K")
    return Fp4Weight(*(cupy.concatenate([getattr(p, f) for p in parts]) for f in ("data", "scale", "gscale")))


def interleave_gate_up(gate: Fp4Weight, up: Fp4Weight) -> Fp4Weight:
    """The gate_up weight of CudaBackend.gate_up_weight (rows in groups of 8: gate 8 j .. 8 j + 7, then up's), each
    row with its own scales."""
    inter = gate.shape[0]
    if up.shape != gate.shape or inter % 8:
        raise BackendError(f"cuda gate_up: gate {gate.shape} and up {up.shape} must match, rows a multiple of 8")
    return Fp4Weight(*(interleave_groups_of_8(getattr(gate, f), getattr(up, f)) for f in ("data", "scale", "gscale")))


def dequantize_bf16(w: Fp4Weight, act: np.dtype, tuning: CudaTuning) -> cupy.ndarray:
    """The weight as a new bf16 [N, K] array (fp4_dequant.cu): the numpy backend's float32 values rounded once."""
    n, k = w.shape
    out = cupy.empty((n, k), dtype=act)
    if n * k:
        kern = kernel_loader.function("fp4_dequant", "fp4_dequant_bf16", ("fp4_dequant_bf16",), tuning=tuning)
        blocks = min(cdiv(n * k // 8, THREADS), 65535 * 8)
        kern((blocks,), (THREADS,), (w.data, w.scale, w.gscale, out, i32(n), i32(k)))
    return out


def random_fp4(shape: tuple[int, int], std: float, seed: int) -> Fp4Weight:
    """A synthetic weight made on the device: uniformly random codes (any byte is a valid code word), every scale
    1.0 and a global scale that gives the values a spread of `std` (the codes' root mean square is 2.93). For
    timing (bench --synthetic --weights nvfp4)."""
    n, k = shape
    gen = cupy.random.RandomState(seed)
    data = gen.randint(0, 256, size=(n, k // 2), dtype=cupy.int32).astype(cupy.uint8)
    one, _, _ = w4_layout.encode_scales(np.array([0x38], dtype=np.uint8))  # E4M3 1.0
    scale = cupy.full((n, k // NVFP4_GROUP), int(one[0]), dtype=cupy.uint8)
    gscale = cupy.full((n,), std / 2.93 * 2.0 ** w4_layout.PRODUCT_SHIFT, dtype=cupy.float32)
    return Fp4Weight(data, scale, gscale)
