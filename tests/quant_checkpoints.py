"""Checkpoints in the released quantized layouts, written from float32 tensors the way each release's tool does:

- Qwen -FP8: `quantization_config {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size}`,
  projections F8_E4M3 with `weight_scale_inv` (F32 or BF16) per block;
- compressed-tensors FP8 (llm-compressor FP8 / FP8_DYNAMIC): `format: float-quantized`, `weight_scale` [N, 1]
  (channel) or [1] (tensor), optional static `input_scale`; and the older configs (frozen, nested);
- AutoFP8: `quant_method: fp8` without weight_block_size, scalar `weight_scale` and optional `input_scale`;
- ModelOpt NVFP4: hf_quant_config.json plus config.json `quantization_config {quant_method: modelopt}`, projections
  U8 [N, K/2] with `weight_scale` F8_E4M3 [N, K/16], `weight_scale_2` F32 [] and `input_scale` F32 [];
- compressed-tensors NVFP4 (llm-compressor NVFP4 / NVFP4A16): `format: nvfp4-pack-quantized`, projections
  `weight_packed` U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16], `weight_global_scale` F32 [1] (a divisor: 6 * 448 /
  amax) and, for the W4A4 scheme, `input_global_scale` F32 [1].
Embeddings, norms and the LM head stay BF16. Tensors are (safetensors dtype, raw array) pairs: the writer emits any
dtype, which tiny.write_safetensors (float weights) does not.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from cudflash.quant.numerics import encode_e4m3
from cudflash.quant.weight import quantize_nvfp4
from cudflash.tiny import float32_to_bf16_bits

QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
             "up_proj.weight", "down_proj.weight")


def write_tagged(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, (tag, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_tagged_model(directory: Path, config: dict, tensors: dict[str, tuple[str, np.ndarray]], shards: int = 1,
                       extra: dict[str, dict] | None = None) -> Path:
    """config.json (+ extra JSON files) and the tensors, in one file or `shards` files with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    for fname, doc in (extra or {}).items():
        (directory / fname).write_text(json.dumps(doc))
    if shards <= 1:
        write_tagged(directory / "model.safetensors", tensors)
        return directory
    # A module's tensors spread over shards: the reader must find a weight and its scale in different files.
    names, weight_map = list(tensors), {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        write_tagged(directory / fname, part)
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _bf16(x: np.ndarray) -> tuple[str, np.ndarray]:
    return "BF16", float32_to_bf16_bits(np.asarray(x, dtype=np.float32))


def _scale_tensor(scale: np.ndarray, dtype: str) -> tuple[str, np.ndarray]:
    return _bf16(scale) if dtype == "BF16" else ("F32", scale.astype(np.float32))


def _stored_scale(scale: np.ndarray, dtype: str) -> np.ndarray:
    """The scale as it will read back (a BF16 scale is rounded once, as a bf16 release stores it)."""
    if dtype == "BF16":
        return (float32_to_bf16_bits(scale).astype(np.uint32) << 16).view(np.float32)
    return scale.astype(np.float32)


def _to_quantize(tensors: dict[str, np.ndarray], out: dict, quantized: tuple[str, ...] = QUANTIZED):
    """(name, bf16 values) of each tensor a quantizing tool converts (names ending in `quantized`); the others go
    into `out` as bf16."""
    for name, w in tensors.items():
        if name.endswith(quantized):
            yield name, _bf16_values(w)
        else:
            out[name] = _bf16(w)


def qwen_fp8(tensors: dict[str, np.ndarray], block=(128, 128), scale_dtype: str = "F32",
             quantized: tuple[str, ...] = QUANTIZED):
    """(tensors, quantization_config) of a Qwen -FP8 release; `quantized`: the suffixes of the weights it converts."""
    out = {}
    bn, bk = block
    for name, w in _to_quantize(tensors, out, quantized):
        n, k = w.shape
        sn, sk = -(-n // bn), -(-k // bk)
        amax = np.zeros((sn, sk), dtype=np.float32)
        for i in range(sn):
            for j in range(sk):
                amax[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max()
        scale = _stored_scale(np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32), scale_dtype)
        full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
        out[name] = ("F8_E4M3", encode_e4m3(w / full))
        out[name[: -len("weight")] + "weight_scale_inv"] = _scale_tensor(scale, scale_dtype)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
              "modules_to_not_convert": None}
    return out, config


def compressed_fp8(tensors: dict[str, np.ndarray], strategy: str = "channel", scale_dtype: str = "BF16",
                   static_input: bool = False, legacy: str = ""):
    """(tensors, quantization_config) of an llm-compressor FP8 checkpoint (channel or tensor weight scales).
    `legacy`: the config as older compressed-tensors wrote it, "frozen" (nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf:
    naive-quantized, quantization_status frozen, per-tensor BF16 scales [1] and BF16 input scales [1]) or "nested"
    (the same fields one level down, in a quantization_config beside a dense sparsity_config)."""
    if legacy:
        strategy, scale_dtype, static_input = "tensor", "BF16", True
    out = {}
    for name, w in _to_quantize(tensors, out):
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max().reshape(1)
        scale = _stored_scale(np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32), scale_dtype)
        out[name] = ("F8_E4M3", encode_e4m3(w / (scale if strategy == "channel" else scale[0])))
        module = name[: -len("weight")]
        out[module + "weight_scale"] = _scale_tensor(scale, scale_dtype)
        if static_input:
            out[module + "input_scale"] = _scale_tensor(np.array([0.05], dtype=np.float32),
                                                        "BF16" if legacy else "F32")
    act = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static_input,
           "strategy": "tensor" if static_input else "token"}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "kv_cache_scheme": None,
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": act,
                                            "output_activations": None,
                                            "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "dynamic": False, "strategy": strategy, "group_size": None,
                                                        "observer": "minmax"}}}}
    if legacy:
        config.update(format="naive-quantized", quantization_status="frozen", global_compression_ratio=1.24)
    if legacy == "nested":
        inner = {k: v for k, v in config.items() if k != "quant_method"}
        config = {"quant_method": "compressed-tensors", "quantization_config": {**inner, "quant_method": "sparseml"},
                  "sparsity_config": {"format": "dense", "global_sparsity": 0.4, "sparsity_structure": "unstructured"}}
    return out, config


