"""Tiny random checkpoints in the exact on-disk formats of real releases (for tests, examples and demos).

`write_random_pair` writes a Hugging Face target (Qwen3, Qwen2 or Llama; tied or untied; one file or shards
with an index) and a drafter for it, with the real tensor names and config layout of each published family
(`TinyHeads`): z-lab DFlash; DFlash2 (`DFlash2DraftModel`, or `DFlashDraftModel` with projector_type "dflash2");
DSpark in the DeepSpec-native dialect (`Qwen3DSparkModel`, head fields at the top level, copies of the target's
embedding and LM head) or the nested one (`DSparkDraftModel`, head fields in `dflash_config`); optionally a
smaller drafter vocabulary (own `lm_head` and `d2t` offsets).
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
        if dtype != "native" and arr.dtype.kind in "iub":  # index tensors (d2t, t2d) keep their own dtype
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
class TinyHeads:
    """Which drafter family to write, and its head settings (ignored fields stay out of the files)."""

    kind: str = "dflash"  # dflash | dflash2 | dspark
    dialect: str = ""  # dflash2: "" (DFlash2DraftModel) | "projector"; dspark: "deepspec" (default) | "nested"
    layer_types: list[str] | None = None  # default: all full_attention
    sliding_window: int | None = None
    conv_kernel_size: int = 2  # DFlash2
    conv_group_size: int = 16
    conv_identity: bool = False  # base kernel identity, kernel projection zero (a freshly initialised DFlash2)
    selector_rank: int = 16
    selector_top_k: int = 4
    selector_scale: float = 0.5  # std of the codebooks and projection; 0 = all zero (a neutral selector)
    markov_rank: int = 16  # DSpark
    confidence_head: bool = True
    confidence_with_markov: bool = True
    draft_vocab_size: int | None = None  # < vocab_size: own lm_head [Vd, H] and d2t offsets [Vd]


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
    heads: TinyHeads = field(default_factory=TinyHeads)


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


def draft_tensors(s: TinyShape, rng: np.random.Generator,
                  target: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The drafter's tensors; `target` (the target's tensors) supplies the copies a DeepSpec checkpoint ships."""
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
    t.update(_head_tensors(s, rng, target))  # drawn after the backbone: same seed, same backbone for every kind
    return t


def _head_tensors(s: TinyShape, rng: np.random.Generator, target: dict[str, np.ndarray] | None) -> dict:
    h, H, V = s.heads, s.hidden_size, s.vocab_size
    Vd = h.draft_vocab_size or V
    t: dict[str, np.ndarray] = {}
    if h.kind == "dflash2" and h.conv_kernel_size:
        K, G = h.conv_kernel_size, H // h.conv_group_size
        for i in range(s.draft_layers):
            for conv in ("attention_conv", "mlp_conv"):
                base = np.zeros((2, K, H), dtype=np.float32)
                base[:, 0] = 1.0  # identity: tap 0 passes the row through, later taps add nothing
                proj = np.zeros((2 * K * G, H), dtype=np.float32)
                if not h.conv_identity:
                    base += _normal(rng, base.shape, 0.2)
                    proj = _normal(rng, proj.shape, 0.05)
                t[f"layers.{i}.{conv}.base_kernel"] = base
                t[f"layers.{i}.{conv}.kernel_projection.weight"] = proj
    if h.kind == "dflash2" and h.selector_rank:
        r, std = h.selector_rank, h.selector_scale
        t["candidate_selector.predecessor_codebook"] = _normal(rng, (V, r), std)
        t["candidate_selector.successor_codebook"] = _normal(rng, (V, r), std)
        t["candidate_selector.hidden_projection.weight"] = _normal(rng, (r, H), std)
    if h.kind == "dspark":
        r = h.markov_rank
        if r:
            t["markov_head.markov_w1.weight"] = _normal(rng, (V, r), 0.5)
            t["markov_head.markov_w2.weight"] = _normal(rng, (Vd, r), 0.5)
        if h.confidence_head:
            t["confidence_head.proj.weight"] = _normal(rng, (1, H + (r if h.confidence_with_markov else 0)), 0.3)
            t["confidence_head.proj.bias"] = np.full((1,), 1.0, dtype=np.float32)
        if h.dialect != "nested" and target is not None:  # DeepSpec saves the target's embedding and head with it
            t["embed_tokens.weight"] = target["model.embed_tokens.weight"]
            if h.draft_vocab_size is None:
                t["lm_head.weight"] = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    if h.draft_vocab_size is not None:
        keep = np.sort(rng.choice(V, size=Vd, replace=False))  # the target ids the drafter can propose
        t["lm_head.weight"] = _normal(rng, (Vd, H), 0.3)
        t["d2t"] = (keep - np.arange(Vd)).astype(np.int64)  # offsets: target id = draft id + d2t[draft id]
        t2d = np.zeros(V, dtype=bool)
        t2d[keep] = True
        t["t2d"] = t2d
    return t


