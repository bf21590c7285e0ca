"""The GEMMs over FP8 weights (fp8_weight.Fp8Weight): the streaming GEMM's W8 instantiations and the many-row path
(dequantized to bf16, then cuBLAS), against numpy's float32 dequantized weight (quant.weight.dequantize) applied to
the same bf16 activations, in float64. Every epilogue, rows off the 128-row block grid, scale row maps, and the
invariances the engine relies on (a row's bits do not depend on the other rows; the graph reads x after its
producer)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import fp8_weight  # noqa: E402
from cudflash.backends import stream_gemm as sg  # noqa: E402
from cudflash.backends.base import DeferredNorm  # noqa: E402
from cudflash.backends.cuda_backend import CudaBackend  # noqa: E402
from cudflash.backends.cuda_util import bits  # noqa: E402
from cudflash.backends.fp8_weight import Fp8Weight  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402
from cudflash.quant import QuantizedWeight, concat_rows, dequantize, quantize_fp8_block  # noqa: E402
from cudflash.tiny import float32_to_bf16_bits  # noqa: E402

from .test_ops import NAN_BITS, check, poison_pool, rnd  # noqa: E402
from .test_stream_gemm import check_deeper_ring, skip_without_tma  # noqa: E402

EPS = 1e-6
# (N, K): N off the 128-row scale grid and off the 16-row tile (200, 1000), blocks of 1..4 tiles, several rounds of
# blocks per CTA (24576), a partial last 128-row block (4000), the long K of down_proj (12288).
SHAPES = [(200, 256), (1000, 512), (4096, 1024), (4000, 4096), (24576, 256), (296, 12288)]


@pytest.fixture(scope="module", params=[4, 8], ids=["w8x4", "w8x8"])
def cb(request):
    """The CUDA backend with FP8 weights kept on the device (tuning.fp8_on_device, off by default): its
    load_quantized gives the Fp8Weight whose GEMMs these tests check; with four and with eight compute warps in the
    streaming GEMM (tuning.stream_gemm_w8_warps: another summation order, the same function)."""
    from cudflash.backends.cuda_backend import CudaBackend

    # fp8_w8a8 off: the inexact rows' many-row path is the dequantized one here (W8A8's: test_w8a8.py)
    return CudaBackend(tuning={"fp8_on_device": True, "stream_gemm_w8_warps": request.param, "fp8_w8a8": False})


def quantized(rng, n: int, k: int, scale: float = 1.0) -> QuantizedWeight:
    return quantize_fp8_block((rng.standard_normal((n, k)) * scale).astype(np.float32))


def ref_gemm(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    return (x.astype(np.float64) @ dequantize(w).astype(np.float64).T)


@pytest.mark.parametrize("n,k", SHAPES)
# x resident; x in boxes of one and of two token tiles; wide launches of four and eight token tiles
@pytest.mark.parametrize("m", [1, 3, 9, 16, 17, 40, 64])
def test_fp8_stream_gemm_matches_numpy(cb, rng, n, k, m):
    qw = quantized(rng, n, k, scale=k ** -0.5)
    check_stream_gemm(cb, rng, qw, fp8_weight.upload(qw), m)


def check_stream_gemm(cb, rng, qw: QuantizedWeight, w, m: int) -> None:
    """The streaming GEMM of x [m, K] over `w` (qw uploaded), float32 and bf16 out, every output written, against
    float64 over qw's dequantized values."""
    skip_without_tma()
    n, k = qw.shape
    wide = rnd(rng, m, k + 64)  # x row-strided, a column slice of a wider activation
    x, dx = wide[:, 64:], cb.asarray(wide, "act")[:, 64:]
    for dtype in (cp.float32, cb.act):
        y = cp.empty((m, n), dtype=dtype)
        bits(y)[...] = NAN_BITS  # every output must be written
        sg.stream_gemm(dx, w, y, cb.num_sms, cb.tuning)
        check(cb.to_numpy(y), ref_gemm(x, qw), tol=1e-5 if dtype == cp.float32 else 1e-2)


