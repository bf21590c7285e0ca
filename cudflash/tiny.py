"""Tiny random checkpoints in the exact on-disk formats of real releases (for tests, examples and demos).

`write_random_pair` writes a Hugging Face target (Qwen3, Qwen2 or Llama; tied or untied; one file or shards
with an index) and a z-lab DFlash drafter for it, with the real tensor names.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_SAFETENSORS_DTYPE = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    # integer tensors (dtype='native'), e.g. to test that a float weight stored as I32 is refused
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (uint16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write float tensors as BF16, F16 or F32 (float16/float32 arrays keep their own dtype when dtype='native')."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        if dtype == "BF16":
            data, tag = float32_to_bf16_bits(arr), "BF16"
        elif dtype == "F16":
            data, tag = arr.astype(np.float16), "F16"
        elif dtype == "F32":
            data, tag = arr.astype(np.float32), "F32"
        else:
            data, tag = arr, _SAFETENSORS_DTYPE[arr.dtype]
        raw = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)


@dataclass(slots=True)
class TinyShape:
    arch: str = "qwen3"  # qwen3 | qwen2 | llama
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    tie_word_embeddings: bool = False
    shards: int = 1  # > 1: model-0000i-of-0000n.safetensors + index
    dtype: str = "BF16"
    max_position_embeddings: int = 2048
    draft_layers: int = 2
    draft_heads: int | None = None  # default: same as the target
    draft_kv_heads: int | None = None
    draft_head_dim: int | None = None
    block_size: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2])
    mask_token_id: int = 1
    eos_token_id: int = 0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Llama / Qwen3: q/k/v/o biases (Qwen2 always has q/k/v biases)
    std: float = 0.08  # large enough that random models are not near-uniform (fewer near-ties)


_ARCH_NAMES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def target_tensors(s: TinyShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, D, I = s.hidden_size, s.head_dim, s.intermediate_size
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": _normal(rng, (s.vocab_size, H), 1.0)}
    for i in range(s.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t[p + "input_layernorm.weight"] = _norm_weight(rng, H)
        t[a + "q_proj.weight"] = _normal(rng, (s.num_heads * D, H), s.std)
        t[a + "k_proj.weight"] = _normal(rng, (s.num_kv_heads * D, H), s.std)
        t[a + "v_proj.weight"] = _normal(rng, (s.num_kv_heads * D, H), s.std)
        if s.arch == "qwen2" or s.attention_bias:
            t[a + "q_proj.bias"] = _normal(rng, (s.num_heads * D,), s.std)
            t[a + "k_proj.bias"] = _normal(rng, (s.num_kv_heads * D,), s.std)
            t[a + "v_proj.bias"] = _normal(rng, (s.num_kv_heads * D,), s.std)
        if s.arch == "qwen3":
            t[a + "q_norm.weight"] = _norm_weight(rng, D)
            t[a + "k_norm.weight"] = _norm_weight(rng, D)
        t[a + "o_proj.weight"] = _normal(rng, (H, s.num_heads * D), s.std)
        if s.attention_bias and s.arch != "qwen2":
            t[a + "o_proj.bias"] = _normal(rng, (H,), s.std)
        t[p + "post_attention_layernorm.weight"] = _norm_weight(rng, H)
        t[p + "mlp.gate_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.up_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.down_proj.weight"] = _normal(rng, (H, I), s.std)
    t["model.norm.weight"] = _norm_weight(rng, H)
    if not s.tie_word_embeddings:
        t["lm_head.weight"] = _normal(rng, (s.vocab_size, H), 0.3)
    return t


def target_config(s: TinyShape) -> dict:
    cfg = {
        "architectures": [_ARCH_NAMES[s.arch]], "model_type": s.arch, "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim, "intermediate_size": s.intermediate_size,
        "rms_norm_eps": 1e-6, "max_position_embeddings": s.max_position_embeddings,
        "tie_word_embeddings": s.tie_word_embeddings, "eos_token_id": s.eos_token_id, "bos_token_id": s.eos_token_id,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": s.attention_bias or s.arch == "qwen2",
    }
    if s.arch == "qwen3":
        cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}  # the newer spelling
    else:
        cfg["rope_theta"] = 10000.0 if s.arch == "llama" else 1000000.0
        cfg["rope_scaling"] = s.rope_scaling
    if s.arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def draft_tensors(s: TinyShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, I = s.hidden_size, s.intermediate_size
    heads, kv_heads, D = s.draft_heads or s.num_heads, s.draft_kv_heads or s.num_kv_heads, s.draft_head_dim or s.head_dim
    t: dict[str, np.ndarray] = {
        "fc.weight": _normal(rng, (H, len(s.target_layer_ids) * H), s.std),
        "hidden_norm.weight": _norm_weight(rng, H),
        "norm.weight": _norm_weight(rng, H),
    }
    for i in range(s.draft_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        t[p + "input_layernorm.weight"] = _norm_weight(rng, H)
        t[a + "q_proj.weight"] = _normal(rng, (heads * D, H), s.std)
        t[a + "k_proj.weight"] = _normal(rng, (kv_heads * D, H), s.std)
        t[a + "v_proj.weight"] = _normal(rng, (kv_heads * D, H), s.std)
        t[a + "q_norm.weight"] = _norm_weight(rng, D)
        t[a + "k_norm.weight"] = _norm_weight(rng, D)
        t[a + "o_proj.weight"] = _normal(rng, (H, heads * D), s.std)
        t[p + "post_attention_layernorm.weight"] = _norm_weight(rng, H)
        t[p + "mlp.gate_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.up_proj.weight"] = _normal(rng, (I, H), s.std)
        t[p + "mlp.down_proj.weight"] = _normal(rng, (H, I), s.std)
    return t


def draft_config(s: TinyShape) -> dict:
    heads, kv_heads, D = s.draft_heads or s.num_heads, s.draft_kv_heads or s.num_kv_heads, s.draft_head_dim or s.head_dim
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": s.block_size,
        "dflash_config": {"mask_token_id": s.mask_token_id, "target_layer_ids": list(s.target_layer_ids)},
        "hidden_size": s.hidden_size, "num_hidden_layers": s.draft_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": D, "intermediate_size": s.intermediate_size,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "max_position_embeddings": s.max_position_embeddings, "num_target_layers": s.num_layers,
        "vocab_size": s.vocab_size, "layer_types": ["full_attention"] * s.draft_layers, "sliding_window": None,
        "tie_word_embeddings": False, "attention_bias": False,
    }


def write_model(directory: str | Path, config: dict, tensors: dict[str, np.ndarray], dtype: str = "BF16",
                shards: int = 1) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", tensors, dtype)
        return directory
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        write_safetensors(directory / fname, part, dtype)
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def write_random_pair(directory: str | Path, shape: TinyShape | None = None, seed: int = 0) -> tuple[Path, Path]:
    """Write `<directory>/target` and `<directory>/drafter`; returns both paths."""
    s = shape or TinyShape()
    rng = np.random.default_rng(seed)
    root = Path(directory)
    target = write_model(root / "target", target_config(s), target_tensors(s, rng), s.dtype, s.shards)
    draft = write_model(root / "drafter", draft_config(s), draft_tensors(s, rng), s.dtype)
    return target, draft
