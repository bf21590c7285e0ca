"""The target transformer (Qwen3, Qwen2, Llama), with taps: the residual stream after chosen layers.

One decoder layer is the usual pre-norm block. The residual add and the RMSNorm after it are one op with the GEMM
in front of them (`linear_add_rms_norm`: o_proj with post_attention_layernorm, down_proj with the next layer's
input_layernorm), so `residual` after layer i's down_proj is the residual stream after layer i (its tap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cudflash.backends.base import Backend
from cudflash.config import TargetConfig
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.models.weights import RandomWeights, WeightLoader


@dataclass(slots=True)
class TargetLayer:
    input_norm: Any  # [H]
    qkv: Any  # [(Hq + 2 Hk) * D, H]
    qkv_bias: Any | None  # [(Hq + 2 Hk) * D]
    q_norm: Any | None  # [D] (Qwen3)
    k_norm: Any | None  # [D]
    o_proj: Any  # [H, Hq * D]
    o_bias: Any | None  # [H]
    post_norm: Any  # [H]
    gate_up: Any  # [2 I, H]
    down: Any  # [H, I]


class TargetModel:
    def __init__(self, cfg: TargetConfig, loader: WeightLoader | RandomWeights, backend: Backend):
        self.cfg, self.b = cfg, backend
        H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_dim, kv_dim = cfg.num_heads * D, cfg.num_kv_heads * D
        self.embed_tokens = loader.get("model.embed_tokens.weight", (cfg.vocab_size, H))  # [V, H]
        self.layers: list[TargetLayer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias = None
            if cfg.attention_bias:
                bias = loader.fused([(attn + "q_proj.bias", (q_dim,)), (attn + "k_proj.bias", (kv_dim,)),
                                     (attn + "v_proj.bias", (kv_dim,))])
            self.layers.append(TargetLayer(
                input_norm=loader.get(p + "input_layernorm.weight", (H,)),
                qkv=loader.fused([(attn + "q_proj.weight", (q_dim, H)), (attn + "k_proj.weight", (kv_dim, H)),
                                  (attn + "v_proj.weight", (kv_dim, H))]),
                qkv_bias=bias,
                q_norm=loader.get(attn + "q_norm.weight", (D,)) if cfg.qk_norm else None,
                k_norm=loader.get(attn + "k_norm.weight", (D,)) if cfg.qk_norm else None,
                o_proj=loader.get(attn + "o_proj.weight", (H, q_dim)),
                o_bias=loader.get(attn + "o_proj.bias", (H,)) if cfg.o_proj_bias else None,
                post_norm=loader.get(p + "post_attention_layernorm.weight", (H,)),
                gate_up=loader.gate_up(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", (I, H)),
                down=loader.get(p + "mlp.down_proj.weight", (H, I)),
            ))
        self.norm = loader.get("model.norm.weight", (H,))  # [H]
        if cfg.tie_word_embeddings and not loader.has("lm_head.weight"):
            self.lm_head = self.embed_tokens  # [V, H], tied
        else:
            self.lm_head = loader.get("lm_head.weight", (cfg.vocab_size, H))  # [V, H]
        # Set by the runner once the KV pool, hence the longest sequence, is known (rope.device_rope_tables).
        self.rope_cos: Any = None  # [max_positions, D / 2] float32
        self.rope_sin: Any = None  # [max_positions, D / 2] float32
        self.scale = D ** -0.5

    def embed(self, ids: Any) -> Any:
        return self.b.embedding(ids, self.embed_tokens)

    def forward(self, batch: ForwardBatch, kv: KVCache, tap_layers: list[int] | None = None) -> tuple[Any, Any | None]:
        """Causal forward over the batch's rows; returns (final-normed hidden [T, H], taps [T, K * H] or None)."""
        b, cfg = self.b, self.cfg
        eps, last = cfg.rms_norm_eps, len(self.layers) - 1
        residual = self.embed(batch.ids)
        hidden = b.rms_norm(residual, self.layers[0].input_norm, eps)
        taps: dict[int, Any] = {}
        for i, layer in enumerate(self.layers):
            qkv = b.linear(hidden, layer.qkv, layer.qkv_bias, out_f32=True)  # RoPE / store round once
            q = b.rope_store(qkv, cfg.num_heads, batch.positions, self.rope_cos, self.rope_sin, layer.q_norm,
                             layer.k_norm, eps, batch.slots, kv.k[i], kv.v[i])
            attn = b.attention(q, kv.k[i], kv.v[i], batch.meta, self.scale, causal=True)
            hidden, residual = b.linear_add_rms_norm(attn, layer.o_proj, layer.o_bias, residual, layer.post_norm, eps)
            act = b.swiglu(hidden, layer.gate_up)
            if i < last:
                hidden, residual = b.linear_add_rms_norm(act, layer.down, None, residual,
                                                         self.layers[i + 1].input_norm, eps)
            else:  # the final norm's rows go to take_rows and the LM head: a plain array
                hidden, residual = b.add_rms_norm(b.linear(act, layer.down, out_f32=True), residual, self.norm, eps)
            if tap_layers and i in tap_layers:
                taps[i] = b.asarray(residual, "act")  # the residual stream after layer i, rounded to bf16
        if tap_layers:
            return hidden, b.cat([taps[i] for i in tap_layers], axis=1)  # in target_layer_ids order
        return hidden, None

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(hidden, self.lm_head, out_f32=True)  # float32 logits: no bf16 ties at argmax
