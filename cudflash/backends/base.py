"""What every backend provides: the op set the models are written against, and the attention metadata.

Layouts shared by all backends (T = rows in this forward, n = sequences, D = head_dim):
- activations are 2-D `[T, width]`; multi-head tensors are `[T, heads * D]`, head-major within a row. Inputs
  may be row-strided views (a column slice of a fused GEMM output); outputs are contiguous.
- one layer's paged KV cache is `[num_blocks, block_size, kv_heads, D]`; the token at position p of a
  sequence lives at slot `block_table[p // block_size] * block_size + p % block_size`.
- RoPE is the rotate-half (GPT-NeoX) form with tables `cos, sin: [max_positions, D // 2]` (float32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(slots=True)
class AttentionMeta:
    """Which keys each query row sees. Row i of sequence s sits at position context_lens[s] - q_len_s + i."""

    cu_seqlens_q: np.ndarray  # int32 [n + 1]: sequence s owns query rows cu[s]..cu[s+1]-1
    context_lens: np.ndarray  # int32 [n]: keys at positions 0..context_len-1 exist in the cache
    block_tables: np.ndarray  # int32 [n, max_blocks], -1 padded
    max_q_len: int
    max_context_len: int
    device: Any = None  # backend-private copies, filled by Backend.prepare_meta


def build_meta(q_lens: list[int], context_lens: list[int], block_tables: list[list[int]]) -> AttentionMeta:
    n = len(q_lens)
    width = max(1, max(len(bt) for bt in block_tables))
    tables = np.full((n, width), -1, dtype=np.int32)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = bt
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    return AttentionMeta(cu, np.asarray(context_lens, dtype=np.int32), tables, max(q_lens), max(context_lens))


class Backend(Protocol):
    name: str
    act_itemsize: int  # bytes per activation / weight / KV element

    def memory_budget(self, utilization: float) -> int: ...  # bytes the KV cache may take

    # ---- memory
    def asarray(self, x: np.ndarray, dtype: str) -> Any: ...  # dtype: "act" | "f32" | "i32"
    def load(self, dtype: str, raw: np.ndarray) -> Any: ...  # checkpoint tensor (BF16 bits, F16, F32) -> "act"
    def random(self, shape: tuple[int, ...], std: float, seed: int) -> Any: ...  # "act", N(0, std^2), made in place
    def all_finite(self, x: Any) -> bool: ...  # no NaN / Inf in a loaded tensor (one reduction)
    def any_nonzero(self, x: Any) -> bool: ...  # some element is not +-0 (one reduction)
    def to_numpy(self, x: Any) -> np.ndarray: ...  # float32 for floating arrays
    def event(self) -> Any: ...  # a timestamp in the backend's stream (a CUDA event on the GPU)
    def elapsed_ms(self, start: Any, end: Any) -> float: ...  # after synchronize()
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def cat(self, xs: list[Any], axis: int = 0) -> Any: ...
    def take_rows(self, x: Any, rows: Any) -> Any: ...  # x[rows], rows int32 on device
    def prepare_meta(self, meta: AttentionMeta) -> AttentionMeta: ...
    def synchronize(self) -> None: ...

    # ---- ops
    def embedding(self, ids: Any, table: Any) -> Any: ...  # [T] i32, [V, H] -> [T, H]
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...
    # (norm(x + residual), x + residual); the residual stream is float32 on every backend
    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]: ...
    def linear(self, x: Any, weight: Any, bias: Any | None = None,
               out_f32: bool = False) -> Any: ...  # x @ weight.T (+ bias); out_f32: float32 output (logits)
    # add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps) in one op: (normed, new residual). The
    # normed rows may come in a form that only `linear` reads (the CUDA backend defers their row scale into the
    # next GEMM), so give them to `linear` and nothing else.
    def linear_add_rms_norm(self, x: Any, weight: Any, bias: Any | None, residual: Any, norm_weight: Any,
                            eps: float) -> tuple[Any, Any]: ...
    # The MLP's first half: silu(x @ gate.T) * (x @ up.T), [T, H] -> [T, I], with x as `linear` takes it. Its weight
    # comes from gate_up_weight(gate [I, H], up [I, H]), in a row order the backend chooses ([2I, H]; the CUDA
    # backend interleaves the two so the GEMM's epilogue applies the SwiGLU).
    def gate_up_weight(self, gate: Any, up: Any) -> Any: ...
    def swiglu(self, x: Any, gate_up: Any) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...
    def head_norm_rope(self, x: Any, head_dim: int, positions: Any, cos: Any, sin: Any,
                       weight: Any | None, eps: float) -> Any: ...
    # x [T, (q_heads + 2 Hk) * D] = [q | k | v] (the qkv GEMM output; Hk, D from the cache shape): q and k get
    # head_norm_rope (with q_norm / k_norm: both or neither when q_heads > 0); k and v are written into the caches
    # at `slots` (slot < 0: a padding row, nothing stored). Returns q [T, q_heads * D], or None if q_heads == 0.
    def rope_store(self, x: Any, q_heads: int, positions: Any, cos: Any, sin: Any, q_norm: Any | None,
                   k_norm: Any | None, eps: float, slots: Any, k_cache: Any, v_cache: Any) -> Any | None: ...
    def attention(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMeta, scale: float,
                  causal: bool, window: int = 0) -> Any: ...
    def argmax(self, x: Any) -> Any: ...  # [T, V] -> int32 [T]

    # ---- drafter heads (DFlash2); numpy_backend.py holds the reference definitions
    def block_conv(self, x: Any, coeff: Any, base: Any, block: int) -> Any: ...  # two-tap grouped dynamic conv
    def topk(self, x: Any, k: int) -> tuple[Any, Any]: ...  # [T, V] -> (f32 [T, k], int32 [T, k]), descending
    def pair_scores(self, unary: Any, cand: Any, pred: Any, hidden: Any, pred_table: Any,
                    succ_table: Any) -> Any: ...  # selector lattice, f32 [R, P, K]
