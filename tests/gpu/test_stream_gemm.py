"""The weight-streaming GEMM (kernels/stream_gemm.cu) against numpy, its row invariance, and its launch inside a
captured graph behind a kernel that writes its input (programmatic dependent launch: the weight is read before
griddepcontrol.wait, x only after it)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import stream_gemm as sg  # noqa: E402
from cudflash.backends.base import DeferredNorm  # noqa: E402
from cudflash.backends.cuda_util import bits  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402
from cudflash.backends.tuning import CudaTuning  # noqa: E402

from .test_ops import NAN_BITS, check, poison_pool, rnd  # noqa: E402

# (N, K): blocks of 1..4 row tiles, a partial last block (N % 16 != 0 and N % (16 t) != 0), several rounds of
# blocks per CTA (N = 24576 with t = 4), the longest K of Qwen3-8B's down_proj.
SHAPES = [(1000, 512), (4096, 1024), (6144, 512), (24576, 256), (296, 4096), (4096, 12288)]


def test_available_on_hopper():
    """On sm_90 (H100, H200: 228 KiB per SM) the kernel must be in use: the routing tests below skip elsewhere, so
    a wrong capability or attribute check would otherwise only show as a slower step."""
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("an sm_90 check")
    assert sg.available()


def skip_without_tma():
    if not sg.available():
        pytest.skip("needs sm_90 and the driver's tensor-map encoder")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
def test_stream_gemm_matches_numpy(cb, rng, n, k, m):
    skip_without_tma()
    wide = rnd(rng, m, k + 64)  # x row-strided, as a column slice of a wider activation
    x, w = wide[:, 64:], rnd(rng, n, k, scale=k ** -0.5)
    dx = cb.asarray(wide, "act")[:, 64:]
    dw = cb.asarray(w, "act")
    for dtype in (cp.float32, cb.act):
        y = cp.empty((m, n), dtype=dtype)
        bits(y)[...] = NAN_BITS  # every output must be written
        sg.stream_gemm(dx, dw, y, cb.num_sms, cb.tuning)
        check(cb.to_numpy(y), x @ w.T, tol=1e-5 if dtype == cp.float32 else 1e-2)


@pytest.mark.parametrize("m", [1, 9])  # x resident, x in boxes
def test_prefill_depth_changes_no_bit(cb, rng, m):
    """The tuning's stream_gemm_prefill_stages only moves where the ring's first copies are issued (before or after
    the wait): none, one, and more than the ring holds give the bits of the default, over several rounds of the
    ring."""
    skip_without_tma()
    n, k = 4096, 12288
    x, w = cb.asarray(rnd(rng, m, k), "act"), cb.asarray(rnd(rng, n, k, scale=k ** -0.5), "act")
    ref = cp.empty((m, n), cp.float32)
    sg.stream_gemm(x, w, ref, cb.num_sms, cb.tuning)
    check(cb.to_numpy(ref), cb.to_numpy(x).astype(np.float32) @ cb.to_numpy(w).astype(np.float32).T, tol=1e-5)
    for prefill in (0, 1, 64):
        y = cp.empty((m, n), cp.float32)
        bits(y)[...] = NAN_BITS
        sg.stream_gemm(x, w, y, cb.num_sms, dataclasses.replace(cb.tuning, stream_gemm_prefill_stages=prefill))
        assert cp.array_equal(y.view(cp.uint32), ref.view(cp.uint32)), prefill


@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 512), (24576, 256)])
def test_stream_gemm_rows_do_not_depend_on_the_other_rows(cb, rng, n, k):
    """Row i of a 16-row product has the bits of the 1-row product of x[i] (a verify row == its decode)."""
    skip_without_tma()
    x, w = cb.asarray(rnd(rng, 16, k), "act"), cb.asarray(rnd(rng, n, k, scale=k ** -0.5), "act")
    full = cp.empty((16, n), cp.float32)
    sg.stream_gemm(x, w, full, cb.num_sms, cb.tuning)
    for rows in ((0, 1), (3, 4), (15, 16), (2, 9), (0, 5)):
        part = cp.empty((rows[1] - rows[0], n), cp.float32)
        sg.stream_gemm(x[rows[0]:rows[1]], w, part, cb.num_sms, cb.tuning)
        assert cp.array_equal(part.view(cp.uint32), full[rows[0]:rows[1]].view(cp.uint32)), rows


def test_linear_routes_big_weights_through_stream_gemm(cb, rng, monkeypatch):
    skip_without_tma()
    calls = []
    real = sg.stream_gemm
    monkeypatch.setattr(sg, "stream_gemm", lambda *a: calls.append(a[1].shape) or real(*a))
    k = 1024
    n_big = cb.tuning.stream_gemm_min_bytes // (2 * k)  # exactly the smallest weight it takes
    big, small = rnd(rng, n_big, k, scale=k ** -0.5), rnd(rng, 512, k, scale=k ** -0.5)
    for m in (1, 16, 17):
        x = rnd(rng, m, k)
        check(cb.to_numpy(cb.linear(cb.asarray(x, "act"), cb.asarray(big, "act"), out_f32=True)), x @ big.T, 1e-5)
        cb.linear(cb.asarray(x, "act"), cb.asarray(small, "act"))
    assert calls == [(n_big, k), (n_big, k)]  # m = 1 and 16; m = 17 and the small weight stay on cuBLAS


def test_the_tuning_threshold_routes_each_backend_on_its_own(cb, rng, monkeypatch):
    """Two backends in one process with different stream_gemm_min_bytes: the one whose threshold is above the
    weight keeps it on cuBLAS, the default one streams it, and both compute the product."""
    skip_without_tma()
    from cudflash.backends.cuda_backend import CudaBackend

    calls = []
    real = sg.stream_gemm
    monkeypatch.setattr(sg, "stream_gemm", lambda *a: calls.append(a[4].stream_gemm_min_bytes) or real(*a))
    k = 1024
    w = rnd(rng, cb.tuning.stream_gemm_min_bytes // (2 * k), k, scale=k ** -0.5)
    cublas = CudaBackend(CudaTuning(stream_gemm_min_bytes=2 * w.size * 2))
    x = rnd(rng, 4, k)
    for b in (cublas, cb, cublas):
        check(b.to_numpy(b.linear(b.asarray(x, "act"), b.asarray(w, "act"), out_f32=True)), x @ w.T, 1e-5)
    assert calls == [cb.tuning.stream_gemm_min_bytes]


@pytest.mark.parametrize("m", [1, 16])  # x resident in shared memory, x in boxes
def test_stream_gemm_in_a_graph_reads_x_after_its_producer(cb, rng, m):
    """x is written by the kernel right before the GEMM in the graph: a read before griddepcontrol.wait would see
    the previous replay's x."""
    skip_without_tma()
    n, k = 6144, 2048
    w_host = rnd(rng, n, k, scale=k ** -0.5)
    w = cb.asarray(w_host, "act")
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
            check(cb.to_numpy(y), (2 * new) @ w_host.T, tol=1e-5)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
                                 (4096, 20480), (1000, 512)])