@pytest.mark.parametrize("m", [1, 16])
def test_every_code_decodes_exactly(cb, rng, m):
    """Each of the 254 finite codes (subnormals, both zeros, +-448) in many positions, checked per element against
    a bound 60x the typical float32 rounding (a wrong exponent or sign of a normal code lands far outside it); and a
    weight of subnormal codes alone, where a code flushed to zero would show at once."""
    skip_without_tma()
    n, k = 256, 2048
    finite = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    codes = rng.choice(finite, size=(n, k)).astype(np.uint8)
    codes[:, :256] = np.resize(finite, 256)  # every code at least once in each row
    qw = QuantizedWeight("fp8", (n, k), codes, rng.uniform(0.5, 2, (2, 16)).astype(np.float32), (128, 128))
    x = rnd(rng, m, k, scale=0.1)
    y = cp.empty((m, n), cp.float32)
    sg.stream_gemm(cb.asarray(x, "act"), fp8_weight.upload(qw), y, cb.num_sms, cb.tuning)
    ref = ref_gemm(x, qw)
    # Subnormal-only rows: any flush to zero shows at once.
    sub = np.where((codes & 0x78) == 0, codes, 0).astype(np.uint8)
    qs = QuantizedWeight("fp8", (n, k), sub, np.ones((2, 16), np.float32), (128, 128))
    ys = cp.empty((m, n), cp.float32)
    sg.stream_gemm(cb.asarray(x, "act"), fp8_weight.upload(qs), ys, cb.num_sms, cb.tuning)
    ref_s = ref_gemm(x, qs)
    bound = np.abs(x).astype(np.float64) @ np.abs(dequantize(qw)).astype(np.float64).T * 2e-6
    assert np.all(np.abs(cb.to_numpy(y) - ref) <= bound)
    bound_s = np.abs(x).astype(np.float64) @ np.abs(dequantize(qs)).astype(np.float64).T * 2e-6 + 1e-30
    assert np.abs(ref_s).max() > 0 and np.all(np.abs(cb.to_numpy(ys) - ref_s) <= bound_s)


def test_scale_layouts_off_the_block_grid(cb, rng):
    """A fused weight whose parts end off the 128-row grid (each row mapped to its part's scale row), per-channel
    and per-tensor scales, 256-column blocks: each through the streamed GEMM (1 and 16 rows) and the many-row
    path."""
    skip_without_tma()
    k = 512
    fused = concat_rows([quantized(rng, n, k) for n in (80, 16, 48)], ["q", "k", "v"])
    assert fused.scale_rows is not None
    channel = QuantizedWeight("fp8", (96, k), rng.integers(0, 0x7E, (96, k)).astype(np.uint8),
                              rng.uniform(1e-3, 1, (96, 1)).astype(np.float32), (1, k))
    tensor = QuantizedWeight("fp8", (64, k), rng.integers(0, 0x7E, (64, k)).astype(np.uint8),
                             np.array([[0.01]], np.float32), (64, k))
    wide = quantize_fp8_block(rng.standard_normal((300, k)).astype(np.float32), block=(128, 256))
    for qw in (fused, channel, tensor, wide):
        assert fp8_weight.fits(qw)
        w = cb.load_quantized(qw)
        assert isinstance(w, Fp8Weight)
        for m in (1, 16, 40):
            x = rnd(rng, m, k, scale=0.1)
            y = cb.linear(cb.asarray(x, "act"), w, out_f32=True)
            check(cb.to_numpy(y), ref_gemm(x, qw), tol=1e-5 if m <= 16 else 1e-2)


def test_narrow_scale_blocks_keep_the_bf16_path(cb, rng):
    """FP8 with 64-column blocks does not fit the W8 kernel: it loads as bf16 (numpy's values rounded once)."""
    qw = quantize_fp8_block(rng.standard_normal((128, 256)).astype(np.float32), block=(128, 64))
    assert not fp8_weight.fits(qw)
    w = cb.load_quantized(qw)
    assert not isinstance(w, Fp8Weight)
    assert np.array_equal(cp.asnumpy(bits(w)), float32_to_bf16_bits(dequantize(qw)))


@pytest.mark.parametrize("n,k", [(200, 384), (4096, 1024), (1000, 4096)])
def test_dequantize_bf16_is_numpy_rounded_once(cb, rng, n, k):
    qw = quantized(rng, n, k)
    got = fp8_weight.dequantize_bf16(fp8_weight.upload(qw), cb.act, cb.tuning)
    assert np.array_equal(cp.asnumpy(bits(got)), float32_to_bf16_bits(dequantize(qw)))


