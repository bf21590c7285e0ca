"""The numpy backend's fused ops against the plain ops they fuse (the GPU suite checks the CUDA ops against these)."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.config import RopeConfig
from cudflash.rope import rope_tables


@pytest.mark.parametrize("q_heads", [0, 4])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_store_is_rope_then_store(q_heads, norm):
    """q = head_norm_rope(q part); k = head_norm_rope(k part); k and v rows go to their slots, padding rows nowhere."""
    b, rng = NumpyBackend(), np.random.default_rng(2 * q_heads + norm)
    kv_heads, d, bs, num_blocks, t = 2, 16, 4, 6, 9
    q_dim, kv_dim = q_heads * d, kv_heads * d
    x = rng.standard_normal((t, q_dim + 2 * kv_dim + 8)).astype(np.float32)[:, 8:]  # a column slice, as in the drafter
    cos, sin = rope_tables(RopeConfig(theta=10000.0), d, 64)
    positions = rng.integers(0, 64, size=t).astype(np.int32)
    slots = rng.choice(num_blocks * bs, size=t, replace=False).astype(np.int32)
    slots[[2, 7]] = -1
    q_norm, k_norm = (rng.standard_normal(d).astype(np.float32) for _ in range(2)) if norm else (None, None)
    k_cache = rng.standard_normal((num_blocks, bs, kv_heads, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, bs, kv_heads, d)).astype(np.float32)
    want_k, want_v = k_cache.copy(), v_cache.copy()

    q = b.rope_store(x, q_heads, positions, cos, sin, q_norm, k_norm, 1e-6, slots, k_cache, v_cache)

    k = b.head_norm_rope(x[:, q_dim:q_dim + kv_dim], d, positions, cos, sin, k_norm, 1e-6)
    for row, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // bs, slot % bs] = k[row].reshape(kv_heads, d)
            want_v[slot // bs, slot % bs] = x[row, q_dim + kv_dim:].reshape(kv_heads, d)
    assert np.array_equal(k_cache, want_k) and np.array_equal(v_cache, want_v)
    if q_heads:
        assert np.array_equal(q, b.head_norm_rope(x[:, :q_dim], d, positions, cos, sin, q_norm, 1e-6))
    else:
        assert q is None


def test_swiglu_is_silu_of_gate_times_up():
    """swiglu(x, gate_up_weight(gate, up)) = silu(x gate^T) * (x up^T), the MLP's first half in HF's definition."""
    b, rng = NumpyBackend(), np.random.default_rng(5)
    x, gate, up = (rng.standard_normal(s).astype(np.float32) for s in ((3, 16), (24, 16), (24, 16)))
    g = x @ gate.T
    want = g / (1 + np.exp(-g)) * (x @ up.T)
    got = b.swiglu(x, b.gate_up_weight(gate, up))
    assert got.shape == (3, 24)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
