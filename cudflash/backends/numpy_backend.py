"""The numpy float32 backend: the readable definition of every op, and the CPU path of the engine.

Each op mirrors the float32 arithmetic of the Hugging Face reference implementation (normalise in float32,
multiply by the weight last; softmax in float32), so that greedy decoding reproduces its token ids exactly.
`linear_add_rms_norm` hands its normed rows back as a DeferredNorm, as the CUDA backend may, and every op but
`linear` and `swiglu` refuses one (base.refuse_deferred): a model that misuses it fails here, on the CPU.
"""
from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext

import numpy as np

from cudflash.backends import gdn_numpy
from cudflash.backends.base import AttentionMeta, DeferredNorm, gdn_mixer_in_steps, refuse_deferred
from cudflash.checkpoint import bf16_bits_to_float32
from cudflash.quant.weight import QuantizedWeight, dequantize


@refuse_deferred
class NumpyBackend:
    name = "cpu"
    act_itemsize = 4
    activation_reserve = None  # host memory: a step's activations are not taken from the KV budget

    def memory_budget(self, utilization: float) -> int:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(min(available * utilization, 2 * 2**30))  # a CPU KV cache beyond 2 GiB is never useful

    # ---- memory
    def asarray(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.int32 if dtype == "i32" else np.float32)

    def load(self, dtype: str, raw: np.ndarray) -> np.ndarray:
        return bf16_bits_to_float32(raw) if dtype == "BF16" else np.array(raw, dtype=np.float32)

    def inexact_rows(self, rows: int) -> AbstractContextManager:
        return nullcontext()  # every product here is the exact one

    def load_quantized(self, w: QuantizedWeight) -> np.ndarray:
        """The exact float32 values of the quantized weight (quant.weight.dequantize): the reference every other
        backend's quantized GEMMs are held to."""
        return dequantize(w)

    def all_finite(self, x: np.ndarray) -> bool:
        # A finite sum of squares (one BLAS pass, cheaper than isfinite, which makes a boolean copy of x) proves every
        # element finite: a NaN or Inf makes it NaN or Inf. Only if it is not finite can huge finite values be the
        # cause: look closer.
        flat = x.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(np.dot(flat, flat)) or np.isfinite(flat).all())

    def any_nonzero(self, x: np.ndarray) -> bool:
        return bool(x.any())

    def random(self, shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
        return (np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(std))

    def event(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=np.int32 if dtype == "i32" else np.float32)

    def cat(self, xs: list[np.ndarray], axis: int = 0) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def prepare_meta(self, meta: AttentionMeta, on_device: tuple | None = None) -> AttentionMeta:
        return meta  # the host arrays are the backend's

    def synchronize(self) -> None:
        pass

    # ---- ops
    def embedding(self, ids: np.ndarray, table: np.ndarray) -> np.ndarray:
        return table[ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return weight * (x * (np.float32(1.0) / np.sqrt(variance + np.float32(eps))))

    def add_rms_norm(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float):
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def linear(self, x: np.ndarray | DeferredNorm, weight: np.ndarray, bias: np.ndarray | None = None,
               out_f32: bool = False) -> np.ndarray:
        if isinstance(x, DeferredNorm):
            x = x.plain
        y = x @ weight.T
        return y + bias if bias is not None else y

    def linear_add_rms_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, residual: np.ndarray,
                            norm_weight: np.ndarray, eps: float,
                            prefetch_all: bool = False) -> tuple[DeferredNorm, np.ndarray]:
        normed, residual = self.add_rms_norm(self.linear(x, weight, bias), residual, norm_weight, eps)
        return DeferredNorm(residual, norm_weight, eps, plain=normed), residual

    def gate_up_weight(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return np.concatenate([gate, up], axis=0)

    def swiglu(self, x: np.ndarray | DeferredNorm, gate_up: np.ndarray) -> np.ndarray:
        gate, up = np.split(self.linear(x, gate_up), 2, axis=-1)
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def head_norm_rope(self, x, head_dim, positions, cos, sin, weight, eps):
        t = x.shape[0]
        h = x.reshape(t, -1, head_dim)
        if weight is not None:
            h = self.rms_norm(h, weight, eps)
        half = head_dim // 2
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        x1, x2 = h[..., :half], h[..., half:]
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        return out.reshape(t, -1)

    def rope_store(self, x, q_heads, positions, cos, sin, q_norm, k_norm, eps, slots, k_cache, v_cache):
        """x [T, (q_heads + 2 Hk) * D] = [q | k | v] (Hk, D from the cache shape): head_norm_rope of q (returned,
        None when q_heads == 0) and of k, then k and v into the caches at `slots` (slot < 0: padding, not stored)."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        q_dim, kv_dim = q_heads * head_dim, kv_heads * head_dim
        assert x.shape[1] == q_dim + 2 * kv_dim, (x.shape, q_heads, k_cache.shape)
        k = self.head_norm_rope(x[:, q_dim:q_dim + kv_dim], head_dim, positions, cos, sin, k_norm, eps)
        slots = np.asarray(slots)
        keep = slots >= 0
        blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
        k_cache[blocks, offsets] = k[keep].reshape(-1, kv_heads, head_dim)
        v_cache[blocks, offsets] = x[keep, q_dim + kv_dim:].reshape(-1, kv_heads, head_dim)
        if q_heads == 0:
            return None
        return self.head_norm_rope(x[:, :q_dim], head_dim, positions, cos, sin, q_norm, eps)

    def attention(self, q, k_cache, v_cache, meta: AttentionMeta, scale: float, causal: bool, window: int = 0,
                  gate=None):
        _, block_size, kv_heads, head_dim = k_cache.shape
        t = q.shape[0]
        q_heads = q.shape[1] // head_dim
        group = q_heads // kv_heads
        out = np.empty((t, q_heads, head_dim), dtype=np.float32)
        for s in range(len(meta.context_lens)):
            lo, hi = int(meta.cu_seqlens_q[s]), int(meta.cu_seqlens_q[s + 1])
            ctx = int(meta.context_lens[s])
            nblk = -(-ctx // block_size)
            table = meta.block_tables[s, :nblk]
            keys = k_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]  # [ctx, Hk, D]
            vals = v_cache[table].reshape(-1, kv_heads, head_dim)[:ctx]
            n = hi - lo
            # Batched matmuls over the kv heads (BLAS; np.einsum would loop without it), a group's query rows as the
            # rows of one product.
            qs = q[lo:hi].reshape(n, kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hk, G, q, D]
            scores = qs.reshape(kv_heads, group * n, head_dim) @ keys.transpose(1, 2, 0)  # [Hk, G q, ctx]
            scores = scores.reshape(kv_heads, group, n, ctx) * np.float32(scale)
            qpos = np.arange(ctx - (hi - lo), ctx)[:, None]
            kpos = np.arange(ctx)[None, :]
            hidden = np.zeros((hi - lo, ctx), dtype=bool)
            if causal:
                hidden |= kpos > qpos
            if window > 0:
                hidden |= kpos <= qpos - window
            if meta.tree_seq is not None and meta.tree_seq[s]:  # a draft tree: its own rows by ancestry alone
                first = ctx - (hi - lo)
                words = meta.tree_mask[lo:hi].view(np.uint32)
                cols = np.arange(hi - lo)
                sees = ((words[:, cols // 32] >> (cols % 32).astype(np.uint32)) & 1).astype(bool)  # [q, q]
                hidden[:, first:] |= ~sees
            scores = np.where(hidden, np.float32(-np.inf), scores)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            mixed = probs.reshape(kv_heads, group * n, ctx) @ vals.transpose(1, 0, 2)  # [Hk, G q, D]
            out[lo:hi] = mixed.reshape(kv_heads, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, q_heads,
                                                                                                 head_dim)
        out = out.reshape(t, q_heads * head_dim)
        return out if gate is None else self.sigmoid_gate(out, gate)

    def copy_slots(self, cache: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """cache [layers, blocks, block_size, ...]: every layer's entries at slots `src` copied to slots `dst` (all
        sources read before any destination is written)."""
        flat = cache.reshape(cache.shape[0], -1, *cache.shape[3:])
        flat[:, np.asarray(dst)] = flat[:, np.asarray(src)]

    def logsumexp(self, x: np.ndarray) -> np.ndarray:
        m = np.max(x, axis=-1, keepdims=True)
        return (np.log(np.sum(np.exp(x - m), axis=-1)) + m[:, 0]).astype(np.float32)

    def argmax(self, x: np.ndarray, nonfinite: int = -1) -> np.ndarray:
        out = np.argmax(x, axis=-1).astype(np.int32)
        bad = ~np.isfinite(x).all(axis=-1)
        if bad.any():
            out[bad] = nonfinite
        return out

    # ---- drafter heads (DFlash2)
    def block_conv(self, x: np.ndarray, coeff: np.ndarray, base: np.ndarray, block: int) -> np.ndarray:
        """Grouped dynamic depthwise convolution along the rows of each block (DFlash2).

        x [T, C] holds whole blocks of `block` rows; base [K, C]; coeff [T, K * G] (row-strided view allowed),
        tap-major, G = groups of C / G consecutive channels:
            out[t, c] = sum over tau < K with tau <= t % block of
                        (base[tau, c] + coeff[t, tau * G + c // (C / G)]) * x[t - tau, c]
        Taps never reach across a block boundary, so row 0 of a block sees only itself.
        """
        t, c = x.shape
        taps = base.shape[0]
        groups = coeff.shape[1] // taps
        assert coeff.shape == (t, taps * groups) and c % groups == 0 and t % block == 0, (x.shape, coeff.shape)
        pos = np.arange(t) % block
        out = np.zeros((t, c), dtype=np.float32)
        for tau in range(taps):
            kernel = base[tau] + np.repeat(coeff[:, tau * groups:(tau + 1) * groups], c // groups, axis=1)
            shifted = np.zeros_like(x)
            shifted[tau:] = x[: t - tau]
            shifted[pos < tau] = 0.0
            out = out + kernel * shifted
        return out

    def topk(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k largest entries of each row, by value descending, equal values by lower index first."""
        t, v = x.shape
        assert 1 <= k <= v, (k, v)
        ids = np.empty((t, k), dtype=np.int32)
        kth = -np.partition(-x, k - 1, axis=1)[:, k - 1]
        for r in range(t):
            row = x[r]
            above = np.flatnonzero(row > kth[r])
            idx = np.concatenate([above, np.flatnonzero(row == kth[r])[: k - len(above)]])
            ids[r] = idx[np.lexsort((idx, -row[idx]))]
        return np.take_along_axis(x, ids, axis=1).astype(np.float32), ids

    def pair_scores(self, unary: np.ndarray, cand: np.ndarray, pred: np.ndarray, hidden: np.ndarray,
                    pred_table: np.ndarray, succ_table: np.ndarray) -> np.ndarray:
        """DFlash2 selector lattice, float32 [R, P, K]:
            out[t, p, c] = unary[t, c] + sum_j pred_table[pred[t, p], j] * hidden[t, j] * succ_table[cand[t, c], j]
        unary f32 [R, K]; cand int32 [R, K]; pred int32 [R, P]; hidden [R, r]; tables [V, r].
        """
        a = pred_table[pred] * hidden[:, None, :]  # [R, P, r]
        return unary[:, None, :] + np.einsum("tpj,tcj->tpc", a, succ_table[cand]).astype(np.float32)

    # ---- hybrid targets (Gated DeltaNet): the definitions are in gdn_numpy.py
    def causal_conv1d(self, x: np.ndarray, weight: np.ndarray, conv_states: np.ndarray, slots: np.ndarray,
                      meta: AttentionMeta, commit: bool, span: np.ndarray | None = None) -> np.ndarray:
        return gdn_numpy.causal_conv1d(x, weight, conv_states, slots, meta.cu_seqlens_q, commit, span)

    def gdn_chunked(self, qkv, a, b, A_log, dt_bias, states, slots, meta: AttentionMeta, commit: bool) -> np.ndarray:
        return gdn_numpy.gated_delta_rule(qkv, a, b, A_log, dt_bias, states, slots, meta.cu_seqlens_q, commit,
                                          gdn_numpy.chunked)

    def gdn_recurrent(self, qkv, a, b, A_log, dt_bias, states, slots, meta: AttentionMeta,
                      commit: bool, span: np.ndarray | None = None) -> np.ndarray:
        return gdn_numpy.gated_delta_rule(qkv, a, b, A_log, dt_bias, states, slots, meta.cu_seqlens_q, commit,
                                          gdn_numpy.recurrent, span)

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float,
                       head_dim: int) -> np.ndarray:
        return gdn_numpy.gated_rms_norm(x, z, weight, eps, head_dim)

    def gdn_recurrent_mixer(self, proj, conv_weight, conv_states, A_log, dt_bias, states, norm_weight, eps: float,
                            slots, meta: AttentionMeta, commit: bool, span: np.ndarray | None = None,
                            normed: bool = True, independent: bool = False) -> np.ndarray | None:
        return gdn_mixer_in_steps(self, proj, conv_weight, conv_states, A_log, dt_bias, states, norm_weight, eps,
                                  slots, meta, commit, span, normed)

    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return x * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)))
