"""Tiny random Qwen3.5 hybrid targets in the released on-disk layouts (tests, goldens, demos).

Both checkpoint classes: `Qwen3_5ForConditionalGeneration` (config fields under `text_config`, a small vision
tower under `model.visual.` with the tensor names and shapes transformers' Qwen3_5VisionModel declares, the language
model under `model.language_model.`, an `mtp.` head) and `Qwen3_5ForCausalLM` (`model.` prefix, an `mtp.` head too:
transformers ignores both `mtp.*` and `model.visual.*` on load). One file, or shards with an index. The same seed
gives the same language-model tensors in both classes, so their outputs must agree. `write_hybrid_drafter` writes a
random drafter (DFlash, DFlash2 or DSpark, cudflash.tiny's writer) whose taps index the hybrid stack.

Value scales follow the family's conventions: decoder RMSNorm weights are zero-centred (the model scales by
1 + weight), the GDN output norm's are one-centred; A_log = log(A) with A in [0.5, 4]; dt_bias around 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cudflash.tiny import TinyShape, draft_config, draft_tensors, write_model


@dataclass(slots=True)
class HybridShape:
    checkpoint_class: str = "conditional"  # conditional (Qwen3_5ForConditionalGeneration) | causal (Qwen3_5ForCausalLM)
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    layer_types: list[str] | None = None  # None: full_attention_interval (written instead of layer_types)
    full_attention_interval: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] = field(default_factory=lambda: [2, 1, 1])  # sums to head_dim * factor / 2
    intermediate_size: int = 128
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False
    shards: int = 1
    dtype: str = "BF16"
    max_position_embeddings: int = 4096
    eos_token_id: int = 0
    std: float = 0.08
    embed_std: float = 1.0  # tied checkpoints want less: a token's own embedding otherwise wins its next logit
    vision: bool = True  # conditional class: write the vision tower's tensors
    mtp: bool = True  # write a multi-token-prediction head (mtp.*)

    def types(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["linear_attention" if (i + 1) % self.full_attention_interval else "full_attention"
                for i in range(self.num_layers)]


# A tiny Qwen3_5VisionConfig; out_hidden_size is the text hidden size (set at write time).
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def language_tensors(s: HybridShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The language model's tensors, named relative to its prefix (`embed_tokens.weight`, `layers.N.…`, `norm.weight`)
    plus `lm_head.weight` (untied only), which is top level in both classes."""
    H, D, I = s.hidden_size, s.head_dim, s.intermediate_size
    hk, hv, dk, dv = s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv
    t: dict[str, np.ndarray] = {"embed_tokens.weight": _normal(rng, (s.vocab_size, H), s.embed_std)}
    for i, kind in enumerate(s.types()):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = _normal(rng, (H,), 0.1)  # zero-centred: scaled by 1 + w
        if kind == "linear_attention":
            a = p + "linear_attn."
            t[a + "in_proj_qkv.weight"] = _normal(rng, (conv_dim, H), s.std * 2)
            t[a + "in_proj_z.weight"] = _normal(rng, (hv * dv, H), s.std * 2)
            t[a + "in_proj_b.weight"] = _normal(rng, (hv, H), s.std * 2)
            t[a + "in_proj_a.weight"] = _normal(rng, (hv, H), s.std * 2)
            t[a + "conv1d.weight"] = _normal(rng, (conv_dim, 1, s.linear_conv_kernel_dim), 0.4)
            t[a + "A_log"] = np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32)
            t[a + "dt_bias"] = _normal(rng, (hv,), 0.5)
            t[a + "norm.weight"] = (1.0 + _normal(rng, (dv,), 0.1)).astype(np.float32)  # one-centred
            t[a + "out_proj.weight"] = _normal(rng, (H, hv * dv), s.std)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = _normal(rng, (2 * s.num_heads * D, H), s.std)  # [query | gate] per head
            t[a + "k_proj.weight"] = _normal(rng, (s.num_kv_heads * D, H), s.std)
            t[a + "v_proj.weight"] = _normal(rng, (s.num_kv_heads * D, H), s.std)
            t[a + "q_norm.weight"] = _normal(rng, (D,), 0.1)
            t[a + "k_norm.weight"] = _normal(rng, (D,), 0.1)
            t[a + "o_proj.weight"] = _normal(rng, (H, s.num_heads * D), s.std)
        t[p + "post_attention_layernorm.weight"] = _normal(rng, (H,), 0.1)
        t[p + "mlp.gate_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.up_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.down_proj.weight"] = _normal(rng, (H, I), s.std)
    t["norm.weight"] = _normal(rng, (H,), 0.1)
    if not s.tie_word_embeddings:
        t["lm_head.weight"] = _normal(rng, (s.vocab_size, H), 0.3)
    return t


