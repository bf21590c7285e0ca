"""The Qwen3.5 / Qwen3.6 dense hybrid target: Gated DeltaNet layers and gated full-attention layers, with taps.

The decoder layer is TargetModel's pre-norm block (the residual add and the next norm fused into the GEMM in front,
so `residual` after layer i's down_proj is the tap of layer i); only the token mixer differs:
- GDN layer (hybrid_config.LINEAR): one GEMM for in_proj_qkv | in_proj_z | in_proj_b | in_proj_a; causal conv1d with
  the sequence's conv state; the gated delta rule with its recurrent state (chunked for prefill, token by token for
  decode and verify); gated RMSNorm with silu(z); out_proj.
- attention layer: one GEMM for [query | k | v | gate] (q_proj's rows split per head into query and gate, which the
  checkpoint interleaves head by head); q_norm / k_norm; partial rotary through the full-width RoPE op by permuting
  the query and key channels (rope.partial_rotary_order; q . k is unchanged); paged attention; output * sigmoid(gate).
Decoder RMSNorm weights are stored as 1 + weight (the family's convention), so the op set's RMSNorm applies them.

State: `HybridCache` holds the KV of the attention layers and, per GDN layer, the conv and recurrent state pools
indexed by a per-sequence state slot. `StateUse` says per forward which sequences commit: prefill chunks (chunked
form) always do; the token-by-token rows either commit (decode) or leave the pools as they were (verify), and then
the forward returns a `GDNTape` (each GDN layer's raw in_proj rows); `commit` re-runs the accepted prefix of those
rows, which leaves exactly the state after them (backends/gdn_numpy.py explains the choice and its memory
arithmetic). One engine step mixes both kinds (prefill chunks first, then verifies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint
from cudflash.config import TargetConfig
from cudflash.hybrid_config import LINEAR
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.models.weights import RandomWeights, WeightLoader, lm_head
from cudflash.rope import partial_rope_tables, partial_rotary_order

MODES = ("prefill", "decode", "verify")  # chunked + commit | recurrent + commit | recurrent, pools untouched


@dataclass(slots=True)
class GDNLayer:
    input_norm: Any  # [H], 1 + weight
    in_proj: Any  # [C + Hv dv + 2 Hv, H]: qkv (C = 2 Hk dk + Hv dv) | z | b | a
    conv: Any  # [C, K]
    A_log: Any  # [Hv] float32
    dt_bias: Any  # [Hv] float32
    norm: Any  # [dv] float32 (weight itself: the gated norm is not zero-centred)
    out_proj: Any  # [H, Hv dv]
    post_norm: Any  # [H], 1 + weight
    gate_up: Any  # [2 I, H]
    down: Any  # [H, I]


@dataclass(slots=True)
class AttentionLayer:
    input_norm: Any  # [H], 1 + weight
    qkvg: Any  # [(Hq + 2 Hk) D + Hq D, H]: query (channels permuted) | k (permuted) | v | gate
    q_norm: Any  # [D], 1 + weight, permuted
    k_norm: Any  # [D], 1 + weight, permuted
    o_proj: Any  # [H, Hq D]
    post_norm: Any  # [H], 1 + weight
    gate_up: Any  # [2 I, H]
    down: Any  # [H, I]


@dataclass(slots=True)
class HybridCache:
    kv: KVCache  # k, v: [attention layers, num_blocks, block_size, Hk, D]
    conv: Any  # [GDN layers, state slots, C, K - 1] float32: the last K-1 raw in_proj_qkv rows of each sequence
    states: Any  # [GDN layers, state slots, Hv, dk, dv] float32


@dataclass(slots=True)
class GDNTape:
    """What a verify forward keeps for the commit: per GDN layer, its in_proj rows (qkv | z | b | a) [T, W]."""

    rows: list[Any]
    meta: Any  # the verify's AttentionMeta (row ranges per sequence)


@dataclass(slots=True)
class StateUse:
    """How the sequences of one forward use their GDN states. The first sequences (rows 0 .. split - 1: prefill
    chunks lead a batch) run the chunked form and commit; the others run token by token and either commit (decode)
    or leave the pools as they were and are taped for `commit` (verify)."""

    slots: Any  # int32 [n] on the backend: every sequence's state slot (-1: a padding sequence)
    chunked_slots: Any | None  # int32 [n]: the chunked sequences' slots, -1 for the others; None: there are none
    recurrent_slots: Any | None  # int32 [n]: the token-by-token sequences' slots, -1 for the others; None: none
    split: int  # rows of the chunked sequences
    commit_recurrent: bool

    @property
    def taped(self) -> bool:
        return self.recurrent_slots is not None and not self.commit_recurrent


def state_use(b: Backend, slots: np.ndarray, cu_seqlens: np.ndarray, chunked: int, commit_recurrent: bool,
              on_device: Any | None = None) -> StateUse:
    """StateUse of a batch whose first `chunked` of n sequences (host slots int32 [n], row ranges cu [n + 1]) are
    prefill chunks. on_device: the same slots on the backend already (staged with the step's inputs), else they are
    uploaded here. A batch of one kind uploads nothing more, so a CUDA graph may record its forward."""
    slots = np.asarray(slots, dtype=np.int32)
    n = len(slots)
    every = on_device if on_device is not None else b.asarray(slots, "i32")

    def only(lo: int, hi: int) -> Any:
        if lo == hi:
            return None
        if hi - lo == n:
            return every
        masked = np.full(n, -1, dtype=np.int32)
        masked[lo:hi] = slots[lo:hi]
        return b.asarray(masked, "i32")

    return StateUse(every, only(0, chunked), only(chunked, n), int(cu_seqlens[chunked]), commit_recurrent)


def commit_span(cu_seqlens: np.ndarray, done: list[int], accepted: list[int]) -> np.ndarray:
    """int32 [2, n] host: per sequence of a verify of n sequences (row ranges cu [n + 1]), the rows already committed
    (done[s]) and the rows to commit now (accepted[s] - done[s]): HybridTargetModel.commit_span's input. done and
    accepted name the first m <= n sequences; the others (a CUDA graph's padding) commit nothing."""
    m, n = len(accepted), len(cu_seqlens) - 1
    assert len(done) == m <= n, (len(done), m, n)
    assert all(0 <= d <= a <= cu_seqlens[s + 1] - cu_seqlens[s] for s, (d, a) in enumerate(zip(done, accepted))), \
        (done, accepted, cu_seqlens)
    span = np.zeros((2, n), dtype=np.int32)
    span[0, :m] = done
    span[1, :m] = np.asarray(accepted) - np.asarray(done, dtype=np.int64)
    return span


def mode_use(b: Backend, slots: np.ndarray, cu_seqlens: np.ndarray, mode: str) -> StateUse:
    """The StateUse of a whole batch in one of MODES."""
    assert mode in MODES, mode
    return state_use(b, slots, cu_seqlens, len(slots) if mode == "prefill" else 0, mode == "decode")


def _host(loader: WeightLoader | RandomWeights, backend: Backend, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small vector as float32 on the host: from the checkpoint itself where there is one (an F32 tensor keeps
    every bit, whatever the backend's activation dtype), else the value the loader made."""
    x = loader.get(name, shape)  # the checks and the progress count
    if isinstance(loader, WeightLoader):
        return loader.ckpt.float32(loader.prefix + name, shape)
    return backend.to_numpy(x).astype(np.float32)


def skipped_tensors(ckpt: Checkpoint, cfg: TargetConfig) -> list[str]:
    """The checkpoint's tensors no hybrid model reads (vision tower, multi-token prediction): never uploaded."""
    return [n for n in ckpt.names if n.startswith(cfg.hybrid.skipped_prefixes)]


class HybridTargetModel:
    def __init__(self, cfg: TargetConfig, loader: WeightLoader | RandomWeights, backend: Backend):
        assert cfg.hybrid is not None, "HybridTargetModel needs a Qwen3.5 hybrid config"
        self.cfg, self.h, self.b = cfg, cfg.hybrid, backend
        h, b = cfg.hybrid, backend
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        P = h.tensor_prefix
        self.embed_tokens = loader.get(P + "embed_tokens.weight", (cfg.vocab_size, H))  # [V, H]
        order = partial_rotary_order(D, h.rotary_dim)

        def norm(name: str, n: int, perm: np.ndarray | None = None) -> Any:
            w = _host(loader, b, name, (n,)) + np.float32(h.norm_offset)
            return b.load("F32", w if perm is None else w[perm])

        def f32(name: str, shape: tuple[int, ...]) -> Any:
            return b.asarray(_host(loader, b, name, shape), "f32")

        def rows(x: Any, idx: np.ndarray) -> Any:
            return b.take_rows(x, b.asarray(idx, "i32"))

        hq, hk = cfg.num_heads, cfg.num_kv_heads
        q_rows = np.concatenate([hd * 2 * D + order for hd in range(hq)])  # query channels of q_proj, permuted
        g_rows = np.concatenate([hd * 2 * D + D + np.arange(D) for hd in range(hq)])  # the gate channels
        k_rows = np.concatenate([hd * D + order for hd in range(hk)])
        C, vd, hv = h.conv_dim, h.value_dim, h.linear_num_value_heads
        self.layers: list[GDNLayer | AttentionLayer] = []
        for i, kind in enumerate(h.layer_types):
            p = f"{P}layers.{i}."
            mlp = dict(post_norm=norm(p + "post_attention_layernorm.weight", H),
                       gate_up=loader.gate_up(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", (I, H)),
                       down=loader.get(p + "mlp.down_proj.weight", (H, I)))
            if kind == LINEAR:
                a = p + "linear_attn."
                self.layers.append(GDNLayer(
                    input_norm=norm(p + "input_layernorm.weight", H),
                    in_proj=loader.fused([(a + "in_proj_qkv.weight", (C, H)), (a + "in_proj_z.weight", (vd, H)),
                                          (a + "in_proj_b.weight", (hv, H)), (a + "in_proj_a.weight", (hv, H))]),
                    conv=loader.get(a + "conv1d.weight", (C, 1, h.linear_conv_kernel_dim)).reshape(C, -1),
                    A_log=f32(a + "A_log", (hv,)), dt_bias=f32(a + "dt_bias", (hv,)),
                    norm=f32(a + "norm.weight", (h.linear_value_head_dim,)),
                    out_proj=loader.get(a + "out_proj.weight", (H, vd)), **mlp))
            else:
                a = p + "self_attn."
                q = loader.get(a + "q_proj.weight", (2 * hq * D, H))
                k = loader.get(a + "k_proj.weight", (hk * D, H))
                v = loader.get(a + "v_proj.weight", (hk * D, H))
                self.layers.append(AttentionLayer(
                    input_norm=norm(p + "input_layernorm.weight", H),
                    qkvg=b.cat([rows(q, q_rows), rows(k, k_rows), v, rows(q, g_rows)], axis=0),
                    q_norm=norm(a + "q_norm.weight", D, order), k_norm=norm(a + "k_norm.weight", D, order),
                    o_proj=loader.get(a + "o_proj.weight", (H, hq * D)), **mlp))
        self.norm = norm(P + "norm.weight", H)  # [H], 1 + weight
        self.lm_head = lm_head(loader, cfg.tie_word_embeddings, P + "embed_tokens.weight", self.embed_tokens,
                               (cfg.vocab_size, H))  # [V, H]
        self.rope_cos: Any = None  # [max_positions, D / 2] float32 (partial_rope_tables), set by set_rope
        self.rope_sin: Any = None
        self.scale = D ** -0.5
        self.qkv_width = (hq + 2 * hk) * D

    # ---------------------------------------------------------------- state
    def set_rope(self, max_positions: int) -> None:
        cos, sin = partial_rope_tables(self.cfg.rope, self.cfg.head_dim, self.h.rotary_dim, max_positions)
        self.rope_cos, self.rope_sin = self.b.asarray(cos, "f32"), self.b.asarray(sin, "f32")

    def new_cache(self, num_blocks: int, block_size: int, state_slots: int) -> HybridCache:
        """Zeroed pools (a fresh slot must be zero: the reference starts every sequence from zero states)."""
        cfg, h, b = self.cfg, self.h, self.b
        kv_shape = (len(h.full_layers), num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        n = len(h.linear_layers)
        return HybridCache(
            kv=KVCache(b.zeros(kv_shape, "act"), b.zeros(kv_shape, "act")),
            conv=b.zeros((n, state_slots, h.conv_dim, h.linear_conv_kernel_dim - 1), "f32"),
            states=b.zeros((n, state_slots, h.linear_num_value_heads, h.linear_key_head_dim,
                            h.linear_value_head_dim), "f32"))

    def state_bytes_per_slot(self) -> int:
        """Bytes of one state slot over every GDN layer: conv [C, K-1] and recurrent [Hv, dk, dv], float32."""
        h = self.h
        per_layer = h.conv_dim * (h.linear_conv_kernel_dim - 1) + \
            h.linear_num_value_heads * h.linear_key_head_dim * h.linear_value_head_dim
        return len(h.linear_layers) * per_layer * 4

    # ---------------------------------------------------------------- forward
    def embed(self, ids: Any) -> Any:
        return self.b.embedding(ids, self.embed_tokens)

    def forward(self, batch: ForwardBatch, cache: HybridCache, use: StateUse,
                tap_layers: list[int] | None = None) -> tuple[Any, Any | None, GDNTape | None]:
        """Causal forward over the batch's rows, each sequence reading (and, as `use` says, advancing) the state in
        its slot. Returns (final-normed hidden [T, H], taps [T, K H] or None, the tape when some sequence does not
        commit, else None)."""
        b, cfg = self.b, self.cfg
        eps, last = cfg.rms_norm_eps, len(self.layers) - 1
        tape: list[Any] = []
        residual = self.embed(batch.ids)
        hidden = b.rms_norm(residual, self.layers[0].input_norm, eps)
        taps: dict[int, Any] = {}
        n_lin = n_full = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, GDNLayer):
                proj = b.linear(hidden, layer.in_proj, out_f32=True)
                if use.taped:
                    tape.append(proj)
                mixed = self._gdn_mixer(layer, proj, cache, n_lin, use, batch.meta)
                n_lin += 1
                hidden, residual = b.linear_add_rms_norm(mixed, layer.out_proj, None, residual, layer.post_norm, eps,
                                                        prefetch_all=True)
            else:
                qkvg = b.linear(hidden, layer.qkvg, out_f32=True)
                q = b.rope_store(qkvg[:, : self.qkv_width], cfg.num_heads, batch.positions, self.rope_cos,
                                 self.rope_sin, layer.q_norm, layer.k_norm, eps, batch.slots, cache.kv.k[n_full],
                                 cache.kv.v[n_full])
                attn = b.attention(q, cache.kv.k[n_full], cache.kv.v[n_full], batch.meta, self.scale, causal=True,
                                   gate=qkvg[:, self.qkv_width:])
                n_full += 1
                hidden, residual = b.linear_add_rms_norm(attn, layer.o_proj, None, residual, layer.post_norm, eps,
                                                        prefetch_all=True)
            act = b.swiglu(hidden, layer.gate_up)
            if i < last:
                hidden, residual = b.linear_add_rms_norm(act, layer.down, None, residual,
                                                         self.layers[i + 1].input_norm, eps)
            else:
                hidden, residual = b.add_rms_norm(b.linear(act, layer.down, out_f32=True), residual, self.norm, eps)
            if tap_layers and i in tap_layers:
                taps[i] = b.asarray(residual, "act")  # the residual stream after layer i
        out_taps = b.cat([taps[i] for i in tap_layers], axis=1) if tap_layers else None
        return hidden, out_taps, (GDNTape(tape, batch.meta) if use.taped else None)

    def _gdn_mixer(self, layer: GDNLayer, proj: Any, cache: HybridCache, j: int, use: StateUse, meta: Any) -> Any:
        """GDN layer j's token mixer on its in_proj rows: conv, the delta rule, the gated norm (before out_proj).
        The chunked and the token-by-token sequences go through separate calls (disjoint slots, the other
        sequences' slots -1), whose rows are then put together: the op signatures stay per-call."""
        b, h, eps = self.b, self.h, self.cfg.rms_norm_eps
        C, vd = h.conv_dim, h.value_dim
        parts = []
        if use.chunked_slots is not None:
            o = self._chunked_delta_rule(layer, proj, cache, j, use.chunked_slots, meta)
            parts.append(b.gated_rms_norm(o, proj[:, C: C + vd], layer.norm, eps, h.linear_value_head_dim))
        if use.recurrent_slots is not None:
            parts.append(b.gdn_recurrent_mixer(proj, layer.conv, cache.conv[j], layer.A_log, layer.dt_bias,
                                               cache.states[j], layer.norm, eps, use.recurrent_slots, meta,
                                               use.commit_recurrent))
        if len(parts) == 1:
            return parts[0]
        return b.cat([parts[0][:use.split], parts[1][use.split:]], axis=0)

    def _chunked_delta_rule(self, layer: GDNLayer, proj: Any, cache: HybridCache, j: int, slots: Any,
                            meta: Any) -> Any:
        """conv + the chunked gated delta rule of GDN layer j for the sequences with a slot in `slots` (prefill
        chunks: they commit): o [T, Hv dv]."""
        h = self.h
        C, vd, hv = h.conv_dim, h.value_dim, h.linear_num_value_heads
        qkv = self.b.causal_conv1d(proj[:, :C], layer.conv, cache.conv[j], slots, meta, True)
        return self.b.gdn_chunked(qkv, proj[:, C + vd + hv:], proj[:, C + vd: C + vd + hv], layer.A_log,
                                  layer.dt_bias, cache.states[j], slots, meta, True)

    def commit(self, tape: GDNTape, cache: HybridCache, state_slots: Any, accepted: list[int],
               done: list[int] | None = None) -> None:
        """After a verify: advance each sequence's conv and recurrent states by its verify rows done[s] ..
        accepted[s] - 1 (the pending token and the accepted drafts, less the first done[s] already committed),
        re-running them from the states the verify left untouched. state_slots: the verify's, int32 [n]."""
        done = done or [0] * len(accepted)
        span = commit_span(tape.meta.cu_seqlens_q, done, accepted)
        if span[1].any():
            self.commit_span(tape, cache, state_slots, self.b.asarray(span, "i32"))

    def commit_span(self, tape: GDNTape, cache: HybridCache, state_slots: Any, span: Any) -> None:
        """`commit` with the rows given on the backend: span int32 [2, n] (rows already committed | rows to commit,
        per sequence of the verify; base.Backend.causal_conv1d). The tape's rows are read in place under the
        verify's own metadata, so nothing here depends on host values of this step: a CUDA graph records it once
        and replays it with new counts. A count of 0 leaves that sequence's state as it is."""
        gdn_layers = [layer for layer in self.layers if isinstance(layer, GDNLayer)]
        for j, (layer, proj) in enumerate(zip(gdn_layers, tape.rows)):
            self.b.gdn_recurrent_mixer(proj, layer.conv, cache.conv[j], layer.A_log, layer.dt_bias, cache.states[j],
                                       layer.norm, self.cfg.rms_norm_eps, state_slots, tape.meta, True, span,
                                       normed=False, independent=True)

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(hidden, self.lm_head, out_f32=True)  # float32 logits: no bf16 ties at argmax
