"""The block-diffusion draft head: z-lab DFlash, and the backbone of DFlash2 and DSpark (heads: draft_heads.py).

Two entry points, both writing into the drafter's own paged KV cache (same block tables as the target):
- `update_context`: target taps of newly committed tokens -> fc -> hidden_norm -> one GEMM with every layer's
  K and V weights stacked -> k_norm + RoPE at their own positions -> stored. Only context K/V ever persist.
- `forward`: the block [anchor, MASK x (B-1)], embedded with the target's table; every layer attends over (its
  context K/V ++ the block's own K/V), non-causally unless the config makes the layer causal (`layer_causal`:
  z-lab's sliding layers, whose block row j then sees block rows 0..j). The block's K/V are written at the block's
  positions (lookahead slots) and are overwritten by context K/V once those positions are committed.
Row j of the output predicts the token at position anchor + j (row 0 echoes the anchor); in a DSpark checkpoint
(`cfg.shifted_rows`) row j predicts anchor + j + 1.

DFlash2 wraps both sublayers of every layer in a dynamic convolution (`DynamicConv`); the selector, Markov and
confidence heads are loaded here and used by the proposer (engine/propose.py). A checkpoint may carry its own
`embed_tokens` / `lm_head` (DeepSpec ships copies of the target's); a smaller drafter vocabulary needs its own
`lm_head` [Vd, H] and `d2t` [Vd] (target id = draft id + d2t[draft id], the EAGLE-3 / speculators convention).
Checkpoint tensors of a head the config does not declare are an error: nothing is silently dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.config import TargetConfig
from cudflash.draft_config import DraftConfig
from cudflash.errors import ConfigError
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.models.draft_checkpoint import DraftCheckpoint
from cudflash.models.draft_heads import CandidateSelector, ConfidenceHead, DynamicConv, MarkovHead
from cudflash.models.target import TargetModel
from cudflash.models.weights import RandomWeights, WeightLoader


@dataclass(slots=True)
class DraftLayer:
    input_norm: Any  # [H]
    q_proj: Any  # [Hq * D, H]
    q_bias: Any | None  # [Hq * D]
    q_norm: Any  # [D]
    k_norm: Any  # [D]
    o_proj: Any  # [H, Hq * D]
    o_bias: Any | None  # [H]
    post_norm: Any  # [H]
    gate_up: Any  # [2 I, H]
    down: Any  # [H, I]
    attn_conv: DynamicConv | None = None  # DFlash2: around the attention sublayer
    mlp_conv: DynamicConv | None = None  # DFlash2: around the MLP sublayer


class DFlashDraftModel:
    def __init__(self, cfg: DraftConfig, loader: WeightLoader | RandomWeights, backend: Backend, num_taps: int):
        self.cfg, self.b = cfg, backend
        # Per layer, whether the block's rows attend causally among themselves (draft_config._layer_windows).
        self.causal = list(cfg.layer_causal) or [False] * cfg.num_layers
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * D, cfg.num_kv_heads * D
        layout = DraftCheckpoint(cfg, loader, backend)
        loader = layout.loader
        self.fc = loader.get("fc.weight", (H, num_taps * H))  # [H, K * H]
        self.hidden_norm = loader.get("hidden_norm.weight", (H,))  # [H]
        self.norm = loader.get("norm.weight", (H,))  # [H]
        self.layers: list[DraftLayer] = []
        kv_rows, kv_bias = [], []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            attn = p + "self_attn."
            kv_rows += [(attn + "k_proj.weight", (kv_dim, H)), (attn + "v_proj.weight", (kv_dim, H))]
            kv_bias += [(attn + "k_proj.bias", (kv_dim,)), (attn + "v_proj.bias", (kv_dim,))]
            conv = (lambda name: DynamicConv(loader, p + name, H, cfg.conv_kernel_size, cfg.conv_group_size)
                    if cfg.conv_kernel_size else None)
            self.layers.append(DraftLayer(
                attn_conv=conv("attention_conv"), mlp_conv=conv("mlp_conv"),
                input_norm=loader.get(p + "input_layernorm.weight", (H,)),
                q_proj=loader.get(attn + "q_proj.weight", (q_dim, H)),
                q_bias=loader.get(attn + "q_proj.bias", (q_dim,)) if cfg.attention_bias else None,
                q_norm=loader.get(attn + "q_norm.weight", (D,)),
                k_norm=loader.get(attn + "k_norm.weight", (D,)),
                o_proj=loader.get(attn + "o_proj.weight", (H, q_dim)),
                o_bias=loader.get(attn + "o_proj.bias", (H,)) if cfg.attention_bias else None,
                post_norm=loader.get(p + "post_attention_layernorm.weight", (H,)),
                gate_up=loader.gate_up(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", (I, H)),
                down=loader.get(p + "mlp.down_proj.weight", (H, I)),
            ))
        # Layer l's K rows then V rows sit at rows [2 l kv_dim, 2 (l + 1) kv_dim): a contiguous row block is also
        # that layer's own K/V weight for the block tokens, so nothing is stored twice.
        self.fused_kv = loader.fused(kv_rows)  # [L * 2 * Hk * D, H]
        self.fused_kv_bias = loader.fused(kv_bias) if cfg.attention_bias else None  # [L * 2 * Hk * D]
        # Set by the runner once the KV pool, hence the longest sequence, is known (rope.device_rope_tables).
        self.rope_cos: Any = None  # [max_positions, D / 2] float32
        self.rope_sin: Any = None  # [max_positions, D / 2] float32
        self.scale = D ** -0.5
        self.kv_dim = kv_dim

        V = layout.vocab  # target vocabulary (None: the drafter has no vocabulary-sized tensor of its own)
        Vd = cfg.draft_vocab_size or V
        self.vocab = V
        self.embed_tokens = layout.optional("embed_tokens.weight", (V, H)) if V else None  # [V, H] or the target's
        self.lm_head = layout.optional("lm_head.weight", (Vd, H)) if Vd else None  # [Vd, H] or the target's
        self.d2t: np.ndarray | None = None  # int64 [Vd]: the target id of each drafter id
        self.d2t_device: Any = None  # int32 [Vd]
        if cfg.draft_vocab_size is not None:
            if self.lm_head is None:
                self.lm_head = loader.get("lm_head.weight", (Vd, H))  # required: names the missing tensor
            self.d2t = layout.d2t(Vd, V)
            self.d2t_device = backend.asarray(self.d2t.astype(np.int32), "i32")
        self.selector = (CandidateSelector(loader, V, H, cfg.selector_rank, cfg.selector_top_k)
                         if cfg.selector_rank else None)
        self.markov = MarkovHead(loader, V, Vd, cfg.markov_rank) if cfg.markov_rank else None
        self.confidence = (ConfidenceHead(loader, H, cfg.markov_rank if cfg.confidence_with_markov else 0)
                           if cfg.confidence_head else None)
        layout.finish()

    def check_target(self, target: TargetConfig) -> None:
        if self.vocab is not None and self.vocab != target.vocab_size:
            raise ConfigError(f"{self.cfg.path}: drafter vocabulary tensors have {self.vocab} rows, target vocab_size "
                              f"is {target.vocab_size}")

    def logits(self, hidden: Any, target: TargetModel) -> Any:
        """Drafter-vocabulary logits [T, Vd] (the target's vocabulary unless the drafter has its own head)."""
        if self.lm_head is not None:
            return self.b.linear(hidden, self.lm_head, out_f32=True)  # float32, as the target's
        return target.logits(hidden)

    def to_target(self, ids: Any) -> Any:
        """Drafter ids -> target ids, on the device (identity without a smaller drafter vocabulary)."""
        return ids if self.d2t is None else self.b.take_rows(self.d2t_device, ids)

    def _layer_kv(self, i: int) -> tuple[Any, Any | None]:
        lo, hi = 2 * i * self.kv_dim, 2 * (i + 1) * self.kv_dim
        bias = self.fused_kv_bias[lo:hi] if self.fused_kv_bias is not None else None
        return self.fused_kv[lo:hi], bias

    def _store(self, i: int, kv_rows: Any, positions: Any, slots: Any, kv: KVCache) -> None:
        """k_norm + RoPE on the K half of `kv_rows` [T, 2 Hk D], then both halves into layer i's cache."""
        self.b.rope_store(kv_rows, 0, positions, self.rope_cos, self.rope_sin, None, self.layers[i].k_norm,
                          self.cfg.rms_norm_eps, slots, kv.k[i], kv.v[i])

    def update_context(self, taps: Any, positions: Any, slots: Any, kv: KVCache) -> None:
        b, cfg = self.b, self.cfg
        ctx = b.rms_norm(b.linear(taps, self.fc, out_f32=True), self.hidden_norm, cfg.rms_norm_eps)
        all_kv = b.linear(ctx, self.fused_kv, self.fused_kv_bias, out_f32=True)  # [T, L * 2 * Hk * D]
        width = 2 * self.kv_dim
        for i in range(cfg.num_layers):
            self._store(i, all_kv[:, i * width:(i + 1) * width], positions, slots, kv)

    def forward(self, batch: ForwardBatch, kv: KVCache, target: TargetModel) -> Any:
        """Final-normed hidden states of the block rows, [T, H]."""
        b, cfg = self.b, self.cfg
        block = batch.meta.max_q_len  # every sequence of a draft batch has one block of this many rows
        hidden = b.embedding(batch.ids, self.embed_tokens) if self.embed_tokens is not None else target.embed(batch.ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual, hidden = hidden, b.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                hidden, residual = b.add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            if layer.attn_conv is not None:
                hidden, attn_coeff = layer.attn_conv.prepare(b, hidden, block)
            q = b.linear(hidden, layer.q_proj, layer.q_bias, out_f32=True)  # RoPE rounds it once
            q = b.head_norm_rope(q, cfg.head_dim, batch.positions, self.rope_cos, self.rope_sin, layer.q_norm,
                                 cfg.rms_norm_eps)
            self._store(i, b.linear(hidden, *self._layer_kv(i), out_f32=True), batch.positions, batch.slots, kv)
            attn = b.attention(q, kv.k[i], kv.v[i], batch.meta, self.scale, causal=self.causal[i],
                               window=cfg.layer_windows[i])
            hidden = b.linear(attn, layer.o_proj, layer.o_bias, out_f32=True)  # feeds the float32 residual
            if layer.attn_conv is not None:
                hidden = layer.attn_conv.finish(b, hidden, attn_coeff, block)
            hidden, residual = b.add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            if layer.mlp_conv is not None:
                hidden, mlp_coeff = layer.mlp_conv.prepare(b, hidden, block)
            hidden = b.linear(b.swiglu(hidden, layer.gate_up), layer.down, out_f32=True)
            if layer.mlp_conv is not None:
                hidden = layer.mlp_conv.finish(b, hidden, mlp_coeff, block)
        hidden, _ = b.add_rms_norm(hidden, residual, self.norm, cfg.rms_norm_eps)
        return hidden
