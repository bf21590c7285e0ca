"""Every CUDA op against the numpy reference op, on fresh random inputs rounded to bf16 first.

The reference runs in float32 on exactly the bf16 values the device sees, so the only differences are bf16
rounding of outputs and float32 summation order: the relative error ||got - ref|| / ||ref|| must stay under
1e-2, and never be NaN. Buffers an op writes into (the KV caches) are poisoned with NaN first; freshly
allocated outputs come from a pool block that was NaN-filled just before (`poison_pool`), so rows an op
forgets to write show up as NaN rather than as stale plausible values.
"""
from __future__ import annotations


import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import cuda_attention  # noqa: E402
from cudflash.backends.base import build_meta  # noqa: E402
from cudflash.backends.cuda_util import bf16_bits_to_f32, bits, f32_to_bf16_bits  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402

TOL = 1e-2
NAN_BITS = 0x7FC0
nb = NumpyBackend()


def rb(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bf16 (what the device stores)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def rnd(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return rb(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{np.size(got) - np.isfinite(got).sum()} non-finite outputs"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check(got: np.ndarray, ref: np.ndarray, tol: float = TOL) -> None:
    err = rel_err(got, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def poison_pool(nbytes: int) -> None:
    """Fill a pool block of this size with NaN bits and free it, so the next allocation likely reuses it."""
    buf = cp.full((max(nbytes, 2) + 1) // 2, NAN_BITS, dtype=cp.uint16)
    del buf


# ----------------------------------------------------------------------------------------------- memory
def test_memory_ops(cb, rng):
    a = rnd(rng, 5, 24)
    d = cb.asarray(a, "act")
    assert np.array_equal(cb.to_numpy(d), a)
    f = rng.standard_normal((3, 7)).astype(np.float32)
    assert np.array_equal(cb.to_numpy(cb.asarray(f, "f32")), f)
    i = rng.integers(-5, 5, size=9).astype(np.int32)
    assert np.array_equal(cb.to_numpy(cb.asarray(i, "i32")), i)
    assert not cb.to_numpy(cb.zeros((4, 8), "act")).any()
    assert cb.zeros((2, 3), "i32").dtype == np.int32
    b = rnd(rng, 5, 16)
    assert np.array_equal(cb.to_numpy(cb.cat([d, cb.asarray(b, "act")], axis=1)), np.concatenate([a, b], axis=1))
    c = rnd(rng, 2, 24)
    assert np.array_equal(cb.to_numpy(cb.cat([d, cb.asarray(c, "act")], axis=0)), np.concatenate([a, c], axis=0))
    rows = np.array([4, 0, 0, 2], dtype=np.int32)
    assert np.array_equal(cb.to_numpy(cb.take_rows(d, cb.asarray(rows, "i32"))), a[rows])  # vector path
    odd = rnd(rng, 5, 12)  # 24-byte rows: the CuPy fallback
    assert np.array_equal(cb.to_numpy(cb.take_rows(cb.asarray(odd, "act"), rows)), odd[rows])
    assert np.array_equal(cb.to_numpy(cb.take_rows(cb.asarray(f, "f32"), rows[:2] % 3)), f[rows[:2] % 3])


@pytest.mark.parametrize("shape", [(7, 40), (64, 4096)])
def test_load(cb, rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    want = rb(x)
    assert np.array_equal(cb.to_numpy(cb.load("BF16", f32_to_bf16_bits(x))), want)
    assert np.array_equal(cb.to_numpy(cb.load("F32", x)), want)
    h = x.astype(np.float16)
    assert np.array_equal(cb.to_numpy(cb.load("F16", h)), rb(h.astype(np.float32)))


def test_random_and_events(cb):
    start = cb.event()
    x = cb.random((3000, 700), 0.02, seed=7)
    end = cb.event()
    assert x.dtype == cb.act and x.shape == (3000, 700)
    host = cb.to_numpy(x)
    assert np.isfinite(host).all() and abs(host.mean()) < 1e-3 and abs(host.std() / 0.02 - 1) < 0.01
    assert np.array_equal(cb.to_numpy(cb.random((3000, 700), 0.02, seed=7)), host)  # same seed, same values
    assert not np.array_equal(cb.to_numpy(cb.random((3000, 700), 0.02, seed=8)), host)
    cb.synchronize()
    assert cb.elapsed_ms(start, end) >= 0.0


# ----------------------------------------------------------------------------------------------- row ops
@pytest.mark.parametrize("vocab,hidden,t", [(1000, 64, 1), (3000, 4096, 37)])
def test_embedding(cb, rng, vocab, hidden, t):
    table = rnd(rng, vocab, hidden)
    ids = rng.integers(0, vocab, size=t).astype(np.int32)
    ids[-1] = ids[0]
    got = cb.embedding(cb.asarray(ids, "i32"), cb.asarray(table, "act"))
    assert np.array_equal(cb.to_numpy(got), table[ids])


NORM_SHAPES = [(1, 64), (7, 1024), (33, 4096), (5, 5120), (3, 8192), (2, 20480)]


@pytest.mark.parametrize("t,h", NORM_SHAPES)
def test_rms_norm(cb, rng, t, h):
    wide = rnd(rng, t, h + 64, scale=3.0)
    x = wide[:, 32:32 + h]  # a row-strided view on the device too
    w = rnd(rng, h)
    poison_pool(t * h * 2)
    got = cb.rms_norm(cb.asarray(wide, "act")[:, 32:32 + h], cb.asarray(w, "act"), 1e-6)
    check(cb.to_numpy(got), nb.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("t,h", NORM_SHAPES)
def test_add_rms_norm(cb, rng, t, h):
    x, res, w = rnd(rng, t, h), rnd(rng, t, h, scale=4.0), rnd(rng, h)
    poison_pool(t * h * 2)
    out, new_res = cb.add_rms_norm(cb.asarray(x, "act"), cb.asarray(res, "act"), cb.asarray(w, "act"), 1e-5)
    ref_out, ref_res = nb.add_rms_norm(x, res, w, 1e-5)
    assert new_res.dtype == cp.float32  # the residual stream is kept in float32
    check(cb.to_numpy(new_res), ref_res, tol=1e-6)  # bf16 inputs add exactly in float32
    check(cb.to_numpy(out), ref_out)
    # The next layer: a float32 GEMM output and the float32 residual stream in, unrounded.
    x2 = rng.standard_normal((t, h)).astype(np.float32)
    out2, res2 = cb.add_rms_norm(cp.asarray(x2), new_res, cb.asarray(w, "act"), 1e-5)
    ref_out2, ref_res2 = nb.add_rms_norm(x2, ref_res, w, 1e-5)
    check(cb.to_numpy(res2), ref_res2, tol=1e-6)
    check(cb.to_numpy(out2), ref_out2)


@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (16, 1024, 512), (300, 512, 1024), (5, 12288, 256)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_f32", [False, True])
def test_linear(cb, rng, m, n, k, strided, with_bias, out_f32):
    wide = rnd(rng, m, k + 64)
    x = wide[:, 64:] if strided else np.ascontiguousarray(wide[:, :k])
    w = rnd(rng, n, k, scale=k ** -0.5)
    bias = rnd(rng, n) if with_bias else None
    dx = cb.asarray(wide, "act")[:, 64:] if strided else cb.asarray(x, "act")
    got = cb.linear(dx, cb.asarray(w, "act"), cb.asarray(bias, "act") if with_bias else None, out_f32=out_f32)
    assert got.dtype == (cp.float32 if out_f32 else cb.act)
    check(cb.to_numpy(got), nb.linear(x, w, bias), tol=1e-5 if out_f32 else TOL)


@pytest.mark.parametrize("t,inter", [(1, 64), (16, 3072), (300, 1024)])
def test_swiglu(cb, rng, t, inter):
    """The cuBLAS product with the interleaved gate_up weight, then the swiglu kernel (weights too small to stream:
    tests/gpu/test_stream_gemm.py has the epilogue) against silu(x gate^T) * (x up^T)."""
    h = 256
    x, gate, up = rnd(rng, t, h), rnd(rng, inter, h, scale=2 * h ** -0.5), rnd(rng, inter, h, scale=2 * h ** -0.5)
    w = cb.gate_up_weight(cb.asarray(gate, "act"), cb.asarray(up, "act"))
    assert w.shape == (2 * inter, h) and cp.array_equal(bits(w[8:16]), bits(cb.asarray(up[:8], "act")))
    poison_pool(t * inter * 2)
    got = cb.swiglu(cb.asarray(x, "act"), w)
    assert got.shape == (t, inter) and got.dtype == cb.act
    check(cb.to_numpy(got), nb.swiglu(x, nb.gate_up_weight(gate, up)))


@pytest.mark.parametrize("t,w", [(1, 64), (17, 4096)])
def test_add(cb, rng, t, w):
    wide = rnd(rng, t, 2 * w)
    b = rnd(rng, t, w)
    dev = cb.asarray(wide, "act")
    check(cb.to_numpy(cb.add(dev[:, w:], cb.asarray(b, "act"))), wide[:, w:] + b)
    res = rng.standard_normal((t, w)).astype(np.float32)  # the float32 residual stream as second operand
    check(cb.to_numpy(cb.add(dev[:, w:], cp.asarray(res))), wide[:, w:] + res)
    check(cb.to_numpy(cb.add(cp.asarray(res), cp.asarray(res))), 2 * res)  # a float32 GEMM output first


def test_linear_float32_output(cb, rng):
    x, w = rnd(rng, 16, 512), rnd(rng, 8192, 512, scale=512 ** -0.5)
    got = cb.linear(cb.asarray(x, "act"), cb.asarray(w, "act"), out_f32=True)
    assert got.dtype == cp.float32
    check(cb.to_numpy(got), nb.linear(x, w), tol=1e-5)  # float32 accumulate, no bf16 rounding of the output


def rope_tables(d: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("t", [1, 19])
def test_head_norm_rope(cb, rng, d, norm, t):
    hq, hk = 4, 2
    fused = rnd(rng, t, (hq + 2 * hk) * d, scale=2.0)  # the qkv GEMM output; q and k are column slices
    cos, sin = rope_tables(d, 4096)
    pos = rng.integers(0, 4096, size=t).astype(np.int32)
    w = rnd(rng, d) if norm else None
    dev = cb.asarray(fused, "act")
    dcos, dsin, dpos = cb.asarray(cos, "f32"), cb.asarray(sin, "f32"), cb.asarray(pos, "i32")
    dw = cb.asarray(w, "act") if norm else None
    for lo, hi in [(0, hq * d), (hq * d, (hq + hk) * d)]:
        poison_pool(t * (hi - lo) * 2)
        got = cb.head_norm_rope(dev[:, lo:hi], d, dpos, dcos, dsin, dw, 1e-6)
        check(cb.to_numpy(got), nb.head_norm_rope(fused[:, lo:hi], d, pos, cos, sin, w, 1e-6))
    fused32 = rng.standard_normal(fused.shape).astype(np.float32) * 2  # the float32 qkv GEMM output
    got = cb.head_norm_rope(cp.asarray(fused32)[:, hq * d:(hq + hk) * d], d, dpos, dcos, dsin, dw, 1e-6)
    check(cb.to_numpy(got), nb.head_norm_rope(fused32[:, hq * d:(hq + hk) * d], d, pos, cos, sin, w, 1e-6))


@pytest.mark.parametrize("d,hq,hk,t", [(64, 4, 1, 37), (128, 32, 8, 16), (128, 8, 8, 1), (128, 0, 8, 37),
                                        (256, 8, 2, 37), (256, 0, 1, 5)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", ["act", "f32"])
def test_rope_store(cb, rng, d, hq, hk, t, norm, dtype):
    """The fused op against the numpy op: q comes back whole, K and V land at every real slot and nowhere else."""
    num_blocks, bs = 9, 16
    q_dim, kv_dim = hq * d, hk * d
    width = q_dim + 2 * kv_dim
    # x is a column slice of a wider GEMM output (row-strided and offset), as the drafter's context update reads it
    wide = rnd(rng, t, width + 16, scale=2.0) if dtype == "act" else \
        rng.standard_normal((t, width + 16)).astype(np.float32) * 2
    x = wide[:, 8:8 + width]
    cos, sin = rope_tables(d, 4096)
    pos = rng.integers(0, 4096, size=t).astype(np.int32)
    slots = rng.choice(num_blocks * bs, size=t, replace=False).astype(np.int32)
    slots[1::5] = -1  # padding rows: nothing may be stored for them
    qn, kn = (rnd(rng, d), rnd(rng, d)) if norm else (None, None)
    dev = cb.asarray(wide, dtype)
    dx = dev[:, 8:8 + width]
    dpos, dcos, dsin = cb.asarray(pos, "i32"), cb.asarray(cos, "f32"), cb.asarray(sin, "f32")
    dqn, dkn = (cb.asarray(qn, "act"), cb.asarray(kn, "act")) if norm else (None, None)
    kc = cp.full((num_blocks, bs, hk, d), NAN_BITS, dtype=cp.uint16).view(cb.act)
    vc = cp.full((num_blocks, bs, hk, d), NAN_BITS, dtype=cp.uint16).view(cb.act)
    poison_pool(t * q_dim * 2)
    q = cb.rope_store(dx, hq, dpos, dcos, dsin, dqn, dkn, 1e-6, cb.asarray(slots, "i32"), kc, vc)
    ref_k = np.full((num_blocks, bs, hk, d), np.nan, dtype=np.float32)
    ref_v = ref_k.copy()
    ref_q = nb.rope_store(x, hq, pos, cos, sin, qn, kn, 1e-6, slots, ref_k, ref_v)
    if hq:
        assert q.shape == (t, q_dim)
        check(cb.to_numpy(q), ref_q)  # check() also fails on a NaN: every q element was written
        # bit for bit what the plain op gives, which is what the engine used before the fusion
        assert np.array_equal(cb.to_numpy(q), cb.to_numpy(cb.head_norm_rope(dx[:, :q_dim], d, dpos, dcos, dsin,
                                                                            dqn, 1e-6)))
    else:
        assert q is None and ref_q is None
    got_k, got_v = cb.to_numpy(kc), cb.to_numpy(vc)
    written = ~np.isnan(ref_k)
    assert written.any()
    for got in (got_k, got_v):
        assert np.array_equal(np.isnan(got), ~written)  # every real slot written, every other row untouched
    check(got_k[written], ref_k[written])
    assert np.array_equal(got_v[written], rb(ref_v[written]))  # V is only rounded to bf16
    keep = slots >= 0
    k_rows = got_k[slots[keep] // bs, slots[keep] % bs].reshape(keep.sum(), kv_dim)
    k_plain = cb.to_numpy(cb.head_norm_rope(dx[:, q_dim:q_dim + kv_dim], d, dpos, dcos, dsin, dkn, 1e-6))
    assert np.array_equal(k_rows, k_plain[keep])
    assert np.array_equal(cb.to_numpy(dev), wide)  # the input is read, never written


@pytest.mark.parametrize("rows,vocab", [(1, 1000), (5, 1001), (16, 151936), (3, 8200)])
@pytest.mark.parametrize("dtype", ["act", "f32"])
def test_argmax(cb, rng, rows, vocab, dtype):
    x = rnd(rng, rows, vocab) if dtype == "act" else rng.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):  # plant a tie for the maximum: the first index must win
        j1, j2 = sorted(rng.choice(vocab, size=2, replace=False))
        x[r, j1] = x[r, j2] = x[r].max() + 1.0
    got = cb.to_numpy(cb.argmax(cb.asarray(x, dtype)))
    assert np.array_equal(got, np.argmax(x, axis=-1).astype(np.int32))


@pytest.mark.parametrize("dtype", ["act", "f32"])
def test_argmax_flags_rows_with_a_non_finite_value(cb, rng, dtype):
    """A row holding a NaN or an infinity (of either sign, anywhere) gives `nonfinite`, as on the numpy backend;
    the other rows keep their argmax."""
    rows, vocab = 6, 151936
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    x[1, 7], x[2, vocab - 1], x[3, 70000], x[4, 12345] = np.nan, np.inf, -np.inf, -np.nan
    dev = cb.asarray(x, dtype)
    want = nb.argmax(cb.to_numpy(dev))
    assert want.tolist()[1:5] == [-1] * 4
    assert np.array_equal(cb.to_numpy(cb.argmax(dev)), want)
    assert cb.to_numpy(cb.argmax(dev, nonfinite=0)).tolist() == [v if v >= 0 else 0 for v in want.tolist()]


# ----------------------------------------------------------------------------------------------- drafter heads
BLOCK_CONV_SHAPES = [(2, 320, 5120, 16, 3), (2, 4, 64, 6, 2), (3, 5, 40, 4, 5), (1, 8, 64, 3, 2), (4, 16, 256, 8, 4)]


@pytest.mark.parametrize("taps,groups,h,block,n", BLOCK_CONV_SHAPES)
@pytest.mark.parametrize("dtype", ["act", "f32"])
def test_block_conv(cb, rng, taps, groups, h, block, n, dtype):
    t, half = block * n, taps * groups
    x = rnd(rng, t, h, scale=2.0) if dtype == "act" else rng.standard_normal((t, h)).astype(np.float32)
    base = rb(1 + 0.2 * rng.standard_normal((taps, h)))
    fused = rnd(rng, t, 2 * half, scale=0.1)  # the fused projection: [first application | second application]
    dx, dbase, dfused = cb.asarray(x, dtype), cb.asarray(base, "act"), cb.asarray(fused, "act")
    # The device computes the reference's float32 values in the reference's order (no FMA): a float32 x gives
    # them bit for bit, a bf16 x gives them rounded once to bf16.
    exact = (lambda ref: ref) if dtype == "f32" else rb
    for coeff, dcoeff in [(fused[:, :half], dfused[:, :half]),  # row-strided column slices, in place
                          (fused[:, half:], dfused[:, half:]),  # ... the second at an offset (not 16-byte aligned)
                          (fused[:, half:], cp.asarray(fused)[:, half:])]:  # float32 coefficients
        ref = nb.block_conv(x, coeff, base, block)
        poison_pool(t * h * 4)
        got = cb.block_conv(dx, dcoeff, dbase, block)
        assert got.dtype == dx.dtype and got.shape == (t, h)
        assert np.array_equal(cb.to_numpy(got), exact(ref))


def _topk_rows(rng, x: np.ndarray, k: int) -> np.ndarray:
    """Plant the hard cases in the first rows of x."""
    rows, vocab = x.shape
    x[0, 10:20] = x[0].max() + 1  # ties at the top: lower index first
    if rows > 1:  # a tie straddling the k-th place, spread over the whole row (every chunk of the kernel)
        kth = np.sort(x[1])[-k]
        x[1, rng.choice(vocab, size=min(vocab, 3 * k + 5), replace=False)] = kth
    if rows > 2:
        x[2] = 0.5  # all equal: ids 0 .. k-1
    if rows > 3:  # +0 and -0 compare equal (ordered by index), and infinities
        x[3] = np.where(rng.random(vocab) < 0.5, np.float32(-0.0), np.float32(0.0))
        x[3, rng.choice(vocab, size=min(vocab, k // 2 + 1), replace=False)] = -np.inf
        x[3, rng.choice(vocab, size=min(vocab, k // 4 + 1), replace=False)] = np.inf
    if rows > 4:
        x[4] = -np.sort(-x[4])  # sorted: the top k all in the first chunk / first threads
    if rows > 5:
        x[5, : min(vocab, 8 * k)] += 100  # the top k clustered in one place, with more candidates than k
    return x


@pytest.mark.parametrize("rows,vocab,k", [(7, 248320, 16), (24, 151936, 16), (2, 151936, 64), (300, 32000, 16),
                                          (6, 4097, 64), (5, 16, 8), (3, 1000, 1), (6, 9000, 128), (6, 130, 128)])
@pytest.mark.parametrize("dtype", ["act", "f32"])
@pytest.mark.parametrize("strided", [False, True])
def test_topk(cb, rng, rows, vocab, k, dtype, strided):
    raw = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    x = _topk_rows(rng, raw, k)
    if dtype == "act":
        x = rb(x)  # what the device stores (ties stay ties)
    if strided:  # a row-strided view at an odd offset: the scalar-load path
        wide = np.zeros((rows, vocab + 5), dtype=np.float32)
        wide[:, 3:3 + vocab] = x
        dx = cb.asarray(wide, dtype)[:, 3:3 + vocab]
    else:
        dx = cb.asarray(x, dtype)
    poison_pool(rows * k * 4)
    vals, ids = cb.topk(dx, k)
    assert vals.dtype == cp.float32 and ids.dtype == cp.int32 and vals.shape == ids.shape == (rows, k)
    ref_vals, ref_ids = nb.topk(x, k)
    assert np.array_equal(cb.to_numpy(ids), ref_ids)
    got_vals = cb.to_numpy(vals)
    assert np.array_equal(got_vals, ref_vals) and np.array_equal(np.signbit(got_vals), np.signbit(ref_vals))


@pytest.mark.parametrize("r,p,k,rank,vocab", [(56, 16, 16, 256, 50000), (6, 4, 4, 16, 300), (3, 70, 65, 72, 1000),
                                              (2, 1, 128, 8, 100), (40, 16, 16, 200, 4000)])
@pytest.mark.parametrize("hidden_dtype", ["act", "f32"])
def test_pair_scores(cb, rng, r, p, k, rank, vocab, hidden_dtype):
    unary = rng.standard_normal((r, k)).astype(np.float32)
    cand = rng.integers(0, vocab, (r, k)).astype(np.int32)
    pred = rng.integers(0, vocab, (r, p)).astype(np.int32)
    pred[:, 0] = cand[:, 0]  # repeated ids
    hwide = rnd(rng, r, rank + 8, scale=0.3)
    if hidden_dtype == "f32":
        hwide = (rng.standard_normal((r, rank + 8)) * 0.3).astype(np.float32)
    h = hwide[:, 8:]  # the selector's hidden projection as a row-strided view
    a, b = rnd(rng, vocab, rank, scale=0.3), rnd(rng, vocab, rank, scale=0.3)
    ref = nb.pair_scores(unary, cand, pred, h, a, b)
    poison_pool(r * p * k * 4)
    got = cb.pair_scores(cb.asarray(unary, "f32"), cb.asarray(cand, "i32"), cb.asarray(pred, "i32"),
                         cb.asarray(hwide, hidden_dtype)[:, 8:], cb.asarray(a, "act"), cb.asarray(b, "act"))
    assert got.dtype == cp.float32 and got.shape == (r, p, k)
    check(cb.to_numpy(got), ref, tol=1e-5)  # float32 throughout: only the summation order differs


# ----------------------------------------------------------------------------------------------- attention
def make_paged(rng, d, hk, q_lens, ctx_lens, block_size=16):
    """Random paged caches with shuffled physical blocks, random queries, and the matching metadata."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables, at = [], 0
    for k in need:
        tables.append(perm[at:at + k].tolist())
        at += k
    kc = rnd(rng, num_blocks, block_size, hk, d)
    vc = rnd(rng, num_blocks, block_size, hk, d)
    return kc, vc, tables


def run_attention(cb, rng, d, hk, group, q_lens, ctx_lens, causal, window, block_size=16):
    kc, vc, tables = make_paged(rng, d, hk, q_lens, ctx_lens, block_size)
    q = rnd(rng, sum(q_lens), hk * group * d)
    scale = d ** -0.5
    ref = nb.attention(q, kc, vc, build_meta(q_lens, ctx_lens, tables), scale, causal, window)
    dq, dk, dv = cb.asarray(q, "act"), cb.asarray(kc, "act"), cb.asarray(vc, "act")
    meta = cb.prepare_meta(build_meta(q_lens, ctx_lens, tables))
    poison_pool(ref.size * 2)
    check(cb.to_numpy(cb.attention(dq, dk, dv, meta, scale, causal, window)), ref)  # split-K as chosen
    poison_pool(ref.size * 2)
    single = cuda_attention.attention(dq, dk, dv, meta, scale, causal, window, num_sms=1,
                                      tuning=cb.tuning)  # fewest splits
    check(cb.to_numpy(single), ref)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("q_len", [1, 4, 16, 300])
@pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 40), (False, 40)])
def test_attention(cb, rng, d, group, q_len, causal, window):
    # three sequences: a pure prefill, and two with earlier context crossing 16-token block boundaries
    q_lens = [q_len] * 3
    ctx_lens = [q_len, q_len + 37, q_len + 300]
    run_attention(cb, rng, d, 2, group, q_lens, ctx_lens, causal, window)


def test_attention_mixed_batch(cb, rng):
    run_attention(cb, rng, 128, 8, 4, [1, 16, 300, 4], [900, 70, 300, 17], True, 0)


@pytest.mark.parametrize("q_len", [1, 16])
def test_attention_long_context_split(cb, rng, q_len):
    # one long and one tiny context: many splits, most of them empty for the short sequence
    run_attention(cb, rng, 128, 8, 4, [q_len, q_len], [5000, q_len + 3], True, 0)


def test_attention_big_blocks(cb, rng):
    run_attention(cb, rng, 128, 2, 4, [16, 7], [600, 300], False, 0, block_size=256)


@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 16], [512, 40]), ([300], [300]), ([1], [5000])],
                         ids=["decode-verify-splits", "prefill-one-split", "long-context"])
@pytest.mark.parametrize("d", [128, 256])
def test_gated_attention_is_the_gate_op_after_attention_bit_for_bit(cb, rng, q_lens, ctx_lens, d):
    """attention(..., gate=) applies the gate in the kernel that writes the output (attn_fwd without splits,
    attn_combine with them): the bits of sigmoid_gate over the ungated output, the gate a float32 row-strided view
    as the qkvg GEMM's output gives it; and against numpy's attention + gate."""
    hk, group = 2, 4
    kc, vc, tables = make_paged(rng, d, hk, q_lens, ctx_lens)
    t, width = sum(q_lens), hk * group * d
    q = rnd(rng, t, width)
    wide = (rng.standard_normal((t, width + 24)) * 2).astype(np.float32)  # the gate columns of a wider row
    scale = d ** -0.5
    host_meta = build_meta(q_lens, ctx_lens, tables)
    dq, dk, dv = cb.asarray(q, "act"), cb.asarray(kc, "act"), cb.asarray(vc, "act")
    gate = cp.asarray(wide)[:, 24:]
    for num_sms in (cb.num_sms, 1):  # the splits as chosen, and the fewest
        meta = cb.prepare_meta(build_meta(q_lens, ctx_lens, tables))
        plain = cuda_attention.attention(dq, dk, dv, meta, scale, True, 0, num_sms=num_sms, tuning=cb.tuning)
        poison_pool(t * width * 2)
        gated = cuda_attention.attention(dq, dk, dv, meta, scale, True, 0, num_sms=num_sms, tuning=cb.tuning,
                                         gate=gate)
        want = cb.sigmoid_gate(plain, gate)
        assert np.array_equal(cp.asnumpy(bits(gated)), cp.asnumpy(bits(want)))
        assert not np.array_equal(cp.asnumpy(bits(gated)), cp.asnumpy(bits(plain)))
    ref = nb.attention(q, kc, vc, host_meta, scale, True, 0, gate=wide[:, 24:])
    check(cb.to_numpy(gated), ref)


@pytest.mark.parametrize("d,group,window", [(128, 4, 0), (64, 3, 0), (128, 8, 100)])
def test_verify_rows_equal_decode_bitwise(cb, rng, d, group, window):
    """A verify pass of 16 tokens gives every row exactly the bits of decoding that token alone, whatever
    else shares the launch: that is what makes speculative greedy output equal autoregressive output."""
    hk, q_len, ctx = 2, 16, 300  # 300 keys: five 64-key splits, the last one partial
    other_ctx = 480  # a longer neighbour: more splits in the grid, the extra ones empty for our rows
    assert cuda_attention.context_bucket(other_ctx) <= cb.tuning.invariant_max_context
    kc, vc, tables = make_paged(rng, d, hk, [q_len, 1], [ctx, other_ctx])
    q = rnd(rng, q_len + 1, hk * group * d)
    dq, dk, dv = cb.asarray(q, "act"), cb.asarray(kc, "act"), cb.asarray(vc, "act")
    scale = d ** -0.5

    def run(q_rows, q_lens, ctx_lens, seq_tables):
        meta = cb.prepare_meta(build_meta(q_lens, ctx_lens, seq_tables))
        return bits(cb.attention(q_rows, dk, dv, meta, scale, True, window)).get()

    verify = run(dq[:q_len], [q_len], [ctx], tables[:1])
    with_neighbour = run(dq, [q_len, 1], [ctx, other_ctx], tables)
    assert np.array_equal(with_neighbour[:q_len], verify)
    for i in range(q_len):
        pos = ctx - q_len + i
        decode = run(dq[i:i + 1], [1], [pos + 1], tables[:1])
        assert np.array_equal(decode[0], verify[i]), f"row {i} (position {pos}) differs from its decode"
    ref = nb.attention(q[:q_len], kc, vc, build_meta([q_len], [ctx], tables[:1]), scale, True, window)
    check(bf16_bits_to_f32(verify), ref)


def test_the_invariant_shape_reaches_the_tuning_limit(rng):
    """A backend tuned to keep the row-invariant shape up to INVARIANT_CONTEXT_LIMIT keys (MAX_SPLITS splits of one
    K/V tile) runs a 4096-key bucket on it: verify rows keep their decode's bits there too."""
    from cudflash.backends.cuda_backend import CudaBackend
    from cudflash.backends.tuning import INVARIANT_CONTEXT_LIMIT, CudaTuning

    assert INVARIANT_CONTEXT_LIMIT == cuda_attention.MAX_SPLITS * cuda_attention.BN
    b = CudaBackend(CudaTuning(invariant_max_context=INVARIANT_CONTEXT_LIMIT))
    d, hk, group, q_len, ctx = 128, 2, 4, 4, 4000
    assert cuda_attention.context_bucket(ctx) == INVARIANT_CONTEXT_LIMIT
    kc, vc, tables = make_paged(rng, d, hk, [q_len], [ctx])
    q = rnd(rng, q_len, hk * group * d)
    dq, dk, dv = b.asarray(q, "act"), b.asarray(kc, "act"), b.asarray(vc, "act")

    def run(rows, n, context):
        return bits(b.attention(rows, dk, dv, b.prepare_meta(build_meta([n], [context], tables)), d ** -0.5,
                                True)).get()

    verify = run(dq, q_len, ctx)
    for i in range(q_len):
        assert np.array_equal(run(dq[i:i + 1], 1, ctx - q_len + i + 1)[0], verify[i]), i
    check(bf16_bits_to_f32(verify), nb.attention(q, kc, vc, build_meta([q_len], [ctx], tables), d ** -0.5, True))


# ----------------------------------------------------------------------------------------------- graphs
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", ["act", "i32"])
def test_cat_many_pieces_inside_cuda_graph(cb, rng, axis, dtype):
    """cat of 15 pieces (the drafter heads' walk has one per slot) is exact, eagerly and captured in a graph
    (cupy.concatenate of that many pieces uploads their addresses from the host, which capture refuses)."""
    pieces = [rnd(rng, 3, 8) if dtype == "act" else rng.integers(-9, 9, (3, 8)) for _ in range(15)]
    xs = [cb.asarray(p, dtype) for p in pieces]
    want = np.concatenate(pieces, axis=axis)
    cb.synchronize()
    np.testing.assert_array_equal(cb.to_numpy(cb.cat(xs, axis=axis)), want)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = cb.cat(xs, axis=axis)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(cb.to_numpy(out), want)


def test_gemm_inside_cuda_graph(cb, rng):
    m, n, k = 16, 1024, 512
    x = cb.asarray(rnd(rng, m, k), "act")
    w_host = rnd(rng, n, k, scale=k ** -0.5)
    w = cb.asarray(w_host, "act")
    cb.synchronize()  # inputs were uploaded on the legacy stream, which a non-blocking stream does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cb.linear(x, w)  # warm-up outside capture: cuBLAS chooses and loads its kernels here
        stream.synchronize()
        stream.begin_capture()
        y = cb.linear(x, w)
        graph = stream.end_capture()
        new_x = rnd(rng, m, k)
        bits(x)[...] = bits(cb.asarray(new_x, "act"))
        bits(y)[...] = NAN_BITS
        graph.launch(stream)
        stream.synchronize()
    check(cb.to_numpy(y), new_x @ w_host.T)


def test_layer_graph_replay_matches_eager(cb, rng):
    """norm -> qkv GEMM -> q/k norm + RoPE and K/V store -> attention -> o_proj -> argmax, captured and replayed."""
    d, hq, hk, h = 128, 8, 2, 512
    q_lens, ctx_lens = [16, 16], [40, 300]
    kc, vc, tables = make_paged(rng, d, hk, q_lens, ctx_lens)
    t = sum(q_lens)
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)]).astype(np.int32)
    slots = np.array([tables[s][p // 16] * 16 + p % 16 for s, (q, c) in enumerate(zip(q_lens, ctx_lens))
                      for p in range(c - q, c)], dtype=np.int32)
    cos, sin = rope_tables(d, 1024)
    args = dict(
        x=cb.asarray(rnd(rng, t, h), "act"), norm=cb.asarray(rnd(rng, h), "act"),
        qkv=cb.asarray(rnd(rng, (hq + 2 * hk) * d, h, scale=h ** -0.5), "act"),
        qn=cb.asarray(rnd(rng, d), "act"), kn=cb.asarray(rnd(rng, d), "act"),
        o=cb.asarray(rnd(rng, h, hq * d, scale=(hq * d) ** -0.5), "act"),
        cos=cb.asarray(cos, "f32"), sin=cb.asarray(sin, "f32"), pos=cb.asarray(pos, "i32"),
        slots=cb.asarray(slots, "i32"), kc=cb.asarray(kc, "act"), vc=cb.asarray(vc, "act"),
        meta=cb.prepare_meta(build_meta(q_lens, ctx_lens, tables)))

    def layer(a):
        hid = cb.rms_norm(a["x"], a["norm"], 1e-6)
        qkv = cb.linear(hid, a["qkv"])
        q = cb.rope_store(qkv, hq, a["pos"], a["cos"], a["sin"], a["qn"], a["kn"], 1e-6, a["slots"], a["kc"], a["vc"])
        out = cb.linear(cb.attention(q, a["kc"], a["vc"], a["meta"], d ** -0.5, True), a["o"])
        return out, cb.argmax(out)

    cb.synchronize()  # inputs were uploaded on the legacy stream, which a non-blocking stream does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager, eager_ids = layer(args)
        eager, eager_ids = cb.to_numpy(eager), cb.to_numpy(eager_ids)
        stream.begin_capture()
        out, ids = layer(args)
        graph = stream.end_capture()
        bits(out)[...] = NAN_BITS
        ids[...] = -1
        graph.launch(stream)
        stream.synchronize()
    assert rel_err(cb.to_numpy(out), eager) < 1e-6  # same kernels, same inputs: bit-identical in practice
    assert np.array_equal(cb.to_numpy(ids), eager_ids)


@pytest.mark.parametrize("shape", [(3, 1000), (151936, 64), (7,)])
def test_weight_checks_find_non_finite_and_all_zero_tensors(cb, rng, shape):
    """all_finite / any_nonzero (the load-time weight checks) against numpy: a planted NaN, +Inf or -Inf anywhere
    is found; an all-zero tensor (signed zeros included) is found; a random tensor passes both."""
    x = rng.standard_normal(shape).astype(np.float32)
    dev = cb.asarray(x, "act")
    assert cb.all_finite(dev) and cb.any_nonzero(dev)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy().reshape(-1)
        y[int(rng.integers(y.size))] = bad
        assert not cb.all_finite(cb.asarray(y.reshape(shape), "act"))
    zeros = np.zeros(shape, np.float32)
    zeros.reshape(-1)[::2] = -0.0
    assert not cb.any_nonzero(cb.asarray(zeros, "act")) and cb.all_finite(cb.asarray(zeros, "act"))
    one = zeros.copy().reshape(-1)
    one[-1] = 1e-30  # a tiny value is still nonzero in bf16 (subnormal bits)
    assert cb.any_nonzero(cb.asarray(one.reshape(shape), "act")) == bool(cb.to_numpy(cb.asarray(one, "act")).any())


@pytest.mark.parametrize("nodes,d,hk,group,committed", [(7, 128, 2, 4, 300), (64, 128, 8, 4, 900), (40, 64, 2, 1, 20),
                                                         (128, 128, 8, 4, 517)])
def test_attention_with_a_draft_tree(cb, rng, nodes, d, hk, group, committed):
    """A draft tree's rows (the root and its nodes at consecutive cache positions) see the committed keys and their
    ancestors only, beside a plain causal chunk in the same launch: as the numpy definition, in bf16 tolerance."""
    from cudflash.engine.tree import DraftTree, ancestor_masks, pack_bits, words_for

    parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, nodes)])
    depths = np.zeros(nodes, np.int64)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    tree = DraftTree(rng.integers(0, 100, nodes), parents, depths)
    q_lens, ctx_lens = [nodes + 1, 5], [committed + nodes + 1, 77]
    kc, vc, tables = make_paged(rng, d, hk, q_lens, ctx_lens)
    q = rnd(rng, sum(q_lens), hk * group * d)
    words = words_for(nodes)
    meta = build_meta(q_lens, ctx_lens, tables)
    meta.tree_seq = np.array([1, 0], np.int32)
    meta.tree_mask = np.zeros((sum(q_lens), words), np.int32)
    meta.tree_mask[:nodes + 1] = pack_bits(ancestor_masks(tree), words)
    ref = nb.attention(q, kc, vc, meta, d ** -0.5, True)
    dev_meta = build_meta(q_lens, ctx_lens, tables)
    dev_meta.tree_seq, dev_meta.tree_mask = meta.tree_seq, meta.tree_mask
    got = cb.attention(cb.asarray(q, "act"), cb.asarray(kc, "act"), cb.asarray(vc, "act"), cb.prepare_meta(dev_meta),
                       d ** -0.5, True)
    assert rel_err(cb.to_numpy(got), ref) < 1e-2
    plain = nb.attention(q, kc, vc, build_meta(q_lens, ctx_lens, tables), d ** -0.5, True)
    assert rel_err(plain[:nodes + 1], ref[:nodes + 1]) > 0.05  # the mask really changes the tree rows
