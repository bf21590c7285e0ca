"""Qwen3.5 hybrid configs (both checkpoint classes), the families refused, and the RoPE conventions: partial rotary by
channel permutation, and multimodal RoPE reducing to it for text-only positions."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from cudflash.config import RopeConfig, load_target_config
from cudflash.errors import ConfigError
from cudflash.rope import inv_freq_and_scale, mrope_angles, partial_rope_tables, partial_rotary_order
from cudflash.tiny_hybrid import HybridShape, hybrid_config_json
from tests.conftest import expect_error


def write(tmp_path, cfg: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def error(tmp_path, cfg: dict, *needles) -> str:
    with pytest.raises(ConfigError) as e:
        load_target_config(write(tmp_path, cfg))
    return expect_error(e, tmp_path / "config.json", *needles)


@pytest.mark.parametrize("cls", ["conditional", "causal"])
@pytest.mark.parametrize("tied", [False, True])
def test_both_classes_read_every_field(tmp_path, cls, tied):
    s = HybridShape(checkpoint_class=cls, tie_word_embeddings=tied, num_layers=8, linear_num_key_heads=3,
                    linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_conv_kernel_dim=3, eos_token_id=7)
    c = load_target_config(write(tmp_path, hybrid_config_json(s)))
    h = c.hybrid
    assert c.arch == "qwen3_5" and c.qk_norm and not c.attention_bias
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (256, 64, 8, 4, 2, 32)
    assert c.tie_word_embeddings is tied and c.eos_token_ids == [7] and c.rope.theta == 1e7
    assert h.tensor_prefix == ("model.language_model." if cls == "conditional" else "model.")
    assert h.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert (h.linear_layers, h.full_layers) == ([0, 1, 2, 4, 5, 6], [3, 7])
    assert (h.linear_num_key_heads, h.linear_num_value_heads, h.linear_key_head_dim, h.linear_value_head_dim,
            h.linear_conv_kernel_dim) == (3, 6, 8, 12, 3)
    assert h.conv_dim == 2 * 3 * 8 + 6 * 12
    assert (h.partial_rotary_factor, h.rotary_dim, h.mrope_section, h.mrope_interleaved) == (0.25, 8, [2, 1, 1], True)
    assert h.attn_output_gate and h.norm_offset == 1.0


def test_legacy_layer_type_names_are_read_as_transformers_remaps_them(tmp_path):
    """transformers' remap_legacy_layer_types (applied by Qwen3_5TextConfig): mamba -> linear_attention, attention ->
    full_attention."""
    cfg = hybrid_config_json(HybridShape(layer_types=["mamba", "mamba", "mamba", "attention"]))
    c = load_target_config(write(tmp_path, cfg))
    assert c.hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"] and c.hybrid.full_layers == [3]


def test_layer_types_given_explicitly_win(tmp_path):
    types = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    c = load_target_config(write(tmp_path, hybrid_config_json(HybridShape(layer_types=types))))
    assert c.hybrid.layer_types == types and c.hybrid.full_layers == [0]


def test_interval_spelling_and_defaults(tmp_path):
    """Without layer_types, full_attention_interval decides; the linear_* fields default as transformers does."""
    cfg = hybrid_config_json(HybridShape(checkpoint_class="causal", num_layers=6, full_attention_interval=2))
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim"):
        del cfg[key]
    h = load_target_config(write(tmp_path, cfg)).hybrid
    assert h.full_layers == [1, 3, 5]
    assert (h.linear_num_key_heads, h.linear_num_value_heads, h.linear_key_head_dim, h.linear_conv_kernel_dim) == \
        (16, 32, 128, 4)


@pytest.mark.parametrize("name,field", [
    ("Qwen3_5MoeForConditionalGeneration", "architectures"), ("Qwen3NextForCausalLM", "architectures"),
    ("qwen3_5_moe", "model_type"), ("qwen3_next", "model_type"),
])
def test_families_not_supported_yet_are_refused_by_name(tmp_path, name, field):
    cfg = hybrid_config_json(HybridShape())
    if field == "architectures":
        cfg["architectures"] = [name]
    else:
        cfg["model_type"], cfg["architectures"] = name, []
    msg = error(tmp_path, cfg, name, "not supported yet")
    assert "mixture-of-experts" in msg


@pytest.mark.parametrize("edit,needles", [
    (lambda t: t.update(linear_num_value_heads=5), ("linear_num_value_heads 5", "linear_num_key_heads 2")),
    (lambda t: t.update(attn_output_gate=False), ("attn_output_gate",)),
    (lambda t: t.update(layer_types=["linear_attention"] * 3), ("layer_types", "3 entries", "expected 4")),
    (lambda t: t.update(layer_types=["sliding_attention"] * 4), ("layer_types", "sliding_attention")),
    (lambda t: t["rope_parameters"].update(mrope_section=[4, 4, 4]), ("mrope_section", "sums to 12", "4")),
    (lambda t: t["rope_parameters"].update(partial_rotary_factor=0.01), ("partial_rotary_factor", "rotary")),
    (lambda t: t.update(hidden_act="gelu"), ("hidden_act", "gelu")),
    (lambda t: t.update(tie_word_embeddings=True), ("tie_word_embeddings", "disagree")),
])
def test_bad_fields_name_themselves(tmp_path, edit, needles):
    cfg = copy.deepcopy(hybrid_config_json(HybridShape()))
    edit(cfg["text_config"])
    msg = error(tmp_path, cfg, *needles)
    assert "text_config" in msg or "hidden_act" in msg


def test_conditional_without_text_config(tmp_path):
    cfg = hybrid_config_json(HybridShape())
    del cfg["text_config"]
    error(tmp_path, cfg, "text_config")


def test_a_tree_budget_on_a_hybrid_target_is_refused_naming_the_recurrent_layers(tmp_path):
    from cudflash import LLM
    from cudflash.tiny import write_random_pair
    from cudflash.tiny_hybrid import write_hybrid_target

    target = write_hybrid_target(tmp_path / "t", HybridShape())
    _, drafter = write_random_pair(tmp_path / "pair")
    with pytest.raises(ConfigError) as e:
        LLM(target, draft=drafter, backend="cpu", draft_options={"tree_budget": 15})
    expect_error(e, "tree budget", "Gated DeltaNet", "--tree-budget")


# ------------------------------------------------------------------------------------------------ RoPE

def _reference_partial_rotary(x: np.ndarray, angles: np.ndarray, rotary_dim: int) -> np.ndarray:
    """transformers' apply_rotary_pos_emb with cos / sin = cat(angles, angles): rotate-half within the first
    rotary_dim channels, the rest passed through. x [T, D], angles [T, rotary_dim / 2]."""
    cos, sin = np.cos(angles), np.sin(angles)
    cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    rot, rest = x[:, :rotary_dim], x[:, rotary_dim:]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[:, half:], rot[:, :half]], -1)
    return np.concatenate([rot * cos + rotated * sin, rest], -1)


def test_text_only_mrope_is_plain_partial_rotary_and_the_permuted_tables_reproduce_it_exactly():
    from cudflash.backends.numpy_backend import NumpyBackend

    head_dim, rotary_dim, section, T = 32, 8, [2, 1, 1], 40
    rope = RopeConfig(theta=1e7)
    inv_freq, _ = inv_freq_and_scale(rope, rotary_dim)
    pos = np.arange(T)
    text_angles = mrope_angles(inv_freq, np.stack([pos, pos, pos]), section, interleaved=True)
    plain = pos.astype(np.float32)[:, None] * inv_freq[None, :]
    np.testing.assert_array_equal(text_angles, plain)
    # A real multimodal position grid differs: the reduction is a property of text positions, not of the function.
    assert not np.array_equal(mrope_angles(inv_freq, np.stack([pos, pos * 2, pos]), section, True), plain)

    x = np.random.default_rng(0).standard_normal((T, head_dim)).astype(np.float32)
    want = _reference_partial_rotary(x, plain, rotary_dim)
    cos, sin = partial_rope_tables(rope, head_dim, rotary_dim, T)
    order = partial_rotary_order(head_dim, rotary_dim)
    got = NumpyBackend().head_norm_rope(x[:, order], head_dim, pos, cos, sin, None, 1e-6)
    np.testing.assert_array_equal(got, want[:, order])  # bit for bit, in the permuted channel order
