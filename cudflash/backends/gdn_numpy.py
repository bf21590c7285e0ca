"""Gated DeltaNet in numpy float32: the readable definition of the hybrid ops (NumpyBackend delegates here).

One GDN layer of a Qwen3.5 hybrid, per sequence and value head h (q / k head h // (Hv / Hk)):

    qkv = silu(causal depthwise conv_K([conv state; in_proj_qkv(x)]))        conv state: the last K-1 input rows
    q, k = l2norm(q), l2norm(k);  q = q * dk^-1/2
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    per token t:  S = e^{g_t} S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t       S: [dk, dv]
    out = out_proj(rmsnorm(o) * norm.weight * silu(z))

`gdn_recurrent` runs that loop; `gdn_chunked` computes the same function 64 rows at a time (the WY / UT form:
within a chunk, with G the cumulative sum of g and D[i, j] = e^{G_i - G_j} for j <= i,
T = I + strictly_lower((beta k) k^T * D), U = T^-1 (beta v), W = T^-1 (beta k e^G); then per chunk
V' = U - W S, O = (q e^G) S + ((q k^T) * D) V', S = e^{G_last} S + (k e^{G_last - G})^T V').

Rollback after a verify (issue #22, point 3): **keep the pre-verify state and re-run the accepted prefix.**
A verify runs the recurrence with commit=False: outputs for all T rows, the pools untouched. The model keeps each
GDN layer's inputs of the verify rows (the raw in_proj_qkv rows and a, b: a tape of T x (conv_dim + 2 Hv) floats);
after acceptance it runs causal_conv1d and gdn_recurrent on the a+1 accepted rows with commit=True, which leaves
exactly the state after the pending token and the a accepted drafts (the same arithmetic, so bit-exact on the CPU).

Memory and time at Qwen3.5-9B (32 layers, 24 of them GDN: Hk 16, Hv 32, dk = dv = 128, conv K 4, conv_dim 8192),
verify of T = 16 rows, float32 state:
- state per GDN layer 32 x 128 x 128 x 4 B = 2 MiB; per sequence 24 x 2 MiB = 48 MiB (+ conv 24 x 8192 x 3 x 4 B =
  2.25 MiB). For scale, the 8 attention layers' KV is 8 x 2 x 4 x 256 x 2 B = 32 KiB per token: the state is worth
  about 1,600 tokens of KV.
- chosen, keep S0 + recompute: the tape is 24 x 16 x (8192 + 64) x 4 B = 12.4 MiB per sequence in the step; the
  verify reads S0 and writes no state; the commit reads S0 and the tape and writes S once: about 24 x (2 + 2 +
  0.5) MiB = 108 MiB of traffic per sequence, ~25 us at 4.3 TB/s, plus one small launch per layer (or one for all 24:
  the layers' commits are independent once the tape exists).
- alternative, per-token snapshots (vLLM / SGLang): the verify writes the state after every row, 16 x 48 MiB =
  768 MiB per sequence (24 GiB at batch 32), ~180 us of writes per step at 4.3 TB/s (about 4% of a 9B step whose
  weight floor is ~4.2 ms); commit is a slot index. It costs 60x the memory of the tape and 7x its traffic.
docs/hybrid.md carries this on to the engine (the state pool, preemption, prefix caching).
"""
from __future__ import annotations

import numpy as np

GDN_CHUNK = 64  # rows per chunk of the chunked form (transformers' and FLA's chunk_size)
L2_EPS = 1e-6  # l2norm: x * rsqrt(sum(x^2) + eps), as FLA and transformers compute it


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus (beta 1, threshold 20): x itself above 20."""
    with np.errstate(over="ignore"):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x * (np.float32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS)))


def span_rows(cu_seqlens: np.ndarray, span: np.ndarray | None, s: int) -> tuple[int, int]:
    """The rows [lo, hi) sequence s runs: all of cu[s] .. cu[s+1] - 1, or with `span` (int32 [2, n]: rows skipped,
    rows run) the span[1, s] rows from cu[s] + span[0, s] on, which must lie within the sequence's rows."""
    lo, hi = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
    if span is None:
        return lo, hi
    first, count = int(span[0, s]), int(span[1, s])
    assert 0 <= first and 0 <= count and first + count <= hi - lo, (s, first, count, hi - lo)
    return lo + first, lo + first + count


def causal_conv1d(x: np.ndarray, weight: np.ndarray, conv_states: np.ndarray, slots: np.ndarray,
                  cu_seqlens: np.ndarray, commit: bool, span: np.ndarray | None = None) -> np.ndarray:
    """y[t, c] = silu(sum_j weight[c, j] * xx[t + j, c]) with xx = [conv state of the sequence (K-1 rows, oldest
    first); its rows of x]; commit: the state becomes the last K-1 rows of xx. With `span` a sequence's rows are
    only those span_rows names (a commit of a verify's accepted rows, read in place); the other rows of out are 0."""
    taps = weight.shape[1]
    out = np.zeros(x.shape, dtype=np.float32)
    for s, slot in enumerate(np.asarray(slots)):
        lo, hi = span_rows(cu_seqlens, span, s)
        if slot < 0 or hi == lo:
            continue
        xx = np.concatenate([conv_states[slot].T, x[lo:hi]], axis=0)  # [K-1 + L, C]
        acc = np.zeros((hi - lo, x.shape[1]), dtype=np.float32)
        for j in range(taps):
            acc += weight[:, j] * xx[j:j + hi - lo]
        out[lo:hi] = acc * _sigmoid(acc)
        if commit:
            conv_states[slot] = xx[-(taps - 1):].T
    return out


