"""Target and drafter config.json dialects, and the drafter validated against its target."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from cudflash.config import TargetConfig, load_target_config, parse_rope

from cudflash.draft_config import DraftConfig, default_target_layer_ids, load_draft_config, validate_pair
from cudflash.errors import ConfigError, CudflashError
from cudflash.tiny import TinyShape, draft_config, target_config, write_random_pair
from tests.conftest import expect_error

LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def write_cfg(directory: Path, cfg: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def target_error(tmp_path: Path, cfg: dict, *needles: object) -> str:
    d = write_cfg(tmp_path / "t", cfg)
    with pytest.raises(ConfigError) as e:
        load_target_config(d)
    return expect_error(e, d / "config.json", *needles)


def draft_error(tmp_path: Path, cfg: dict, *needles: object) -> str:
    d = write_cfg(tmp_path / "d", cfg)
    with pytest.raises(ConfigError) as e:
        load_draft_config(d)
    return expect_error(e, d / "config.json", *needles)


# ------------------------------------------------------------------------------------------ targets

@pytest.mark.parametrize("arch,hf_name", [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                          ("llama", "LlamaForCausalLM")])
@pytest.mark.parametrize("tied", [False, True])
def test_target_archs(tmp_path, arch, hf_name, tied):
    s = TinyShape(arch=arch, tie_word_embeddings=tied, vocab_size=300, hidden_size=96, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=16, intermediate_size=200, target_layer_ids=[0, 1])
    cfg = target_config(s)
    assert cfg["architectures"] == [hf_name]
    c = load_target_config(write_cfg(tmp_path, cfg))
    assert isinstance(c, TargetConfig)
    assert (c.arch, c.vocab_size, c.hidden_size, c.num_layers) == (arch, 300, 96, 3)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (6, 2, 16, 200)
    assert c.tie_word_embeddings is tied
    assert c.attention_bias is (arch == "qwen2")
    assert c.qk_norm is (arch == "qwen3")
    assert c.max_position_embeddings == 2048
    assert c.rms_norm_eps == 1e-6
    assert c.rope.kind == "default"
    assert c.rope.theta == (10000.0 if arch == "llama" else 1e6)
    assert c.eos_token_ids == [0]
    assert c.path == str(tmp_path)


def test_rope_theta_top_level_or_in_rope_parameters(tmp_path):
    base = target_config(TinyShape(arch="qwen3"))
    base.pop("rope_parameters", None)
    a = load_target_config(write_cfg(tmp_path / "a", {**base, "rope_theta": 5e5}))
    b = load_target_config(write_cfg(tmp_path / "b", {**base, "rope_parameters": {"rope_theta": 5e5,
                                                                                 "rope_type": "default"}}))
    assert a.rope.theta == b.rope.theta == 5e5
    # the newer block wins over a stale top-level value
    c = load_target_config(write_cfg(tmp_path / "c", {**base, "rope_theta": 1e4,
                                                      "rope_parameters": {"rope_theta": 2e6}}))
    assert c.rope.theta == 2e6
    target_error(tmp_path, base, "rope_theta")


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_scaling_legacy_type", "rope_parameters"])
def test_llama3_rope_scaling(tmp_path, spelling):
    cfg = target_config(TinyShape(arch="llama"))
    cfg["rope_theta"] = 500000.0
    if spelling == "rope_scaling":
        cfg["rope_scaling"] = dict(LLAMA31_SCALING)
    elif spelling == "rope_scaling_legacy_type":
        cfg["rope_scaling"] = {**{k: v for k, v in LLAMA31_SCALING.items() if k != "rope_type"}, "type": "llama3"}
    else:
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg["rope_parameters"] = {**LLAMA31_SCALING, "rope_theta": 500000.0}
    r = load_target_config(write_cfg(tmp_path, cfg)).rope
    assert (r.kind, r.theta, r.factor) == ("llama3", 500000.0, 8.0)
    assert (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (1.0, 4.0, 8192)


def test_yarn_rope_scaling(tmp_path):
    cfg = target_config(TinyShape(arch="llama"))
    cfg["rope_scaling"] = dict(QWEN_YARN)
    r = load_target_config(write_cfg(tmp_path, cfg)).rope
    assert (r.kind, r.factor, r.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert (r.beta_fast, r.beta_slow, r.attention_factor, r.truncate) == (32.0, 1.0, None, True)
    # optional keys, and the fallback of original_max_position_embeddings to max_position_embeddings
    cfg["rope_scaling"] = {"type": "yarn", "factor": 2, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707,
                           "mscale_all_dim": 0.707, "attention_factor": 1.2, "truncate": False}
    r = load_target_config(write_cfg(tmp_path, cfg)).rope
    assert (r.factor, r.beta_fast, r.beta_slow) == (2.0, 16.0, 2.0)
    assert (r.mscale, r.mscale_all_dim, r.attention_factor, r.truncate) == (0.707, 0.707, 1.2, False)
    assert r.original_max_position_embeddings == cfg["max_position_embeddings"]


def test_rope_scaling_null_or_default_is_default(tmp_path):
    cfg = target_config(TinyShape(arch="llama"))
    for scaling in (None, {}, {"rope_type": "default"}, {"type": "default"}):
        cfg["rope_scaling"] = scaling
        assert load_target_config(write_cfg(tmp_path, cfg)).rope.kind == "default"


@pytest.mark.parametrize("scaling,needles", [
    ({"rope_type": "dynamic", "factor": 2.0}, ["unsupported RoPE type", "dynamic"]),
    ({"rope_type": "longrope", "factor": 2.0}, ["longrope"]),
    ({"rope_type": "llama3", "factor": 8.0}, ["original_max_position_embeddings"]),
    ({**LLAMA31_SCALING, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, ["high_freq_factor", "low_freq_factor"]),
    ({"rope_type": "yarn"}, ["factor"]),
    ({"rope_type": "yarn", "factor": 0}, ["factor", "> 0"]),
    ({"rope_type": "yarn", "factor": "four"}, ["factor", "'four'"]),
    ("yarn", ["rope_scaling", "object"]),
])
def test_bad_rope_scaling(tmp_path, scaling, needles):
    cfg = target_config(TinyShape(arch="llama"))
    cfg["rope_scaling"] = scaling
    target_error(tmp_path, cfg, *needles)


def test_unsupported_rope_layouts(tmp_path):
    cfg = target_config(TinyShape(arch="qwen3"))
    cfg["rope_parameters"] = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    target_error(tmp_path, cfg, "per-layer-type")
    cfg = target_config(TinyShape(arch="llama"))
    cfg["partial_rotary_factor"] = 0.5
    target_error(tmp_path, cfg, "partial_rotary_factor", "0.5")
    cfg = target_config(TinyShape(arch="llama"))
    cfg["rope_theta"] = 1
    target_error(tmp_path, cfg, "rope_theta")


def test_sliding_window_only_where_a_layer_slides(tmp_path):
    """Qwen2Config / Qwen3Config slide a window only with use_sliding_window and a sliding_window, on the layers
    layer_types names sliding_attention or, without it, from max_window_layers (default 28) on."""
    for i, (arch, fields) in enumerate([
        ("qwen2", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2)),  # Qwen2.5's shape
        ("qwen2", dict(use_sliding_window=True)),  # defaults: window 4096 from layer 28 on
        ("qwen3", dict(use_sliding_window=True, sliding_window=None, max_window_layers=0)),  # no window
        ("qwen3", dict(use_sliding_window=True, sliding_window=32, layer_types=["full_attention"] * 2)),
        ("qwen3", dict(use_sliding_window=False, sliding_window=32, layer_types=["sliding_attention"] * 2)),
    ]):
        cfg = {**target_config(TinyShape(arch=arch, num_layers=2)), **fields}
        assert load_target_config(write_cfg(tmp_path / str(i), cfg)).num_layers == 2
    cfg = {**target_config(TinyShape(arch="qwen3", num_layers=2)), "use_sliding_window": True,
           "layer_types": ["full_attention", "sliding_attention"]}
    target_error(tmp_path / "a", cfg, "sliding_window 4096", "layers [1]", "from 'layer_types'")
    cfg["layer_types"] = ["full_attention"]
    target_error(tmp_path / "b", cfg, "layer_types", "should list 2")


def test_qwen3_head_dim_defaults_to_128(tmp_path):
    """Qwen3Config's head_dim defaults to 128, not hidden_size / heads (Llama's rule, kept for Llama)."""
    cfg = target_config(TinyShape(arch="qwen3", hidden_size=64, num_heads=4, num_kv_heads=2))
    del cfg["head_dim"]
    assert load_target_config(write_cfg(tmp_path / "q", cfg)).head_dim == 128
    cfg = target_config(TinyShape(arch="llama", hidden_size=64, num_heads=4, num_kv_heads=2))
    del cfg["head_dim"]
    assert load_target_config(write_cfg(tmp_path / "l", cfg)).head_dim == 16


def test_defaults_when_optional_fields_absent(tmp_path):
    cfg = target_config(TinyShape(arch="llama", hidden_size=64, num_heads=4))
    for key in ("num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps", "eos_token_id"):
        del cfg[key]
    c = load_target_config(write_cfg(tmp_path, cfg))
    assert c.num_kv_heads == 4 and c.head_dim == 16
    assert c.tie_word_embeddings is False and c.rms_norm_eps == 1e-6 and c.eos_token_ids == []


def test_attention_bias(tmp_path):
    cfg = target_config(TinyShape(arch="llama"))
    cfg["attention_bias"] = True
    assert load_target_config(write_cfg(tmp_path / "a", cfg)).attention_bias is True
    cfg = target_config(TinyShape(arch="qwen2"))
    cfg["attention_bias"] = False  # Qwen2 has q/k/v biases whatever the config says
    assert load_target_config(write_cfg(tmp_path / "b", cfg)).attention_bias is True


def test_eos_ids_merge_generation_config(tmp_path):
    cfg = target_config(TinyShape(arch="qwen3", eos_token_id=5))
    d = write_cfg(tmp_path, cfg)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 9]}))
    assert load_target_config(d).eos_token_ids == [5, 7, 9]
    (d / "generation_config.json").write_text("{broken")  # optional file: ignored when broken
    assert load_target_config(d).eos_token_ids == [5]


def test_missing_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError) as e:
        load_target_config(tmp_path / "m")
    expect_error(e, tmp_path / "m" / "config.json", "missing config.json")
    with pytest.raises(ConfigError) as e:
        load_draft_config(tmp_path / "m")
    expect_error(e, tmp_path / "m" / "config.json", "missing config.json")


def test_model_dir_missing(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_target_config(tmp_path / "nope")
    expect_error(e, tmp_path / "nope", "not a directory")


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError) as e:
        load_target_config(tmp_path)
    expect_error(e, tmp_path / "config.json", "not valid JSON")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        load_target_config(tmp_path)
    expect_error(e, tmp_path / "config.json", "JSON object")


def test_unknown_architecture(tmp_path):
    cfg = target_config(TinyShape())
    cfg["architectures"] = ["MistralForCausalLM"]
    target_error(tmp_path, cfg, "unknown target architecture", "MistralForCausalLM", "Qwen3ForCausalLM")
    del cfg["architectures"]
    target_error(tmp_path, cfg, "unknown target architecture", "qwen3")
    # a drafter given where the target belongs says so
    target_error(tmp_path, draft_config(TinyShape()), "DFlashDraftModel", "drafter")
    draft_error(tmp_path, target_config(TinyShape()), "unknown drafter architecture", "Qwen3ForCausalLM", "target")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "intermediate_size", "max_position_embeddings"])
def test_missing_required_field(tmp_path, field):
    cfg = target_config(TinyShape())
    del cfg[field]
    target_error(tmp_path, cfg, "missing field", f"'{field}'")


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", "64", "should be an integer"),
    ("hidden_size", 64.5, "should be an integer"),
    ("num_hidden_layers", True, "should be an integer"),
    ("num_attention_heads", 0, ">= 1"),
    ("vocab_size", -3, ">= 1"),
    ("rms_norm_eps", "1e-6", "should be a number"),
])
def test_bad_field_values(tmp_path, field, value, needle):
    cfg = target_config(TinyShape())
    cfg[field] = value
    target_error(tmp_path, cfg, f"'{field}'", needle)


def test_integral_floats_accepted(tmp_path):
    cfg = target_config(TinyShape())
    cfg["hidden_size"] = 64.0
    assert load_target_config(write_cfg(tmp_path, cfg)).hidden_size == 64


def test_head_layout_errors(tmp_path):
    cfg = target_config(TinyShape(num_heads=4, num_kv_heads=3))
    target_error(tmp_path, cfg, "num_attention_heads 4", "num_key_value_heads 3")
    cfg = target_config(TinyShape(head_dim=15))
    target_error(tmp_path, cfg, "head_dim 15", "even")
    cfg = target_config(TinyShape(arch="llama", hidden_size=66, num_heads=4))
    del cfg["head_dim"]
    target_error(tmp_path, cfg, "hidden_size 66", "num_attention_heads 4")


def test_unsupported_target_features(tmp_path):
    cfg = target_config(TinyShape(arch="qwen2", num_layers=3))
    cfg.update(use_sliding_window=True, sliding_window=64, max_window_layers=1)
    target_error(tmp_path, cfg, "use_sliding_window", "sliding_window 64", "layers [1, 2]", "max_window_layers")
    cfg = target_config(TinyShape(arch="llama"))
    cfg["hidden_act"] = "gelu"
    target_error(tmp_path, cfg, "hidden_act", "gelu")
    cfg = target_config(TinyShape(arch="llama"))
    cfg["mlp_bias"] = True
    target_error(tmp_path, cfg, "mlp_bias")


# ----------------------------------------------------------------------------------------- drafters

def zlab_qwen3_4b_drafter() -> dict:
    """The published z-lab/Qwen3-4B-DFlash-b16 config.json (docs/drafters.md, 'Released configs')."""
    return {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "max_window_layers": 5,
        "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
        "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    }


def qwen3_4b_target() -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
            "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"}


def test_zlab_drafter_config(tmp_path):
    d = load_draft_config(write_cfg(tmp_path / "d", zlab_qwen3_4b_drafter()))
    assert isinstance(d, DraftConfig)
    assert (d.kind, d.hidden_size, d.num_layers, d.num_heads, d.num_kv_heads) == ("dflash", 2560, 5, 32, 8)
    assert (d.head_dim, d.intermediate_size, d.block_size, d.mask_token_id) == (128, 9728, 16, 151669)
    assert d.target_layer_ids == [1, 9, 17, 25, 33]
    assert d.layer_windows == [0] * 5
    assert (d.vocab_size, d.num_target_layers, d.max_position_embeddings) == (151936, 36, 40960)
    assert d.rope.theta == 1e6 and d.rope.kind == "default"
    t = load_target_config(write_cfg(tmp_path / "t", qwen3_4b_target()))
    validate_pair(t, d)  # the real pairing is accepted


def test_tiny_pair_loads_and_validates(tmp_path):
    target_dir, draft_dir = write_random_pair(tmp_path)
    t, d = load_target_config(target_dir), load_draft_config(draft_dir)
    s = TinyShape()
    assert d.target_layer_ids == s.target_layer_ids and d.block_size == s.block_size
    validate_pair(t, d)


def test_block_size_top_level_or_nested(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 8
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).block_size == 8
    cfg["block_size"] = 16  # DFlash2 exports carry both: the nested value overrides
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).block_size == 8
    del cfg["block_size"], cfg["dflash_config"]["block_size"]
    draft_error(tmp_path, cfg, "missing field 'block_size'", "dflash_config")
    cfg["block_size"] = 0
    draft_error(tmp_path, cfg, "block_size", ">= 1")


def test_target_layer_ids_default_rule(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    del cfg["dflash_config"]["target_layer_ids"]
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).target_layer_ids == [1, 9, 17, 25, 33]
    cfg["num_target_layers"] = 32  # Llama-3.1-8B depth
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).target_layer_ids == [1, 8, 15, 22, 29]
    del cfg["num_target_layers"]
    draft_error(tmp_path, cfg, "target_layer_ids", "num_target_layers")


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(28, 2) == [1, 25]
    for n, k in [(64, 5), (48, 3), (24, 4), (36, 8)]:
        ids = default_target_layer_ids(n, k)
        assert len(ids) == k and ids[0] == 1 and ids[-1] == n - 3 and ids == sorted(ids)


def test_target_layer_ids_explicit_and_bad(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"]["target_layer_ids"] = [2, 4]  # K decoupled from the number of drafter layers
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).target_layer_ids == [2, 4]
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["target_layer_ids"] = [3, 5, 7]  # top-level spelling
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).target_layer_ids == [3, 5, 7]
    for bad in ([], "1,9", [1, "9"], [1.5]):
        cfg["target_layer_ids"] = bad
        draft_error(tmp_path, cfg, "target_layer_ids")


def test_mask_token_id(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    del cfg["dflash_config"]["mask_token_id"]
    cfg["mask_token_id"] = 151670
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).mask_token_id == 151670
    del cfg["mask_token_id"]
    draft_error(tmp_path, cfg, "mask_token_id")
    cfg["dflash_config"]["mask_token_id"] = -1
    draft_error(tmp_path, cfg, "mask_token_id", "-1")


def test_layer_types_and_sliding_window(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    cfg["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                          "full_attention"]
    cfg["sliding_window"] = 2048
    cfg["use_sliding_window"] = True
    d = load_draft_config(write_cfg(tmp_path / "a", cfg))
    assert d.layer_windows == [2048, 0, 2048, 0, 0]
    # z-lab's rule (dflash/model.py): a sliding_attention layer without is_causal attends causally in the block.
    assert d.layer_causal == [True, False, True, False, False]
    cfg["use_sliding_window"] = False  # Qwen3Config drops the window (sliding_window = None); the layers stay causal
    d = load_draft_config(write_cfg(tmp_path / "a2", cfg))
    assert (d.layer_windows, d.layer_causal) == ([0] * 5, [True, False, True, False, False])
    del cfg["use_sliding_window"]  # absent: the window applies (every released sliding drafter sets it true)
    assert load_draft_config(write_cfg(tmp_path / "a3", cfg)).layer_windows == [2048, 0, 2048, 0, 0]
    cfg["use_sliding_window"] = False
    del cfg["layer_types"]  # absent: all full attention, sliding_window unused
    d = load_draft_config(write_cfg(tmp_path / "b", cfg))
    assert (d.layer_windows, d.layer_causal) == ([0] * 5, [False] * 5)
    cfg["layer_types"] = ["sliding_attention"] * 5
    cfg["use_sliding_window"] = True
    cfg["sliding_window"] = None
    draft_error(tmp_path, cfg, "sliding_window")
    cfg["layer_types"] = ["full_attention"] * 4
    draft_error(tmp_path, cfg, "layer_types", "4 entries", "expected 5")
    cfg["layer_types"] = ["full_attention"] * 4 + ["chunked_attention"]
    draft_error(tmp_path, cfg, "chunked_attention")


def test_drafter_rope_parameters_dialect(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": 1e7, "rope_type": "default"}
    assert load_draft_config(write_cfg(tmp_path, cfg)).rope.theta == 1e7


def test_drafter_missing_fields(tmp_path):
    for field in ("hidden_size", "num_hidden_layers", "intermediate_size"):
        cfg = zlab_qwen3_4b_drafter()
        del cfg[field]
        draft_error(tmp_path, cfg, f"'{field}'")
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"] = [1, 2]
    draft_error(tmp_path, cfg, "dflash_config")


# ------------------------------------------------------------------------------------------ pairing

@pytest.fixture
def pair(tmp_path) -> tuple[TargetConfig, DraftConfig]:
    return (load_target_config(write_cfg(tmp_path / "t", qwen3_4b_target())),
            load_draft_config(write_cfg(tmp_path / "d", zlab_qwen3_4b_drafter())))


def pair_error(t: TargetConfig, d: DraftConfig, *needles: object) -> str:
    with pytest.raises(ConfigError) as e:
        validate_pair(t, d)
    return expect_error(e, t.path, d.path, *needles)


def test_pair_hidden_size_mismatch(pair):
    t, d = pair
    t.hidden_size = 4096
    pair_error(t, d, "hidden_size", "2560", "4096")


def test_pair_vocab_mismatch(pair):
    t, d = pair
    t.vocab_size = 128256
    pair_error(t, d, "vocab_size", "151936", "128256")
    d.vocab_size = None  # a drafter without vocab_size is checked through mask_token_id only
    pair_error(t, d, "mask_token_id", "151669", "vocab_size 128256")
    t.vocab_size = 152064
    validate_pair(t, d)


@pytest.mark.parametrize("ids,bad", [([1, 9, 17, 25, 36], 36), ([-1, 9], -1), ([40], 40)])
def test_pair_target_layer_ids_out_of_range(pair, ids, bad):
    t, d = pair
    d.target_layer_ids = ids
    pair_error(t, d, "target_layer_ids", str(bad), "36 layers")


def test_pair_last_layer_is_allowed(pair):
    t, d = pair
    d.target_layer_ids = [0, 35]
    validate_pair(t, d)


def test_pair_mask_token_outside_vocab(pair):
    t, d = pair
    d.mask_token_id = 151936
    pair_error(t, d, "mask_token_id", "151936", "vocab_size 151936")
    d.mask_token_id = 151935
    validate_pair(t, d)


def test_pair_num_target_layers_mismatch(pair):
    t, d = pair
    t.num_layers = 28
    d.target_layer_ids = [1, 9, 17]  # in range for 28 layers: the declared depth still disagrees
    pair_error(t, d, "num_target_layers", "36", "28")


def test_errors_are_cudflash_errors():
    assert issubclass(ConfigError, CudflashError)
    # parse_rope is usable on its own (model code passes plain dicts in tests)
    r = parse_rope({"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
                    "max_position_embeddings": 4096}, "x/config.json")
    assert r.original_max_position_embeddings == 4096 and math.isclose(r.factor, 2.0)


def test_use_swa_dialect_sets_the_windows(tmp_path):
    """DSpark / MiMo exports: `use_swa` + `swa_window_size` (nested or top level) window the sliding layers, or
    every layer without `layer_types`; a window the checkpoint asks for is never dropped silently."""
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"].update(use_swa=True, swa_window_size=1024)
    assert load_draft_config(write_cfg(tmp_path / "f", cfg)).layer_windows == [0] * 5  # layers all declared full
    del cfg["layer_types"]
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).layer_windows == [1024] * 5
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).layer_windows == [1024, 0, 1024, 0, 1024]
    cfg["sliding_window"] = 1024  # the model field may repeat the window
    assert load_draft_config(write_cfg(tmp_path / "c", cfg)).layer_windows == [1024, 0, 1024, 0, 1024]
    cfg["sliding_window"] = 2048
    draft_error(tmp_path, cfg, "swa_window_size", "1024", "sliding_window", "2048")
    del cfg["sliding_window"], cfg["dflash_config"]["swa_window_size"]
    draft_error(tmp_path, cfg, "use_swa", "swa_window_size")
    cfg["dflash_config"].update(use_swa=False, swa_window_size=1024)  # declared but switched off
    del cfg["layer_types"]
    assert load_draft_config(write_cfg(tmp_path / "d", cfg)).layer_windows == [0] * 5
    cfg["dflash_config"]["use_swa"] = "yes"
    draft_error(tmp_path, cfg, "use_swa")
    del cfg["dflash_config"]["use_swa"], cfg["dflash_config"]["swa_window_size"]
    cfg.update(use_swa=True, swa_window_size=0)  # top level, as DeepSpec-native configs keep their fields
    draft_error(tmp_path, cfg, "swa_window_size", ">= 1")
    cfg["swa_window_size"] = 512
    assert load_draft_config(write_cfg(tmp_path / "e", cfg)).layer_windows == [512] * 5


# ------------------------------------------------------------------- DFlash2 / DSpark dialects

def zlab_dflash2_27b() -> dict:
    """z-lab/Qwen3.8-27B-DFlash2 (docs/drafters.md, 'Released configs')."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
        "vocab_size": 248320, "num_target_layers": 64, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}, "sliding_window": 2048,
        "use_sliding_window": True, "layer_types": ["sliding_attention"] * 5, "is_causal": False,
        "tie_word_embeddings": False,
        "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 248070,
                          "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]},
    }


