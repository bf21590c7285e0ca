"""Target configs, read from Hugging Face `config.json` files in every dialect seen in the wild, and the field
readers the drafter configs (draft_config.py) share.

Dialects handled here so that no model code ever looks at raw JSON: RoPE base as `rope_theta` (older) or inside
`rope_parameters` (newer), scaling as `rope_scaling` or inside `rope_parameters` (`rope_type` or `type`:
default, llama3, yarn).
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
DRAFT_ARCHITECTURES = {
    "DFlashDraftModel": "dflash",  # z-lab; DFlash2 / DSpark when dflash_config.projector_type or its fields say so
    "DFlash2DraftModel": "dflash2",
    "DSparkDraftModel": "dspark",  # SpecForge / speculators: DSpark fields inside dflash_config
    "Qwen3DSparkModel": "dspark",  # DeepSpec-native: DSpark fields at the top level
}
PROJECTOR_TYPES = {"dflash": "dflash", "dflash2": "dflash2", "dspark": "dspark"}
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
    o_proj_bias: bool  # an o_proj bias too (Llama / Qwen3 with attention_bias; never Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)


_REQUIRED = object()


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory")
    if not path.is_file():
        raise ConfigError(f"{path}: missing config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _missing(path: str, label: str, default: Any) -> Any:
    if default is _REQUIRED:
        raise ConfigError(f"{path}: missing field '{label}'")
    return default


def _int(cfg: dict, key: str, path: str, default: Any = _REQUIRED, minimum: int | None = 1, label: str = "") -> Any:
    """An integer field (integral floats such as 4096.0 accepted; bools and strings are not)."""
    label = label or key
    value = cfg.get(key)
    if value is None:
        return _missing(path, label, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: field '{label}' should be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path}: field '{label}' must be >= {minimum}, got {value}")
    return value


def _float(cfg: dict, key: str, path: str, default: Any = _REQUIRED, positive: bool = True, label: str = "") -> Any:
    label = label or key
    value = cfg.get(key)
    if value is None:
        return _missing(path, label, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{path}: field '{label}' should be a number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{path}: field '{label}' must be > 0, got {value}")
    return float(value)


def _need(cfg: dict, key: str, path: str, kind: type = int) -> Any:
    """A required field (kept for callers outside this module): positive int, or positive float."""
    return _int(cfg, key, path) if kind is int else _float(cfg, key, path)


def parse_rope(cfg: dict, path: str) -> RopeConfig:
    """RoPE settings from `rope_theta` + `rope_scaling` (older) or `rope_parameters` (newer); the latter wins."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f"{path}: field '{key}' should be an object or null, got {cfg[key]!r}")
    params = cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"{path}: per-layer-type 'rope_parameters' ({', '.join(params)}) are not supported"
        )
    merged = {**(cfg.get("rope_scaling") or {}), **params}
    where = "rope_parameters" if params else "rope_scaling"
    if "rope_theta" in merged:
        theta = _float(merged, "rope_theta", path, label=f"{where}.rope_theta")
    elif cfg.get("rope_theta") is not None:
        theta = _float(cfg, "rope_theta", path)
    else:
        raise ConfigError(f"{path}: missing field 'rope_theta' (top level or in 'rope_parameters')")
    if theta <= 1.0:
        raise ConfigError(f"{path}: rope_theta must be > 1, got {theta}")
    prf = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and prf != 1:
        raise ConfigError(f"{path}: partial_rotary_factor {prf} is not supported (only 1.0)")
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "llama3", "yarn"):
        raise ConfigError(f"{path}: unsupported RoPE type {kind!r} in '{where}' (supported: default, llama3, yarn)")
    rope = RopeConfig(theta=theta, kind=kind)
    if kind == "default":
        return rope
    rope.factor = _float(merged, "factor", path, label=f"{where}.factor")
    rope.original_max_position_embeddings = _int(
        merged, "original_max_position_embeddings", path, default=None, label=f"{where}.original_max_position_embeddings"
    )
    if kind == "llama3":
        rope.low_freq_factor = _float(merged, "low_freq_factor", path, 1.0, label=f"{where}.low_freq_factor")
        rope.high_freq_factor = _float(merged, "high_freq_factor", path, 4.0, label=f"{where}.high_freq_factor")
        if rope.high_freq_factor <= rope.low_freq_factor:
            raise ConfigError(
                f"{path}: llama3 RoPE needs high_freq_factor > low_freq_factor, got "
                f"{rope.high_freq_factor} and {rope.low_freq_factor}"
            )
        if rope.original_max_position_embeddings is None:
            raise ConfigError(f"{path}: llama3 RoPE needs '{where}.original_max_position_embeddings'")
    if kind == "yarn":
        # `or`: null and 0 mean "the default", as in the reference implementation.
        rope.beta_fast = float(_float(merged, "beta_fast", path, None, label=f"{where}.beta_fast") or 32.0)
        rope.beta_slow = float(_float(merged, "beta_slow", path, None, label=f"{where}.beta_slow") or 1.0)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            setattr(rope, key, _float(merged, key, path, None, positive=False, label=f"{where}.{key}"))
        rope.truncate = bool(merged.get("truncate", True))
        if rope.original_max_position_embeddings is None:
            rope.original_max_position_embeddings = _int(cfg, "max_position_embeddings", path, default=None)
        if rope.original_max_position_embeddings is None:
            raise ConfigError(
                f"{path}: yarn RoPE needs '{where}.original_max_position_embeddings' or 'max_position_embeddings'"
            )
    return rope


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    ids: list[int] = []
    sources = [cfg]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            gen_cfg = json.loads(gen.read_text(encoding="utf-8"))
            if isinstance(gen_cfg, dict):
                sources.append(gen_cfg)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # generation_config.json is optional: a broken one only loses its extra stop ids
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids


def _check_mlp(cfg: dict, path: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (only silu / SwiGLU)")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{path}: mlp_bias: true is not supported")


def _head_dim(cfg: dict, path: str, hidden: int, heads: int) -> int:
    if cfg.get("head_dim") is not None:
        return _int(cfg, "head_dim", path)
    if hidden % heads:
        raise ConfigError(
            f"{path}: no 'head_dim' and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    return hidden // heads


def load_target_config(model_dir: str | Path) -> TargetConfig:
    model_dir = Path(model_dir)
    cfg = read_config_json(model_dir)
    path = str(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = next((TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        found = archs or cfg.get("model_type") or "none given"
        hint = " (that is a drafter; pass it as the drafter)" if any(a in DRAFT_ARCHITECTURES for a in archs) else ""
        raise ConfigError(
            f"{path}: unknown target architecture {found!r}{hint} (supported: {', '.join(TARGET_ARCHITECTURES)})"
        )
    hidden = _int(cfg, "hidden_size", path)
    heads = _int(cfg, "num_attention_heads", path)
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ConfigError(f"{path}: sliding-window attention (use_sliding_window: true) is not supported")
    _check_mlp(cfg, path)
    tc = TargetConfig(
        path=str(model_dir),
        arch=arch,
        vocab_size=_int(cfg, "vocab_size", path),
        hidden_size=hidden,
        num_layers=_int(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", path, default=heads),
        head_dim=_head_dim(cfg, path, hidden, heads),
        intermediate_size=_int(cfg, "intermediate_size", path),
        rms_norm_eps=_float(cfg, "rms_norm_eps", path, 1e-6),
        rope=parse_rope(cfg, path),
        max_position_embeddings=_int(cfg, "max_position_embeddings", path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (its HF config has no switch); Qwen3 and Llama follow attention_bias.
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        o_proj_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_ids(model_dir, cfg),
    )
    _check_heads(tc, path)
    return tc


def _check_heads(c: Any, path: str) -> None:  # a TargetConfig or a DraftConfig
    if c.num_heads % c.num_kv_heads:
        raise ConfigError(
            f"{path}: num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads {c.num_kv_heads}"
        )
    if c.head_dim % 2:
        raise ConfigError(f"{path}: head_dim {c.head_dim} must be even for RoPE")

