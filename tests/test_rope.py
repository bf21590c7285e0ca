"""RoPE frequency tables against their closed forms: default, llama3, yarn."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cudflash.config import RopeConfig, parse_rope
from cudflash.rope import inv_freq_and_scale, rope_tables


def closed_form(theta: float, d: int) -> np.ndarray:
    """1 / theta^(2i/d), i = 0..d/2-1, in float64."""
    return 1.0 / theta ** (2.0 * np.arange(d // 2, dtype=np.float64) / d)


LLAMA31 = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
QWEN_YARN = RopeConfig(theta=1e6, kind="yarn", factor=4.0, original_max_position_embeddings=32768)


@pytest.mark.parametrize("theta,d", [(10000.0, 64), (1e6, 128), (500000.0, 128), (1e7, 256), (10000.0, 2)])
def test_default_inv_freq_closed_form(theta, d):
    inv, scale = inv_freq_and_scale(RopeConfig(theta=theta), d)
    assert inv.dtype == np.float32 and inv.shape == (d // 2,)
    assert scale == 1.0
    np.testing.assert_allclose(inv, closed_form(theta, d), rtol=2e-6)
    assert inv[0] == 1.0
    assert np.all(np.diff(inv) < 0)


def test_llama3_high_freq_unchanged_low_freq_divided():
    d = 128
    r = LLAMA31
    base = closed_form(r.theta, d)
    default_inv, _ = inv_freq_and_scale(RopeConfig(theta=r.theta), d)
    inv, scale = inv_freq_and_scale(r, d)
    assert scale == 1.0 and inv.dtype == np.float32
    wavelen = 2 * math.pi / base
    high = wavelen < r.original_max_position_embeddings / r.high_freq_factor  # < 2048 tokens
    low = wavelen > r.original_max_position_embeddings / r.low_freq_factor  # > 8192 tokens
    mid = ~high & ~low
    assert high.sum() > 10 and low.sum() > 10 and mid.sum() > 0  # all three bands are exercised
    np.testing.assert_array_equal(inv[high], default_inv[high])  # untouched, bit for bit
    np.testing.assert_allclose(inv[low], base[low] / r.factor, rtol=2e-6)
    # the medium band interpolates smoothly between the two
    smooth = (r.original_max_position_embeddings / wavelen[mid] - r.low_freq_factor) / (
        r.high_freq_factor - r.low_freq_factor)
    np.testing.assert_allclose(inv[mid], (1 - smooth) * base[mid] / r.factor + smooth * base[mid], rtol=1e-5)
    assert np.all(inv[mid] < base[mid]) and np.all(inv[mid] > base[mid] / r.factor)
    assert np.all(np.diff(inv) < 0)


def test_llama3_factor_one_is_default():
    r = RopeConfig(theta=500000.0, kind="llama3", factor=1.0, original_max_position_embeddings=8192)
    np.testing.assert_allclose(inv_freq_and_scale(r, 128)[0], closed_form(500000.0, 128), rtol=2e-6)


def test_yarn_attention_factor_default():
    for factor in (2.0, 4.0, 40.0):
        r = RopeConfig(theta=1e6, kind="yarn", factor=factor, original_max_position_embeddings=32768)
        _, scale = inv_freq_and_scale(r, 128)
        assert scale == pytest.approx(0.1 * math.log(factor) + 1.0, rel=1e-12)
    assert scale > 1.0


def test_yarn_attention_factor_variants():
    kw = dict(theta=1e6, kind="yarn", factor=4.0, original_max_position_embeddings=32768)
    assert inv_freq_and_scale(RopeConfig(**kw, attention_factor=1.5), 64)[1] == 1.5
    # DeepSeek style: mscale / mscale_all_dim ratio
    got = inv_freq_and_scale(RopeConfig(**kw, mscale=1.0, mscale_all_dim=0.5), 64)[1]
    assert got == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert inv_freq_and_scale(RopeConfig(**kw, mscale=0.707, mscale_all_dim=0.707), 64)[1] == pytest.approx(1.0)
    # factor <= 1: no attention scaling
    assert inv_freq_and_scale(RopeConfig(theta=1e6, kind="yarn", factor=1.0,
                                         original_max_position_embeddings=32768), 64)[1] == 1.0


def test_yarn_inv_freq_between_interpolation_and_extrapolation():
    d, r = 128, QWEN_YARN
    extrapolation = closed_form(r.theta, d)
    interpolation = extrapolation / r.factor
    inv, _ = inv_freq_and_scale(r, d)
    assert inv.dtype == np.float32 and inv.shape == (d // 2,)
    tol = 2e-6 * extrapolation
    assert np.all(inv <= extrapolation + tol) and np.all(inv >= interpolation - tol)

    # The ramp runs between the correction dims of beta_fast=32 and beta_slow=1 (floor / ceil):
    def correction_dim(rotations: float) -> float:
        return d * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    lo, hi = math.floor(correction_dim(32)), math.ceil(correction_dim(1))
    assert (lo, hi) == (23, 40)
    np.testing.assert_allclose(inv[:lo + 1], extrapolation[:lo + 1], rtol=2e-6)  # high frequencies kept
    np.testing.assert_allclose(inv[hi:], interpolation[hi:], rtol=2e-6)  # low frequencies interpolated
    between = slice(lo + 1, hi)
    assert np.all(inv[between] < extrapolation[between]) and np.all(inv[between] > interpolation[between])
    weight = (extrapolation - inv) / (extrapolation - interpolation)  # 0 = extrapolate, 1 = interpolate
    np.testing.assert_allclose(weight[lo:hi + 1], (np.arange(lo, hi + 1) - lo) / (hi - lo), atol=1e-4)


def test_yarn_without_truncation_differs():
    r = RopeConfig(theta=1e6, kind="yarn", factor=4.0, original_max_position_embeddings=32768, truncate=False)
    a, _ = inv_freq_and_scale(r, 128)
    b, _ = inv_freq_and_scale(QWEN_YARN, 128)
    assert not np.allclose(a, b)
    ext = closed_form(1e6, 128)
    assert np.all(a <= ext * (1 + 2e-6)) and np.all(a >= ext / 4 * (1 - 2e-6))


@pytest.mark.parametrize("rope", [RopeConfig(theta=1e6), LLAMA31, QWEN_YARN], ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("d,max_pos", [(128, 64), (16, 100)])
def test_cos_sin_tables(rope, d, max_pos):
    cos, sin = rope_tables(rope, d, max_pos)
    assert cos.shape == sin.shape == (max_pos, d // 2)
    assert cos.dtype == sin.dtype == np.float32
    inv, scale = inv_freq_and_scale(rope, d)
    angles = np.arange(max_pos, dtype=np.float64)[:, None] * inv.astype(np.float64)[None, :]
    np.testing.assert_allclose(cos, scale * np.cos(angles), atol=2e-5)
    np.testing.assert_allclose(sin, scale * np.sin(angles), atol=2e-5)
    np.testing.assert_allclose(cos ** 2 + sin ** 2, scale ** 2, rtol=1e-5)
    np.testing.assert_allclose(cos[0], scale, rtol=1e-6)
    np.testing.assert_array_equal(sin[0], 0)


def test_tables_from_parsed_config():
    """parse_rope -> rope_tables end to end, with the rope_parameters dialect."""
    r = parse_rope({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}}, "cfg")
    assert (r.kind, r.factor, r.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    np.testing.assert_array_equal(inv_freq_and_scale(r, 128)[0], inv_freq_and_scale(LLAMA31, 128)[0])
    cos, _ = rope_tables(r, 128, 8)
    assert cos.shape == (8, 64)


def test_scaled_rope_without_original_length_is_refused():
    for kind in ("llama3", "yarn"):
        with pytest.raises(ValueError, match="original_max_position_embeddings"):
            inv_freq_and_scale(RopeConfig(theta=1e6, kind=kind, factor=4.0), 64)