def deepspec_dspark_4b() -> dict:
    """DeepSpec-native DSpark (Qwen3DSparkModel, config/dspark/dspark_qwen3_4b_online.py): heads at the top level."""
    cfg = zlab_qwen3_4b_drafter()
    del cfg["dflash_config"], cfg["auto_map"]
    cfg.update(architectures=["Qwen3DSparkModel"], block_size=7, target_layer_ids=[1, 9, 17, 25, 33],
               mask_token_id=151669, num_anchors=512, markov_rank=256, markov_head_type="vanilla",
               enable_confidence_head=True, confidence_head_with_markov=True)
    return cfg


def nested_dspark_4b() -> dict:
    """The same drafter in the SpecForge / speculators dialect: DSparkDraftModel, heads inside dflash_config."""
    cfg = zlab_qwen3_4b_drafter()
    del cfg["auto_map"]
    cfg.update(architectures=["DSparkDraftModel"], block_size=7)
    cfg["dflash_config"].update(projector_type="dspark", markov_rank=256, markov_head_type="vanilla",
                                use_confidence_head=True, confidence_head_with_markov=True, shift_label=True,
                                causal=False)
    return cfg


def test_dflash2_config(tmp_path):
    d = load_draft_config(write_cfg(tmp_path, zlab_dflash2_27b()))
    assert (d.kind, d.block_size, d.mask_token_id, d.target_layer_ids) == ("dflash2", 8, 248070, [5, 19, 33, 47, 61])
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (2, 16, 256, 16)
    assert d.layer_windows == [2048] * 5  # the drafter's own trained window, per layer
    assert d.rope.theta == 1e7  # read from rope_parameters
    assert not d.shifted_rows and d.markov_rank == 0 and not d.confidence_head


