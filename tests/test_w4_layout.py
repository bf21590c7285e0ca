"""The NVFP4 device layout (backends/w4_layout.py) on the host: the kernel's decode of it, simulated bit for bit,
gives exactly the checkpoint's float32 weights (quant.weight.dequantize) for every code under every scale."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash.backends import w4_layout as L
from cudflash.quant import QuantizedWeight, dequantize
from cudflash.quant.numerics import pack_e2m1

@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(4)


FINITE_E4M3 = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)


def nvfp4(codes: np.ndarray, scales: np.ndarray, global_scale: np.ndarray) -> QuantizedWeight:
    n, k = codes.shape
    return QuantizedWeight("nvfp4", (n, k), pack_e2m1(codes), scales, (1, 16), global_scale=global_scale)


def device_values(w: QuantizedWeight) -> np.ndarray:
    data, scale, gscale = L.device_layout(w.data, w.scale, w.global_scale)
    return L.dequantize_device_layout(data, scale, gscale)


def test_the_rotations_tile_a_word():
    """Each bit of a code word goes to exactly one pair's magnitude or sign: the layout loses nothing."""
    seen = 0
    for mag, sign in zip(L.MAG_ROT, L.SIGN_ROT):
        for mask, r in ((L.MAG_MASK, mag), (L.SIGN_MASK, sign)):
            src = int(L._rotr(np.uint32(mask), r, np))
            assert seen & src == 0
            seen |= src
    assert seen == 0xFFFFFFFF
    assert L.SIGN_BITS == 0x1E001E00  # the signs sit in bits 9..12 and 25..28 of a word


def test_the_rotations_the_kernel_shifts_are_shifts():
    """nvfp4.cuh writes every rotation but MAG_ROT[3] as a left shift (an FMA-pipe IMAD.SHL): under its mask, no bit
    the rotation wraps around may survive."""
    words = np.random.default_rng(0).integers(0, 2 ** 32, size=4096, dtype=np.uint64).astype(np.uint32)
    words = np.concatenate([words, np.uint32([0xFFFFFFFF, 0x80000001])])
    shifted = [(L.MAG_MASK, r) for r in L.MAG_ROT[:3]] + [(L.SIGN_MASK, r) for r in L.SIGN_ROT]
    for mask, r in shifted:
        rotated = L._rotl(words, r, np) & np.uint32(mask)
        assert np.array_equal(rotated, (words << np.uint32(r)) & np.uint32(mask)), (hex(mask), r)
    mask, r = L.MAG_MASK, L.MAG_ROT[3]  # the one true rotation: a shift would lose bits
    assert not np.array_equal(L._rotl(words, r, np) & np.uint32(mask), (words << np.uint32(r)) & np.uint32(mask))


def test_every_code_under_every_scale_is_exact():
    """Row r has scale code FINITE_E4M3[r] (negative, zero and subnormal scales included) over all 16 codes."""
    n = FINITE_E4M3.size
    codes = np.tile(np.arange(16, dtype=np.uint8), (n, 4))  # [n, 64]
    scales = np.repeat(FINITE_E4M3[:, None], 4, axis=1)
    w = nvfp4(codes, scales, np.array([0.37], np.float32))
    assert np.array_equal(device_values(w).view(np.uint32), dequantize(w).view(np.uint32))  # signed zeros too


def test_scale_bytes_are_what_the_kernel_expands():
    """Every finite positive scale: its byte's bf16 (byte << 4) + bias is scale * 2^119, and the byte fits."""
    pos = FINITE_E4M3[FINITE_E4M3 < 0x80][1:]  # positive, nonzero
    byte, negative, zero = L.encode_scales(pos)
    assert not negative.any() and not zero.any() and byte.max() < 0xB8
    from cudflash.quant.numerics import decode_e4m3
    got = (L.scale_bf16_bits(byte).astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got.astype(np.float64), decode_e4m3(pos).astype(np.float64) * 2.0 ** 119)


def test_random_weights_with_per_row_global_scales(rng):
    n, k = 48, 512
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    scales = rng.choice(FINITE_E4M3, size=(n, k // 16))
    g = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    w = nvfp4(codes, scales, g)
    assert np.array_equal(device_values(w).view(np.uint32), dequantize(w).view(np.uint32))


def test_pack_and_decode_are_inverse(rng):
    """decode_pairs of pack_codes puts each code's sign and magnitude where the bf16 pairs want them."""
    codes = rng.integers(0, 16, (3, 64)).astype(np.uint8)
    b16 = L.decode_pairs(L.pack_codes(codes))
    assert np.array_equal(((b16 >> 15) << 3) | ((b16 >> 6) & 7), codes)
    assert not np.any(b16 & ~np.uint16(0x81C0))


def test_a_nan_scale_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        L.encode_scales(np.array([0x38, 0x7F], np.uint8))
