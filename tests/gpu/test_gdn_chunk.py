"""The chunked gated delta rule of the CUDA backend (kernels/gdn_chunk.cu through cuda_gdn_chunk.py) against the
numpy chunked form (gdn_numpy.chunked) on float32 inputs, and its speed against the recurrent kernel and the floor.

Tolerance, derived (not fitted). The kernels' tensor-core products take bf16 operands (8 significand bits: a
rounding is within 2^-9 relative, ~2^-9 / sqrt(3) = 1.1e-3 rms) with float32 accumulation; a product of two rounded
operands is then off by ~1.6e-3 rms relative per term, and a dot product of many terms of mixed sign by about the same
relative to its norm. An output row passes through about five such products in series (k k^T into T, T (beta v) into
u, w S, qg S and intra v', with S itself made of kd^T v' products), each adding ~1.6e-3 independently: ~4e-3 normwise;
the delta rule is contractive (decay <= 1; I - beta k k^T has eigenvalues in [0, 1]), so errors of earlier chunks
are damped, not amplified. CHUNK_TOL = 2e-2 normwise leaves ~5x. The element-wise check (2e-2 of the largest value;
the largest element error is of the same order as the normwise one) catches a wrong row that the norm would dilute.
The hybrid model's inputs to this op are GEMM outputs of bf16 activations, already ~2^-9 relative off, so an op error
of that order is what FLA's chunk_gated_delta_rule (bf16 operands too) gives every serving engine's Qwen3.5 prefill.
Everything the tests require to be unchanged (states with commit off, slots of no sequence, padding rows) is compared
bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from cudflash.backends import cuda_gdn_chunk  # noqa: E402
from tests.gpu.test_gdn_kernels import POOL, QWEN35_9B, TINY, gdn_inputs, metas, nb, rel_err  # noqa: E402

CHUNK_TOL = 2e-2
ELEMENT_TOL = 2e-2
# (lens, slots): several sequences of different lengths in one call, lengths not a multiple of the chunk, length 1,
# an empty sequence and a padding one (slot -1); slots out of order, some of the pool in no sequence.
CASES = {
    "mixed": ([1, 5, 0, 70, 130, 16], [3, -1, 0, 5, 1, 6]),
    "one_row": ([1], [2]),
    "chunk_edges": ([63, 64, 65, 128], [0, 7, 2, 4]),
    "long": ([300], [5]),
}
HK, HV, DK, DV, _ = QWEN35_9B
BANDWIDTH = 4.28e12  # H200 HBM3e copy bandwidth (H200.md), bytes / s
TENSOR_FLOPS = 7.5e14  # ~dense bf16 mma rate of an H200, FLOP / s


def close_chunked(got: np.ndarray, ref: np.ndarray, what: str) -> float:
    assert np.abs(ref).max() > 0  # a comparison of something
    err = rel_err(got, ref)
    print(f"  {what}: normwise relative error {err:.2e}, max |got - ref| / max |ref| "
          f"{np.abs(got - ref).max() / np.abs(ref).max():.2e}")
    assert err < CHUNK_TOL, what
    np.testing.assert_allclose(got, ref, rtol=0, atol=ELEMENT_TOL * float(np.abs(ref).max()), err_msg=what)
    return err


def run_both(cb, rng, dims, lens, slots, commit, block_dv=None):
    """(numpy out, numpy states after, device out, device states after, states before) for one call."""
    t = sum(lens)
    host, dev, states = gdn_inputs(rng, dims, t)
    states_dev = cp.asarray(states)
    host_meta, dev_meta = metas(cb, lens)
    want_states = states.copy()
    want = nb.gdn_chunked(*host, want_states, np.asarray(slots, np.int32), host_meta, commit)
    got = cuda_gdn_chunk.gated_delta_rule(*dev, states_dev, cb.asarray(slots, "i32"), dev_meta, commit, cb.tuning,
                                          block_dv=block_dv)
    assert got.dtype == cp.float32 and got.shape == (t, dims[1] * dims[3])
    return want, want_states, cp.asnumpy(got), cp.asnumpy(states_dev), states


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dims", [TINY, QWEN35_9B], ids=["tiny", "qwen3.5-9b"])
@pytest.mark.parametrize("commit", [True, False])
def test_chunked_matches_numpy(cb, rng, case, dims, commit):
    lens, slots = CASES[case]
    want, want_states, got, got_states, states = run_both(cb, rng, dims, lens, slots, commit)
    close_chunked(got, want, f"{case} o")
    for s, (slot, n) in enumerate(zip(slots, lens)):
        lo = sum(lens[:s])
        if slot < 0:
            assert not got[lo: lo + n].any()  # the padding sequence's rows are zero, as numpy's
    used = [s for s, n in zip(slots, lens) if s >= 0 and n]
    if commit:
        assert not np.allclose(want_states[used], states[used])
        close_chunked(got_states[used], want_states[used], f"{case} state")
        others = [s for s in range(POOL) if s not in used]
        assert np.array_equal(got_states[others], states[others])
    else:
        assert np.array_equal(got_states, states)  # bit for bit: the verify's rollback


@pytest.mark.parametrize("block_dv", cuda_gdn_chunk.BLOCK_DV)
def test_every_column_block_matches_numpy(cb, rng, block_dv):
    lens, slots = [200, 37], [1, 3]
    want, want_states, got, got_states, _ = run_both(cb, rng, QWEN35_9B, lens, slots, True, block_dv=block_dv)
    close_chunked(got, want, f"block_dv {block_dv} o")
    close_chunked(got_states[slots], want_states[slots], f"block_dv {block_dv} state")


def test_chunked_matches_the_recurrent_kernel(cb, rng):
    """The two CUDA forms of the same function, both with commit, from the same nonzero states."""
    lens, slots = [150, 64, 3], [0, 1, 2]
    _, dev, states = gdn_inputs(rng, QWEN35_9B, sum(lens))
    _, meta = metas(cb, lens)
    pool_rec, pool_chunk = cp.asarray(states), cp.asarray(states)
    rec = cb.gdn_recurrent(*dev, pool_rec, cb.asarray(slots, "i32"), meta, True)
    chunk = cuda_gdn_chunk.gated_delta_rule(*dev, pool_chunk, cb.asarray(slots, "i32"), meta, True, cb.tuning)
    close_chunked(cp.asnumpy(chunk), cp.asnumpy(rec), "o vs recurrent")
    close_chunked(cp.asnumpy(pool_chunk)[slots], cp.asnumpy(pool_rec)[slots], "state vs recurrent")


def test_gdn_chunked_dispatch(cb, rng):
    """CudaBackend.gdn_chunked takes the chunked kernels from MIN_ROWS rows on, the recurrent one below."""
    for rows, chunked in ((cuda_gdn_chunk.MIN_ROWS, True), (cuda_gdn_chunk.MIN_ROWS - 1, False)):
        _, dev, states = gdn_inputs(rng, QWEN35_9B, rows)
        _, meta = metas(cb, [rows])
        slots = cb.asarray([0], "i32")
        pools = [cp.asarray(states) for _ in range(2)]
        got = cb.gdn_chunked(*dev, pools[0], slots, meta, True)
        if chunked:
            want = cuda_gdn_chunk.gated_delta_rule(*dev, pools[1], slots, meta, True, cb.tuning)
        else:
            want = cb.gdn_recurrent(*dev, pools[1], slots, meta, True)
        assert cp.array_equal(got, want) and cp.array_equal(pools[0], pools[1])  # the same kernels: bit-exact


def floor_us(rows: int) -> tuple[float, float]:
    """(byte floor, FLOP floor) of one committed chunked call at Qwen3.5-9B shapes, us: q, k, v, a, b read, the
    state read and written, o written; the tensor-core work of the chunked form counted in full tiles."""
    moved = rows * ((2 * HK * DK + HV * DV) + 2 * HV + HV * DV) * 4 + 2 * HV * DK * DV * 4
    c = cuda_gdn_chunk.CHUNK
    per_chunk = 2 * c * c * DK * 2 + 2 * c * c * (DK + DV) + 2 * c * DK * DV * 3 + 2 * c * c * DV
    flops = -(-rows // c) * HV * per_chunk
    return moved / BANDWIDTH * 1e6, flops / TENSOR_FLOPS * 1e6


def time_us(cb, fn, iters: int) -> float:
    """us per call: `iters` calls captured in one CUDA graph, replayed between two CUDA events after a warm-up replay
    (the kernels alone, as the engine's captured steps run them)."""
    fn()
    cb.stream.synchronize()
    cb.stream.begin_capture()
    for _ in range(iters):
        fn()
    graph = cb.stream.end_capture()
    graph.launch(cb.stream)
    start = cb.event()
    graph.launch(cb.stream)
    end = cb.event()
    return cb.elapsed_ms(start, end) * 1e3 / iters


class _Skipped:
    """A kernel that is not launched (the timing's prepare-only run)."""

    def reserve_shared(self, nbytes: int) -> None:
        pass

    def __call__(self, *args, **kwargs) -> None:
        pass


def prepare_only_us(cb, fn, iters: int) -> float:
    """time_us of fn with gdn_chunk_scan not launched: the prepare kernel's share."""
    real = cuda_gdn_chunk._kernel
    cuda_gdn_chunk._kernel = lambda name, tuning: real(name, tuning) if "prepare" in name else _Skipped()
    try:
        return time_us(cb, fn, iters)
    finally:
        cuda_gdn_chunk._kernel = real


def timings(cb, rows_list=(16, 32, 64, 128, 256, 512, 2048, 8192)) -> list[dict]:
    rng = np.random.default_rng(0)
    results = []
    for rows in rows_list:
        _, dev, states = gdn_inputs(rng, QWEN35_9B, rows)
        _, meta = metas(cb, [rows])
        slots = cb.asarray([0], "i32")
        pool = cp.asarray(states)
        iters = max(3, min(50, 20000 // rows))
        rec = time_us(cb, lambda: cb.gdn_recurrent(*dev, pool, slots, meta, True), iters)
        chunk = {bv: time_us(cb, lambda bv=bv: cuda_gdn_chunk.gated_delta_rule(*dev, pool, slots, meta, True, cb.tuning,
                                                                              block_dv=bv), iters)
                 for bv in cuda_gdn_chunk.BLOCK_DV}
        best = min(chunk, key=chunk.get)
        prep = prepare_only_us(cb, lambda: cuda_gdn_chunk.gated_delta_rule(*dev, pool, slots, meta, True, cb.tuning,
                                                                           block_dv=best), iters)
        byte_floor, flop_floor = floor_us(rows)
        floor = max(byte_floor, flop_floor)
        results.append(dict(rows=rows, recurrent_us=rec, chunked_us=chunk, prepare_us=prep, floor_us=floor))
        print(f"rows {rows:5d}: recurrent {rec:9.1f} us ({rec / floor:7.1f}x floor) | chunked "
              + " ".join(f"bv{bv} {us:8.1f}" for bv, us in chunk.items())
              + f" us (prepare {prep:7.1f}), best bv{best} {chunk[best] / floor:5.2f}x floor, "
              f"{rec / chunk[best]:6.1f}x faster | floor {floor:6.1f} us (bytes {byte_floor:.1f}, FLOPs "
              f"{flop_floor:.1f})")
    return results


def test_timing_against_the_recurrent_kernel_and_the_floor(cb):
    """Prints (run with -s); asserts only that the chunked form wins from 512 rows on."""
    results = timings(cb)
    for r in results:
        if r["rows"] >= 512:
            assert min(r["chunked_us"].values()) < r["recurrent_us"]


if __name__ == "__main__":  # PYTHONPATH=$PWD python3 tests/gpu/test_gdn_chunk.py
    from cudflash.backends.cuda_backend import CudaBackend

    timings(CudaBackend())