def test_dflash2_projector_dialect_parses_the_same(tmp_path):
    cfg = zlab_dflash2_27b()
    a = load_draft_config(write_cfg(tmp_path / "a", cfg))
    cfg["architectures"] = ["DFlashDraftModel"]  # Model-Optimizer: the family is named by projector_type
    cfg["dflash_config"]["projector_type"] = "dflash2"
    b = load_draft_config(write_cfg(tmp_path / "b", cfg))
    assert replace(a, path="") == replace(b, path="")


def test_dspark_dialects_parse_to_the_same_settings(tmp_path):
    a = load_draft_config(write_cfg(tmp_path / "a", deepspec_dspark_4b()))
    b = load_draft_config(write_cfg(tmp_path / "b", nested_dspark_4b()))
    assert (a.kind, a.shifted_rows, a.markov_rank, a.confidence_head, a.confidence_with_markov) == (
        "dspark", True, 256, True, True)
    assert (a.block_size, a.mask_token_id, a.target_layer_ids) == (7, 151669, [1, 9, 17, 25, 33])
    assert replace(a, path="") == replace(b, path="")
    # A DFlashDraftModel export with projector_type "dspark" is the same drafter too.
    cfg = nested_dspark_4b()
    cfg["architectures"] = ["DFlashDraftModel"]
    assert replace(load_draft_config(write_cfg(tmp_path / "c", cfg)), path="") == replace(a, path="")