def check_routes(cb, rng, m: int, monkeypatch, quantized, ref_gemm, off_k: int) -> None:
    """CudaBackend.linear of x [m, K] over a quantized weight [520, K] (`quantized(rng, n, k, scale)`): with K = 1024
    every row streams the codes, beyond 16 rows in launches of stream_gemm.launch_rows (a verify's rows keep their
    decodes' bits whatever their number), except inexact rows (Backend.inexact_rows) of a product beyond
    quantized_stream_max_rows (64),
    which go through the dequantized bf16 weight and cuBLAS, as every row at K = off_k (off the stage's columns)
    does. All compute the product (`ref_gemm`), and a streamed row has the bits of that row streamed alone."""
    skip_without_tma()
    assert cb.tuning.quantized_stream_max_rows == 64
    calls = []
    real = sg.stream_gemm
    monkeypatch.setattr(sg, "stream_gemm", lambda *a: calls.append((a[0].shape[0], a[1].shape)) or real(*a))
    for k in (1024, off_k):
        qw = quantized(rng, 520, k, scale=k ** -0.5)
        x = rnd(rng, m, k)
        w = cb.load_quantized(qw)
        per = sg.launch_rows(sg.weight_bits(w), cb.tuning) if m > 16 else 16
        assert not (isinstance(w, fp8_weight.Fp8Weight) and cb.tuning.fp8_w8a8)  # W8A8's routes: test_w8a8.py
        for inexact in (0, m):
            calls.clear()
            with cb.inexact_rows(inexact):
                y = cb.linear(cb.asarray(x, "act"), w, out_f32=True)
            streamed = k == 1024 and (m <= 64 or not inexact)
            assert calls == ([(min(per, m - i), (520, 1024)) for i in range(0, m, per)] if streamed else [])
            check(cb.to_numpy(y), ref_gemm(x, qw), tol=1e-5 if streamed else 1e-2)
            if streamed:
                for i in sorted({0, 15, 16, 33, 64, m - 1} & set(range(m))):
                    alone = cb.linear(cb.asarray(x[i:i + 1], "act"), w, out_f32=True)
                    assert cp.array_equal(alone.view(cp.uint32), y[i:i + 1].view(cp.uint32)), i


@pytest.mark.parametrize("m", [1, 16, 17, 40, 64, 65, 300])
def test_linear_routes_by_rows_and_k(cb, rng, m, monkeypatch):
    """K % 256 == 0 streams every exact row (check_routes); K = 384 does not."""
    check_routes(cb, rng, m, monkeypatch, quantized, ref_gemm, off_k=384)


def check_rows_alone(cb, rng, w) -> None:
    """Row i of a product over w [n, k] has the bits of the 1-row product of x[i] (a verify row == its decode),
    for rows alone and in runs: one launch of 16 rows, and 64 rows in wide launches of 32 and 64 rows (row tiles and
    token tiles of other sizes, the same summation order) and of 16."""
    skip_without_tma()
    n, k = w.shape
    x = cb.asarray(rnd(rng, 64, k), "act")
    full = cp.empty((16, n), cp.float32)
    sg.stream_gemm(x[:16], w, full, cb.num_sms, cb.tuning)
    for lo, hi in ((0, 1), (3, 4), (15, 16), (2, 9), (0, 5)):
        part = cp.empty((hi - lo, n), cp.float32)
        sg.stream_gemm(x[lo:hi], w, part, cb.num_sms, cb.tuning)
        assert cp.array_equal(part.view(cp.uint32), full[lo:hi].view(cp.uint32)), (lo, hi)
    alone = cp.concatenate([cb.linear(x[i:i + 1], w, out_f32=True) for i in range(64)])
    for rows in (16, 32, 64):
        wide = CudaBackend(tuning=dataclasses.replace(cb.tuning, quantized_launch_rows=rows))
        for lo, hi in ((0, 64), (0, 17), (5, 45), (20, 52)):
            got = wide.linear(x[lo:hi], w, out_f32=True)
            assert cp.array_equal(got.view(cp.uint32), alone[lo:hi].view(cp.uint32)), (rows, lo, hi)


@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 512)])
def test_fp8_rows_do_not_depend_on_the_other_rows(cb, rng, n, k):
    """check_rows_alone on an Fp8Weight."""
    check_rows_alone(cb, rng, fp8_weight.upload(quantized(rng, n, k)))


