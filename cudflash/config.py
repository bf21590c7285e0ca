"""Target and drafter configs, read from Hugging Face `config.json` files in every dialect seen in the wild.

Dialects handled here so that no model code ever looks at raw JSON:
- RoPE base as `rope_theta` (older) or inside `rope_parameters` (newer), scaling as `rope_scaling` or inside
  `rope_parameters` (`rope_type` or `type`: default, llama3, yarn).
- DFlash `block_size` at the top level (DFlash-1) or inside `dflash_config` (DFlash2 releases).
- `target_layer_ids` / `mask_token_id` inside `dflash_config`, with the reference's default layer rule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudflash.errors import ConfigError

TARGET_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
DRAFT_ARCHITECTURES = {"DFlashDraftModel": "dflash"}


@dataclass(slots=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos/sin
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(slots=True)
class TargetConfig:
    path: str
    arch: str  # qwen3 | qwen2 | llama
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2, some Llamas)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DraftConfig:
    path: str
    kind: str  # dflash
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    attention_bias: bool
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int | None
    # Per drafter layer: 0 for full attention, else the sliding window (in tokens) over the context.
    layer_windows: list[int] = field(default_factory=list)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory")
    if not path.is_file():
        raise ConfigError(f"{path}: missing config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _need(cfg: dict, key: str, path: str, kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{path}: missing field '{key}'")
    value = cfg[key]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: field '{key}' should be {kind.__name__}, got {value!r}") from None


def parse_rope(cfg: dict, path: str) -> RopeConfig:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{path}: missing field 'rope_theta' (top level or in 'rope_parameters')")
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "yarn"):
        raise ConfigError(f"{path}: unsupported RoPE type '{kind}' (supported: default, llama3, yarn)")
    rope = RopeConfig(theta=float(theta), kind=kind)
    if kind != "default":
        rope.factor = float(merged.get("factor", 1.0))
        orig = merged.get("original_max_position_embeddings")
        rope.original_max_position_embeddings = int(orig) if orig is not None else None
    if kind == "llama3":
        rope.low_freq_factor = float(merged.get("low_freq_factor", 1.0))
        rope.high_freq_factor = float(merged.get("high_freq_factor", 4.0))
        if rope.original_max_position_embeddings is None:
            raise ConfigError(f"{path}: llama3 RoPE needs 'original_max_position_embeddings'")
    if kind == "yarn":
        rope.beta_fast = float(merged.get("beta_fast") or 32.0)
        rope.beta_slow = float(merged.get("beta_slow") or 1.0)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if merged.get(key) is not None:
                setattr(rope, key, float(merged[key]))
        rope.truncate = bool(merged.get("truncate", True))
        if rope.original_max_position_embeddings is None:
            rope.original_max_position_embeddings = int(cfg.get("max_position_embeddings", 0)) or None
    return rope


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    ids: list[int] = []
    sources = [cfg]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()))
        except json.JSONDecodeError:
            pass
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def load_target_config(model_dir: str | Path) -> TargetConfig:
    model_dir = Path(model_dir)
    cfg = read_config_json(model_dir)
    path = str(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"{path}: unknown target architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(TARGET_ARCHITECTURES)})"
        )
    hidden = _need(cfg, "hidden_size", path)
    heads = _need(cfg, "num_attention_heads", path)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise ConfigError(f"{path}: Qwen2 sliding-window attention (use_sliding_window: true) is not supported")
    tc = TargetConfig(
        path=str(model_dir),
        arch=arch,
        vocab_size=_need(cfg, "vocab_size", path),
        hidden_size=hidden,
        num_layers=_need(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=_need(cfg, "intermediate_size", path),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg, path),
        max_position_embeddings=_need(cfg, "max_position_embeddings", path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_ids(model_dir, cfg),
    )
    _check_heads(tc, path)
    return tc


def _check_heads(c: TargetConfig | DraftConfig, path: str) -> None:
    if c.num_heads % c.num_kv_heads:
        raise ConfigError(
            f"{path}: num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads {c.num_kv_heads}"
        )
    if c.head_dim % 2:
        raise ConfigError(f"{path}: head_dim {c.head_dim} must be even for RoPE")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: evenly spaced from layer 1 to layer N-3 (one layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def load_draft_config(model_dir: str | Path) -> DraftConfig:
    model_dir = Path(model_dir)
    cfg = read_config_json(model_dir)
    path = str(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    kind = next((DRAFT_ARCHITECTURES[a] for a in archs if a in DRAFT_ARCHITECTURES), None)
    if kind is None:
        raise ConfigError(
            f"{path}: unknown drafter architecture {archs!r} (supported: {', '.join(DRAFT_ARCHITECTURES)})"
        )
    dcfg = cfg.get("dflash_config") or {}
    hidden = _need(cfg, "hidden_size", path)
    heads = _need(cfg, "num_attention_heads", path)
    num_layers = _need(cfg, "num_hidden_layers", path)
    block_size = dcfg.get("block_size", cfg.get("block_size"))
    if block_size is None:
        raise ConfigError(f"{path}: missing field 'block_size' (top level or in 'dflash_config')")
    layer_ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if layer_ids is None:
        if "num_target_layers" not in cfg:
            raise ConfigError(f"{path}: missing 'dflash_config.target_layer_ids' (and no 'num_target_layers')")
        layer_ids = default_target_layer_ids(int(cfg["num_target_layers"]), num_layers)
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ConfigError(f"{path}: missing field 'dflash_config.mask_token_id'")
    layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"{path}: 'layer_types' has {len(layer_types)} entries, expected {num_layers}")
    windows = []
    for t in layer_types:
        if t == "full_attention":
            windows.append(0)
        elif t == "sliding_attention":
            windows.append(_need(cfg, "sliding_window", path))
        else:
            raise ConfigError(f"{path}: unknown layer type '{t}' in 'layer_types'")
    dc = DraftConfig(
        path=str(model_dir),
        kind=kind,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=_need(cfg, "intermediate_size", path),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg, path),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        attention_bias=bool(cfg.get("attention_bias", False)),
        block_size=int(block_size),
        target_layer_ids=[int(i) for i in layer_ids],
        mask_token_id=int(mask),
        vocab_size=int(cfg["vocab_size"]) if cfg.get("vocab_size") is not None else None,
        layer_windows=windows,
    )
    _check_heads(dc, path)
    if dc.block_size < 1:
        raise ConfigError(f"{path}: block_size must be >= 1, got {dc.block_size}")
    return dc


def validate_pair(target: TargetConfig, draft: DraftConfig) -> None:
    """A drafter borrows the target's embedding, LM head and hidden states: their shapes must agree."""
    where = f"{draft.path}/config.json vs {target.path}/config.json"
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: drafter hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}")
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: drafter vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}")
    for i in draft.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise ConfigError(
                f"{where}: target_layer_ids entry {i} outside the target's {target.num_layers} layers (0..{target.num_layers - 1})"
            )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(
            f"{where}: mask_token_id {draft.mask_token_id} outside the target vocabulary (vocab_size {target.vocab_size})"
        )