def _per_tensor_fp8(w: np.ndarray) -> tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]:
    """The E4M3 codes of w and its one F32 scale, amax / 448 (1 for an all-zero weight): AutoFP8's and ModelOpt's
    per-tensor recipe."""
    amax = np.float32(np.abs(w).max())
    scale = np.float32(amax / np.float32(448)) if amax > 0 else np.float32(1)
    return ("F8_E4M3", encode_e4m3(w / scale)), ("F32", np.array(scale, dtype=np.float32))


def autofp8(tensors: dict[str, np.ndarray], static: bool = False):
    """(tensors, quantization_config) of an AutoFP8 checkpoint (neuralmagic's first -FP8 releases, e.g.
    Meta-Llama-3-8B-Instruct-FP8): `quant_method: fp8` without weight_block_size, one F32 scalar weight_scale (amax /
    448) per module and, for the static scheme, a scalar input_scale."""
    out = {}
    for name, w in _to_quantize(tensors, out):
        module = name[: -len("weight")]
        out[name], out[module + "weight_scale"] = _per_tensor_fp8(w)
        if static:
            out[module + "input_scale"] = ("F32", np.array(0.04, dtype=np.float32))
    return out, {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                 "ignored_layers": ["lm_head"]}


def modelopt_nvfp4(tensors: dict[str, np.ndarray]):
    """(tensors, hf_quant_config.json, config.json quantization_config) of a ModelOpt NVFP4 export: global scale
    amax / (6 * 448), block scales E4M3 of block amax / (6 * global), elements E2M1 of w / (block * global)."""
    out = {}
    for name, w in _to_quantize(tensors, out):
        qw = quantize_nvfp4(w)  # the engine's quantize="nvfp4" is this recipe too
        module = name[: -len("weight")]
        out[name] = ("U8", qw.data)
        out[module + "weight_scale"] = ("F8_E4M3", qw.scale)
        out[module + "weight_scale_2"] = ("F32", np.array(qw.global_scale[0], dtype=np.float32))
        out[module + "input_scale"] = ("F32", np.array(0.02, dtype=np.float32))
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    hf = {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}
    return out, hf, {"quant_method": "modelopt", **quant}