def check_epilogues(cb, rng, m: int, quantized, h: int, weight_type: type) -> None:
    """The layer's chain on quantized weights (`quantized(rng, n, k, scale)`, loading as `weight_type`): an
    o_proj-like producer adding the residual (SG_ADD_NORM), the gate_up consumer scaling rows and applying SwiGLU
    (SG_ROW_SCALE | SG_SWIGLU), a row-scaled plain consumer, and SwiGLU on plain x: each against the numpy backend on
    the dequantized weights; the fused SwiGLU with the bits of the swiglu kernel on the same GEMM's float32 output.
    h: the hidden width (a multiple of the format's stage columns); gate_up's 2000 rows and wq's 600 lie off the
    128-row grid."""
    skip_without_tma()
    nb = NumpyBackend()
    k_in, inter = 2048, 1000  # inter % 8 == 0
    wo, wq = quantized(rng, h, k_in, k_in ** -0.5), quantized(rng, 600, h, h ** -0.5)
    gate, up = quantized(rng, inter, h, h ** -0.5), quantized(rng, inter, h, h ** -0.5)
    w_gu = cb.gate_up_weight(cb.load_quantized(gate), cb.load_quantized(up))
    assert isinstance(w_gu, weight_type)
    x = rnd(rng, m, k_in)
    res = (rng.standard_normal((m, h)) * 4).astype(np.float32)
    nw = rnd(rng, h, scale=0.3) + 1
    ref_normed, ref_r = nb.add_rms_norm(x @ dequantize(wo).T, res, nw, EPS)
    poison_pool(16 * h * 4 * 4)
    normed, r = cb.linear_add_rms_norm(cb.asarray(x, "act"), cb.load_quantized(wo), None, cp.asarray(res),
                                       cb.asarray(nw, "act"), EPS)
    assert isinstance(normed, DeferredNorm) and isinstance(normed.partial, sg.PartialNorm)
    check(cb.to_numpy(r), ref_r, tol=1e-5)
    check(cb.to_numpy(cb.linear(normed, cb.load_quantized(wq), out_f32=True)), ref_normed @ dequantize(wq).T,
          tol=1e-2)
    gu_ref = np.concatenate([dequantize(gate), dequantize(up)])
    check(cb.to_numpy(cb.swiglu(normed, w_gu)), nb.swiglu(ref_normed, gu_ref), tol=1e-2)
    assert normed.plain is None  # every consumer streamed
    y32 = cp.empty((m, 2 * inter), cp.float32)
    sg.row_scaled(normed, w_gu, y32, cb.num_sms, cb.tuning)
    assert cp.array_equal(bits(cb.swiglu(normed, w_gu)), bits(cb._swiglu_rows(y32)))
    xa = rnd(rng, m, h)
    check(cb.to_numpy(cb.swiglu(cb.asarray(xa, "act"), w_gu)), nb.swiglu(xa, gu_ref), tol=1e-2)


@pytest.mark.parametrize("m", [1, 3, 9, 16])
def test_fp8_epilogues_match_numpy(cb, rng, m):
    """check_epilogues on FP8 weights."""
    check_epilogues(cb, rng, m, quantized, 1280, Fp8Weight)


@pytest.mark.parametrize("m", [1, 16])  # x resident in shared memory, x in boxes
def test_fp8_gemm_in_a_graph_reads_x_after_its_producer(cb, rng, m):
    """Captured with PDL right behind the kernel that writes x: a read before griddepcontrol.wait would see the
    previous replay's x."""
    skip_without_tma()
    n, k = 6144, 2048
    qw = quantized(rng, n, k, k ** -0.5)
    w = cb.load_quantized(qw)
    src = cb.asarray(rnd(rng, m, k), "act")
    cb.synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cb.linear(cb.add(src, src), w, out_f32=True)
        stream.synchronize()
        stream.begin_capture()
        y = cb.linear(cb.add(src, src), w, out_f32=True)
        graph = stream.end_capture()
        for _ in range(3):
            new = rnd(rng, m, k)
            bits(src)[...] = bits(cb.asarray(new, "act"))
            bits(y)[...] = NAN_BITS
            graph.launch(stream)
            stream.synchronize()
            check(cb.to_numpy(y), ref_gemm(2 * new, qw), tol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 9, 16])  # x resident, x in boxes
@pytest.mark.parametrize("n", [4096, 24576])  # 6 ring stages, gate_up's 3
def test_fp8_deeper_rings_change_no_bit(cb, rng, m, n):
    """check_deeper_ring on FP8 weights."""
    qw = quantized(rng, n, 4096, scale=4096 ** -0.5)
    check_deeper_ring(cb, rng, fp8_weight.upload(qw), m)


