"""The Gated DeltaNet ops of the numpy backend: the chunked and recurrent forms agree, state carries across calls,
a verify without commit leaves the pools untouched and re-running the accepted prefix restores the exact state, and
the recurrence matches an independent scalar transcription of the per-token rule."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash.backends.base import build_meta
from cudflash.backends.numpy_backend import NumpyBackend

B = NumpyBackend()
HK, HV, DK, DV, K = 2, 4, 8, 6, 4
C = 2 * HK * DK + HV * DV


def inputs(rng: np.random.Generator, rows: int):
    qkv = rng.standard_normal((rows, C)).astype(np.float32)
    a = rng.standard_normal((rows, HV)).astype(np.float32)
    b = rng.standard_normal((rows, HV)).astype(np.float32)
    return qkv, a, b


def params(rng: np.random.Generator):
    A_log = np.log(rng.uniform(0.5, 4.0, HV)).astype(np.float32)
    dt_bias = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    return A_log, dt_bias


def pool(rng: np.random.Generator, slots: int, zero: bool = False) -> np.ndarray:
    if zero:
        return np.zeros((slots, HV, DK, DV), dtype=np.float32)
    return (rng.standard_normal((slots, HV, DK, DV)) * 0.3).astype(np.float32)


def meta(lens: list[int]):
    return build_meta(lens, lens, [[0]] * len(lens))


def naive_recurrence(qkv, a, b, A_log, dt_bias, state):
    """The per-token rule written out head by head in float64 loops (not the op's vectorised code): S = e^g S;
    delta = beta (v - S^T k); S += k delta^T; o = S^T q, with q, k L2-normalised, q / sqrt(dk), value head h reading
    key head h // (HV / HK)."""
    s = state.astype(np.float64).copy()
    rows = qkv.shape[0]
    out = np.zeros((rows, HV, DV))
    for t in range(rows):
        for h in range(HV):
            kh = h // (HV // HK)
            q = qkv[t, kh * DK:(kh + 1) * DK].astype(np.float64)
            k = qkv[t, HK * DK + kh * DK: HK * DK + (kh + 1) * DK].astype(np.float64)
            v = qkv[t, 2 * HK * DK + h * DV: 2 * HK * DK + (h + 1) * DV].astype(np.float64)
            q = q / np.sqrt(q @ q + 1e-6) / np.sqrt(DK)
            k = k / np.sqrt(k @ k + 1e-6)
            beta = 1 / (1 + np.exp(-float(b[t, h])))
            g = -np.exp(float(A_log[h])) * np.log1p(np.exp(float(a[t, h]) + float(dt_bias[h])))
            s[h] *= np.exp(g)
            delta = beta * (v - s[h].T @ k)
            s[h] += np.outer(k, delta)
            out[t, h] = s[h].T @ q
    return out.reshape(rows, HV * DV), s


def test_recurrent_form_is_the_per_token_rule():
    rng = np.random.default_rng(0)
    qkv, a, b = inputs(rng, 9)
    A_log, dt_bias = params(rng)
    states = pool(rng, 2)
    want_out, want_state = naive_recurrence(qkv, a, b, A_log, dt_bias, states[1])
    out = B.gdn_recurrent(qkv, a, b, A_log, dt_bias, states, np.array([1], np.int32), meta([9]), commit=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(states[1], want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lens", [[1], [5, 64], [65, 3], [130], [200, 64, 7]])
def test_chunked_equals_recurrent_with_state_in_and_out(lens):
    rng = np.random.default_rng(sum(lens))
    qkv, a, b = inputs(rng, sum(lens))
    A_log, dt_bias = params(rng)
    start = pool(rng, len(lens) + 1)
    slots = np.arange(len(lens), 0, -1, dtype=np.int32)  # not the row order: each sequence reads its own slot
    s_rec, s_chk = start.copy(), start.copy()
    out_rec = B.gdn_recurrent(qkv, a, b, A_log, dt_bias, s_rec, slots, meta(lens), commit=True)
    out_chk = B.gdn_chunked(qkv, a, b, A_log, dt_bias, s_chk, slots, meta(lens), commit=True)
    assert np.abs(out_rec).max() > 100 * 2e-5  # the comparison is of values well above its atol
    np.testing.assert_allclose(out_chk, out_rec, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(s_chk, s_rec, rtol=2e-4, atol=2e-5)
    np.testing.assert_array_equal(s_rec[0], start[0])  # a slot no sequence names is untouched
    assert not np.allclose(s_rec[1:], start[1:])


@pytest.mark.parametrize("form", ["gdn_chunked", "gdn_recurrent"])
@pytest.mark.parametrize("split", [1, 40, 64, 100])
def test_state_carried_across_calls_equals_one_call(form, split):
    rng = np.random.default_rng(split)
    rows = 130
    qkv, a, b = inputs(rng, rows)
    A_log, dt_bias = params(rng)
    op = getattr(B, form)
    slot = np.array([0], np.int32)
    whole = pool(rng, 1, zero=True)
    out_whole = op(qkv, a, b, A_log, dt_bias, whole, slot, meta([rows]), commit=True)
    parts = pool(rng, 1, zero=True)
    first = op(qkv[:split], a[:split], b[:split], A_log, dt_bias, parts, slot, meta([split]), commit=True)
    second = op(qkv[split:], a[split:], b[split:], A_log, dt_bias, parts, slot, meta([rows - split]), commit=True)
    np.testing.assert_allclose(np.concatenate([first, second]), out_whole, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(parts, whole, rtol=2e-4, atol=2e-5)


def test_verify_without_commit_then_rerun_of_the_accepted_prefix_is_exact():
    """The rollback the engine uses: a verify of T rows (commit=False) leaves S0; re-running the first n rows with
    commit=True gives exactly (bit for bit) the state after those n rows, and the verify's first n outputs are the
    outputs of those rows."""
    rng = np.random.default_rng(7)
    T = 16
    qkv, a, b = inputs(rng, T)
    A_log, dt_bias = params(rng)
    s0 = pool(rng, 1)
    states = s0.copy()
    slot = np.array([0], np.int32)
    verify = B.gdn_recurrent(qkv, a, b, A_log, dt_bias, states, slot, meta([T]), commit=False)
    np.testing.assert_array_equal(states, s0)
    for n in (1, 5, T):
        kept = s0.copy()
        out = B.gdn_recurrent(qkv[:n], a[:n], b[:n], A_log, dt_bias, kept, slot, meta([n]), commit=True)
        np.testing.assert_array_equal(out, verify[:n])
        straight = s0.copy()  # decoding the same n tokens one at a time
        for t in range(n):
            B.gdn_recurrent(qkv[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias, straight, slot, meta([1]), True)
        np.testing.assert_array_equal(kept, straight)


def test_conv_with_state_split_across_calls_equals_one_call_and_commit_keeps_the_last_rows():
    rng = np.random.default_rng(3)
    rows, ch = 23, 10
    x = rng.standard_normal((rows, ch)).astype(np.float32)
    w = rng.standard_normal((ch, K)).astype(np.float32)
    start = rng.standard_normal((2, ch, K - 1)).astype(np.float32)
    slot = np.array([1], np.int32)
    whole_state = start.copy()
    whole = B.causal_conv1d(x, w, whole_state, slot, meta([rows]), commit=True)
    # the definition, written directly: rows of [state; x] in a window of K, then SiLU
    xx = np.concatenate([start[1].T, x])
    pre = np.stack([(w.T * xx[t:t + K]).sum(0) for t in range(rows)])
    np.testing.assert_allclose(whole, pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(whole_state[1], xx[-(K - 1):].T)
    np.testing.assert_array_equal(whole_state[0], start[0])
    for split in (1, 2, 3, 10):
        parts_state = start.copy()
        first = B.causal_conv1d(x[:split], w, parts_state, slot, meta([split]), commit=True)
        second = B.causal_conv1d(x[split:], w, parts_state, slot, meta([rows - split]), commit=True)
        np.testing.assert_array_equal(np.concatenate([first, second]), whole)
        np.testing.assert_array_equal(parts_state, whole_state)
    untouched = start.copy()
    B.causal_conv1d(x, w, untouched, slot, meta([rows]), commit=False)
    np.testing.assert_array_equal(untouched, start)


def test_padding_sequences_are_skipped():
    rng = np.random.default_rng(5)
    qkv, a, b = inputs(rng, 6)
    A_log, dt_bias = params(rng)
    states = pool(rng, 1)
    before = states.copy()
    out = B.gdn_recurrent(qkv, a, b, A_log, dt_bias, states, np.array([-1, 0], np.int32), meta([2, 4]), True)
    assert not out[:2].any() and out[2:].any()
    solo = before.copy()
    np.testing.assert_array_equal(out[2:], B.gdn_recurrent(qkv[2:], a[2:], b[2:], A_log, dt_bias, solo,
                                                           np.array([0], np.int32), meta([4]), True))
    np.testing.assert_array_equal(states, solo)


def test_gated_rms_norm_and_sigmoid_gate():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3 * DV)).astype(np.float32)
    z = rng.standard_normal((5, 3 * DV)).astype(np.float32)
    w = rng.standard_normal(DV).astype(np.float32)
    got = B.gated_rms_norm(x, z, w, 1e-6, DV)
    h = x.reshape(5, 3, DV).astype(np.float64)
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * w * (z.reshape(5, 3, DV) / (1 + np.exp(-z.reshape(5, 3, DV))))
    np.testing.assert_allclose(got, want.reshape(5, -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(B.sigmoid_gate(x, z), x / (1 + np.exp(-z)), rtol=1e-6)


@pytest.mark.parametrize("op", ["conv", "gdn"])
def test_a_span_runs_exactly_its_rows_in_place(op):
    """span [2, n] (rows skipped, rows run): each sequence computes, and commits, what the same op computes on those
    rows alone (bit for bit); its other rows are 0; a count of 0 leaves the state as it was; padding stays skipped."""
    rng = np.random.default_rng(11)
    lens, slots = [6, 6, 6, 6, 3], np.array([2, 0, -1, 3, 1], np.int32)
    span = np.array([[0, 2, 0, 1, 3], [4, 3, 2, 0, 0]], np.int32)
    t = sum(lens)
    qkv, a, b = inputs(rng, t)
    A_log, dt_bias = params(rng)
    w = rng.standard_normal((C, K)).astype(np.float32)
    conv0 = rng.standard_normal((4, C, K - 1)).astype(np.float32)
    states0 = pool(rng, 4)

    def run(rows_of, m, slot_of, pools, **kw):
        if op == "conv":
            return B.causal_conv1d(rows_of(qkv), w, pools, slot_of, m, True, **kw)
        return B.gdn_recurrent(rows_of(qkv), rows_of(a), rows_of(b), A_log, dt_bias, pools, slot_of, m, True, **kw)

    start = np.cumsum([0] + lens)
    pools0 = conv0 if op == "conv" else states0
    spanned = pools0.copy()
    out = run(lambda x: x, meta(lens), slots, spanned, span=span)
    alone = pools0.copy()
    for s, slot in enumerate(slots):
        lo, first, count = start[s], span[0, s], span[1, s]
        rows = np.zeros(t, bool)
        rows[lo + first:lo + first + count] = True
        if slot >= 0 and count:
            got = run(lambda x: x[rows], meta([count]), np.array([slot], np.int32), alone)
            np.testing.assert_array_equal(out[rows], got)
        outside = np.zeros(t, bool)
        outside[lo:start[s + 1]] = True
        outside &= ~rows
        assert not out[outside].any() and (not out[rows].any()) == (slot < 0 or not count)
    np.testing.assert_array_equal(spanned, alone)
    np.testing.assert_array_equal(spanned[3], pools0[3])  # slot 3: count 0


def test_commit_span_names_the_rows_done_and_to_do():
    from cudflash.models.hybrid import commit_span

    cu = np.array([0, 4, 8, 12, 16])  # the last sequence: padding the caller does not name
    np.testing.assert_array_equal(commit_span(cu, [0, 1, 0], [3, 4, 0]), [[0, 1, 0, 0], [3, 3, 0, 0]])
    with pytest.raises(AssertionError):
        commit_span(cu, [0, 0, 0], [5, 0, 0])  # more rows than the sequence's verify has
    with pytest.raises(AssertionError):
        commit_span(cu, [2, 0, 0], [1, 0, 0])  # fewer accepted than done
    with pytest.raises(AssertionError):
        commit_span(cu[:3], [0, 0, 0], [1, 1, 1])  # more sequences than the verify had
