"""gdn_recurrent_mixer on the GPU: the fused kernel (gdn.cu's gdn_mixer) against the three CUDA kernels it stands for
(causal_conv1d, gdn_recurrent, gated_rms_norm: base.gdn_mixer_in_steps) bit for bit, since it runs their arithmetic
in their order; and against numpy's definition within the tolerances test_gdn_kernels.py derives.

Tolerances: the states are float32 on both backends (FP32_TOL, test_gdn_kernels.py); the conv states are copies of
input rows (exact). The normed output is bf16 of a float32 value that both backends compute within ~1e-5 relative,
so the two roundings land on the same or neighbouring bf16 values: within one bf16 ulp, 2^-7 relative.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends.base import gdn_mixer_in_steps  # noqa: E402
from cudflash.backends.cuda_util import bf16_bits_to_f32  # noqa: E402
from tests.gpu.test_gdn_kernels import POOL, close_fp32, metas, nb, rb  # noqa: E402

EPS = 1e-6
# (Hk, Hv, dk, dv, conv kernel): the trained pair's dims (2 value heads per key head), Qwen3.5-9B's (2), 27B's (3),
# one value head per key head (no cluster), and a conv of 3 taps.
DIMS = {"pair": (2, 4, 48, 48, 4), "qwen3.5-9b": (16, 32, 128, 128, 4), "qwen3.5-27b": (16, 48, 128, 128, 4),
        "r1": (4, 4, 64, 64, 4), "taps3": (2, 8, 32, 64, 3)}
LENS = [1, 5, 0, 20, 16]  # a decode row, a verify, an empty sequence, two stages of 16 rows, a full stage
SLOTS = [3, -1, 0, 5, 1]  # -1: a padding sequence


def mixer_inputs(cb, rng: np.random.Generator, dims, t: int):
    """(host args, device args) of gdn_recurrent_mixer before the pools: proj float32, on the device a row-strided
    slice of a wider array (the in_proj GEMM's output read in place); the conv weight in bf16 as the model loads it."""
    hk, hv, dk, dv, taps = dims
    c = 2 * hk * dk + hv * dv
    width = c + hv * dv + 2 * hv
    wide = rng.standard_normal((t, width + 16)).astype(np.float32)
    conv = rb(rng.standard_normal((c, taps)) * 0.5)
    a_log = np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32)
    dt_bias = rng.uniform(-4.0, 1.0, hv).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, dv).astype(np.float32)
    host = (wide[:, 8: 8 + width], conv, a_log, dt_bias, norm)
    dev = (cp.asarray(wide)[:, 8: 8 + width], cb.asarray(conv, "act"), cp.asarray(a_log), cp.asarray(dt_bias),
           cp.asarray(norm))
    return host, dev


def pools(rng: np.random.Generator, dims):
    hk, hv, dk, dv, taps = dims
    c = 2 * hk * dk + hv * dv
    return (rng.standard_normal((POOL, c, taps - 1)).astype(np.float32),
            (rng.standard_normal((POOL, hv, dk, dv)) * 0.1).astype(np.float32))


def run(b, args, conv_pool, state_pool, slots, meta, commit, span=None, normed=True, fused=None, **kw):
    """b.gdn_recurrent_mixer (fused=None), or gdn_mixer_in_steps on b (fused=False)."""
    proj, conv, a_log, dt_bias, norm = args
    call = b.gdn_recurrent_mixer if fused is None else (lambda *a, **k: gdn_mixer_in_steps(b, *a, **k))
    return call(proj, conv, conv_pool, a_log, dt_bias, state_pool, norm, EPS, slots, meta, commit, span=span,
                normed=normed, **kw)


def bits(x) -> np.ndarray:
    return cp.asnumpy(x).view(np.uint16) if x.dtype.itemsize == 2 else cp.asnumpy(x).view(np.uint32)


@pytest.mark.parametrize("dims", list(DIMS.values()), ids=list(DIMS))
@pytest.mark.parametrize("commit", [True, False])
def test_mixer_equals_its_three_kernels_and_numpy(cb, rng, dims, commit):
    from cudflash.backends import cuda_gdn

    t = sum(LENS)
    host, dev = mixer_inputs(cb, rng, dims, t)
    assert cuda_gdn.mixer_fits(dev[0], dev[1], cp.zeros((1, dims[1], dims[2], dims[3]), cp.float32))
    conv_pool, state_pool = pools(rng, dims)
    host_meta, dev_meta = metas(cb, LENS)
    slots_dev = cb.asarray(SLOTS, "i32")
    fused_pools = cp.asarray(conv_pool), cp.asarray(state_pool)
    steps_pools = cp.asarray(conv_pool), cp.asarray(state_pool)
    got = run(cb, dev, *fused_pools, slots_dev, dev_meta, commit)
    steps = run(cb, dev, *steps_pools, slots_dev, dev_meta, commit, fused=False)
    assert got.dtype == steps.dtype and got.shape == (t, dims[1] * dims[3])
    assert np.array_equal(bits(got), bits(steps))  # the same arithmetic in the same order
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(fused_pools, steps_pools))
    want_pools = conv_pool.copy(), state_pool.copy()
    want = nb.gdn_recurrent_mixer(host[0], host[1], want_pools[0], host[2], host[3], want_pools[1], host[4], EPS,
                                  np.asarray(SLOTS, np.int32), host_meta, commit)
    got_f = bf16_bits_to_f32(bits(got))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got_f, want, rtol=2.0 ** -7, atol=1e-6)
    pad = slice(LENS[0], LENS[0] + LENS[1])
    assert not got_f[pad].any()  # the padding sequence: the norm of zero rows
    if commit:
        used = [s for s, n in zip(SLOTS, LENS) if s >= 0 and n]
        assert not np.allclose(want_pools[1][used], state_pool[used])
        close_fp32(cp.asnumpy(fused_pools[1])[used], want_pools[1][used])
        assert np.array_equal(cp.asnumpy(fused_pools[0]), want_pools[0])  # conv states: copies of input rows
        others = [s for s in range(POOL) if s not in used]
        assert np.array_equal(cp.asnumpy(fused_pools[1])[others], state_pool[others])
    else:  # the verify's rollback: both pools bit for bit as they were
        assert np.array_equal(cp.asnumpy(fused_pools[0]), conv_pool)
        assert np.array_equal(cp.asnumpy(fused_pools[1]), state_pool)


