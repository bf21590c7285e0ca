"""Dense targets with the config.json key sets and value conventions of real releases (reconstructed field by field;
only the dimensions are scaled down), their generation_config.json eos lists and their tensor-name sets: each loads,
is read as transformers reads it, and generates on the CPU.

Releases (their published config.json files): Qwen/Qwen3-8B (untied, head_dim given, rope_scaling null,
sliding_window null), Qwen/Qwen3-4B-Instruct-2507 (tied: no lm_head tensor), Qwen/Qwen2.5-7B-Instruct (q/k/v
biases, use_sliding_window false beside sliding_window 131072 and max_window_layers 28), meta-llama/Llama-3.1-8B-Instruct
(no head_dim, llama3 rope_scaling, eos_token_id a list, pretraining_tp, mlp_bias), meta-llama/Llama-3.2-1B-Instruct
(tied, head_dim given), and a transformers v5 save (dtype, rope_parameters).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.config import load_target_config
from cudflash.tiny import TinyShape, target_tensors, write_model

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=256)


def _qwen3_8b() -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643 % 256, "eos_token_id": 151645 % 256, "head_dim": 16, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 36,
            "model_type": "qwen3", "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, **TINY}


def _qwen3_4b_2507() -> dict:
    return {**_qwen3_8b(), "max_position_embeddings": 262144, "rope_theta": 5000000, "tie_word_embeddings": True,
            "transformers_version": "4.51.0"}


def _qwen25_7b() -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643 % 256,
            "eos_token_id": 151645 % 256, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
            "use_sliding_window": False, **TINY}


def _llama31_8b() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 128000 % 256, "eos_token_id": [128001 % 256, 128008 % 256, 128009 % 256],
            "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
            "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.42.3", "use_cache": True, **TINY}


def _llama32_1b() -> dict:
    return {**_llama31_8b(), "head_dim": 16, "tie_word_embeddings": True, "transformers_version": "4.45.0.dev0",
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def _transformers_v5(cfg: dict) -> dict:
    """How transformers v5 saves the same model: `dtype`, and rope_theta moved into rope_parameters."""
    out = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "rope_theta", "rope_scaling")}
    params = {"rope_theta": cfg["rope_theta"], **(cfg.get("rope_scaling") or {"rope_type": "default"})}
    return {**out, "dtype": "bfloat16", "rope_parameters": params}


RELEASES = {
    "Qwen3-8B": (_qwen3_8b, "qwen3", [151645 % 256, 151643 % 256]),
    "Qwen3-4B-Instruct-2507": (_qwen3_4b_2507, "qwen3", [151645 % 256, 151643 % 256]),
    "Qwen2.5-7B-Instruct": (_qwen25_7b, "qwen2", [151645 % 256, 151643 % 256]),
    "Llama-3.1-8B-Instruct": (_llama31_8b, "llama", [128001 % 256, 128008 % 256, 128009 % 256]),
    "Llama-3.2-1B-Instruct": (_llama32_1b, "llama", [128001 % 256, 128008 % 256, 128009 % 256]),
    "Llama-3.1-8B-Instruct, transformers v5": (lambda: _transformers_v5(_llama31_8b()), "llama",
                                               [128001 % 256, 128008 % 256, 128009 % 256]),
    "Qwen3-8B, transformers v5": (lambda: _transformers_v5(_qwen3_8b()), "qwen3", [151645 % 256, 151643 % 256]),
}


@pytest.mark.parametrize("name", list(RELEASES))
def test_a_released_dense_config_loads_and_generates(tmp_path, name):
    make, arch, gen_eos = RELEASES[name]
    cfg = make()
    tied = cfg["tie_word_embeddings"]
    shape = TinyShape(arch=arch, tie_word_embeddings=tied, num_layers=2)
    tensors = target_tensors(shape, np.random.default_rng(0))  # the release's tensor names: biases, q/k norms, head
    assert ("lm_head.weight" in tensors) is not tied
    d = write_model(tmp_path / "t", cfg, tensors, shards=2)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"], "do_sample": True,
                                                          "eos_token_id": gen_eos, "temperature": 0.6,
                                                          "top_p": 0.9}))
    c = load_target_config(d)
    assert (c.arch, c.head_dim, c.tie_word_embeddings) == (arch, 16, tied)
    assert c.attention_bias is (arch == "qwen2") and c.qk_norm is (arch == "qwen3")
    assert c.rope.kind == ("llama3" if arch == "llama" else "default")
    assert c.rope.theta == (cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    assert set(c.eos_token_ids) == set(gen_eos) | set(np.atleast_1d(cfg["eos_token_id"]).tolist())
    llm = LLM(d, backend="cpu", kv_block_size=8)
    assert np.array_equal(llm.runner.target.lm_head, llm.runner.target.embed_tokens) is tied
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
