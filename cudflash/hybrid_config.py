"""Qwen3.5 / Qwen3.6 dense hybrid targets (Gated DeltaNet + gated full attention): their config.json, both
checkpoint classes.

- `Qwen3_5ForConditionalGeneration` (`model_type` `qwen3_5`): the language model's fields sit under `text_config`,
  its tensors under `model.language_model.`; the vision tower (`model.visual.`) and the multi-token-prediction head
  (`mtp.`) are in the checkpoint too and are never uploaded. `lm_head.weight` is top level.
- `Qwen3_5ForCausalLM` (`model_type` `qwen3_5_text`): the same fields at the top level, tensors under `model.`.

Conventions the model needs and the config does not spell out (as transformers' `modeling_qwen3_5.py` computes):
every RMSNorm of the decoder (input / post-attention / final / q_norm / k_norm) scales by `1 + weight`; the GDN
output norm (`linear_attn.norm`) scales by `weight`; `q_proj` yields `[query | gate]` per head; RoPE rotates the
first `rotary_dim = int(head_dim * partial_rotary_factor)` channels of each head (rotate-half within them). The
multimodal RoPE (`mrope_section`, `mrope_interleaved`) gives each frequency of section j the position of axis j;
text-only positions are the same on every axis, so it reduces to this plain partial rotary (tests/test_hybrid_config.py
checks that) and only the section sizes are validated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cudflash.errors import ConfigError
from cudflash.model_files import shown

HYBRID_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "conditional",  # model_type qwen3_5, fields under text_config
    "Qwen3_5ForCausalLM": "causal",  # model_type qwen3_5_text, fields at the top level
}
HYBRID_MODEL_TYPES = {"qwen3_5": "conditional", "qwen3_5_text": "causal"}
# Families recognised and refused: what they need beyond the dense hybrid (experts, fused projections).
REFUSED_FAMILIES = {
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5-MoE (mixture-of-experts hybrid)",
    "Qwen3_5MoeForCausalLM": "Qwen3.5-MoE (mixture-of-experts hybrid)",
    "Qwen3NextForCausalLM": "Qwen3-Next (mixture-of-experts hybrid, fused in_proj_qkvz / in_proj_ba)",
    "qwen3_5_moe": "Qwen3.5-MoE (mixture-of-experts hybrid)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (mixture-of-experts hybrid)",
    "qwen3_next": "Qwen3-Next (mixture-of-experts hybrid, fused in_proj_qkvz / in_proj_ba)",
}
LINEAR, FULL = "linear_attention", "full_attention"
# Older layer-type names transformers still maps onto the current ones (configuration_utils'
# remap_legacy_layer_types, applied by Qwen3_5TextConfig to `layer_types`).
LEGACY_LAYER_TYPES = {"mamba": LINEAR, "attention": FULL}
MAX_LINEAR_HEADS = 1024
MAX_LINEAR_HEAD_DIM = 1024
MAX_CONV_KERNEL = 16


@dataclass(slots=True)
class HybridConfig:
    """What a hybrid target adds to TargetConfig (whose attention fields describe its full-attention layers)."""

    checkpoint_class: str  # Qwen3_5ForConditionalGeneration | Qwen3_5ForCausalLM
    tensor_prefix: str  # "model.language_model." | "model.": embed_tokens, layers.N., norm live under it
    layer_types: list[str]  # per layer: linear_attention | full_attention
    linear_num_key_heads: int  # Hk: q / k heads of a GDN layer
    linear_num_value_heads: int  # Hv: value heads (a multiple of Hk; each q / k head serves Hv / Hk of them)
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_conv_kernel_dim: int  # K: the causal depthwise conv's taps
    partial_rotary_factor: float
    rotary_dim: int  # channels of each attention head that RoPE rotates (the first ones)
    mrope_section: list[int] | None  # frequencies per axis (t, h, w); sums to rotary_dim / 2
    mrope_interleaved: bool
    attn_output_gate: bool = True  # q_proj yields [query | gate] per head; output * sigmoid(gate)
    norm_offset: float = 1.0  # decoder RMSNorms scale by (offset + weight)
    skipped_prefixes: tuple[str, ...] = ("model.visual.", "mtp.")  # in the checkpoint, never uploaded
    linear_layers: list[int] = field(default_factory=list)  # indices of the GDN layers, in order
    full_layers: list[int] = field(default_factory=list)  # indices of the full-attention layers, in order

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of in_proj_qkv): q, k (Hk * dk each) and v (Hv * dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def hybrid_family(cfg: dict, archs: list[str], path: str) -> str | None:
    """'conditional' or 'causal' for a dense Qwen3.5 checkpoint, None for anything else; a hybrid family cudflash
    cannot run yet raises ConfigError (by architecture or model_type)."""
    for name in [*archs, cfg.get("model_type")]:
        if isinstance(name, str) and name in REFUSED_FAMILIES:
            raise ConfigError(f"{path}: {REFUSED_FAMILIES[name]} targets ({shown(name)}) are not supported yet; the dense "
                              f"Qwen3.5 / Qwen3.6 hybrids (Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM) are")
    for a in archs:
        if a in HYBRID_ARCHITECTURES:
            return HYBRID_ARCHITECTURES[a]
    if not archs and isinstance(cfg.get("model_type"), str):
        return HYBRID_MODEL_TYPES.get(cfg["model_type"])
    return None


def text_fields(cfg: dict, family: str, path: str) -> tuple[dict, str]:
    """The language model's fields and where they were found ('text_config' or the top level)."""
    if family == "causal":
        return cfg, ""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: a Qwen3_5ForConditionalGeneration config needs a 'text_config' object, got "
                          f"{shown(text)}")
    return text, "text_config."


