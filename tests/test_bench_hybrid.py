"""`cudflash bench --synthetic` for the Qwen3.5 hybrids: the shapes it writes, and the bytes behind its floors,
computed here again from the shape itself (not from the model the engine built)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cudflash.bench import SYNTHETIC, HybridPair, write_synthetic_configs
from cudflash.cli import SYNTHETIC_MODELS
from cudflash.config import load_target_config
from cudflash.draft_config import load_draft_config, validate_pair
from cudflash.tiny import draft_tensors
from cudflash.tiny_hybrid import hybrid_drafter_shape, language_tensors


def test_cli_offers_every_synthetic_model():
    assert sorted(SYNTHETIC_MODELS) == sorted(SYNTHETIC)


@pytest.mark.parametrize("name, hidden, layers, value_heads, inter, taps, params", [
    ("qwen3.5-9b", 4096, 32, 32, 12288, [1, 8, 15, 22, 29], 9.0e9),
    ("qwen3.5-27b", 5120, 64, 48, 17408, [1, 16, 31, 46, 61], 26.9e9),
])
def test_synthetic_qwen35_configs_have_the_released_shapes(tmp_path, name, hidden, layers, value_heads, inter, taps,
                                                           params):
    target_dir, draft_dir = write_synthetic_configs(name, tmp_path)
    t, d = load_target_config(target_dir), load_draft_config(draft_dir)
    h = t.hybrid
    assert h.checkpoint_class == "Qwen3_5ForConditionalGeneration" and t.vocab_size == 248320
    assert (t.hidden_size, t.num_layers, t.intermediate_size) == (hidden, layers, inter)
    assert (t.num_heads, t.num_kv_heads, t.head_dim, h.rotary_dim) == (16 if layers == 32 else 24, 4, 256, 64)
    assert h.full_layers == list(range(3, layers, 4)) and not t.tie_word_embeddings
    assert (h.linear_num_key_heads, h.linear_num_value_heads, h.linear_key_head_dim, h.linear_value_head_dim,
            h.linear_conv_kernel_dim) == (16, value_heads, 128, 128, 4)
    assert (d.num_layers, d.block_size, d.mask_token_id, d.target_layer_ids) == (5, 16, 248070, taps)
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size) == (hidden, 32, 8, 128, inter)
    assert d.layer_windows == [0] * 5
    validate_pair(t, d)
    count = parameter_count(SYNTHETIC[name].target)
    assert abs(count - params) < 0.01 * params  # the released sizes: 9B (text 8.95B with the LM head), 27B


def test_parameter_count_is_what_the_tiny_writer_draws():
    from cudflash.tiny_hybrid import HybridShape

    s = HybridShape()
    assert parameter_count(s) == sum(x.size for x in language_tensors(s, np.random.default_rng(0)).values()) \
        + s.vocab_size * s.hidden_size * s.tie_word_embeddings


def parameter_count(s) -> int:
    """The language model's parameters from its shape (what language_tensors draws, without drawing 27B numbers)."""
    H, I, D, hv = s.hidden_size, s.intermediate_size, s.head_dim, s.linear_num_value_heads
    conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim + hv * s.linear_value_head_dim
    value_dim = hv * s.linear_value_head_dim
    mlp_and_norms = 3 * I * H + 2 * H
    gdn = (conv_dim + value_dim + 2 * hv) * H + conv_dim * s.linear_conv_kernel_dim + 2 * hv \
        + s.linear_value_head_dim + H * value_dim
    attention = (2 * s.num_heads + 2 * s.num_kv_heads) * D * H + H * s.num_heads * D + 2 * D
    types = s.types()
    return (types.count("linear_attention") * (gdn + mlp_and_norms) + types.count("full_attention")
            * (attention + mlp_and_norms) + 2 * s.vocab_size * H + H)


def expected_bytes(pair: HybridPair, batch: int, context: int, block: int, item: int = 4) -> dict[str, int]:
    """The phases' bytes from the shape alone: weights from the checkpoint's tensors, KV of the full-attention
    layers only, GDN conv [C, K - 1] + recurrent [Hv, dk, dv] states in float32."""
    s = pair.target
    lang = language_tensors(s, np.random.default_rng(0))
    target_w = item * sum(x.size for k, x in lang.items() if k != "embed_tokens.weight")  # untied: rows gathered
    dshape = hybrid_drafter_shape(s, pair.drafter)
    draft_w = item * (sum(x.size for x in draft_tensors(dshape, np.random.default_rng(0)).values())
                      + s.vocab_size * s.hidden_size)  # + the target's LM head it borrows
    types = s.types()
    n_full, n_gdn = types.count("full_attention"), types.count("linear_attention")
    kv = n_full * 2 * s.num_kv_heads * s.head_dim * item
    draft_kv = 2 * dshape.num_kv_heads * dshape.head_dim * item
    conv_dim = 2 * s.linear_num_key_heads * s.linear_key_head_dim + s.linear_num_value_heads * s.linear_value_head_dim
    state = 4 * n_gdn * (conv_dim * (s.linear_conv_kernel_dim - 1)
                         + s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim)
    verify = target_w + batch * (context * kv + block * kv + state)
    propose = draft_w + batch * dshape.draft_layers * context * draft_kv
    return {"AR step": target_w + batch * (context * kv + kv + 2 * state), "verify": verify, "propose": propose,
            "spec step": verify + propose + batch * state}


def test_tiny_hybrid_bench_on_numpy_writes_the_floors_of_its_bytes(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny-hybrid", "--backend", "cpu",
                        "--batch", "1,2", "--prompt-len", "24", "--new", "2", "--warmup", "1", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    pair = SYNTHETIC["tiny-hybrid"]
    assert data["step_bytes"]["state_bytes"] > 0
    # The pools: 2 live slots (max_num_seqs = the largest batch), 2 x 2 snapshots and the zero slot.
    assert data["state_pool_bytes"] == 7 * data["step_bytes"]["state_bytes"]
    assert f"GDN state pools {data['state_pool_bytes'] / 1e9:.3f} GB" in r.stdout
    for x, nbytes, floors in zip(data["results"], data["phase_bytes"], data["floors_ms"]):
        want = expected_bytes(pair, x["batch"], 24, 16)
        assert nbytes == want
        assert floors == pytest.approx({k: v / (data["copy_gb_per_s"] * 1e6) for k, v in want.items()})
        assert x["prefill_tokens_per_s"] == pytest.approx(x["batch"] * 24 / x["prefill_ms"] * 1e3)
    assert "batch 2 byte floors: AR step" in r.stdout and "spec step" in r.stdout


def test_prefill_only_times_each_batch_of_prompts(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "cudflash", "bench", "--synthetic", "tiny-hybrid", "--backend", "cpu",
                        "--batch", "1,3", "--prompt-len", "40", "--prefill-only", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert "results" not in data and [p["batch"] for p in data["prefill"]] == [1, 3]
    for p in data["prefill"]:
        assert p["prompt_len"] == 40 and p["tokens_per_s"] == pytest.approx(p["batch"] * 40 / p["prefill_ms"] * 1e3)
        assert p["gemm_tflop_s"] > 0
    assert "GEMM TFLOP/s" in r.stdout


def test_bench_quantized_weights_refuse_an_unknown_layer():
    from cudflash.bench import synthetic_quantized
    from cudflash.errors import BackendError

    class Cuda:
        name = "cuda"

    class Target:
        layers = [object()]

    with pytest.raises(BackendError, match="none of the projections"):
        synthetic_quantized(Target(), Cuda(), "fp8")