def test_radixark_dspark_minimal_nested_config(tmp_path):
    """RadixArk/Qwen3.8-27B-DSpark: only markov_rank and projector_type inside dflash_config (not rank 0!)."""
    cfg = zlab_dflash2_27b()
    cfg.update(architectures=["DSparkDraftModel"], block_size=7, num_attention_heads=40,
               layer_types=["full_attention"] * 5)
    cfg["dflash_config"] = {"target_layer_ids": [4, 16, 28, 40, 52], "markov_rank": 256, "projector_type": "dspark",
                            "mask_token_id": 248070}
    d = load_draft_config(write_cfg(tmp_path, cfg))
    assert (d.kind, d.shifted_rows, d.markov_rank, d.confidence_head, d.block_size) == ("dspark", True, 256, False, 7)


def test_tiny_writers_dialects(tmp_path):
    from cudflash.tiny import TinyHeads
    cfgs = {}
    for name, heads in {"deepspec": TinyHeads(kind="dspark"), "nested": TinyHeads(kind="dspark", dialect="nested"),
                        "dflash2": TinyHeads(kind="dflash2"),
                        "projector": TinyHeads(kind="dflash2", dialect="projector")}.items():
        cfgs[name] = load_draft_config(write_cfg(tmp_path / name, draft_config(TinyShape(heads=heads))))
    assert replace(cfgs["deepspec"], path="") == replace(cfgs["nested"], path="")
    assert replace(cfgs["dflash2"], path="") == replace(cfgs["projector"], path="")
    assert cfgs["deepspec"].kind == "dspark" and cfgs["dflash2"].kind == "dflash2"