@pytest.mark.parametrize("dims", [DIMS["pair"], DIMS["qwen3.5-27b"]], ids=["pair", "qwen3.5-27b"])
def test_verify_then_spanned_commit_equals_decoding_row_by_row(cb, rng, dims):
    """The speculative step's GDN part: a verify of 16 rows (commit=False), then the commit of its first 5 rows
    through a span (normed=False), leaves the pools bit for bit as 5 decodes one row at a time; the verify's first
    5 output rows are those decodes' outputs (a verify row is its decode)."""
    host, dev = mixer_inputs(cb, rng, dims, 16)
    conv_pool, state_pool = pools(rng, dims)
    slots = cb.asarray([2], "i32")
    verify_pools = cp.asarray(conv_pool), cp.asarray(state_pool)
    _, meta16 = metas(cb, [16])
    verify = run(cb, dev, *verify_pools, slots, meta16, False)
    span = cp.asarray(np.array([[0], [5]], np.int32))
    assert run(cb, dev, *verify_pools, slots, meta16, True, span=span, normed=False) is None
    decode_pools = cp.asarray(conv_pool), cp.asarray(state_pool)
    _, meta1 = metas(cb, [1])
    decodes = [run(cb, (dev[0][i: i + 1], *dev[1:]), *decode_pools, slots, meta1, True) for i in range(5)]
    assert np.array_equal(bits(verify[:5]), bits(cp.concatenate(decodes)))
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(verify_pools, decode_pools))
    assert not np.array_equal(cp.asnumpy(decode_pools[1])[2], state_pool[2])


def test_spanned_commit_matches_numpy(cb, rng):
    """A commit of part of each sequence's rows (span: rows already committed | rows to commit) against numpy."""
    dims = DIMS["qwen3.5-9b"]
    t = sum(LENS)
    host, dev = mixer_inputs(cb, rng, dims, t)
    conv_pool, state_pool = pools(rng, dims)
    span = np.array([[0, 0, 0, 3, 16], [1, 4, 0, 9, 0]], np.int32)  # the last sequence commits nothing
    host_meta, dev_meta = metas(cb, LENS)
    got_pools = cp.asarray(conv_pool), cp.asarray(state_pool)
    run(cb, dev, *got_pools, cb.asarray(SLOTS, "i32"), dev_meta, True, span=cp.asarray(span), normed=False)
    want_pools = conv_pool.copy(), state_pool.copy()
    nb.gdn_recurrent_mixer(host[0], host[1], want_pools[0], host[2], host[3], want_pools[1], host[4], EPS,
                           np.asarray(SLOTS, np.int32), host_meta, True, span, normed=False)
    moved = [3, 5]
    close_fp32(cp.asnumpy(got_pools[1])[moved], want_pools[1][moved])
    assert np.array_equal(cp.asnumpy(got_pools[0]), want_pools[0])
    still = [s for s in range(POOL) if s not in moved]
    assert np.array_equal(cp.asnumpy(got_pools[1])[still], state_pool[still])


def test_independent_commits_replayed_side_by_side_equal_them_one_after_another(cb, rng):
    """The commit graph's layers: captured with independent=True (no launch waits for the one in front, so under PDL
    the layers' kernels overlap), each layer on its own tape rows and pools, a replay leaves every pool bit for bit
    as the same commits run eagerly in turn; and a second replay from the same start does it again."""
    dims, layers = DIMS["qwen3.5-9b"], 6
    inputs = [mixer_inputs(cb, rng, dims, 16)[1] for _ in range(layers)]
    start = [pools(rng, dims) for _ in range(layers)]
    slots = cb.asarray([2], "i32")
    _, meta = metas(cb, [16])
    span = cp.asarray(np.array([[3], [7]], np.int32))
    eager = [(cp.asarray(c), cp.asarray(st)) for c, st in start]
    for args, p in zip(inputs, eager):
        assert run(cb, args, *p, slots, meta, True, span=span, normed=False) is None
    replayed = [(cp.asarray(c), cp.asarray(st)) for c, st in start]
    cb.synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for args, p in zip(inputs, replayed):
            run(cb, args, *p, slots, meta, True, span=span, normed=False, independent=True)
        graph = stream.end_capture()
    for _ in range(2):
        for (c, st), p in zip(start, replayed):
            p[0][...], p[1][...] = cp.asarray(c), cp.asarray(st)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        for p, q, (c, st) in zip(replayed, eager, start):
            assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(p, q))
            assert not np.array_equal(cp.asnumpy(p[1])[2], st[2])  # the commit moved the state
