"""The two small float formats of quantized weights, in numpy, exactly: FP8 E4M3 ("e4m3fn") and FP4 E2M1.

E4M3 (OCP FP8, the `fn` variant every released checkpoint uses): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
infinities; S.1111.111 (0x7F, 0xFF) is NaN, so the largest finite value is S.1111.110 = 448; exponent 0 holds the
subnormals m/8 * 2^-6. E2M1 (the NVFP4 element): 1 sign, 2 exponent (bias 1), 1 mantissa bit: the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN or infinity. Both decode to float32 exactly (every value is a float32).
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # the positive NaN code; 0xFF is the negative one
E2M1_MAX = 6.0


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    table = (sign * mag).astype(np.float32)
    table[(codes & 0x7F) == E4M3_NAN] = np.nan
    table.flags.writeable = False
    return table


E4M3_TABLE = _e4m3_table()  # float32 [256]: the value of every code (NaN for 0x7F and 0xFF)
E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)  # [16]
E2M1_TABLE.flags.writeable = False


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """uint8 E4M3 codes -> float32 values (exact)."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def encode_e4m3(x: np.ndarray, xp=np) -> np.ndarray:
    """float32 -> uint8 E4M3 codes: round to nearest, ties to even; finite values beyond the largest code saturate
    to +-448 (block-scaled quantization only ever rounds up to a hair over it); NaN and +-inf give NaN codes (a
    corrupt weight stays visibly corrupt, and the loader's finite check names it).

    A magnitude a in [2^E, 2^(E+1)) with E >= -6 has steps of 2^(E-3): its code is rint(a / 2^(E-3)) + 8 (E + 6),
    where a mantissa that rounds up to 16 steps carries into the exponent by itself; below 2^-6 (subnormals and
    zero) the steps are 2^-9 and the code is rint(a / 2^-9). Every operation here is exact in float32 but the
    rint, which numpy does to nearest even. `xp`: the array module (numpy, or CuPy for synthetic weights made on the
    device, fp8_weight.random_fp8).
    """
    x = xp.asarray(x, dtype=xp.float32)
    a = xp.abs(x)
    _, e = xp.frexp(a)  # a = m 2^e, m in [0.5, 1)
    exp = xp.where(a < xp.float32(2.0**-6), -6, e.astype(xp.int32) - 1)
    with np.errstate(invalid="ignore"):  # NaN / inf lanes are overwritten below
        steps = xp.rint(xp.ldexp(a, (3 - exp).astype(xp.int32)))
        code = xp.where(xp.isfinite(a), xp.minimum(steps + 8 * (exp + 6), 0x7E), E4M3_NAN)
    sign = xp.signbit(x).astype(xp.uint8) << 7
    return code.astype(xp.uint8) | sign


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] with two E2M1 codes per byte -> uint8 codes [..., K]; element 2j is the low nibble of byte j,
    element 2j + 1 its high nibble (the ModelOpt / vLLM / TensorRT-LLM order, docs/quantization.md)."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """The inverse of unpack_e2m1: uint8 codes [..., K] (K even, each < 16) -> packed bytes [..., K/2]."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """uint8 E2M1 codes (one per element, < 16) -> float32 values (exact)."""
    return E2M1_TABLE[np.asarray(codes, dtype=np.uint8)]


# E2M1 rounding: the midpoint between magnitude codes c and c + 1, and whether a tie there goes up (c odd: to the even
# code c + 1) or stays (c even).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """float32 -> uint8 E2M1 codes: nearest magnitude, ties to the even code, saturating at +-6 (NVFP4 checkpoints the
    tests write, and quantize="nvfp4"). NaN is refused: E2M1 has no code for it. The magnitude code is the count of
    midpoints below |x| (one comparison per midpoint over the array: no [..., 8] distance table)."""
    x = np.asarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError("encode_e2m1: NaN has no E2M1 code")
    a = np.abs(x)
    code = np.zeros(x.shape, dtype=np.uint8)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (a >= np.float32(mid)) if tie_up else (a > np.float32(mid))
    return code | (np.signbit(x).astype(np.uint8) << 3)
