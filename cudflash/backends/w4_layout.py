"""The device layout of an NVFP4 weight for the streaming GEMM's W4 path (kernels/nvfp4.cuh): the checkpoint's
codes and scales rearranged at load so that the kernel turns them into bf16 with a few bit operations. No CuPy here:
`xp` is numpy (tests, the reference) or CuPy (the upload, on the device); both give the same bytes.

The checkpoint: w[n, k] = e2m1(q[n, k]) * e4m3(s[n, k // 16]) * g[n], q packed two per byte (low nibble first).

Codes. Every 32-bit word of a row holds the 8 codes of columns 8 i .. 8 i + 7, so that the four bf16 pairs
(8 i + 2 j, 8 i + 2 j + 1), j = 0..3, come out as

    pair_j = (rotl(word, MAG_ROT[j]) & MAG_MASK) | (rotl(word, SIGN_ROT[j]) & SIGN_MASK)

each half a bf16 with the code's sign at bit 15 and its three magnitude bits (e1 e0 m) at bits 8..6: the bf16
whose exponent field is the code's exponent and whose top mantissa bit is the code's, i.e. exactly the code's value
times 2^-126 (a bf16 subnormal for the codes 0 and 0.5). The rotations are a tiling of the word's 32 bits by the
four pairs' bit patterns, chosen for the kernel's issue pipes: all but MAG_ROT[3] act as left shifts (no bit they
wrap around survives the mask), which can issue on the FMA pipe, so the decode takes 7 ALU instructions per 8 codes
(6 masks, 1 rotation) beside 4 shifts: the fewest ALU instructions of any such tiling.

Scales. The kernel multiplies each decoded pair by its row's scale as a bf16 pair, scale * 2^119 (an exact power-of-
two shift: every E4M3 value times 2^119 is a normal bf16 below 2^128). A product code * 2^-126 * scale * 2^119 has at
most 2 + 4 significant bits and lies in [2^-17, 21], so the bf16 multiply is exact: the weight enters the MMA as
exactly code * scale * 2^-7, and the 2^7 is put back with the global scale, per row, after the sum
(`gscale` = g * 2^7). The bf16 scale * 2^119 has exponent fields 237..254 and three mantissa bits, stored in one
byte as ((field - 232) << 3) | mantissa, so that its bf16 bits are (byte << 4) + SCALE_BIAS.
Two cases are folded into the codes, where they are exact: a negative scale (-0 too) flips the signs of its 16 codes,
and a zero scale zeroes their magnitudes, keeping each sign (code * 0 is a signed zero; the byte is then anything:
0). A NaN scale is refused.
"""
from __future__ import annotations

import numpy as np

from cudflash.quant.numerics import decode_e4m3

GROUP = 16  # columns per E4M3 scale
CODES_PER_WORD = 8
MAG_ROT = (0, 3, 6, 9)  # rotate-left amounts of the magnitude bits of pair j
SIGN_ROT = (4, 3, 6, 5)  # and of its sign bits
MAG_MASK = 0x01C001C0  # bits 8..6 of both halves
SIGN_MASK = 0x80008000
SCALE_SHIFT = 119  # the scales' power of two in the kernel
PRODUCT_SHIFT = 7  # 126 - SCALE_SHIFT: what the global scale restores
SCALE_BIAS = 232 << 7  # bf16 bits of (scale * 2^119) = (byte << 4) + SCALE_BIAS


def _rotl(w, r: int, xp):
    r %= 32
    return w if r == 0 else ((w << xp.uint32(r)) | (w >> xp.uint32(32 - r))) & xp.uint32(0xFFFFFFFF)


def _rotr(w, r: int, xp):
    return _rotl(w, 32 - r % 32, xp)


# The bits of a code word that hold the codes' signs (all the others hold magnitudes: a word of value zero has none).
SIGN_BITS = int(np.bitwise_or.reduce([_rotr(np.uint32(SIGN_MASK), r, np) for r in SIGN_ROT]))