def test_draft_vocab_size(tmp_path):
    cfg = deepspec_dspark_4b()
    cfg["draft_vocab_size"] = 32000
    assert load_draft_config(write_cfg(tmp_path / "a", cfg)).draft_vocab_size == 32000
    cfg["draft_vocab_size"] = cfg["vocab_size"]  # the full vocabulary: nothing to remap
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).draft_vocab_size is None


@pytest.mark.parametrize("edit,needles", [
    (lambda c: c.update(markov_head_type="gated"), ["gated", "vanilla"]),
    (lambda c: c.update(markov_head_type="rnn"), ["rnn", "vanilla"]),
    (lambda c: c.update(markov_rank=0), ["confidence_head_with_markov", "markov_rank"]),
    (lambda c: c.update(shift_label=False), ["shift_label"]),
    (lambda c: c.update(conv_kernel_size=2, conv_group_size=16), ["conv_kernel_size", "dspark"]),
    (lambda c: c.update(is_causal="yes"), ["is_causal", "true or false"]),
    (lambda c: c.update(enable_confidence_head="yes"), ["enable_confidence_head", "true or false"]),
    (lambda c: c.update(markov_rank=-1), ["markov_rank", ">= 0"]),
])
def test_dspark_config_errors(tmp_path, edit, needles):
    cfg = deepspec_dspark_4b()
    edit(cfg)
    draft_error(tmp_path, cfg, *needles)


