"""The numpy float32 backend: the readable definition of every op, and the CPU path of the engine.

Each op mirrors the float32 arithmetic of the Hugging Face reference implementation (normalise in float32,
multiply by the weight last; softmax in float32), so that greedy decoding reproduces its token ids exactly.
"""
from __future__ import annotations

import os

import numpy as np

from cudflash.backends.base import AttentionMeta
from cudflash.checkpoint import bf16_bits_to_float32


class NumpyBackend:
    name = "cpu"
    act_itemsize = 4

    def memory_budget(self, utilization: float) -> int:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(min(available * utilization, 2 * 2**30))  # a CPU KV cache beyond 2 GiB is never useful

    # ---- memory
    def asarray(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.int32 if dtype == "i32" else np.float32)

    def load(self, dtype: str, raw: np.ndarray) -> np.ndarray:
        return bf16_bits_to_float32(raw) if dtype == "BF16" else np.array(raw, dtype=np.float32)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=np.int32 if dtype == "i32" else np.float32)

    def cat(self, xs: list[np.ndarray], axis: int = 0) -> np.ndarray:
        return np.concatenate(xs, axis=axis)

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def prepare_meta(self, meta: AttentionMeta) -> AttentionMeta:
        return meta

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

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = x @ weight.T
        return y + bias if bias is not None else y

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        gate, up = np.split(gate_up, 2, axis=-1)
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

    def store_kv(self, k, v, k_cache, v_cache, slots) -> None:
        _, block_size, kv_heads, head_dim = k_cache.shape
        blocks, offsets = slots // block_size, slots % block_size
        k_cache[blocks, offsets] = k.reshape(-1, kv_heads, head_dim)
        v_cache[blocks, offsets] = v.reshape(-1, kv_heads, head_dim)

    def attention(self, q, k_cache, v_cache, meta: AttentionMeta, scale: float, causal: bool, window: int = 0):
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
            qs = q[lo:hi].reshape(hi - lo, kv_heads, group, head_dim)
            scores = np.einsum("qhgd,khd->hgqk", qs, keys) * np.float32(scale)  # [Hk, G, q, ctx]
            qpos = np.arange(ctx - (hi - lo), ctx)[:, None]
            kpos = np.arange(ctx)[None, :]
            hidden = np.zeros((hi - lo, ctx), dtype=bool)
            if causal:
                hidden |= kpos > qpos
            if window > 0:
                hidden |= kpos <= qpos - window
            scores = np.where(hidden, np.float32(-np.inf), scores)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            out[lo:hi] = np.einsum("hgqk,khd->qhgd", probs, vals).reshape(hi - lo, q_heads, head_dim)
        return out.reshape(t, q_heads * head_dim)

    def argmax(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(x, axis=-1).astype(np.int32)