def check_row_slice(cb, rng, w, lo: int, hi: int) -> None:
    """w[lo:hi] (the drafter's per-layer K/V rows of its fused weight) multiplies as those rows of w do; a stepped
    slice is refused."""
    skip_without_tma()
    x = cb.asarray(rnd(rng, 3, w.shape[1]), "act")
    full = cb.to_numpy(cb.linear(x, w, out_f32=True))
    part = w[lo:hi]
    assert part.shape == (hi - lo, w.shape[1])
    assert np.array_equal(cb.to_numpy(cb.linear(x, part, out_f32=True)), full[:, lo:hi])
    with pytest.raises(TypeError):
        w[::2]


def check_wide_swiglu(cb, rng, quantized, h: int) -> None:
    """SwiGLU in the epilogue of a wide launch (17, 40 and 64 rows): against numpy on the dequantized weights, and
    row by row with the bits of the rows alone."""
    skip_without_tma()
    nb = NumpyBackend()
    inter = 1000
    gate, up = quantized(rng, inter, h, h ** -0.5), quantized(rng, inter, h, h ** -0.5)
    w_gu = cb.gate_up_weight(cb.load_quantized(gate), cb.load_quantized(up))
    gu_ref = np.concatenate([dequantize(gate), dequantize(up)])
    for m in (17, 40, 64):
        xa = rnd(rng, m, h)
        x = cb.asarray(xa, "act")
        got = cb.swiglu(x, w_gu)
        check(cb.to_numpy(got), nb.swiglu(xa, gu_ref), tol=1e-2)
        for i in (0, m // 2, m - 1):
            assert cp.array_equal(bits(cb.swiglu(x[i:i + 1], w_gu)), bits(got[i:i + 1])), (m, i)


def test_fp8_wide_swiglu(cb, rng):
    """check_wide_swiglu on FP8 weights."""
    check_wide_swiglu(cb, rng, quantized, 1280)


def test_a_row_slice_is_those_rows_of_the_weight(cb, rng):
    """check_row_slice on an Fp8Weight, its row map still pointing into the whole scale array (rows off the
    128-row grid)."""
    check_row_slice(cb, rng, fp8_weight.upload(quantized(rng, 1000, 1024)), 200, 456)


def test_fp8_plans_fit_and_do_not_depend_on_rows():
    """FP8 plans: the same row blocks and grid as bf16 (the grid is about rows, not bytes), a deeper ring (half the
    bytes per stage), the same shared-memory request (one CTA per SM)."""
    for (n, k), warps in itertools.product(((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (200, 256)),
                                           (4, 8)):
        bf, f8 = sg.plan_for(n, k, 132), sg.plan_for(n, k, 132, 8, warps)
        assert (f8.t, f8.grid) == (bf.t, bf.grid) and f8.stages >= bf.stages and f8.threads == 32 * (warps + 1)
        for m in (1, 8, 16):
            x_bytes = sg.resident_x_bytes(m, k, 8)
            assert f8.smem(x_bytes) == sg.SMEM_BUDGET
            assert f8.fixed_bytes(f8.t, warps) + f8.stages * f8.stage_bytes(f8.t, x_bytes is not None, 8) + (
                x_bytes or 0) <= sg.SMEM_BUDGET


def test_wide_plans_fit():
    """The wide launches' plans: row blocks of at most WIDE_MAX_T tiles, at least two ring stages, within
    WIDE_SMEM_BUDGET (more than half an SM: one CTA per SM), for every synthetic shape and both quantized formats."""
    for (n, k), (bits, nt) in itertools.product(((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                                                  (2560, 9728), (200, 512)), sg.WIDE_MAX_T):
        if k % sg.stage_cols(bits):
            continue
        plan = sg.wide_plan(n, k, 132, bits, 8, nt)
        assert plan.nt == nt and 1 <= plan.t <= sg.WIDE_MAX_T[bits, nt] and plan.stages >= 2
        need = plan.fixed_bytes(plan.t, 8, nt) + plan.stages * plan.stage_bytes(plan.t, False, bits, nt)
        assert sg.SMEM_BUDGET < plan.smem() == max(sg.SMEM_BUDGET, need) <= sg.WIDE_SMEM_BUDGET


def test_random_fp8_has_the_requested_spread(cb):
    w = fp8_weight.random_fp8((512, 1024), 0.02, seed=3)
    assert w.data.dtype == cp.uint8 and w.scale.shape == (4, 8) and w.rows.shape == (512,)
    assert not bool(cp.any((w.data & 0x7F) == 0x7F))
    std = float(np.std(cb.to_numpy(fp8_weight.dequantize_bf16(w, cb.act, cb.tuning))))
    assert 0.018 < std < 0.022