def _split(qkv: np.ndarray, a: np.ndarray, b: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray,
           hv: int, dk: int, dv: int):
    """q, k [L, Hv, dk] (normalised, q scaled, key heads repeated over their value heads), v [L, Hv, dv],
    beta, g [L, Hv]."""
    rows = qkv.shape[0]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    assert qkv.shape[1] == 2 * hk * dk + hv * dv and hv % hk == 0, (qkv.shape, hv, dk, dv)
    q = qkv[:, : hk * dk].reshape(rows, hk, dk)
    k = qkv[:, hk * dk: 2 * hk * dk].reshape(rows, hk, dk)
    v = qkv[:, 2 * hk * dk:].reshape(rows, hv, dv).astype(np.float32)
    q, k = (np.repeat(_l2norm(t.astype(np.float32)), hv // hk, axis=1) for t in (q, k))
    q = q * np.float32(dk ** -0.5)
    beta = _sigmoid(b.astype(np.float32))
    g = -np.exp(A_log) * _softplus(a.astype(np.float32) + dt_bias)
    return q, k, v, beta, g.astype(np.float32)


def recurrent(q, k, v, beta, g, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token by token over one sequence: (o [L, Hv, dv], final state [Hv, dk, dv])."""
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def _forward_substitute(lower: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """X with (I + lower) X = rhs, lower strictly lower triangular [..., C, C], rhs [..., C, n]."""
    x = np.empty_like(rhs)
    for i in range(rhs.shape[-2]):
        x[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jn->...n", lower[..., i, :i], x[..., :i, :])
    return x


def chunked(q, k, v, beta, g, state: np.ndarray, chunk: int = GDN_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The same function 64 rows at a time (module docstring); rows padded to a whole chunk with zeros (beta = g = 0:
    a padded row changes neither the outputs of real rows nor the state)."""
    rows, hv, dv = v.shape
    dk = q.shape[2]
    pad = -rows % chunk
    n = (rows + pad) // chunk

    def blocks(x: np.ndarray) -> np.ndarray:  # [L, Hv, ...] -> [Hv, N, C, ...]
        x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), dtype=np.float32)], axis=0)
        return np.moveaxis(x.reshape(n, chunk, *x.shape[1:]), 2, 0)

    q, k, v, beta, g = blocks(q), blocks(k), blocks(v), blocks(beta), blocks(g)
    G = np.cumsum(g, axis=-1, dtype=np.float32)  # [Hv, N, C]
    causal = np.tril(np.ones((chunk, chunk), dtype=bool))
    with np.errstate(over="ignore"):  # above the diagonal G_i - G_j > 0 may overflow; masked to 0
        decay = np.where(causal, np.exp(G[..., :, None] - G[..., None, :]), np.float32(0.0))  # [Hv, N, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = np.einsum("hncd,hnjd->hncj", k_beta, k) * decay
    lower = np.tril(system, -1)
    u = _forward_substitute(lower, v_beta)  # [Hv, N, C, dv]
    w = _forward_substitute(lower, k_beta * np.exp(G)[..., None])  # [Hv, N, C, dk]
    intra = np.einsum("hncd,hnjd->hncj", q, k) * decay
    q_decayed = q * np.exp(G)[..., None]
    k_to_end = k * np.exp(G[..., -1:] - G)[..., None]
    chunk_decay = np.exp(G[..., -1])  # [Hv, N]
    s = state.astype(np.float32, copy=True)
    out = np.empty((hv, n, chunk, dv), dtype=np.float32)
    for i in range(n):
        v_new = u[:, i] - np.einsum("hcd,hdv->hcv", w[:, i], s)
        out[:, i] = np.einsum("hcd,hdv->hcv", q_decayed[:, i], s) + np.einsum("hcj,hjv->hcv", intra[:, i], v_new)
        s = s * chunk_decay[:, i, None, None] + np.einsum("hcd,hcv->hdv", k_to_end[:, i], v_new)
    out = np.moveaxis(out, 0, 2).reshape(n * chunk, hv, dv)[:rows]
    return out, s


def gated_delta_rule(qkv, a, b, A_log, dt_bias, states: np.ndarray, slots, cu_seqlens, commit: bool,
                     form, span: np.ndarray | None = None) -> np.ndarray:
    """Either form over a batch of sequences (base.Backend.gdn_chunked / gdn_recurrent); `span` as causal_conv1d's."""
    _, hv, dk, dv = states.shape
    out = np.zeros((qkv.shape[0], hv * dv), dtype=np.float32)
    for s, slot in enumerate(np.asarray(slots)):
        lo, hi = span_rows(cu_seqlens, span, s)
        if slot < 0 or hi == lo:
            continue
        q, k, v, beta, g = _split(qkv[lo:hi], a[lo:hi], b[lo:hi], A_log, dt_bias, hv, dk, dv)
        o, final = form(q, k, v, beta, g, states[slot])
        out[lo:hi] = o.reshape(hi - lo, hv * dv)
        if commit:
            states[slot] = final
    return out


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float, head_dim: int) -> np.ndarray:
    """Per head: x * rsqrt(mean(x^2) + eps) * weight * silu(z), as transformers' Qwen3_5RMSNormGated."""
    t = x.shape[0]
    h = x.reshape(t, -1, head_dim)
    variance = np.mean(h * h, axis=-1, keepdims=True, dtype=np.float32)
    normed = weight * (h * (np.float32(1.0) / np.sqrt(variance + np.float32(eps))))
    gate = z.reshape(t, -1, head_dim)
    return (normed * (gate * _sigmoid(gate))).reshape(t, -1)
