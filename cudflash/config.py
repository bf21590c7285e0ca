"""Target configs, read from Hugging Face `config.json` files in every dialect seen in the wild, and the field
readers the drafter configs (draft_config.py) share.

Dialects handled here so that no model code ever looks at raw JSON: RoPE base as `rope_theta` (older) or inside
`rope_parameters` (newer), scaling as `rope_scaling` or inside `rope_parameters` (`rope_type` or `type`:
default, llama3, yarn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudflash.errors import ConfigError
from cudflash.model_files import JSONError, UnsafeFileError, parse_json, read_bounded, resolve_inside, shown

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
    # Qwen3.5 hybrids (arch "qwen3_5"): the GDN layers and conventions (hybrid_config.HybridConfig); the fields
    # above then describe the full-attention layers. None for every other target.
    hybrid: Any = None


# Bounds on what a config may claim: a few times the largest released model, far below what would make an
# allocation sized from the config fail (every such allocation is also bounded by what the run will use).
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 17
MAX_LAYERS = 1024
MAX_HEADS = 4096
MAX_HEAD_DIM = 1024
MAX_INTERMEDIATE = 1 << 20
MAX_POSITIONS = 1 << 28
MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32
MAX_CONFIG_BYTES = 16 << 20  # configs are a few KB; a multimodal one with an embedded processor config, a few MB
_MAX_INT = (1 << 31) - 1  # any other integer field

_REQUIRED = object()


def read_json_file(path: Path, folder: Path) -> Any:
    """A JSON file of a model folder, refused (ConfigError naming it) when it leaves the folder, is too large or
    too deep, or is not valid JSON."""
    try:
        return parse_json(read_bounded(resolve_inside(folder, path.name), MAX_CONFIG_BYTES))
    except UnsafeFileError as e:
        raise ConfigError(f"{path}: is {e}, refusing to read outside {folder}") from None
    except JSONError as e:
        raise ConfigError(f"{path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the file ({e.strerror})") from None


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory")
    if not path.is_file() and not path.is_symlink():
        raise ConfigError(f"{path}: missing config.json")
    cfg = read_json_file(path, Path(model_dir))
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _missing(path: str, label: str, default: Any) -> Any:
    if default is _REQUIRED:
        raise ConfigError(f"{path}: missing field '{label}'")
    return default


def _int(cfg: dict, key: str, path: str, default: Any = _REQUIRED, minimum: int | None = 1, label: str = "",
         maximum: int = _MAX_INT) -> Any:
    """An integer field in [minimum, maximum] (integral floats such as 4096.0 accepted; bools and strings are
    not)."""
    label = label or key
    value = cfg.get(key)
    if value is None:
        return _missing(path, label, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: field '{label}' should be an integer, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{path}: field '{label}' must be >= {minimum}, got {value}")
    if value > maximum:
        raise ConfigError(f"{path}: field '{label}' must be <= {maximum}, got {shown(value)}")
    return value


def _float(cfg: dict, key: str, path: str, default: Any = _REQUIRED, positive: bool = True, label: str = "",
           maximum: float = math.inf) -> Any:
    """A finite number field (> 0 when `positive`), at most `maximum`."""
    label = label or key
    value = cfg.get(key)
    if value is None:
        return _missing(path, label, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: field '{label}' should be a number, got {shown(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"{path}: field '{label}' must be a finite number, got {value}")
    if positive and not value > 0:
        raise ConfigError(f"{path}: field '{label}' must be > 0, got {value}")
    if value > maximum:
        raise ConfigError(f"{path}: field '{label}' must be <= {maximum}, got {value}")
    return float(value)


def _typed(cfg: dict, key: str, path: str, default: Any, kind: type, label: str) -> Any:
    """A field of one JSON type, bool or str (null: the default); 0 and 1 are not booleans."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        expected = "true or false" if kind is bool else "a string"
        raise ConfigError(f"{path}: field '{label or key}' should be {expected}, got {shown(value)}")
    return value


def _bool(cfg: dict, key: str, path: str, default: bool, label: str = "") -> bool:
    return _typed(cfg, key, path, default, bool, label)


def _str(cfg: dict, key: str, path: str, default: Any, label: str = "") -> Any:
    return _typed(cfg, key, path, default, str, label)