@pytest.mark.parametrize("edit,needles", [
    (lambda d: d.pop("conv_group_size"), ["conv_group_size"]),
    (lambda d: d.update(conv_group_size=48), ["conv_group_size 48", "hidden_size 5120"]),
    (lambda d: d.pop("selector_top_k"), ["selector_top_k"]),
    (lambda d: d.update(conv_kernel_size=0, selector_rank=0), ["neither"]),
    (lambda d: d.update(projector_type="domino"), ["projector_type", "domino"]),
    (lambda d: d.update(projector_type="dspark"), ["contradicts", "DFlash2DraftModel"]),
    (lambda d: d.update(markov_rank=64), ["markov_rank", "dflash2"]),
])
def test_dflash2_config_errors(tmp_path, edit, needles):
    cfg = zlab_dflash2_27b()
    edit(cfg["dflash_config"])
    draft_error(tmp_path, cfg, *needles)


def test_speculators_flat_format_is_a_clear_error(tmp_path):
    cfg = {"architectures": ["DFlash2Speculator"], "speculators_model_type": "dflash2", "block_size": 8,
           "aux_hidden_state_layer_ids": [1, 2], "transformer_layer_config": {}}
    draft_error(tmp_path, cfg, "speculators", "dflash_config")


def test_pair_checks_drafter_vocabularies(tmp_path):
    t = load_target_config(write_cfg(tmp_path / "t", qwen3_4b_target()))
    d = load_draft_config(write_cfg(tmp_path / "d", deepspec_dspark_4b()))
    d.draft_vocab_size = t.vocab_size + 1
    pair_error(t, d, "draft_vocab_size")
    d = load_draft_config(write_cfg(tmp_path / "e", zlab_dflash2_27b()))
    t.vocab_size, t.hidden_size, t.num_layers = 248320, 5120, 64
    d.draft_vocab_size, d.selector_top_k = 8, 16
    pair_error(t, d, "selector_top_k 16")


