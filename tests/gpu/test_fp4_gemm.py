"""The GEMMs over NVFP4 weights kept on the device (fp4_weight.Fp4Weight): the streaming GEMM's W4 instantiations
and the many-row path (dequantized to bf16, then cuBLAS), against numpy's float32 dequantized weight
(quant.weight.dequantize) applied to the same bf16 activations, in float64. Every code under every scale, every
epilogue, per-row global scales (fused parts), and the invariances the engine relies on."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import fp4_weight  # noqa: E402
from cudflash.backends import stream_gemm as sg  # noqa: E402
from cudflash.backends.cuda_util import bits  # noqa: E402
from cudflash.backends.fp4_weight import Fp4Weight  # noqa: E402
from cudflash.quant import QuantizedWeight, concat_rows, dequantize  # noqa: E402
from cudflash.quant.numerics import encode_e4m3, pack_e2m1  # noqa: E402
from cudflash.tiny import float32_to_bf16_bits  # noqa: E402

from .test_ops import check, rnd  # noqa: E402
from .test_quant_gemm import (  # noqa: E402
    check_epilogues, check_routes, check_row_slice, check_rows_alone, check_stream_gemm, check_wide_swiglu, ref_gemm)
from .test_stream_gemm import check_deeper_ring, skip_without_tma  # noqa: E402

FINITE_E4M3 = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
# (N, K): N off the 16-row tile (200, 1000), blocks of 1..4 tiles, several rounds of blocks per CTA (24576), the
# long K of down_proj (12288), qwen3-4b's K (2560 = 5 stages).
SHAPES = [(200, 512), (1000, 1024), (4000, 4096), (24576, 512), (296, 12288), (2560, 2560)]


@pytest.fixture(scope="module")
def cb():
    from cudflash.backends.cuda_backend import CudaBackend

    return CudaBackend(tuning={"nvfp4_on_device": True})


def quantized(rng, n: int, k: int, scale: float = 1.0, global_scale: float | None = None) -> QuantizedWeight:
    """Random codes with per-16 scales of the typical spread (amax / 6 per group, the ModelOpt recipe's shape)."""
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    group = rng.uniform(0.2, 1.0, (n, k // 16)).astype(np.float32) * 448
    g = np.float32(global_scale if global_scale is not None else scale / 448 / 2.93)
    return QuantizedWeight("nvfp4", (n, k), pack_e2m1(codes), encode_e4m3(group), (1, 16),
                           global_scale=np.array([g], np.float32))


@pytest.mark.parametrize("n,k", SHAPES)
# x resident; x in boxes of one and of two token tiles; a wide launch of four token tiles (NVFP4's widest)
@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 32])
def test_fp4_stream_gemm_matches_numpy(cb, rng, n, k, m):
    qw = quantized(rng, n, k, scale=k ** -0.5)
    check_stream_gemm(cb, rng, qw, fp4_weight.upload(qw), m)


@pytest.mark.parametrize("m", [1, 16])
def test_every_code_under_every_scale_is_exact(cb, rng, m):
    """Row r's groups cycle through every finite E4M3 scale (negative, zero, subnormal) and every code appears in
    each group; checked per element against a bound 60x the typical float32 rounding (a wrong sign, exponent or
    scale lands far outside it)."""
    skip_without_tma()
    n, k = 256, 4096
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    codes[:, :16] = np.arange(16)
    scales = FINITE_E4M3[(np.arange(n)[:, None] + np.arange(k // 16)[None, :]) % FINITE_E4M3.size]
    qw = QuantizedWeight("nvfp4", (n, k), pack_e2m1(codes), scales, (1, 16),
                         global_scale=rng.uniform(1e-4, 1e-3, n).astype(np.float32))
    x = rnd(rng, m, k, scale=0.1)
    y = cp.empty((m, n), cp.float32)
    sg.stream_gemm(cb.asarray(x, "act"), fp4_weight.upload(qw), y, cb.num_sms, cb.tuning)
    ref = ref_gemm(x, qw)
    bound = np.abs(x).astype(np.float64) @ np.abs(dequantize(qw)).astype(np.float64).T * 2e-6
    assert np.all(np.abs(cb.to_numpy(y) - ref) <= bound)


def test_fused_parts_keep_their_global_scales(cb, rng):
    """q / k / v with different global scales concatenated (a global scale per row), through the streamed GEMM
    (1 and 16 rows) and the many-row path."""
    skip_without_tma()
    k = 1024
    fused = concat_rows([quantized(rng, n, k, global_scale=g) for n, g in ((80, 1e-3), (16, 4e-3), (48, 2.5e-4))],
                        ["q", "k", "v"])
    assert fused.global_scale.size == 144
    w = cb.load_quantized(fused)
    assert isinstance(w, Fp4Weight)
    for m in (1, 16, 40):
        x = rnd(rng, m, k, scale=0.1)
        check(cb.to_numpy(cb.linear(cb.asarray(x, "act"), w, out_f32=True)), ref_gemm(x, fused),
              tol=1e-5 if m <= 16 else 1e-2)


@pytest.mark.parametrize("n,k", [(200, 384), (4096, 1024), (1000, 4096)])
def test_dequantize_bf16_is_numpy_rounded_once(cb, rng, n, k):
    qw = quantized(rng, n, k)
    got = fp4_weight.dequantize_bf16(fp4_weight.upload(qw), cb.act, cb.tuning)
    assert np.array_equal(cp.asnumpy(bits(got)), float32_to_bf16_bits(dequantize(qw)))


@pytest.mark.parametrize("m", [1, 16, 17, 40, 64, 65, 300])
def test_linear_routes_by_rows_and_k(cb, rng, m, monkeypatch):
    """K % 512 == 0 streams every exact row (test_quant_gemm.check_routes); K = 256 does not."""
    check_routes(cb, rng, m, monkeypatch, quantized, ref_gemm, off_k=256)


@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 512)])
def test_fp4_rows_do_not_depend_on_the_other_rows(cb, rng, n, k):
    """test_quant_gemm.check_rows_alone on an Fp4Weight."""
    check_rows_alone(cb, rng, fp4_weight.upload(quantized(rng, n, k)))


@pytest.mark.parametrize("m", [1, 9, 16])
def test_fp4_epilogues_match_numpy(cb, rng, m):
    """test_quant_gemm.check_epilogues on NVFP4 weights."""
    check_epilogues(cb, rng, m, quantized, 1536, Fp4Weight)


@pytest.mark.parametrize("m", [1, 3, 9, 16])  # x resident, x in boxes
@pytest.mark.parametrize("n", [4096, 24576])  # o_proj's 4 stages, gate_up's 2
def test_fp4_deeper_rings_change_no_bit(cb, rng, m, n):
    """check_deeper_ring on NVFP4 weights."""
    qw = quantized(rng, n, 4096, scale=4096 ** -0.5)
    check_deeper_ring(cb, rng, fp4_weight.upload(qw), m)


def test_fp4_wide_swiglu(cb, rng):
    """test_quant_gemm.check_wide_swiglu on NVFP4 weights."""
    check_wide_swiglu(cb, rng, quantized, 1536)


def test_a_row_slice_is_those_rows_of_the_weight(cb, rng):
    """test_quant_gemm.check_row_slice on an Fp4Weight."""
    check_row_slice(cb, rng, fp4_weight.upload(quantized(rng, 1024, 1024)), 256, 512)


def test_fp4_plans_fit():
    """NVFP4 plans: the row blocks and grid of bf16's whole-block plan (its stages of 512 columns save half the tile
    stages a split would, so it splits less often: Qwen3-4B's down_proj stays whole), eight compute warps, a ring
    that fits the request."""
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (2560, 9728), (200, 512)):
        bf, f4 = sg.plan_for(n, k, 132, split=False), sg.weight_plan(n, k, 132, 4, cb_tuning())
        assert (f4.t, f4.grid, f4.split) == (bf.t, bf.grid, False)
        assert f4.warps == 8 and f4.kt == 512 and f4.stages >= 2
        for m in (1, 8, 16):
            x_bytes = sg.resident_x_bytes(m, k, 4)
            assert f4.smem(x_bytes) == sg.SMEM_BUDGET
            assert f4.fixed_bytes(f4.t, 8) + f4.stages * f4.stage_bytes(f4.t, x_bytes is not None, 4) + (
                x_bytes or 0) <= sg.SMEM_BUDGET


def cb_tuning():
    from cudflash.backends.tuning import CudaTuning

    return CudaTuning(nvfp4_on_device=True)


def test_random_fp4_has_the_requested_spread(cb):
    w = fp4_weight.random_fp4((512, 1024), 0.02, seed=3)
    assert w.data.shape == (512, 512) and w.scale.shape == (512, 64) and w.gscale.shape == (512,)
    std = float(np.std(cb.to_numpy(fp4_weight.dequantize_bf16(w, cb.act, cb.tuning))))
    assert 0.018 < std < 0.022