def draft_config(s: TinyShape) -> dict:
    heads, kv_heads, D = s.draft_heads or s.num_heads, s.draft_kv_heads or s.num_kv_heads, s.draft_head_dim or s.head_dim
    h = s.heads
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": s.block_size,
        "dflash_config": {"mask_token_id": s.mask_token_id, "target_layer_ids": list(s.target_layer_ids)},
        "hidden_size": s.hidden_size, "num_hidden_layers": s.draft_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": D, "intermediate_size": s.intermediate_size,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "max_position_embeddings": s.max_position_embeddings, "num_target_layers": s.num_layers,
        "vocab_size": s.vocab_size, "layer_types": h.layer_types or ["full_attention"] * s.draft_layers,
        "sliding_window": h.sliding_window, "tie_word_embeddings": False, "attention_bias": False,
    }
    if h.draft_vocab_size is not None:
        cfg["draft_vocab_size"] = h.draft_vocab_size
    if h.kind == "dflash2":  # as z-lab/Qwen3.8-27B-DFlash2: RoPE in rope_parameters, block size nested
        del cfg["block_size"], cfg["rope_theta"], cfg["rope_scaling"]
        cfg.update(rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, is_causal=False,
                   use_sliding_window=any(t == "sliding_attention" for t in cfg["layer_types"]))
        cfg["dflash_config"].update(block_size=s.block_size)
        if h.conv_kernel_size:
            cfg["dflash_config"].update(conv_kernel_size=h.conv_kernel_size, conv_group_size=h.conv_group_size)
        if h.selector_rank:
            cfg["dflash_config"].update(selector_rank=h.selector_rank, selector_top_k=h.selector_top_k)
        if h.dialect == "projector":  # NVIDIA Model-Optimizer export
            cfg["dflash_config"]["projector_type"] = "dflash2"
        else:
            cfg["architectures"] = ["DFlash2DraftModel"]
    if h.kind == "dspark":
        fields = {"markov_rank": h.markov_rank, "markov_head_type": "vanilla",
                  "enable_confidence_head": h.confidence_head, "confidence_head_with_markov": h.confidence_with_markov}
        if h.dialect == "nested":  # SpecForge / speculators
            cfg["architectures"] = ["DSparkDraftModel"]
            cfg["dflash_config"].update(projector_type="dspark", shift_label=True, causal=False, **fields)
        else:  # DeepSpec-native: everything at the top level, no dflash_config
            cfg["architectures"] = ["Qwen3DSparkModel"]
            cfg.update(cfg.pop("dflash_config"), num_anchors=512, **fields)
    return cfg


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
    target_t = target_tensors(s, rng)
    target = write_model(root / "target", target_config(s), target_t, s.dtype, s.shards)
    draft = write_model(root / "drafter", draft_config(s), draft_tensors(s, rng, target_t), s.dtype)
    return target, draft