def test_draft_options(tmp_path):
    from cudflash.draft_config import DraftOptions, apply_draft_options
    d = load_draft_config(write_cfg(tmp_path / "a", zlab_dflash2_27b()))
    assert apply_draft_options(d, DraftOptions()) is d  # the checkpoint's values by default
    assert apply_draft_options(d, DraftOptions(sliding_window=512)).layer_windows == [512] * 5
    assert apply_draft_options(d, DraftOptions(sliding_window=0)).layer_windows == [0] * 5
    with pytest.raises(ConfigError, match="confidence head"):
        apply_draft_options(d, DraftOptions(adaptive=True))
    full = load_draft_config(write_cfg(tmp_path / "b", zlab_qwen3_4b_drafter()))
    with pytest.raises(ConfigError, match="no sliding_attention layers"):
        apply_draft_options(full, DraftOptions(sliding_window=512))
    dspark = load_draft_config(write_cfg(tmp_path / "c", deepspec_dspark_4b()))
    apply_draft_options(dspark, DraftOptions(confidence_threshold=0.4, adaptive=True))
    for bad in ({"sliding_window": -1}, {"sliding_window": True}, {"confidence_threshold": 1.0},
                {"verify_cost": -0.1}):
        with pytest.raises(ConfigError):
            DraftOptions(**bad)


# --------------------------------------------------------------------------- fields as typed data

@pytest.mark.parametrize("field,value,needle", [
    ("tie_word_embeddings", "false", "true or false"),  # bool("false") is True: never coerced
    ("attention_bias", 1, "true or false"),
    ("architectures", [["Qwen3ForCausalLM"]], "list of strings"),
    ("hidden_act", ["silu"], "should be a string"),
    ("rms_norm_eps", float("inf"), "finite"),
    ("num_hidden_layers", 10**6, "<= 1024"),
    ("vocab_size", 2**40, "<="),
    ("eos_token_id", [0, "1"], "token id"),
])
def test_fields_are_typed_and_bounded(tmp_path, field, value, needle):
    cfg = target_config(TinyShape())
    cfg[field] = value
    target_error(tmp_path, cfg, field, needle)


def test_generation_config_ids_are_typed_but_an_unreadable_file_is_ignored(tmp_path):
    d = write_cfg(tmp_path, target_config(TinyShape(eos_token_id=5)))
    (d / "generation_config.json").write_text('{"a": ' + "[" * 10_000 + "]" * 10_000 + "}")
    assert load_target_config(d).eos_token_ids == [5]  # optional file, unreadable: only its extra ids are lost
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["7"]}))
    with pytest.raises(ConfigError) as e:
        load_target_config(d)
    expect_error(e, d / "generation_config.json", "eos_token_id")


def test_drafter_fields_checked_against_its_own_declarations(tmp_path):
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"]["target_layer_ids"] = [1, 36]
    draft_error(tmp_path, cfg, "target_layer_ids", "36", "num_target_layers")
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"]["mask_token_id"] = 151936
    draft_error(tmp_path, cfg, "mask_token_id", "<= 151935")
    cfg = zlab_qwen3_4b_drafter()
    cfg["block_size"] = 4096
    draft_error(tmp_path, cfg, "block_size", "<= 256")
    cfg = zlab_qwen3_4b_drafter()
    cfg["dflash_config"]["projector_type"] = ["dflash2"]
    draft_error(tmp_path, cfg, "projector_type", "string")


def test_config_json_linked_from_outside_is_refused(tmp_path):
    (tmp_path / "elsewhere.json").write_text(json.dumps(target_config(TinyShape())))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ConfigError) as e:
        load_target_config(tmp_path / "m")
    expect_error(e, tmp_path / "m" / "config.json", "symbolic link")


# ------------------------------------------------------- released drafter conventions (z-lab reference, DSpark)

