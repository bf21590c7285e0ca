"""What every backend provides: the op set the models are written against, and the attention metadata.

Layouts shared by all backends (T = rows in this forward, n = sequences, D = head_dim):
- activations are 2-D `[T, width]`; multi-head tensors are `[T, heads * D]`, head-major within a row. Inputs
  may be row-strided views (a column slice of a fused GEMM output); outputs are contiguous.
- one layer's paged KV cache is `[num_blocks, block_size, kv_heads, D]`; the token at position p of a
  sequence lives at slot `block_table[p // block_size] * block_size + p % block_size`.
- RoPE is the rotate-half (GPT-NeoX) form with tables `cos, sin: [max_positions, D // 2]` (float32).
"""
from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cudflash.errors import BackendError


@dataclass(slots=True)
class AttentionMeta:
    """Which keys each query row sees. Row i of sequence s sits at position context_lens[s] - q_len_s + i."""

    cu_seqlens_q: np.ndarray  # int32 [n + 1]: sequence s owns query rows cu[s]..cu[s+1]-1
    context_lens: np.ndarray  # int32 [n]: keys at positions 0..context_len-1 exist in the cache
    block_tables: np.ndarray  # int32 [n, max_blocks], -1 padded
    max_q_len: int
    max_context_len: int
    device: Any = None  # backend-private copies of the arrays, filled by Backend.prepare_meta
    # Draft trees (engine/tree.py): for a sequence with tree_seq[s] = 1, query row r sees the keys of its own rows
    # (the last q_len of its context) only where bit j of tree_mask[r] is set, j counted from its first row.
    tree_seq: np.ndarray | None = None  # int32 [n]
    tree_mask: np.ndarray | None = None  # int32 [T, W]


def build_meta(q_lens: list[int], context_lens: list[int], block_tables: list[list[int]]) -> AttentionMeta:
    n = len(q_lens)
    width = max(1, max(len(bt) for bt in block_tables))
    tables = np.full((n, width), -1, dtype=np.int32)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = bt
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    return AttentionMeta(cu, np.asarray(context_lens, dtype=np.int32), tables, max(q_lens), max(context_lens))


@dataclass(eq=False)
class DeferredNorm:
    """rms_norm(residual) * weight as `linear_add_rms_norm` returns its normed rows: a value that only the ops in
    DEFERRED_READERS take. A backend may keep the norm half applied (the CUDA backend: weight * residual and each
    producer CTA's partial sums of squares, whose rsqrt the next GEMM applies to its output rows) and build the
    plain rows only for a reader that needs them; the numpy backend builds them at once and refuses the value in
    every other op, so a model that hands it elsewhere fails on the CPU."""

    residual: Any  # [T, H] float32: the residual stream the norm is of
    weight: Any  # [H]
    eps: float
    plain: Any | None = None  # [T, H]: the normed rows, once built
    partial: Any | None = None  # the backend's half-applied form, if it keeps one (stream_gemm.PartialNorm)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.residual.shape


DEFERRED_READERS = frozenset({"linear", "swiglu"})  # the ops that accept a DeferredNorm as x


