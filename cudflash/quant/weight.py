"""A quantized linear weight as it lives in memory: packed codes, scales, and the rule that maps one to the other.

`QuantizedWeight` is what the WeightLoader hands to `Backend.load_quantized`, whatever the checkpoint's format: the
model code never sees it. Two formats (docs/quantization.md):

- "fp8": E4M3 codes [N, K] (uint8), one float32 scale per block of `block` = (rows, cols) elements:
      w[n, k] = e4m3(data[n, k]) * scale[scale_row(n), k // cols]
  Qwen's 128x128 block scales (`weight_scale_inv`) are block (128, 128); compressed-tensors per-channel scales are
  block (1, K) (scale [N, 1]), per-tensor ones block (N, K) (scale [1, 1]).
- "nvfp4": E2M1 codes packed two per byte [N, K/2] (element 2j in the low nibble of byte j), one E4M3 scale code
  per 16 elements of a row [N, K/16], and a float32 global scale (one per tensor, or one per row once parts with
  different global scales were concatenated):
      w[n, k] = (e2m1(q[n, k]) * e4m3(scale[n, k // 16])) * global_scale[n]
  The first product is exact in float32 (at most 2 + 4 significant bits), so the value is one rounding away from
  the real product: the same on every device that multiplies in IEEE float32.

scale_row(n) is `n // rows`, unless `scale_rows` [N] lists it per row. The list exists only after a row
concatenation that leaves the block grid (`concat_rows`): a fused weight keeps every part's own scales exactly, and a
kernel reads one int32 per row more. Dequantized float32 values are the reference every backend is held to.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cudflash.quant.numerics import (E2M1_MAX, E4M3_MAX, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3,
                                     pack_e2m1, unpack_e2m1)

FORMATS = ("fp8", "nvfp4")
NVFP4_GROUP = 16
FP8_BLOCK = (128, 128)  # what quantize="fp8" produces: the Qwen -FP8 releases' layout


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    format: str  # "fp8" | "nvfp4"
    shape: tuple[int, int]  # logical [N, K]: what the dequantized weight is
    data: np.ndarray  # uint8: fp8 [N, K] E4M3 codes; nvfp4 [N, K / 2] two E2M1 codes per byte (low nibble first)
    scale: np.ndarray  # fp8: float32 [S, cdiv(K, cols)]; nvfp4: uint8 E4M3 codes [N, K / 16]
    block: tuple[int, int]  # (rows, cols) of weight elements one scale covers
    global_scale: np.ndarray | None = None  # nvfp4: float32 [1] (the tensor's) or [N] (per row)
    scale_rows: np.ndarray | None = None  # int32 [N]: scale row of each weight row (None: n // block[0])
    input_scale: np.ndarray | None = None  # float32, the checkpoint's static activation scale: kept, unused (W*A16)
    source: str = ""  # where it came from (file: tensor, or "quantized at load"), for messages

    @property
    def nbytes(self) -> int:
        """Bytes of the packed form (codes, scales, row map): what a kernel that reads it streams."""
        return sum(int(a.nbytes) for a in (self.data, self.scale, self.global_scale, self.scale_rows)
                   if a is not None)

    def row_scales(self) -> np.ndarray:
        """int32 [N]: the scale row of every weight row."""
        if self.scale_rows is not None:
            return self.scale_rows
        return (np.arange(self.shape[0]) // self.block[0]).astype(np.int32)


def dequantize(w: QuantizedWeight, xp=np):
    """The float32 weight [N, K] (the reference values). `xp` is the array module to compute with (numpy, or CuPy
    for the CUDA backend, which then gets exactly the same float32 values on the device)."""
    n, k = w.shape
    rows = xp.asarray(w.row_scales())
    if w.format == "fp8":
        values = xp.take(xp.asarray(decode_e4m3(np.arange(256, dtype=np.uint8))), xp.asarray(w.data))  # [N, K]
        cols = xp.asarray(np.arange(k) // w.block[1])
        scale = xp.asarray(w.scale)[rows][:, cols]
        return values * scale
    if w.format == "nvfp4":
        codes = xp.asarray(w.data)
        nibbles = xp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, k)  # element 2j: low nibble of byte j
        values = xp.take(xp.asarray(decode_e2m1(np.arange(16, dtype=np.uint8))), nibbles)
        block_scale = xp.take(xp.asarray(decode_e4m3(np.arange(256, dtype=np.uint8))), xp.asarray(w.scale))  # [N, K/16]
        product = (values.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP) * block_scale[:, :, None]).reshape(n, k)
        g = xp.asarray(w.global_scale, dtype=xp.float32)
        return product * (g[:, None] if g.size == n and g.size != 1 else g.reshape(1, 1))
    raise ValueError(f"unknown quantized format {w.format!r}")


def dequantize_reference(w: QuantizedWeight) -> np.ndarray:
    """dequantize() element by element through the unpacking helpers: a slower second reading of the same rule, for
    tests of the vectorised form."""
    n, k = w.shape
    rows = w.row_scales()
    out = np.empty((n, k), dtype=np.float32)
    if w.format == "fp8":
        vals = decode_e4m3(w.data)
        for r in range(n):
            out[r] = vals[r] * np.repeat(w.scale[rows[r]], w.block[1])[:k]
        return out
    vals = decode_e2m1(unpack_e2m1(w.data))
    scales = np.repeat(decode_e4m3(w.scale), NVFP4_GROUP, axis=1)
    g = np.broadcast_to(w.global_scale.astype(np.float32), (n,)) if w.global_scale.size in (1, n) else None
    for r in range(n):
        out[r] = (vals[r] * scales[r]) * g[r]
    return out


def concat_rows(parts: list[QuantizedWeight], names: list[str]) -> QuantizedWeight:
    """Parts stacked along the output dimension (q/k/v -> qkv), every part's scales kept as they are.

    The rule (docs/quantization.md): codes are concatenated; scale rows are concatenated; while every part but the
    last has a multiple of its block's rows (and all share one block), the block grid of the result is the parts'
    grids end to end and no row map is needed; otherwise `scale_rows` records each row's scale row. Requantizing
    is never done: the released codes and scales are the model. Parts must share format, K and the block's width.
    """
    first = parts[0]
    for p, name in zip(parts, names):
        if p.format != first.format or p.shape[1] != first.shape[1] or p.block[1] != first.block[1]:
            raise ValueError(f"cannot fuse {names[0]} ({first.format}, K {first.shape[1]}, block {first.block}) with "
                             f"{name} ({p.format}, K {p.shape[1]}, block {p.block})")
    n = sum(p.shape[0] for p in parts)
    data = np.concatenate([p.data for p in parts], axis=0)
    scale = np.concatenate([p.scale for p in parts], axis=0)
    aligned = all(p.scale_rows is None and p.block == first.block for p in parts) and \
        all(p.shape[0] % p.block[0] == 0 for p in parts[:-1])
    scale_rows, block = None, first.block
    if not aligned:
        offsets = np.cumsum([0] + [p.scale.shape[0] for p in parts[:-1]])
        scale_rows = np.concatenate([p.row_scales() + off for p, off in zip(parts, offsets)]).astype(np.int32)
        block = (1, first.block[1])  # rows are mapped one by one
    global_scale = None
    if first.format == "nvfp4":
        gs = [p.global_scale.astype(np.float32).reshape(-1) for p in parts]
        if all(g.size == 1 for g in gs) and all(g[0] == gs[0][0] for g in gs):
            global_scale = gs[0]
        else:
            global_scale = np.concatenate([np.broadcast_to(g, (p.shape[0],)) for g, p in zip(gs, parts)])
    return QuantizedWeight(first.format, (n, first.shape[1]), data, scale, block, global_scale, scale_rows,
                           input_scale=None, source=" + ".join(p.source for p in parts))


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK, source: str = "") -> QuantizedWeight:
    """A float32 weight [N, K] as block-scaled FP8, the Qwen -FP8 layout: per block of rows x cols (the last row /
    column blocks cover what is left), scale = amax / 448 in float32, codes = E4M3 of w / scale rounded to nearest
    even. A block of zeros gets scale 1 (any scale dequantizes it to zeros; 1 keeps the division defined)."""
    n, k = w.shape
    bn, bk = block
    sn, sk = cdiv(n, bn), cdiv(k, bk)
    padded = np.zeros((sn * bn, sk * bk), dtype=np.float32)
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(sn, bn, sk, bk)).max(axis=(1, 3))  # [sn, sk]; NaN propagates into the scale
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    scale[scale == 0] = 1.0
    full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:n, :k]
    with np.errstate(invalid="ignore"):
        codes = encode_e4m3(w / full)
    return QuantizedWeight("fp8", (n, k), codes, scale, block, source=source or "quantized at load")


def quantize_nvfp4(w: np.ndarray, source: str = "") -> QuantizedWeight:
    """A float32 weight [N, K] (K % 16 == 0) as NVFP4, the ModelOpt recipe for weights: global scale amax / (6 * 448),
    each 16 columns' scale the E4M3 of their amax / (6 * global), codes the E2M1 (nearest, ties to even) of
    w / (scale * global). All zeros: global scale 1. A NaN or Inf gives a NaN global scale (and zero codes), which
    the loader's finiteness check then refuses by name."""
    n, k = w.shape
    w = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        return QuantizedWeight("nvfp4", (n, k), np.zeros((n, k // 2), np.uint8), np.zeros((n, k // NVFP4_GROUP),
                               np.uint8), (1, NVFP4_GROUP), np.array([np.nan], np.float32),
                               source=source or "quantized at load")
    amax = np.abs(w).max() if w.size else np.float32(0)
    g = np.float32(amax / np.float32(E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1)
    blocks = w.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    scale_codes = encode_e4m3(np.abs(blocks).max(axis=2) / (np.float32(E2M1_MAX) * g))
    scale = decode_e4m3(scale_codes)
    denom = np.where(scale > 0, scale * g, 1).astype(np.float32)
    codes = encode_e2m1((blocks / denom[:, :, None]).reshape(n, k))
    return QuantizedWeight("nvfp4", (n, k), pack_e2m1(codes), scale_codes, (1, NVFP4_GROUP),
                           np.array([g], np.float32), source=source or "quantized at load")


def quantize_weight(w: np.ndarray, fmt: str, source: str = "") -> QuantizedWeight | None:
    """quantize="fp8" / "nvfp4" at load for one float32 matrix; None where the format cannot hold it (NVFP4 needs
    K % 16 == 0: such a weight stays as stored)."""
    if fmt == "fp8":
        return quantize_fp8_block(w, source=source)
    if fmt == "nvfp4":
        return quantize_nvfp4(w, source=source) if w.shape[1] % NVFP4_GROUP == 0 else None
    raise ValueError(f"unknown quantize format {fmt!r}")