def zlab_qwen36_27b_dflash() -> dict:
    """z-lab/Qwen3.6-27B-DFlash as public engines' fixtures copy it (SGLang / mio tests: 4 sliding + 1 full layer,
    sliding_window 2048, block_size 16 at the top level, no is_causal); use_sliding_window as the z-lab sliding
    releases set it (z-lab/Qwen3.8-27B-DFlash2, z-lab/Qwen3.5-122B-A10B-DFlash)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 5, "head_dim": 128,
            "vocab_size": 248320, "num_target_layers": 64, "block_size": 16, "rope_theta": 10000000,
            "max_position_embeddings": 262144, "sliding_window": 2048, "use_sliding_window": True,
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
            "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}}


def test_zlab_sliding_layers_are_causal_unless_the_config_says(tmp_path):
    d = load_draft_config(write_cfg(tmp_path / "a", zlab_qwen36_27b_dflash()))
    assert d.layer_windows == [2048] * 4 + [0]
    assert d.layer_causal == [True] * 4 + [False]  # dflash/model.py: is_causal = layer_type == "sliding_attention"
    cfg = zlab_qwen36_27b_dflash()
    cfg["is_causal"] = False  # as z-lab/Qwen3.8-27B-DFlash2 writes it
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).layer_causal == [False] * 5
    cfg["is_causal"] = True
    assert load_draft_config(write_cfg(tmp_path / "c", cfg)).layer_causal == [True] * 5
    cfg = zlab_qwen36_27b_dflash()
    cfg["dflash_config"]["causal"] = False  # vLLM's override
    assert load_draft_config(write_cfg(tmp_path / "d", cfg)).layer_causal == [False] * 5
    assert load_draft_config(write_cfg(tmp_path / "e", zlab_dflash2_27b())).layer_causal == [False] * 5
    cfg = nested_dspark_4b()  # DSpark: not z-lab's modeling, bidirectional unless told
    del cfg["dflash_config"]["causal"]
    cfg.update(layer_types=["sliding_attention"] * 5, sliding_window=64, use_sliding_window=True)
    assert load_draft_config(write_cfg(tmp_path / "f", cfg)).layer_causal == [False] * 5


def test_qwen3_config_rule_for_windows_without_layer_types(tmp_path):
    """No layer_types: Qwen3Config fills them in (layers from max_window_layers on are sliding when
    use_sliding_window is true), and z-lab's reference reads those (z-lab/Qwen3.5-122B-A10B-DFlash's config as a
    public fixture copies it: use_sliding_window true, sliding_window 4096, 6 layers)."""
    cfg = zlab_qwen36_27b_dflash()
    del cfg["layer_types"]
    cfg.update(num_hidden_layers=6, sliding_window=4096, max_window_layers=2)
    d = load_draft_config(write_cfg(tmp_path / "a", cfg))
    assert d.layer_windows == [0, 0] + [4096] * 4 and d.layer_causal == [False, False] + [True] * 4
    del cfg["max_window_layers"]  # Qwen3Config's default 28: no layer of a 6-layer drafter is sliding
    d = load_draft_config(write_cfg(tmp_path / "b", cfg))
    assert d.layer_windows == [0] * 6 and d.layer_causal == [False] * 6
    cfg.update(max_window_layers=0, use_sliding_window=False)  # the window is off: no sliding layer at all
    assert load_draft_config(write_cfg(tmp_path / "c", cfg)).layer_windows == [0] * 6


def test_dspark_config_block_is_read_like_dflash_config(tmp_path):
    """SGLang's, vLLM's and TensorRT-LLM's DSpark readers take the nested fields from `dspark_config`."""
    cfg = nested_dspark_4b()
    fields = cfg.pop("dflash_config")
    cfg["dspark_config"] = fields
    d = load_draft_config(write_cfg(tmp_path / "a", cfg))
    assert (d.kind, d.markov_rank, d.confidence_head, d.mask_token_id) == ("dspark", 256, True, 151669)
    assert d.target_layer_ids == [1, 9, 17, 25, 33]
    cfg["dflash_config"] = {"mask_token_id": 151669}  # both blocks: agreeing fields are fine
    assert load_draft_config(write_cfg(tmp_path / "b", cfg)).markov_rank == 256
    cfg["dflash_config"] = {"markov_rank": 64}
    draft_error(tmp_path, cfg, "dflash_config.markov_rank", "dspark_config.markov_rank", "disagree")
    cfg["dflash_config"] = {}
    cfg["dspark_config"]["markov_head_type"] = "gated"
    draft_error(tmp_path, cfg, "gated")
    cfg["dspark_config"] = [1]
    draft_error(tmp_path, cfg, "dspark_config", "object")


@pytest.mark.parametrize("key,value", [("input_embedding_scale", 2.0), ("output_multiplier", 0.5),
                                       ("final_logit_softcapping", 30.0)])
def test_reference_logit_fields_other_than_neutral_are_refused(tmp_path, key, value):
    """z-lab's reference scales the block embedding / the logits by these; cudflash does not, so it refuses them."""
    cfg = zlab_qwen36_27b_dflash()
    neutral = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}[key]
    cfg[key] = neutral
    load_draft_config(write_cfg(tmp_path / "ok", cfg))
    cfg["dflash_config"][key] = value
    draft_error(tmp_path, cfg, f"dflash_config.{key}", "not supported")