class Backend(Protocol):
    name: str
    act_itemsize: int  # bytes per activation / weight / KV element
    # Bytes memory_budget already leaves free for one step's activations (None: they are not budgeted, host memory).
    activation_reserve: int | None

    def memory_budget(self, utilization: float) -> int: ...  # bytes the KV cache may take

    # ---- memory
    def asarray(self, x: np.ndarray, dtype: str) -> Any: ...  # dtype: "act" | "f32" | "i32"
    def load(self, dtype: str, raw: np.ndarray) -> Any: ...  # checkpoint tensor (BF16 bits, F16, F32) -> "act"
    # A quantized linear weight (cudflash.quant.QuantizedWeight: packed codes + scales) -> the weight `linear`,
    # `swiglu`'s gate_up_weight and `cat` take, in whatever form the backend computes with.
    def load_quantized(self, w: Any) -> Any: ...
    def random(self, shape: tuple[int, ...], std: float, seed: int) -> Any: ...  # "act", N(0, std^2), made in place
    def all_finite(self, x: Any) -> bool: ...  # no NaN / Inf in a loaded tensor (one reduction)
    def any_nonzero(self, x: Any) -> bool: ...  # some element is not +-0 (one reduction)
    def to_numpy(self, x: Any) -> np.ndarray: ...  # float32 for floating arrays
    def event(self) -> Any: ...  # a timestamp in the backend's stream (a CUDA event on the GPU)
    def elapsed_ms(self, start: Any, end: Any) -> float: ...  # after synchronize()
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def cat(self, xs: list[Any], axis: int = 0) -> Any: ...
    def take_rows(self, x: Any, rows: Any) -> Any: ...  # x[rows], rows int32 on device
    # The backend's copies of meta's arrays: `on_device` (cu_seqlens_q, context_lens, block_tables[, tree_seq,
    # tree_mask]) where the caller has them on the backend already (step_inputs.py stages them with the rows), else
    # uploaded from meta.
    def prepare_meta(self, meta: AttentionMeta, on_device: tuple | None = None) -> AttentionMeta: ...
    def synchronize(self) -> None: ...

    # Within it, the first `rows` rows of every product need not round as a decode of their token would: a step's
    # prefill chunks (they come first; no decode's logits are compared with theirs) or a drafter's rows (a draft
    # only changes how much is accepted). A backend may compute those faster if less exactly (CUDA: a quantized
    # weight's many-row product, W8A8 or over the dequantized weight); every other row rounds as a decode does.
    def inexact_rows(self, rows: int) -> AbstractContextManager: ...

    # ---- ops
    def embedding(self, ids: Any, table: Any) -> Any: ...  # [T] i32, [V, H] -> [T, H]
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...
    # (norm(x + residual), x + residual); the residual stream is float32 on every backend
    def add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]: ...
    # x @ weight.T (+ bias); out_f32: float32 output (logits). x may be a DeferredNorm.
    def linear(self, x: Any | DeferredNorm, weight: Any, bias: Any | None = None, out_f32: bool = False) -> Any: ...
    # add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps) in one op: (normed, new residual). The
    # normed rows may be a DeferredNorm (always on the numpy backend; on the CUDA backend where the GEMM streams, which
    # then defers their row scale into the next GEMM): give them to `linear` or `swiglu` and nothing else.
    # prefetch_all: the kernels in front (attention, a GDN mixer) leave HBM idle, so the GEMM may request its weight
    # before it waits for them (a hint: the result is the same).
    def linear_add_rms_norm(self, x: Any, weight: Any, bias: Any | None, residual: Any, norm_weight: Any,
                            eps: float, prefetch_all: bool = False) -> tuple[Any, Any]: ...
    # The MLP's first half: silu(x @ gate.T) * (x @ up.T), [T, H] -> [T, I], with x as `linear` takes it. Its weight
    # comes from gate_up_weight(gate [I, H], up [I, H]), in a row order the backend chooses ([2I, H]; the CUDA
    # backend interleaves the two so the GEMM's epilogue applies the SwiGLU).
    def gate_up_weight(self, gate: Any, up: Any) -> Any: ...
    def swiglu(self, x: Any | DeferredNorm, gate_up: Any) -> Any: ...
    def add(self, a: Any, b: Any) -> Any: ...
    def head_norm_rope(self, x: Any, head_dim: int, positions: Any, cos: Any, sin: Any,
                       weight: Any | None, eps: float) -> Any: ...
    # x [T, (q_heads + 2 Hk) * D] = [q | k | v] (the qkv GEMM output; Hk, D from the cache shape): q and k get
    # head_norm_rope (with q_norm / k_norm: both or neither when q_heads > 0); k and v are written into the caches
    # at `slots` (slot < 0: a padding row, nothing stored). Returns q [T, q_heads * D], or None if q_heads == 0.
    def rope_store(self, x: Any, q_heads: int, positions: Any, cos: Any, sin: Any, q_norm: Any | None,
                   k_norm: Any | None, eps: float, slots: Any, k_cache: Any, v_cache: Any) -> Any | None: ...
    # gate [T, q_heads * D] (None: none): the output is sigmoid_gate(attention, gate), the gated attention of
    # Qwen3.5's full-attention layers, with the rounding of the two ops in turn.
    def attention(self, q: Any, k_cache: Any, v_cache: Any, meta: AttentionMeta, scale: float,
                  causal: bool, window: int = 0, gate: Any | None = None) -> Any: ...
    # [T, V] -> int32 [T], first index on ties; `nonfinite` for a row that holds a NaN or an infinity
    def argmax(self, x: Any, nonfinite: int = -1) -> Any: ...
    # cache [layers, blocks, block_size, ...] (a whole KV cache): every layer's entries at slots src copied to slots
    # dst, int32 [m] each; all sources are read before any destination is written (a draft tree's compaction).
    def copy_slots(self, cache: Any, src: Any, dst: Any) -> None: ...
    def logsumexp(self, x: Any) -> Any: ...  # [T, V] -> float32 [T]

    # ---- drafter heads (DFlash2); numpy_backend.py holds the reference definitions
    def block_conv(self, x: Any, coeff: Any, base: Any, block: int) -> Any: ...  # two-tap grouped dynamic conv
    def topk(self, x: Any, k: int) -> tuple[Any, Any]: ...  # [T, V] -> (f32 [T, k], int32 [T, k]), descending
    def pair_scores(self, unary: Any, cand: Any, pred: Any, hidden: Any, pred_table: Any,
                    succ_table: Any) -> Any: ...  # selector lattice, f32 [R, P, K]

    # ---- hybrid targets (Gated DeltaNet layers); numpy_backend.py holds the reference definitions. Sequence s owns
    # rows meta.cu_seqlens_q[s]..[s+1]-1 and the state slot slots[s] (int32 [n]; < 0: a padding sequence, skipped) of
    # the pools conv_states [S, C, K-1] and states [S, Hv, dk, dv] (float32). commit: write the state after the
    # sequence's last row into its slot; else leave the pools as they were (a verify: rollback keeps the old state).
    # span (int32 [2, n] on the backend, or None: every row): sequence s runs only its span[1, s] rows from row
    # cu[s] + span[0, s] on (within its own rows), the other rows' outputs are 0: the commit of a verify's accepted
    # rows, read in place from the tape with the verify's own metadata (a CUDA graph replays it with new counts).
    # Depthwise causal conv over the rows of each sequence after its conv state, then SiLU: x [T, C], weight [C, K].
    def causal_conv1d(self, x: Any, weight: Any, conv_states: Any, slots: Any, meta: AttentionMeta,
                      commit: bool, span: Any | None = None) -> Any: ...
    # The gated delta rule over qkv [T, 2 Hk dk + Hv dv] (the conv's output: q | k | v), a, b [T, Hv], A_log, dt_bias
    # [Hv] (float32); returns o [T, Hv * dv] float32. Chunked (chunks of 64 rows: prefill) and token by token (decode,
    # verify) compute the same function.
    def gdn_chunked(self, qkv: Any, a: Any, b: Any, A_log: Any, dt_bias: Any, states: Any, slots: Any,
                    meta: AttentionMeta, commit: bool) -> Any: ...
    def gdn_recurrent(self, qkv: Any, a: Any, b: Any, A_log: Any, dt_bias: Any, states: Any, slots: Any,
                      meta: AttentionMeta, commit: bool, span: Any | None = None) -> Any: ...
    # RMSNorm over each head_dim group of x [T, heads * head_dim], times weight [head_dim] (float32), times silu(z).
    def gated_rms_norm(self, x: Any, z: Any, weight: Any, eps: float, head_dim: int) -> Any: ...
    # The token-by-token mixer of a GDN layer on its in_proj rows proj [T, C + Hv dv + 2 Hv] (qkv | z | b | a, C =
    # 2 Hk dk + Hv dv): causal_conv1d of qkv, gdn_recurrent with a and b, then gated_rms_norm with z and norm_weight
    # [dv]; returns that norm (out_proj's input, [T, Hv dv]), or None if not `normed` (a commit). Its definition is
    # gdn_mixer_in_steps; a backend may compute it in one pass. independent: every input was written before the
    # step's first op, and such calls are the step's last ops (the commit's layers, each on its own tape rows and
    # states), so a backend may run them side by side rather than one after the other: what an op after them
    # would read could still be in flight.
    def gdn_recurrent_mixer(self, proj: Any, conv_weight: Any, conv_states: Any, A_log: Any, dt_bias: Any,
                            states: Any, norm_weight: Any, eps: float, slots: Any, meta: AttentionMeta, commit: bool,
                            span: Any | None = None, normed: bool = True, independent: bool = False) -> Any | None: ...
    def sigmoid_gate(self, x: Any, gate: Any) -> Any: ...  # x * sigmoid(gate), both [T, W]