def _architectures(cfg: dict, path: str) -> list[str]:
    """`architectures`: a list of strings (a lone string is accepted as one)."""
    archs = cfg.get("architectures")
    if archs is None:
        return []
    if isinstance(archs, str):
        return [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{path}: field 'architectures' should be a list of strings, got {shown(archs)}")
    return archs


def parse_rope(cfg: dict, path: str) -> RopeConfig:
    """RoPE settings from `rope_theta` + `rope_scaling` (older) or `rope_parameters` (newer); the latter wins."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ConfigError(f"{path}: field '{key}' should be an object or null, got {shown(cfg[key])}")
    params = cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"{path}: per-layer-type 'rope_parameters' ({shown(', '.join(params))}) are not supported"
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
    if prf is not None and (isinstance(prf, bool) or prf != 1):
        raise ConfigError(f"{path}: partial_rotary_factor {shown(prf)} is not supported (only 1.0)")
    kind = merged.get("rope_type", merged.get("type")) or "default"
    if not isinstance(kind, str) or kind not in ("default", "llama3", "yarn"):
        raise ConfigError(f"{path}: unsupported RoPE type {shown(kind)} in '{where}' (supported: default, llama3, "
                          f"yarn)")
    rope = RopeConfig(theta=theta, kind=kind)
    if kind == "default":
        return rope
    rope.factor = _float(merged, "factor", path, label=f"{where}.factor")
    rope.original_max_position_embeddings = _int(
        merged, "original_max_position_embeddings", path, default=None,
        label=f"{where}.original_max_position_embeddings", maximum=MAX_POSITIONS,
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
        rope.truncate = _bool(merged, "truncate", path, True, label=f"{where}.truncate")
        if rope.original_max_position_embeddings is None:
            rope.original_max_position_embeddings = _int(cfg, "max_position_embeddings", path, default=None,
                                                         maximum=MAX_POSITIONS)
        if rope.original_max_position_embeddings is None:
            raise ConfigError(
                f"{path}: yarn RoPE needs '{where}.original_max_position_embeddings' or 'max_position_embeddings'"
            )
    return rope


def _token_ids(src: dict, key: str, where: str) -> list[int]:
    """A token id or a list of them (null: none)."""
    value = src.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in ids):
        raise ConfigError(f"{where}: field '{key}' should be a token id (an integer >= 0) or a list of them, got "
                          f"{shown(value)}")
    return ids


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    ids = _token_ids(cfg, "eos_token_id", str(model_dir / "config.json"))
    gen = model_dir / "generation_config.json"
    if gen.is_file() or gen.is_symlink():
        try:
            gen_cfg = read_json_file(gen, model_dir)
        except ConfigError:
            gen_cfg = None  # generation_config.json is optional: an unreadable one only loses its extra stop ids
        if isinstance(gen_cfg, dict):
            ids += [i for i in _token_ids(gen_cfg, "eos_token_id", str(gen)) if i not in ids]
    return list(dict.fromkeys(ids))


def _check_mlp(cfg: dict, path: str) -> None:
    act = _str(cfg, "hidden_act", path, "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{path}: hidden_act {shown(act)} is not supported (only silu / SwiGLU)")
    if _bool(cfg, "mlp_bias", path, False):
        raise ConfigError(f"{path}: mlp_bias: true is not supported")


def transformer_dims(cfg: dict, path: str, default_head_dim: int | None = None) -> dict[str, Any]:
    """The decoder shape targets and drafters both declare, as TargetConfig / DraftConfig fields: each within
    its bound, and the heads consistent (KV heads divide the query heads; head_dim even for RoPE; without an
    explicit head_dim, `default_head_dim` (the architecture's own default) or else hidden_size / heads, which must
    then divide)."""
    hidden = _int(cfg, "hidden_size", path, maximum=MAX_HIDDEN)
    heads = _int(cfg, "num_attention_heads", path, maximum=MAX_HEADS)
    kv_heads = _int(cfg, "num_key_value_heads", path, default=heads, maximum=MAX_HEADS)
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", path, maximum=MAX_HEAD_DIM)
    elif default_head_dim is not None:
        head_dim = default_head_dim
    elif hidden % heads:
        raise ConfigError(
            f"{path}: no 'head_dim' and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"{path}: head_dim {head_dim} must be even for RoPE")
    return dict(hidden_size=hidden, num_layers=_int(cfg, "num_hidden_layers", path, maximum=MAX_LAYERS),
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                intermediate_size=_int(cfg, "intermediate_size", path, maximum=MAX_INTERMEDIATE),
                rms_norm_eps=_float(cfg, "rms_norm_eps", path, 1e-6, maximum=1.0), rope=parse_rope(cfg, path))


# head_dim where config.json has none, as transformers' config classes default it: Qwen3Config declares head_dim = 128
# (not hidden_size / heads: Qwen3-0.6B has 1024 / 16 and head_dim 128); Llama and Qwen2 take hidden_size / heads.
DEFAULT_HEAD_DIM = {"qwen3": 128}
QWEN_LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_no_sliding_layers(cfg: dict, path: str, num_layers: int) -> None:
    """Refuse a Qwen2 / Qwen3 config whose attention slides a window on some layer, which transformers' Qwen2Config /
    Qwen3Config decide so: none without use_sliding_window or with sliding_window null; else the layers `layer_types`
    names sliding_attention or, without layer_types, those from max_window_layers on (defaults: window 4096, 28)."""
    if not _bool(cfg, "use_sliding_window", path, False):
        return
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        return
    window = _int(cfg, "sliding_window", path, default=4096)
    types = cfg.get("layer_types")
    if types is None:
        first = _int(cfg, "max_window_layers", path, default=28, minimum=0)
        sliding = list(range(first, num_layers))
    else:
        if not (isinstance(types, list) and len(types) == num_layers and all(t in QWEN_LAYER_TYPES for t in types)):
            raise ConfigError(f"{path}: field 'layer_types' should list {num_layers} (num_hidden_layers) of "
                              f"{' / '.join(QWEN_LAYER_TYPES)}, got {shown(types)}")
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        where = "layer_types" if types is not None else "max_window_layers"
        raise ConfigError(f"{path}: sliding-window attention (use_sliding_window: true, sliding_window {window}) on "
                          f"layers {shown(sliding, 60)} (from '{where}') is not supported")


def load_target_config(model_dir: str | Path) -> TargetConfig:
    model_dir = Path(model_dir)
    cfg = read_config_json(model_dir)
    path = str(model_dir / "config.json")
    archs = _architectures(cfg, path)
    from cudflash import hybrid_config  # here: it reads fields with this module's readers

    family = hybrid_config.hybrid_family(cfg, archs, path)
    if family is not None:
        return _load_hybrid_config(model_dir, cfg, path, family)
    arch = next((TARGET_ARCHITECTURES[a] for a in archs if a in TARGET_ARCHITECTURES), None)
    if arch is None:
        found = archs or cfg.get("model_type") or "none given"
        hint = " (that is a drafter; pass it as the drafter)" if any(a in DRAFT_ARCHITECTURES for a in archs) else ""
        raise ConfigError(
            f"{path}: unknown target architecture {shown(found)}{hint} (supported: {', '.join(TARGET_ARCHITECTURES)})"
        )
    _check_mlp(cfg, path)
    attention_bias = _bool(cfg, "attention_bias", path, False)
    dims = transformer_dims(cfg, path, DEFAULT_HEAD_DIM.get(arch))
    if arch in ("qwen2", "qwen3"):
        _check_no_sliding_layers(cfg, path, dims["num_layers"])
    return TargetConfig(
        path=str(model_dir),
        arch=arch,
        vocab_size=_int(cfg, "vocab_size", path, maximum=MAX_VOCAB),
        **dims,
        max_position_embeddings=_int(cfg, "max_position_embeddings", path, maximum=MAX_POSITIONS),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", path, False),
        # Qwen2 always has q/k/v biases (its HF config has no switch); Qwen3 and Llama follow attention_bias.
        attention_bias=True if arch == "qwen2" else attention_bias,
        o_proj_bias=arch != "qwen2" and attention_bias,
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_ids(model_dir, cfg),
    )


def _load_hybrid_config(model_dir: Path, cfg: dict, path: str, family: str) -> TargetConfig:
    """A Qwen3.5 dense hybrid (hybrid_config.py): the language model's fields, under text_config or at the top."""
    from cudflash import hybrid_config as hc

    text, where = hc.text_fields(cfg, family, path)
    _check_mlp(text, path)
    dims = transformer_dims(hc.rope_source(text), path)
    hybrid = hc.parse_hybrid(text, where, path, family, dims["num_layers"], dims["head_dim"], _int, _float, _bool)
    eos_src = text if text.get("eos_token_id") is not None else cfg
    return TargetConfig(
        path=str(model_dir), arch="qwen3_5",
        vocab_size=_int(text, "vocab_size", path, label=where + "vocab_size", maximum=MAX_VOCAB),
        **dims,
        max_position_embeddings=_int(text, "max_position_embeddings", path, label=where + "max_position_embeddings",
                                     maximum=MAX_POSITIONS),
        tie_word_embeddings=hc.tied_embeddings(cfg, text, family, path, _bool),
        attention_bias=False, o_proj_bias=False, qk_norm=True,
        eos_token_ids=_eos_ids(model_dir, {"eos_token_id": eos_src.get("eos_token_id")}),
        hybrid=hybrid,
    )