def vision_tensors(s: HybridShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Qwen3_5VisionModel's parameters for VISION, under `model.visual.`."""
    v, E = VISION, VISION["hidden_size"]
    merged = E * v["spatial_merge_size"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (E, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
        "patch_embed.proj.bias": (E,), "pos_embed.weight": (v["num_position_embeddings"], E),
    }
    for b in range(v["depth"]):
        p = f"blocks.{b}."
        shapes.update({p + "norm1.weight": (E,), p + "norm1.bias": (E,), p + "norm2.weight": (E,),
                       p + "norm2.bias": (E,), p + "attn.qkv.weight": (3 * E, E), p + "attn.qkv.bias": (3 * E,),
                       p + "attn.proj.weight": (E, E), p + "attn.proj.bias": (E,),
                       p + "mlp.linear_fc1.weight": (v["intermediate_size"], E),
                       p + "mlp.linear_fc1.bias": (v["intermediate_size"],),
                       p + "mlp.linear_fc2.weight": (E, v["intermediate_size"]), p + "mlp.linear_fc2.bias": (E,)})
    shapes.update({"merger.norm.weight": (E,), "merger.norm.bias": (E,), "merger.linear_fc1.weight": (merged, merged),
                   "merger.linear_fc1.bias": (merged,), "merger.linear_fc2.weight": (s.hidden_size, merged),
                   "merger.linear_fc2.bias": (s.hidden_size,)})
    return {"model.visual." + n: _normal(rng, shape, 0.05) for n, shape in shapes.items()}


def mtp_tensors(s: HybridShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A one-layer multi-token-prediction head as the releases ship it (`mtp.*`); no one loads it."""
    H = s.hidden_size
    return {"mtp.fc.weight": _normal(rng, (H, 2 * H), s.std), "mtp.norm.weight": _normal(rng, (H,), 0.1),
            "mtp.pre_fc_norm_embedding.weight": _normal(rng, (H,), 0.1),
            "mtp.pre_fc_norm_hidden.weight": _normal(rng, (H,), 0.1),
            "mtp.layers.0.input_layernorm.weight": _normal(rng, (H,), 0.1)}


def text_config(s: HybridShape) -> dict:
    rotary = int(s.head_dim * s.partial_rotary_factor)
    cfg = {
        "model_type": "qwen3_5_text", "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": s.max_position_embeddings, "attention_bias": False, "attn_output_gate": True,
        "linear_num_key_heads": s.linear_num_key_heads, "linear_num_value_heads": s.linear_num_value_heads,
        "linear_key_head_dim": s.linear_key_head_dim, "linear_value_head_dim": s.linear_value_head_dim,
        "linear_conv_kernel_dim": s.linear_conv_kernel_dim, "partial_rotary_factor": s.partial_rotary_factor,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": s.partial_rotary_factor, "mrope_section": list(s.mrope_section),
                            "mrope_interleaved": True},
        "tie_word_embeddings": s.tie_word_embeddings, "eos_token_id": s.eos_token_id, "bos_token_id": s.eos_token_id,
        "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1 if s.mtp else 0, "torch_dtype": "bfloat16",
    }
    assert sum(s.mrope_section) == rotary // 2, (s.mrope_section, rotary)
    if s.layer_types is not None:
        cfg["layer_types"] = list(s.layer_types)
    else:
        cfg["full_attention_interval"] = s.full_attention_interval
    return cfg


def hybrid_config_json(s: HybridShape) -> dict:
    text = text_config(s)
    if s.checkpoint_class == "causal":
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    v = s.vocab_size  # the multimodal special tokens: the top ids, which the tests' prompts avoid
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": {"model_type": "qwen3_5_vision", **VISION, "out_hidden_size": s.hidden_size},
            "image_token_id": v - 4, "video_token_id": v - 3, "vision_start_token_id": v - 2,
            "vision_end_token_id": v - 1, "tie_word_embeddings": s.tie_word_embeddings}


def hybrid_tensors(s: HybridShape, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, with its released name. The language model is drawn first from `seed`, so
    both classes hold the same language model for one seed."""
    lang = language_tensors(s, np.random.default_rng(seed))
    prefix = "model.language_model." if s.checkpoint_class == "conditional" else "model."
    t = {("lm_head.weight" if n == "lm_head.weight" else prefix + n): x for n, x in lang.items()}
    extra = np.random.default_rng(seed + 1)
    if s.checkpoint_class == "conditional" and s.vision:
        t.update(vision_tensors(s, extra))
    if s.mtp:
        t.update(mtp_tensors(s, extra))
    return t


def write_hybrid_target(directory: str | Path, shape: HybridShape | None = None, seed: int = 0) -> Path:
    s = shape or HybridShape()
    return write_model(directory, hybrid_config_json(s), hybrid_tensors(s, seed), s.dtype, s.shards)


def hybrid_drafter_shape(target: HybridShape, drafter: TinyShape | None = None) -> TinyShape:
    """The drafter fields of `drafter` (its layers, heads, block size, family, `target_layer_ids` into the hybrid
    stack, sliding-window layers) with the target's vocabulary, hidden size, layer count and positions."""
    return replace(drafter or TinyShape(), vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                   num_layers=target.num_layers, max_position_embeddings=target.max_position_embeddings)


def write_hybrid_drafter(directory: str | Path, target: HybridShape, drafter: TinyShape | None = None,
                         seed: int = 0) -> Path:
    """A tiny random drafter (hybrid_drafter_shape) for the hybrid target of shape `target`. It borrows the
    target's embedding and LM head (no DeepSpec copies)."""
    s = hybrid_drafter_shape(target, drafter)
    return write_model(directory, draft_config(s), draft_tensors(s, np.random.default_rng(seed)), s.dtype)