def gdn_mixer_in_steps(b: Backend, proj: Any, conv_weight: Any, conv_states: Any, A_log: Any, dt_bias: Any,
                       states: Any, norm_weight: Any, eps: float, slots: Any, meta: AttentionMeta, commit: bool,
                       span: Any | None = None, normed: bool = True) -> Any | None:
    """Backend.gdn_recurrent_mixer as the three ops it stands for."""
    c, hv, dv = conv_weight.shape[0], states.shape[1], states.shape[3]
    vd = hv * dv
    qkv = b.causal_conv1d(proj[:, :c], conv_weight, conv_states, slots, meta, commit, span)
    o = b.gdn_recurrent(qkv, proj[:, c + vd + hv: c + vd + 2 * hv], proj[:, c + vd: c + vd + hv], A_log, dt_bias,
                        states, slots, meta, commit, span)
    return b.gated_rms_norm(o, proj[:, c: c + vd], norm_weight, eps, dv) if normed else None


def refuse_deferred(cls: type) -> type:
    """Class decorator: every op of `Backend` on `cls` except DEFERRED_READERS raises BackendError when an argument
    (or an element of a list / tuple argument) is a DeferredNorm."""

    def guarded(name: str, fn):
        @functools.wraps(fn)
        def op(self, *args, **kwargs):
            for arg in (*args, *kwargs.values()):
                items = arg if isinstance(arg, (list, tuple)) else (arg,)
                if any(isinstance(item, DeferredNorm) for item in items):
                    raise BackendError(f"{self.name} backend: {name} was given the deferred normed rows of "
                                       f"linear_add_rms_norm, which only {' and '.join(sorted(DEFERRED_READERS))} "
                                       "read")
            return fn(self, *args, **kwargs)
        return op

    for name in backend_ops():
        if name not in DEFERRED_READERS:
            setattr(cls, name, guarded(name, getattr(cls, name)))
    return cls


def backend_ops() -> list[str]:
    """The methods of the Backend protocol, in declaration order."""
    return [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