def test_plans_cover_the_weight_one_cta_per_sm(n, k):
    """Every plan covers all N rows with at most one CTA per SM, holds at least two ring stages, and asks for more
    than half an SM's shared memory: under PDL a grid launched early would otherwise put two CTAs on the SMs free
    at that moment and stream at half speed there."""
    for num_sms in (132, 114, 78):
        plan = sg.plan_for(n, k, num_sms)
        blocks = -(-n // (16 * plan.t))
        if plan.split:  # every SM, each CTA at least one (block, k tile) unit
            assert plan.grid == num_sms and blocks * (k // plan.kt) >= num_sms
        else:
            assert plan.grid <= num_sms and -(-blocks // plan.grid) == -(-blocks // num_sms)  # no extra rounds
        assert plan.stages >= 2
        for m in (1, 8, 16):  # x resident in shared memory or in boxes with each stage
            x_bytes = sg.resident_x_bytes(m, k)
            smem = plan.smem(x_bytes)
            assert smem >= plan.fixed_bytes(plan.t) + plan.stages * plan.stage_bytes(plan.t, x_bytes is not None) + (
                x_bytes or 0)
            assert smem == sg.SMEM_BUDGET  # resident x takes no more room than the x boxes it replaces
            assert 2 * (smem + 1024) > 228 * 1024  # Hopper: 228 KiB per SM, 1 KiB reserved per CTA


def test_decode_rows_are_resident_and_verify_rows_come_in_boxes():
    """At batch 1 every Qwen3-8B GEMM's x row stays in shared memory (8 KiB, 24 KiB for down_proj); a 16-row verify
    pass and wide rows past X_RESIDENT_BYTES take the boxes."""
    for k in (4096, 12288):
        assert sg.resident_x_bytes(1, k) == 2 * k + 16
    assert sg.resident_x_bytes(8, 1024) == 8 * 2064
    assert sg.resident_x_bytes(16, 256) is None and sg.resident_x_bytes(9, 256) is None
    assert sg.resident_x_bytes(2, 12288) is None


# ------------------------------------------------------------------- SwiGLU in the gate_up GEMM's epilogue
def _gate_up(cb, rng, inter: int = 2048, h: int = 1024):
    """gate, up [inter, h] on the host and the interleaved device weight (8 MiB at the defaults: it streams)."""
    gate, up = rnd(rng, inter, h, scale=h ** -0.5), rnd(rng, inter, h, scale=h ** -0.5)
    return gate, up, cb.gate_up_weight(cb.asarray(gate, "act"), cb.asarray(up, "act"))


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])  # resident x; boxes of one and of two token tiles
def test_swiglu_epilogue_has_the_bits_of_the_swiglu_kernel(cb, rng, m):
    """The epilogue's silu(gate) * up equals the swiglu kernel applied to the same GEMM's float32 output, bit for
    bit (plain x and a deferred norm's rows), and silu(x gate^T) * (x up^T) within bf16 rounding."""
    skip_without_tma()
    gate, up, w = _gate_up(cb, rng)
    inter, h = gate.shape
    x_host = rnd(rng, m, h)
    x = cb.asarray(x_host, "act")
    poison_pool(m * inter * 4)
    fused = cb.swiglu(x, w)
    y32 = cp.empty((m, 2 * inter), cp.float32)
    sg.stream_gemm(x, w, y32, cb.num_sms, cb.tuning)
    assert cp.array_equal(bits(fused), bits(cb._swiglu_rows(y32)))
    check(cb.to_numpy(fused), NumpyBackend().swiglu(x_host, np.concatenate([gate, up])))

    res = cp.asarray((rng.standard_normal((m, h)) * 4).astype(np.float32))
    w_in = cb.asarray(rnd(rng, h, 4096, scale=4096 ** -0.5), "act")  # a producer that streams (8 MiB)
    normed, _ = cb.linear_add_rms_norm(cb.asarray(rnd(rng, m, 4096), "act"), w_in, None, res,
                                       cb.asarray(rnd(rng, h) + 1, "act"), EPS)
    assert isinstance(normed, DeferredNorm) and isinstance(normed.partial, sg.PartialNorm)
    fused = cb.swiglu(normed, w)
    sg.row_scaled(normed, w, y32, cb.num_sms, cb.tuning)
    assert cp.array_equal(bits(fused), bits(cb._swiglu_rows(y32)))


def test_swiglu_rows_do_not_depend_on_the_other_rows(cb, rng):
    skip_without_tma()
    _, _, w = _gate_up(cb, rng)
    x = cb.asarray(rnd(rng, 16, w.shape[1]), "act")
    full = cb.swiglu(x, w)
    for lo, hi in ((0, 1), (7, 8), (15, 16), (3, 12), (8, 16)):
        assert cp.array_equal(bits(cb.swiglu(x[lo:hi], w)), bits(full[lo:hi])), (lo, hi)


# ------------------------------------------------------------------- the RMSNorm deferred between two GEMMs
H, K_IN, N_OUT = 2048, 2048, 2048  # every weight exactly the default stream_gemm_min_bytes: the smallest that streams
EPS = 1e-6


def _norm_pair(cb, rng, m: int):
    """Host and device operands of linear_add_rms_norm: x [m, K_IN], W [H, K_IN], residual [m, H] float32 (the
    size of a real residual stream), norm weight [H], and the next GEMM's weight [N_OUT, H]."""
    host = dict(x=rnd(rng, m, K_IN), w=rnd(rng, H, K_IN, scale=K_IN ** -0.5),
                res=(rng.standard_normal((m, H)) * 4).astype(np.float32), nw=rnd(rng, H, scale=0.3) + 1,
                w2=rnd(rng, N_OUT, H, scale=H ** -0.5))
    dev = {k: cp.asarray(v) if k == "res" else cb.asarray(v, "act") for k, v in host.items()}
    return host, dev


@pytest.mark.parametrize("m", [1, 5, 16])
def test_linear_add_rms_norm_defers_the_norm_into_the_next_gemm(cb, rng, m):
    """o_proj / down_proj add the residual and leave the normed rows unscaled; the next GEMM scales its rows. The
    product must be rms_norm(residual + x W^T) * norm_w @ W2^T, and the small-weight fallback the same."""
    skip_without_tma()
    host, dev = _norm_pair(cb, rng, m)
    nb = NumpyBackend()
    ref_normed, ref_r = nb.add_rms_norm(host["x"] @ host["w"].T, host["res"], host["nw"], EPS)
    poison_pool(16 * H * 4 * 4)
    normed, r = cb.linear_add_rms_norm(dev["x"], dev["w"], None, dev["res"], dev["nw"], EPS)
    assert isinstance(normed, DeferredNorm) and normed.partial.ssq.shape[1] == sg.MAX_ROWS
    check(cb.to_numpy(r), ref_r, tol=1e-5)
    y = cb.linear(normed, dev["w2"], out_f32=True)
    check(cb.to_numpy(y), ref_normed @ host["w2"].T, tol=1e-2)
    assert normed.plain is None  # the streamed consumer never built the plain rows
    small = host["w2"][:256]  # 1 MiB: cuBLAS, which needs the plain rows
    y_small = cb.linear(normed, cb.asarray(small, "act"), out_f32=True)
    assert normed.plain is not None
    check(cb.to_numpy(y_small), ref_normed @ small.T, tol=1e-2)
    check(cb.to_numpy(normed.plain), ref_normed, tol=1e-2)


@pytest.mark.parametrize("m", [1, 9, 16])  # x resident, x in boxes
def test_prefetch_all_changes_no_bit(cb, rng, m):
    """A GEMM behind attention (prefetch_all, with the tuning's stream_gemm_prefetch_all_kib) keeps its blocks and
    grid, so its residual, normed rows and sums of squares have the default's bits; only the ring is deeper and all
    of it is requested before the wait."""
    skip_without_tma()
    host, dev = _norm_pair(cb, rng, m)
    ref_normed, ref_r = cb.linear_add_rms_norm(dev["x"], dev["w"], None, dev["res"], dev["nw"], EPS)
    for kib in (116, 144):
        tuned = dataclasses.replace(cb.tuning, stream_gemm_prefetch_all_kib=kib)
        plan = sg.weight_plan(H, K_IN, cb.num_sms, 16, tuned)
        deep = sg.deep_plan(plan, sg.resident_x_bytes(m, K_IN), kib << 10)
        assert (deep.t, deep.grid) == (plan.t, plan.grid) and plan.stages <= deep.stages <= 16
        assert kib < 144 or deep.stages > plan.stages
        assert deep.smem(sg.resident_x_bytes(m, K_IN)) <= max(kib << 10, sg.SMEM_BUDGET)
        normed, r = sg.add_norm(cb._gemm_rows(dev["x"], True), dev["w"], dev["res"], dev["nw"], EPS, cb.num_sms,
                                tuned, prefetch_all=True)
        for a, b in ((r, ref_r), (normed.partial.normed, ref_normed.partial.normed),
                     (normed.partial.ssq, ref_normed.partial.ssq)):
            assert cp.array_equal(bits(a), bits(b)), kib


@pytest.mark.parametrize("m", [1, 9, 16])  # x resident, x in boxes
@pytest.mark.parametrize("n", [4096, 24576])  # 4 ring stages, gate_up's 2
def test_bf16_keeps_its_ring(cb, m, n):
    """tuning.stream_gemm_quantized_stages leaves a bf16 launch's plan alone: a bf16 stage holds twice a quantized
    one's bytes, and deeper bf16 rings were even or slower (BENCHMARKS.md, sessions 35-36)."""
    plan = sg.weight_plan(n, K_IN, cb.num_sms, 16, cb.tuning)
    deepest = dataclasses.replace(cb.tuning, stream_gemm_quantized_stages=16)
    assert sg.floored_plan(plan, sg.resident_x_bytes(m, K_IN, 16), deepest) == plan


def check_deeper_ring(cb, rng, w, m: int) -> None:
    """tuning.stream_gemm_quantized_stages, x [m, K] resident or in boxes: a launch over a quantized `w` takes a ring
    at least that deep where the shared memory allows (sg.floored_plan: the same blocks and grid; 4 stages, and 16
    the most), and its outputs keep the bits of the plan's own stage count (0)."""
    skip_without_tma()
    n, k = w.shape
    x_bytes = sg.resident_x_bytes(m, k, sg.weight_bits(w))
    x = cb.asarray(rnd(rng, m, k), "act")
    shallow = dataclasses.replace(cb.tuning, stream_gemm_quantized_stages=0)
    plan = sg.weight_plan(n, k, cb.num_sms, sg.weight_bits(w), shallow)
    assert sg.floored_plan(plan, x_bytes, shallow) == plan
    ref = cp.empty((m, n), cp.float32)
    sg.stream_gemm(x, w, ref, cb.num_sms, shallow)
    for stages in (4, 16):
        tuned = dataclasses.replace(shallow, stream_gemm_quantized_stages=stages)
        deep = sg.floored_plan(plan, x_bytes, tuned)
        budget = sg.SMEM_BUDGET if x_bytes is not None else sg.WIDE_SMEM_BUDGET
        room = sg.deep_plan(plan, x_bytes, budget).stages  # the deepest ring the budget holds
        assert (deep.t, deep.grid) == (plan.t, plan.grid)
        assert deep.stages == max(plan.stages, min(stages, room)), (plan, deep, room)
        assert deep.smem(x_bytes) <= budget
        y = cp.empty((m, n), cp.float32)
        sg.stream_gemm(x, w, y, cb.num_sms, tuned)
        assert cp.array_equal(bits(y), bits(ref)), stages


def test_deferred_norm_rows_do_not_depend_on_the_other_rows(cb, rng):
    """A verify row of the fused pair has the bits of the decode of that row alone: the residual, the sums of
    squares and the scaled product."""
    skip_without_tma()
    _, dev = _norm_pair(cb, rng, 16)
    normed, r = cb.linear_add_rms_norm(dev["x"], dev["w"], None, dev["res"], dev["nw"], EPS)
    y = cb.linear(normed, dev["w2"], out_f32=True)
    for lo, hi in ((0, 1), (7, 8), (15, 16), (3, 12)):
        normed_p, r_p = cb.linear_add_rms_norm(dev["x"][lo:hi], dev["w"], None, cp.ascontiguousarray(dev["res"][lo:hi]),
                                               dev["nw"], EPS)
        y_p = cb.linear(normed_p, dev["w2"], out_f32=True)
        assert cp.array_equal(r_p.view(cp.uint32), r[lo:hi].view(cp.uint32)), (lo, hi)
        assert cp.array_equal(y_p.view(cp.uint32), y[lo:hi].view(cp.uint32)), (lo, hi)


@pytest.mark.parametrize("m", [1, 16])  # x resident in shared memory, x in boxes
def test_deferred_norm_in_a_graph_reads_its_inputs_after_their_producers(cb, rng, m):
    """Captured with PDL behind kernels that write x and the residual: the producer reads the residual, the
    consumer the sums of squares, each only after griddepcontrol.wait."""
    skip_without_tma()
    host, dev = _norm_pair(cb, rng, m)
    nb = NumpyBackend()
    src_x, src_res = dev["x"], cp.zeros((m, H), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        def step():
            res = cb.add_rms_norm(src_x, src_res, dev["nw"], EPS)[1]  # a float32 residual written in the graph
            normed, _ = cb.linear_add_rms_norm(cb.add(src_x, src_x), dev["w"], None, res, dev["nw"], EPS)
            return cb.linear(normed, dev["w2"], out_f32=True)
        step()
        stream.synchronize()
        stream.begin_capture()
        y = step()
        graph = stream.end_capture()
        for _ in range(3):
            x_new, res_new = rnd(rng, m, K_IN), (rng.standard_normal((m, H)) * 4).astype(np.float32)
            bits(src_x)[...] = bits(cb.asarray(x_new, "act"))
            src_res[...] = cp.asarray(res_new)
            bits(y)[...] = NAN_BITS
            graph.launch(stream)
            stream.synchronize()
            ref_normed, _ = nb.add_rms_norm((2 * x_new) @ host["w"].T, x_new + res_new, host["nw"], EPS)
            check(cb.to_numpy(y), ref_normed @ host["w2"].T, tol=1e-2)