def modelopt_fp8(tensors: dict[str, np.ndarray]):
    """(tensors, hf_quant_config.json, config.json quantization_config) of a ModelOpt FP8 export (nvidia's -FP8
    releases, e.g. Llama-3.1-8B-Instruct-FP8): one float32 scalar weight_scale (amax / 448) and input_scale per
    module, FP8 KV-cache scales on k_proj / v_proj (the engine keeps a bf16 cache and reads none of these)."""
    out = {}
    for name, w in _to_quantize(tensors, out):
        module = name[: -len("weight")]
        out[name], out[module + "weight_scale"] = _per_tensor_fp8(w)
        out[module + "input_scale"] = ("F32", np.array(0.03, dtype=np.float32))
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            out[module + name.split(".")[-2][0] + "_scale"] = ("F32", np.array(1.0, dtype=np.float32))
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    hf = {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quant}
    return out, hf, {"quant_method": "modelopt", **quant}


def compressed_nvfp4(tensors: dict[str, np.ndarray], w4a4: bool = False):
    """(tensors, quantization_config) of an llm-compressor NVFP4 checkpoint (NVFP4A16, or NVFP4 with activation
    global scales): the ModelOpt recipe's codes and block scales, its global scale stored as the divisor
    float32(1 / global)."""
    out = {}
    for name, w in _to_quantize(tensors, out):
        qw = quantize_nvfp4(w)
        module = name[: -len("weight")]
        out[name + "_packed"] = ("U8", qw.data)
        out[module + "weight_scale"] = ("F8_E4M3", qw.scale)
        out[module + "weight_global_scale"] = ("F32", (np.float32(1) / qw.global_scale).astype(np.float32))
        if w4a4:
            out[module + "input_global_scale"] = ("F32", np.array([300.0], dtype=np.float32))
    act = ({"num_bits": 4, "type": "float", "symmetric": True, "dynamic": "local", "strategy": "tensor_group",
            "group_size": 16} if w4a4 else None)
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor_group",
               "group_size": 16, "observer": "minmax"}
    config = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                            "output_activations": None, "format": "nvfp4-pack-quantized"}}}
    return out, config


def _bf16_values(w: np.ndarray) -> np.ndarray:
    """What a bf16 release holds: the tools quantize from the bf16 weights."""
    return (float32_to_bf16_bits(w).astype(np.uint32) << 16).view(np.float32)


def write_quantized(directory: Path, config: dict, tensors: dict[str, np.ndarray], fmt: str, shards: int = 1,
                    **kw) -> Path:
    """A target checkpoint in `fmt` (qwen_fp8 | compressed_fp8 | modelopt_nvfp4) from its float32 tensors."""
    config = dict(config)
    extra = None
    if fmt == "qwen_fp8":
        out, config["quantization_config"] = qwen_fp8(tensors, **kw)
    elif fmt == "compressed_fp8":
        out, config["quantization_config"] = compressed_fp8(tensors, **kw)
    elif fmt == "modelopt_nvfp4":
        out, hf, config["quantization_config"] = modelopt_nvfp4(tensors)
        extra = {"hf_quant_config.json": hf}
    else:
        raise ValueError(fmt)
    return write_tagged_model(directory, config, out, shards, extra)


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation files of a model folder (everything but config.json and the weights)."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (dst / f.name).write_bytes(f.read_bytes())