def pack_codes(nibbles, xp=np):
    """Codes [N, K] (uint8, 0..15, K % 8 == 0) -> the device words as bytes [N, K / 2] (little-endian words)."""
    n, k = nibbles.shape
    c = nibbles.reshape(n, k // CODES_PER_WORD, CODES_PER_WORD).astype(xp.uint32)
    word = xp.zeros((n, k // CODES_PER_WORD), dtype=xp.uint32)
    for j in range(4):
        lo, hi = c[..., 2 * j], c[..., 2 * j + 1]
        pair = ((lo & 7) << 6) | ((lo >> 3) << 15) | ((hi & 7) << 22) | ((hi >> 3) << 31)
        word |= _rotr(pair & xp.uint32(MAG_MASK), MAG_ROT[j], xp) | _rotr(pair & xp.uint32(SIGN_MASK), SIGN_ROT[j], xp)
    return xp.ascontiguousarray(word).view(xp.uint8).reshape(n, k // 2)


def decode_pairs(data, xp=np):
    """The kernel's decode, on the host: device bytes [N, K / 2] -> bf16 bits [N, K] (uint16) of code * 2^-126."""
    n, half = data.shape
    word = xp.ascontiguousarray(data).view(xp.uint32).reshape(n, half // 4)
    out = xp.empty((n, half // 4, 4), dtype=xp.uint32)
    for j in range(4):
        out[..., j] = (_rotl(word, MAG_ROT[j], xp) & xp.uint32(MAG_MASK)) | \
            (_rotl(word, SIGN_ROT[j], xp) & xp.uint32(SIGN_MASK))
    return out.view(xp.uint16).reshape(n, 2 * half)  # little-endian: low half first = the even column


def encode_scales(codes, xp=np):
    """E4M3 scale codes [N, K / 16] -> (device bytes, sign bit set [bool], zero [bool]). Raises ValueError on NaN."""
    table = xp.asarray(decode_e4m3(np.arange(256, dtype=np.uint8)))
    value = xp.take(table, xp.asarray(codes).astype(xp.int32))
    if bool(xp.any(xp.isnan(value))):
        raise ValueError("NaN scale code")
    mag = xp.abs(value).astype(xp.float32) * xp.float32(2.0 ** SCALE_SHIFT)  # exact, normal, below 2^128
    bf16 = (xp.ascontiguousarray(mag).view(xp.uint32) >> 16).astype(xp.int32)  # exact: at most 4 significant bits
    zero = value == 0
    byte = xp.where(zero, 0, (bf16 - SCALE_BIAS) >> 4)
    return byte.astype(xp.uint8), xp.signbit(value), zero


def device_layout(packed, scale_codes, global_scale, xp=np):
    """A checkpoint's NVFP4 weight (packed codes [N, K / 2], E4M3 scale codes [N, K / 16], global scale [1] or [N])
    in the device layout: (code words [N, K / 2] uint8, scale bytes [N, K / 16] uint8, gscale [N] float32 = g * 2^7).
    K % 16 == 0 (the caller checks)."""
    packed = xp.asarray(packed)
    n, half = packed.shape
    k = 2 * half
    nibbles = xp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k // GROUP, GROUP)
    byte, negative, zero = encode_scales(scale_codes, xp)
    nibbles = xp.where(negative[:, :, None], nibbles ^ 8, nibbles)
    nibbles = xp.where(zero[:, :, None], nibbles & 8, nibbles).astype(xp.uint8)  # +-0, the sign of code * scale
    g = xp.asarray(global_scale, dtype=xp.float32).reshape(-1)
    gscale = (xp.broadcast_to(g, (n,)) * xp.float32(2.0 ** PRODUCT_SHIFT)).astype(xp.float32)
    return pack_codes(nibbles.reshape(n, k), xp), byte, xp.ascontiguousarray(gscale)


def scale_bf16_bits(byte, xp=np):
    """The bf16 bits of scale * 2^119 that the kernel makes of a device scale byte."""
    return (xp.asarray(byte).astype(xp.uint32) << 4) + SCALE_BIAS


def dequantize_device_layout(data, scale, gscale, xp=np):
    """The float32 weight [N, K] that the device layout holds, computed the kernel's way (decode, bf16 product with
    the scale, then the global scale): for tests against quant.weight.dequantize."""
    n = data.shape[0]

    def as_float64(b16):  # bf16 bits -> float64 by integer fields (a GPU cast may flush float32 subnormals)
        b = xp.asarray(b16).astype(xp.int64)
        field, mant = (b >> 7) & 0xFF, (b & 0x7F).astype(xp.float64)
        mag = xp.where(field == 0, xp.ldexp(mant, -133), xp.ldexp(1.0 + mant / 128.0, (field - 127).astype(xp.int32)))
        return xp.where(b & 0x8000, -mag, mag)

    codes = as_float64(decode_pairs(data, xp))  # code * 2^-126
    s = as_float64(scale_bf16_bits(scale, xp))  # scale * 2^119
    product = codes.reshape(n, -1, GROUP) * s[:, :, None]  # exact in float64 (and in bf16: the kernel's multiply)
    return (product.reshape(n, -1).astype(xp.float32) * gscale[:, None]).astype(xp.float32)
