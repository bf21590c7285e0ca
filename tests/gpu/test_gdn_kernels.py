"""The Gated DeltaNet ops of the CUDA backend (kernels/gdn.cu) against the numpy definitions (gdn_numpy.py), and the
hybrid model on the GPU against the same model on numpy.

Tolerances, derived (not fitted):
- conv and delta rule: both backends get the same float32 inputs and return float32, so they differ only by float32
  summation order. A dot product of n terms then differs by about sqrt(n) * 2^-24 relative (n = dk = 128: ~7e-7), and
  the delta rule is contractive (decay <= 1, I - beta k k^T has eigenvalues in [0, 1] for unit k), so errors add over
  the L rows of a sequence rather than grow: sqrt(L) * 7e-7 ~ 1e-5 at L = 200. FP32_TOL = 1e-4 (normwise) leaves 10x.
  The element-wise check (rtol 1e-3 of the largest value) catches a wrong row that a norm would dilute.
  gdn_chunked from cuda_gdn_chunk.MIN_ROWS rows on runs tensor-core kernels with bf16 operands: test_gdn_chunk.py
  derives their tolerance (CHUNK_TOL).
- gated_rms_norm and sigmoid_gate return bf16: round-to-nearest is within 2^-8 of each value (8 significand bits),
  plus float32 error far below that: |got - ref| <= 2^-8 |ref| + 1e-6.
- the model: its GEMM inputs are rounded to bf16 on the GPU (activations, ~2^-9 rms relative each) about 3 times per
  layer, 12 roundings over the 4 layers of the tiny config; independent errors add to ~sqrt(12) 2^-9 ~ 7e-3 of the
  hidden state, times the LM head's gain (~1-2 for normed rows): MODEL_TOL = 3e-2 normwise on the logits, the
  recurrent states after a commit likewise.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends.base import build_meta  # noqa: E402
from cudflash.backends.cuda_util import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from cudflash.backends.numpy_backend import NumpyBackend  # noqa: E402

FP32_TOL = 1e-4
BF16_RTOL = 2.0 ** -8
MODEL_TOL = 3e-2
nb = NumpyBackend()

# (Hk, Hv, dk, dv, conv kernel): the tiny test config, and Qwen3.5-9B's released GDN dims (hybrid_config defaults)
TINY = (2, 4, 16, 16, 4)
QWEN35_9B = (16, 32, 128, 128, 4)
PAIR = (2, 4, 48, 48, 4)  # the trained tiny hybrid pair's GDN dims (tests/data/tiny-hybrid-pair): dk, dv not 2^k
LENS = [1, 5, 0, 70, 130, 16]  # several sequences in one call: a decode row, a verify, an empty one, > one chunk
SLOTS = [3, -1, 0, 5, 1, 6]  # out of order; -1: a padding sequence (skipped by numpy too)
POOL = 8  # state slots; 2, 4 and 7 are in no sequence and must stay as they were


def rb(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{np.size(got) - np.isfinite(got).sum()} non-finite outputs"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def close_fp32(got: np.ndarray, ref: np.ndarray) -> None:
    assert np.abs(ref).max() > 0  # a comparison of something
    assert rel_err(got, ref) < FP32_TOL
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))


def metas(cb, lens: list[int]):
    """(numpy meta, CUDA meta) over sequences of `lens` rows (only the row ranges matter to these ops)."""
    host = build_meta(lens, lens, [[0]] * len(lens))
    dev = cb.prepare_meta(build_meta(lens, lens, [[0]] * len(lens)))
    return host, dev


def strided(rng: np.random.Generator, rows: int, width: int, pad: int = 24, scale: float = 1.0):
    """(host [rows, width] float32, device column slice of a wider float32 array with the same values): the ops
    read GEMM outputs in place as row-strided views."""
    wide = (rng.standard_normal((rows, width + pad)) * scale).astype(np.float32)
    return wide[:, 8: 8 + width], cp.asarray(wide)[:, 8: 8 + width]


@pytest.mark.parametrize("dims", [TINY, QWEN35_9B], ids=["tiny", "qwen3.5-9b"])
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("x_dtype", ["f32", "bf16"])
def test_causal_conv1d(cb, rng, dims, commit, x_dtype):
    hk, hv, dk, dv, taps = dims
    c = 2 * hk * dk + hv * dv
    t = sum(LENS)
    x, x_dev = strided(rng, t, c)
    if x_dtype == "bf16":  # the device sees bf16 rows, numpy their exact float32 values
        x = rb(x)
        x_dev = cb.asarray(x, "act")
    w = rb(rng.standard_normal((c, taps)) * 0.5)
    pool = rng.standard_normal((POOL, c, taps - 1)).astype(np.float32)
    pool_dev = cp.asarray(pool)
    host_meta, dev_meta = metas(cb, LENS)
    want_pool = pool.copy()
    want = nb.causal_conv1d(x, w, want_pool, np.asarray(SLOTS, np.int32), host_meta, commit)
    got = cb.causal_conv1d(x_dev, cb.asarray(w, "act"), pool_dev, cb.asarray(SLOTS, "i32"), dev_meta, commit)
    assert got.dtype == cp.float32 and got.shape == (t, c)
    close_fp32(cp.asnumpy(got), want)
    pad_rows = slice(LENS[0], LENS[0] + LENS[1])
    assert not cp.asnumpy(got)[pad_rows].any()  # the padding sequence's rows are zero, as numpy's
    if commit:
        assert not np.array_equal(want_pool, pool)
        close_fp32(cp.asnumpy(pool_dev), want_pool)
        untouched = [s for s in range(POOL) if s not in SLOTS or LENS[SLOTS.index(s)] == 0]
        assert np.array_equal(cp.asnumpy(pool_dev)[untouched], pool[untouched])
    else:
        assert np.array_equal(cp.asnumpy(pool_dev), pool)  # bit for bit: the verify's rollback


def gdn_inputs(rng: np.random.Generator, dims, t: int):
    hk, hv, dk, dv, _ = dims
    qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv)).astype(np.float32)
    ab, ab_dev = strided(rng, t, 2 * hv)  # a and b: adjacent column slices of one wide array (the in_proj output)
    a_log = np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32)  # tiny_hybrid's range
    dt_bias = rng.uniform(-4.0, 1.0, hv).astype(np.float32)  # slow and fast decays: state carried over many rows
    states = (rng.standard_normal((POOL, hv, dk, dv)) * 0.1).astype(np.float32)
    host = (qkv, ab[:, hv:], ab[:, :hv], a_log, dt_bias)
    dev = (cp.asarray(qkv), ab_dev[:, hv:], ab_dev[:, :hv], cp.asarray(a_log), cp.asarray(dt_bias))
    return host, dev, states


@pytest.mark.parametrize("dims", [TINY, PAIR, QWEN35_9B], ids=["tiny", "pair", "qwen3.5-9b"])
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("form", ["gdn_recurrent", "gdn_chunked"])
def test_gated_delta_rule(cb, rng, dims, commit, form):
    hv, dv = dims[1], dims[3]
    t = sum(LENS)
    host, dev, states = gdn_inputs(rng, dims, t)
    states_dev = cp.asarray(states)
    host_meta, dev_meta = metas(cb, LENS)
    want_states = states.copy()
    want = getattr(nb, form)(*host, want_states, np.asarray(SLOTS, np.int32), host_meta, commit)
    got = getattr(cb, form)(*dev, states_dev, cb.asarray(SLOTS, "i32"), dev_meta, commit)
    assert got.dtype == cp.float32 and got.shape == (t, hv * dv)
    if form == "gdn_chunked":  # the tensor-core kernels (LENS reach MIN_ROWS): bf16 operands, their own tolerance
        from tests.gpu.test_gdn_chunk import close_chunked

        close = lambda got, want: close_chunked(got, want, form)  # noqa: E731
    else:
        close = close_fp32
    close(cp.asnumpy(got), want)
    assert not cp.asnumpy(got)[LENS[0]: LENS[0] + LENS[1]].any()  # the padding sequence
    if commit:
        used = [s for s, n in zip(SLOTS, LENS) if s >= 0 and n]
        assert not np.allclose(want_states[used], states[used])
        close(cp.asnumpy(states_dev)[used], want_states[used])
        others = [s for s in range(POOL) if s not in used]
        assert np.array_equal(cp.asnumpy(states_dev)[others], states[others])
    else:
        assert np.array_equal(cp.asnumpy(states_dev), states)  # bit for bit: the verify's rollback


def test_verify_then_commit_of_the_accepted_prefix_equals_running_it(cb, rng):
    """The model's rollback on the GPU: a verify (commit=False) of 16 rows, then a commit of the first 5 rows from the
    untouched state, equals one committed run of those 5 rows; the verify's first 5 outputs are that run's."""
    dims = QWEN35_9B
    host, dev, states = gdn_inputs(rng, dims, 16)
    slots = cb.asarray([2], "i32")
    pool = cp.asarray(states)
    _, meta16 = metas(cb, [16])
    verify = cb.gdn_recurrent(*dev, pool, slots, meta16, False)
    prefix = tuple(x[:5] if x.ndim == 2 else x for x in dev)
    pool_once = cp.asarray(states)
    once = cb.gdn_recurrent(*prefix, pool_once, slots, metas(cb, [5])[1], True)
    commit_meta = build_meta([5], [5], [[0]])  # as the model builds it: not prepared (rows uploaded by the op)
    again = cb.gdn_recurrent(*prefix, pool, slots, commit_meta, True)
    assert cp.array_equal(again, once) and cp.array_equal(pool, pool_once)  # the same arithmetic: bit-exact
    assert cp.array_equal(verify[:5], once)
    assert not cp.array_equal(pool[2], cp.asarray(states[2]))


@pytest.mark.parametrize("dtypes", [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32")])
def test_gated_rms_norm(cb, rng, dtypes):
    t, heads, d = 19, 32, 128
    x, x_dev = strided(rng, t, heads * d)
    z, z_dev = strided(rng, t, heads * d, scale=2.0)
    if dtypes[0] == "bf16":
        x = rb(x)
        x_dev = cb.asarray(x, "act")
    if dtypes[1] == "bf16":
        z = rb(z)
        z_dev = cb.asarray(z, "act")
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    want = nb.gated_rms_norm(x, z, w, 1e-6, d)
    got = cb.gated_rms_norm(x_dev, z_dev, cp.asarray(w), 1e-6, d)
    assert got.dtype == cb.act and got.shape == (t, heads * d)
    got = cb.to_numpy(got)
    assert np.all(np.abs(got - want) <= BF16_RTOL * np.abs(want) + 1e-6)


@pytest.mark.parametrize("dtypes", [("bf16", "f32"), ("bf16", "bf16"), ("f32", "f32")])
def test_sigmoid_gate(cb, rng, dtypes):
    t, width = 7, 4096
    x, x_dev = strided(rng, t, width)
    g, g_dev = strided(rng, t, width, scale=3.0)
    if dtypes[0] == "bf16":
        x = rb(x)
        x_dev = cb.asarray(x, "act")
    if dtypes[1] == "bf16":
        g = rb(g)
        g_dev = cb.asarray(g, "act")
    want = nb.sigmoid_gate(x, g)
    got = cb.to_numpy(cb.sigmoid_gate(x_dev, g_dev))
    assert np.all(np.abs(got - want) <= BF16_RTOL * np.abs(want) + 1e-6)


def test_hybrid_model_on_the_gpu_matches_numpy(cb, tmp_path):
    """models/hybrid.py on both backends, one tiny checkpoint: prefill (longer than a GDN chunk), decode steps, a
    verify, the commit of its accepted prefix (the rollback), and a decode after it."""
    from cudflash.checkpoint import Checkpoint
    from cudflash.config import load_target_config
    from cudflash.models.hybrid import HybridTargetModel
    from cudflash.models.hybrid_reference import OneSequence
    from cudflash.models.weights import WeightLoader
    from cudflash.tiny_hybrid import HybridShape, write_hybrid_target

    # head_dim 64: the CUDA attention's smallest head dim (cuda_attention.HEAD_DIMS)
    directory = write_hybrid_target(tmp_path / "t", HybridShape(checkpoint_class="causal", head_dim=64,
                                                                mrope_section=[4, 2, 2]), seed=5)
    cfg = load_target_config(directory)
    seqs = [OneSequence(HybridTargetModel(cfg, WeightLoader(Checkpoint(directory), b), b), 160) for b in (nb, cb)]
    prompt = [int(x) for x in np.random.default_rng(3).integers(2, 250, 75)]

    def step(ids: list[int], mode: str):
        (want, _, want_tape), (got, _, got_tape) = (s.run(ids, mode) for s in seqs)
        assert rel_err(got, want) < MODEL_TOL, mode
        return want, want_tape, got_tape

    logits, _, _ = step(prompt, "prefill")
    for s in seqs:
        s.length = len(prompt)
    tok = int(np.argmax(logits[-1]))
    for _ in range(3):
        logits, _, _ = step([tok], "decode")
        for s in seqs:
            s.length += 1
        tok = int(np.argmax(logits[-1]))
    _, tape_np, tape_cuda = step([tok, 7, 9, 11], "verify")
    for s, tape in zip(seqs, (tape_np, tape_cuda)):
        s.model.commit(tape, s.cache, s.slots, [2])
        s.length += 2
    host_states = seqs[0].cache.states
    assert rel_err(cp.asnumpy(seqs[1].cache.states), host_states) < MODEL_TOL
    assert rel_err(cp.asnumpy(seqs[1].cache.conv), seqs[0].cache.conv) < MODEL_TOL
    step([13], "decode")
