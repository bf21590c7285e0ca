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
from cudflash.models.weights import RandomWeights, WeightLoader, lm_head
from cudflash.parallel.comm import Communicator
from cudflash.parallel.config import TensorParallel, rows_of_heads


@dataclass(slots=True)
class TargetLayer:  # shapes at tp=1; a tensor-parallel rank holds its heads' / intermediate's / vocab's share
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
    def __init__(self, cfg: TargetConfig, loader: WeightLoader | RandomWeights, backend: Backend,
                 tp: TensorParallel | None = None, comm: Communicator | None = None):
        """tp, comm: this model is rank tp.rank of tp.size (docs/tensor_parallel.md); None: the whole model."""
        self.cfg, self.b = cfg, backend
        self.tp, self.comm = tp, comm
        # The heads this model computes: all of them, or one rank's share (q, and KV possibly replicated).
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.vocab_start = 0  # the first vocab id of the LM head's rows
        if tp is not None:
            self._load_shard(cfg, loader, tp)
            return
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
        self.lm_head = lm_head(loader, cfg.tie_word_embeddings, "model.embed_tokens.weight", self.embed_tokens,
                               (cfg.vocab_size, H))  # [V, H]
        self._finish(D)

    def _finish(self, head_dim: int) -> None:
        # Set by the runner once the KV pool, hence the longest sequence, is known (rope.device_rope_tables).
        self.rope_cos: Any = None  # [max_positions, D / 2] float32
        self.rope_sin: Any = None  # [max_positions, D / 2] float32
        self.scale = head_dim ** -0.5

    def _load_shard(self, cfg: TargetConfig, loader: WeightLoader, tp: TensorParallel) -> None:
        """Rank tp.rank's share: qkv and gate_up column-parallel (rows of q / k / v and of gate / up, each sliced
        before fusing, so the backend's fused layout is whatever gate_up_weight makes), o_proj and down_proj
        row-parallel (their input columns), the LM head vocab-parallel (rows); the embedding and the norms whole."""
        b, H, D, I = self.b, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        tp.check_heads(cfg.num_heads, cfg.num_kv_heads)
        q_heads, kv_heads, inter = tp.q_heads(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads), tp.split(I)
        self.num_heads, self.num_kv_heads = len(q_heads), len(kv_heads)
        q_rows, kv_rows = rows_of_heads(q_heads, D), rows_of_heads(kv_heads, D)
        q_dim, kv_dim = cfg.num_heads * D, cfg.num_kv_heads * D
        vocab = tp.vocab(cfg.vocab_size)
        self.vocab_start = vocab.start

        def qkv(suffix: str, tail: tuple[int, ...]) -> Any:
            return b.cat([loader.get_slices(attn + f"{x}_proj.{suffix}", (n,) + tail, 0, [rows])
                          for x, n, rows in (("q", q_dim, q_rows), ("k", kv_dim, kv_rows), ("v", kv_dim, kv_rows))],
                         axis=0)

        self.embed_tokens = loader.get("model.embed_tokens.weight", (cfg.vocab_size, H))  # [V, H], replicated
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            mlp = p + "mlp."
            self.layers.append(TargetLayer(
                input_norm=loader.get(p + "input_layernorm.weight", (H,)),
                qkv=qkv("weight", (H,)),  # [(Hq + 2 Hk) * D / ranks..., H]
                qkv_bias=qkv("bias", ()) if cfg.attention_bias else None,
                q_norm=loader.get(attn + "q_norm.weight", (D,)) if cfg.qk_norm else None,
                k_norm=loader.get(attn + "k_norm.weight", (D,)) if cfg.qk_norm else None,
                o_proj=loader.get_slices(attn + "o_proj.weight", (H, q_dim), 1, [q_rows]),  # [H, Hq_r * D]
                o_bias=loader.get(attn + "o_proj.bias", (H,)) if cfg.o_proj_bias else None,  # added once, after
                post_norm=loader.get(p + "post_attention_layernorm.weight", (H,)),
                gate_up=b.gate_up_weight(*(loader.get_slices(mlp + f"{x}_proj.weight", (I, H), 0, [inter])
                                           for x in ("gate", "up"))),  # [2 I / size, H]
                down=loader.get_slices(mlp + "down_proj.weight", (H, I), 1, [inter]),  # [H, I / size]
            ))
        self.norm = loader.get("model.norm.weight", (H,))
        head = "lm_head.weight"
        if cfg.tie_word_embeddings and not loader.has(head):
            head = "model.embed_tokens.weight"
        self.lm_head = loader.get_slices(head, (cfg.vocab_size, H), 0, [vocab])  # [V_r, H]
        self._finish(D)

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
            q = b.rope_store(qkv, self.num_heads, batch.positions, self.rope_cos, self.rope_sin, layer.q_norm,
                             layer.k_norm, eps, batch.slots, kv.k[i], kv.v[i])
            attn = b.attention(q, kv.k[i], kv.v[i], batch.meta, self.scale, causal=True)
            hidden, residual = self._row_parallel(attn, layer.o_proj, layer.o_bias, residual, layer.post_norm, eps,
                                                  prefetch_all=True)
            act = b.swiglu(hidden, layer.gate_up)
            if i < last:
                hidden, residual = self._row_parallel(act, layer.down, None, residual,
                                                      self.layers[i + 1].input_norm, eps)
            else:  # the final norm's rows go to take_rows and the LM head: a plain array
                hidden, residual = b.add_rms_norm(self._all_reduce(b.linear(act, layer.down, out_f32=True)),
                                                  residual, self.norm, eps)
            if tap_layers and i in tap_layers:
                taps[i] = b.asarray(residual, "act")  # the residual stream after layer i, rounded to bf16
        if tap_layers:
            return hidden, b.cat([taps[i] for i in tap_layers], axis=1)  # in target_layer_ids order
        return hidden, None

    def _all_reduce(self, partial: Any) -> Any:
        return partial if self.comm is None else self.comm.all_reduce(partial)

    def _row_parallel(self, x: Any, weight: Any, bias: Any | None, residual: Any, norm_weight: Any,
                      eps: float, prefetch_all: bool = False) -> tuple[Any, Any]:
        """linear_add_rms_norm; on a tensor-parallel rank the GEMM over its input columns is a partial sum, so the
        fused op splits: GEMM, all-reduce, then the bias (once) and the add + norm on the whole sum."""
        b = self.b
        if self.comm is None:
            return b.linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps, prefetch_all)
        y = self.comm.all_reduce(b.linear(x, weight, out_f32=True))
        return b.add_rms_norm(b.add(y, bias) if bias is not None else y, residual, norm_weight, eps)

    def logits(self, hidden: Any) -> Any:
        """float32 [T, V], or on a tensor-parallel rank its vocab shard [T, V_r] from vocab_start
        (parallel/vocab.py reduces them exactly)."""
        return self.b.linear(hidden, self.lm_head, out_f32=True)  # float32 logits: no bf16 ties at argmax