def _layer_types(text: dict, where: str, path: str, num_layers: int, int_field) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        interval = int_field(text, "full_attention_interval", path, default=4, label=where + "full_attention_interval")
        return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    if isinstance(types, list):
        types = [LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types]
    if not isinstance(types, list) or not all(t in (LINEAR, FULL) for t in types):
        raise ConfigError(f"{path}: field '{where}layer_types' should list 'linear_attention' / 'full_attention', got "
                          f"{shown(types)}")
    if len(types) != num_layers:
        raise ConfigError(f"{path}: '{where}layer_types' has {len(types)} entries, expected {num_layers} "
                          f"(num_hidden_layers)")
    return list(types)


def _rotary(text: dict, where: str, path: str, head_dim: int, float_field) -> tuple[float, int, list[int] | None, bool]:
    params = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    src, label = (params, where + "rope_parameters.") if "partial_rotary_factor" in params else (text, where)
    prf = float_field(src, "partial_rotary_factor", path, 0.25, label=label + "partial_rotary_factor", maximum=1.0)
    rotary_dim = int(head_dim * prf)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{path}: head_dim {head_dim} x {label}partial_rotary_factor {prf} gives {rotary_dim} rotary "
                          f"channels; RoPE needs an even number >= 2")
    section = params.get("mrope_section")
    if section is not None:
        if not (isinstance(section, list) and section and all(isinstance(s, int) and not isinstance(s, bool)
                                                               and s >= 0 for s in section)):
            raise ConfigError(f"{path}: field '{where}rope_parameters.mrope_section' should be a list of integers "
                              f">= 0, got {shown(section)}")
        if sum(section) != rotary_dim // 2:
            raise ConfigError(f"{path}: '{where}rope_parameters.mrope_section' {section} sums to {sum(section)}, "
                              f"expected rotary_dim / 2 = {rotary_dim // 2}")
    interleaved = params.get("mrope_interleaved", False)
    if not isinstance(interleaved, bool):
        raise ConfigError(f"{path}: field '{where}rope_parameters.mrope_interleaved' should be true or false, got "
                          f"{shown(interleaved)}")
    return prf, rotary_dim, section, interleaved


def parse_hybrid(text: dict, where: str, path: str, family: str, num_layers: int, head_dim: int,
                 int_field, float_field, bool_field) -> HybridConfig:
    """HybridConfig from the language model's fields (`where` prefixes field names in messages). The field readers
    are config.py's, passed in to keep one definition of each."""
    def dim(key: str, default: int, maximum: int) -> int:
        return int_field(text, key, path, default=default, label=where + key, maximum=maximum)

    hk, hv = dim("linear_num_key_heads", 16, MAX_LINEAR_HEADS), dim("linear_num_value_heads", 32, MAX_LINEAR_HEADS)
    if hv % hk:
        raise ConfigError(f"{path}: {where}linear_num_value_heads {hv} is not a multiple of "
                          f"{where}linear_num_key_heads {hk}")
    if not bool_field(text, "attn_output_gate", path, True, label=where + "attn_output_gate"):
        raise ConfigError(f"{path}: {where}attn_output_gate: false is not supported (Qwen3.5 attention always gates "
                          f"its output)")
    if bool_field(text, "attention_bias", path, False, label=where + "attention_bias"):
        raise ConfigError(f"{path}: {where}attention_bias: true is not supported for Qwen3.5 hybrids")
    types = _layer_types(text, where, path, num_layers, int_field)
    prf, rotary_dim, section, interleaved = _rotary(text, where, path, head_dim, float_field)
    return HybridConfig(
        checkpoint_class="Qwen3_5ForConditionalGeneration" if family == "conditional" else "Qwen3_5ForCausalLM",
        tensor_prefix="model.language_model." if family == "conditional" else "model.",
        layer_types=types, linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=dim("linear_key_head_dim", 128, MAX_LINEAR_HEAD_DIM),
        linear_value_head_dim=dim("linear_value_head_dim", 128, MAX_LINEAR_HEAD_DIM),
        linear_conv_kernel_dim=dim("linear_conv_kernel_dim", 4, MAX_CONV_KERNEL),
        partial_rotary_factor=prf, rotary_dim=rotary_dim, mrope_section=section, mrope_interleaved=interleaved,
        linear_layers=[i for i, t in enumerate(types) if t == LINEAR],
        full_layers=[i for i, t in enumerate(types) if t == FULL],
    )


def tied_embeddings(cfg: dict, text: dict, family: str, path: str, bool_field) -> bool:
    """tie_word_embeddings: the wrapper's own field and its text_config's must agree where both are given."""
    inner = bool_field(text, "tie_word_embeddings", path, None, label="text_config.tie_word_embeddings") \
        if family == "conditional" else None
    outer = bool_field(cfg, "tie_word_embeddings", path, None)
    if outer is not None and inner is not None and outer != inner:
        raise ConfigError(f"{path}: tie_word_embeddings {str(outer).lower()} and text_config.tie_word_embeddings "
                          f"{str(inner).lower()} disagree")
    return bool(outer if outer is not None else inner)


def rope_source(text: dict) -> dict[str, Any]:
    """The fields parse_rope reads, without the ones the hybrid reads itself (partial rotary, multimodal sections),
    which parse_rope would refuse."""
    src = {k: v for k, v in text.items() if k != "partial_rotary_factor"}
    if isinstance(text.get("rope_parameters"), dict):
        src["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items()
                                  if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    return src
