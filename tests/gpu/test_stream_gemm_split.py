"""Split (stream-K) plans of the weight-streaming GEMM (stream_gemm.Plan.split, kernels/stream_gemm.cu "Work"): the
CTAs share the (block, k tile) units evenly and a block spanning CTAs is summed by its owner from the others'
partials. Against numpy in every weight format and epilogue, with cuts that put a CTA's whole range inside one block
and spread one block over many CTAs; a row's bits do not depend on the other rows (verify == decode), wide launches
included; the workspace's flags are left clear, so launches replayed from a graph stay right."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import fp4_weight, fp8_weight  # noqa: E402
from cudflash.backends import stream_gemm as sg  # noqa: E402
from cudflash.backends.cuda_backend import CudaBackend  # noqa: E402
from cudflash.backends.cuda_util import bits  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402
from cudflash.quant import dequantize  # noqa: E402

from . import test_fp4_gemm, test_quant_gemm  # noqa: E402
from .test_ops import NAN_BITS, check, rnd  # noqa: E402
from .test_stream_gemm import skip_without_tma  # noqa: E402

EPS = 1e-6
# (N, K, grid), blocks of SPLIT_T = 2 tiles: 5 blocks of 4 k tiles over 7 CTAs (cuts inside blocks); 2 blocks of 16
# k tiles over 11 CTAs (owners and CTAs whose ranges lie inside one block); 10 blocks over 37 CTAs of 4-5 units,
# N off the tile; 32 blocks of 2 k tiles over 13 CTAs.
FORCED = [(160, 1024, 7), (64, 4096, 11), (296, 4096, 37), (1000, 512, 13)]


@pytest.fixture(scope="module")
def backends():
    """bf16 (streamed at any size), FP8 and NVFP4 weights on the device."""
    return {16: CudaBackend(tuning={"stream_gemm_min_bytes": 0}), 8: CudaBackend(tuning={"fp8_on_device": True, "fp8_w8a8": False}),
            4: CudaBackend(tuning={"nvfp4_on_device": True})}


def force(monkeypatch, grid: int) -> None:
    """Every launch takes a split plan over `grid` CTAs (wide ones too: they keep its blocks)."""
    def plan(n, k, num_sms, bits=16, warps=sg.BF16_WARPS, split=True):
        return sg.split_plan(grid, bits, warps)
    monkeypatch.setattr(sg, "plan_for", plan)
    sg.wide_plan.cache_clear()


@pytest.fixture(autouse=True)
def _clear_wide_plans():
    yield
    sg.wide_plan.cache_clear()


def _weight(backends, rng, fmt: int, n: int, k: int):
    """(device weight, float32 reference) of format fmt."""
    if fmt == 16:
        w = rnd(rng, n, k, scale=k ** -0.5)
        return backends[16].asarray(w, "act"), w
    if fmt == 8:
        q = test_quant_gemm.quantized(rng, n, k, scale=k ** -0.5)
        return fp8_weight.upload(q), dequantize(q)
    q = test_fp4_gemm.quantized(rng, n, k, scale=k ** -0.5)
    return fp4_weight.upload(q), dequantize(q)


def _flags_clear(num_sms: int) -> bool:
    return not cp.asnumpy(sg.split_workspace(num_sms)[1]).any()


@pytest.mark.parametrize("fmt", [16, 8, 4])
@pytest.mark.parametrize("n,k,grid", FORCED)
def test_split_plans_match_numpy_and_rows_stand_alone(backends, rng, monkeypatch, fmt, n, k, grid):
    skip_without_tma()
    cb = backends[fmt]
    force(monkeypatch, grid)
    w, ref = _weight(backends, rng, fmt, n, k)
    rows = 64 if fmt == 8 else 32 if fmt == 4 else 16
    xh = rnd(rng, rows, k)
    x = cb.asarray(xh, "act")
    alone = cp.concatenate([cb.linear(x[i:i + 1], w, out_f32=True) for i in range(rows)])
    check(cb.to_numpy(alone), xh.astype(np.float64) @ ref.astype(np.float64).T, tol=1e-5)
    for m in (5, 9, 16, rows):  # x resident, x in boxes of one and two token tiles, wide launches (quantized)
        assert cp.array_equal(bits(cb.linear(x[:m], w, out_f32=True)), bits(alone[:m])), m
    yb = cp.empty((9, n), cb.act)
    sg.stream_gemm(x[:9], w, yb, cb.num_sms, cb.tuning)
    check(cb.to_numpy(yb), xh[:9] @ ref.T, tol=1e-2)
    assert _flags_clear(cb.num_sms)


@pytest.mark.parametrize("fmt", [16, 8, 4])
@pytest.mark.parametrize("m", [1, 9, 16])
def test_split_epilogues_match_numpy(backends, rng, monkeypatch, fmt, m):
    """The layer's chain on split plans: the residual-adding producer (its sums of squares per CTA), the row-scaled
    SwiGLU consumer and a row-scaled plain one, against the numpy backend."""
    skip_without_tma()
    cb, nb = backends[fmt], NumpyBackend()
    force(monkeypatch, 23)
    h, k_in, inter = 1536, 2048, 1000
    wo, wo_ref = _weight(backends, rng, fmt, h, k_in)
    wq, wq_ref = _weight(backends, rng, fmt, 600, h)
    (gate, gate_ref), (up, up_ref) = _weight(backends, rng, fmt, inter, h), _weight(backends, rng, fmt, inter, h)
    w_gu = cb.gate_up_weight(gate, up)
    x = rnd(rng, m, k_in)
    res = (rng.standard_normal((m, h)) * 4).astype(np.float32)
    nw = rnd(rng, h, scale=0.3) + 1
    ref_normed, ref_r = nb.add_rms_norm(x @ wo_ref.T, res, nw, EPS)
    normed, r = cb.linear_add_rms_norm(cb.asarray(x, "act"), wo, None, cp.asarray(res), cb.asarray(nw, "act"), EPS)
    assert isinstance(normed.partial, sg.PartialNorm) and normed.partial.ssq.shape[0] == 23
    check(cb.to_numpy(r), ref_r, tol=1e-5)
    check(cb.to_numpy(cb.linear(normed, wq, out_f32=True)), ref_normed @ wq_ref.T, tol=1e-2)
    check(cb.to_numpy(cb.swiglu(normed, w_gu)), nb.swiglu(ref_normed, np.concatenate([gate_ref, up_ref])), tol=1e-2)
    assert normed.plain is None and _flags_clear(cb.num_sms)


@pytest.mark.parametrize("n,k", [(2560, 9728)])
def test_the_default_plan_splits_the_narrow_weights_of_real_models(backends, rng, n, k):
    """Qwen3-4B's down_proj streams split by default; against numpy, one row and sixteen, and replayed from a graph
    several times (the flags each launch leaves clear)."""
    skip_without_tma()
    cb = backends[16]
    if cb.num_sms != 132:
        pytest.skip("the plans of the H100 / H200's 132 SMs")
    assert sg.weight_plan(n, k, cb.num_sms, 16, cb.tuning).split
    w, ref = _weight(backends, rng, 16, n, k)
    xh = rnd(rng, 16, k)
    x = cb.asarray(xh, "act")
    y1, y16 = cp.empty((1, n), cp.float32), cp.empty((16, n), cp.float32)
    sg.stream_gemm(x[:1], w, y1, cb.num_sms, cb.tuning)
    sg.stream_gemm(x, w, y16, cb.num_sms, cb.tuning)
    check(cb.to_numpy(y16), xh @ ref.T, tol=1e-5)
    assert cp.array_equal(bits(y1), bits(y16[:1]))
    whole = dataclasses.replace(cb.tuning, stream_gemm_split=False)
    assert not sg.weight_plan(n, k, cb.num_sms, 16, whole).split
    stream = cb.stream
    stream.begin_capture()
    for _ in range(3):
        sg.stream_gemm(x, w, y16, cb.num_sms, cb.tuning)
    graph = stream.end_capture()
    for _ in range(4):
        bits(y16)[...] = NAN_BITS
        graph.launch(stream)
        stream.synchronize()
        assert cp.array_equal(bits(y16[:1]), bits(y1))
    assert _flags_clear(cb.num_sms)


def test_split_plans_fill_every_sm_and_keep_whole_plans_elsewhere():
    """Split where a whole-block plan leaves a third of the SMs idle over a long stream (Qwen3-4B's down_proj), whole
    blocks where the saving is short (4B's o_proj, 27B's out_proj), a small share of the stream (27B's gate_up, the
    LM heads) or the idle SMs few (27B's down_proj and qkvg, 9B's qkvg: the neighbouring kernels use them), and for
    every Qwen3-8B weight (the held numbers' plans); a split plan runs one CTA per SM with a unit each."""
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (12352, 4096),
                 (2560, 4096), (5120, 6144), (10240, 4096), (34816, 5120), (248320, 4096), (5120, 17408),
                 (14336, 5120)):
        assert not sg.plan_for(n, k, 132).split, (n, k)
    for n, k in ((2560, 9728),):
        for bits, warps in ((16, 4), (8, 8)):
            plan = sg.plan_for(n, k, 132, bits, warps)
            assert plan.split and plan.grid == 132 and plan.t == sg.SPLIT_T
            assert -(-n // (16 * plan.t)) * (k // plan.kt) >= plan.grid
            assert not sg.plan_for(n, k, 132, bits, warps, split=False).split
            for nt in (4, 8):
                if (bits, nt) in sg.WIDE_MAX_T:
                    wide = sg.wide_plan(n, k, 132, bits, warps, nt)
                    assert (wide.t, wide.grid, wide.split, wide.nt) == (plan.t, plan.grid, True, nt)
