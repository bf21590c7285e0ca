"""Quantized weights: the E4M3 / E2M1 numerics against tables built here from the format definitions, every
released layout round-tripped through a tiny checkpoint written in it (tests/quant_checkpoints.py) and loaded by the
real loader, exact float32 values, fused weights off the block grid, quantize="fp8" at load, refusals by name, and
speculative greedy == autoregressive greedy of each quantized target on the numpy backend."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.backends.tuning import CudaTuning
from cudflash.checkpoint import Checkpoint
from cudflash.config import load_target_config
from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.llm_engine import LLM
from cudflash.errors import CheckpointError, ConfigError
from cudflash.quant import QuantizedWeight, concat_rows, dequantize, quantize_fp8_block, read_quant_scheme
from cudflash.quant.memory import dequantized_bytes, keep_quantized
from cudflash.quant.numerics import (E4M3_TABLE, decode_e2m1, encode_e2m1, encode_e4m3, pack_e2m1, unpack_e2m1)
from cudflash.quant.weight import dequantize_reference
from cudflash.sampling_params import SamplingParams
from cudflash.tiny import TinyShape, draft_config, draft_tensors, target_config, target_tensors, write_model
from tests.quant_checkpoints import (autofp8, compressed_fp8, compressed_nvfp4, modelopt_fp8, modelopt_nvfp4, qwen_fp8,
                                     write_tagged_model)


def e4m3_value(code: int) -> float:
    """The E4M3 (fn) definition: bias 7, exponent 0 subnormal, S.1111.111 NaN, no infinity."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 7
    if exp == 0xF and man == 7:
        return math.nan
    return sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


E4M3 = np.array([e4m3_value(c) for c in range(256)], dtype=np.float32)
E2M1 = np.array([e2m1_value(c) for c in range(16)], dtype=np.float32)


# ---- numerics
def test_e4m3_table_is_the_format_definition():
    nan = np.isnan(E4M3)
    assert np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    assert np.array_equal(np.isnan(E4M3_TABLE), nan)
    assert np.array_equal(E4M3_TABLE[~nan], E4M3[~nan])
    assert np.array_equal(np.signbit(E4M3_TABLE[~nan]), np.signbit(E4M3[~nan]))  # 0x80 is -0
    assert E4M3[0x7E] == 448 and E4M3[0x01] == 2.0**-9 and E4M3[0x08] == 2.0**-6 and E4M3[0x07] == 7 * 2.0**-9


def test_e4m3_encode_round_trips_every_code_and_rounds_to_nearest_even():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
    assert np.array_equal(encode_e4m3(E4M3[codes]), codes)
    pos = np.sort(E4M3[:0x7F])  # the 127 non-negative values, ascending; codes 0..0x7E in the same order
    mids = (pos[:-1].astype(np.float64) + pos[1:]) / 2  # exact in float32: one more mantissa bit
    assert np.array_equal(mids.astype(np.float32).astype(np.float64), mids)
    lo, hi = np.arange(126), np.arange(1, 127)
    even = np.where(lo % 2 == 0, lo, hi)
    for sign in (1, -1):
        got = encode_e4m3((sign * mids).astype(np.float32)) & 0x7F
        assert np.array_equal(got, even)
        below = np.nextafter((sign * mids).astype(np.float32), np.float32(0))
        above = np.nextafter((sign * mids).astype(np.float32), np.float32(sign * np.inf))
        assert np.array_equal(encode_e4m3(below) & 0x7F, lo) and np.array_equal(encode_e4m3(above) & 0x7F, hi)
    big = encode_e4m3(np.array([449, 464, 479, 480, 1e30, -1e30, np.inf, np.nan, 2.0**-11, -0.0], np.float32))
    assert big.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x00, 0x80]


def test_e4m3_encode_is_the_nearest_value():
    x = np.random.default_rng(0).standard_normal(20000).astype(np.float32) * np.float32(40)
    got = E4M3[encode_e4m3(x)].astype(np.float64)
    finite = E4M3[~np.isnan(E4M3)].astype(np.float64)
    best = np.abs(x.astype(np.float64)[:, None] - finite[None, :]).min(axis=1)
    assert np.array_equal(np.abs(got - x), best)


def test_e2m1_table_order_and_encoding():
    assert np.array_equal(decode_e2m1(np.arange(16, dtype=np.uint8)), E2M1)
    assert E2M1[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    # Element 2j is the low nibble of byte j (the order vLLM's break_fp4_bytes and ModelOpt's packing use).
    assert unpack_e2m1(np.array([[0x21, 0xF9]], np.uint8)).tolist() == [[1, 2, 9, 15]]
    codes = np.random.default_rng(1).integers(0, 16, (3, 32)).astype(np.uint8)
    assert np.array_equal(unpack_e2m1(pack_e2m1(codes)), codes)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 9, -5], np.float32)
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -4]


def test_e2m1_encoding_is_the_nearest_magnitude_everywhere():
    """encode_e2m1 against the definition (float64 distance to every magnitude, a tie to the even code) on random
    values and on the float32 neighbours of every midpoint, both signs, with -0, infinities and subnormals."""
    rng = np.random.default_rng(2)
    mids = np.array([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 3, near, -near,
                        np.array([np.inf, -np.inf, 1e-40, -0.0], np.float32)])
    mags = E2M1[:8].astype(np.float64)
    dist = np.abs(np.minimum(np.abs(x.astype(np.float64)), 6.0)[:, None] - mags)
    best = dist.argmin(axis=1)  # the lower code on a tie
    up = (best % 2 == 1) & (best < 7) & (dist[np.arange(x.size), np.minimum(best + 1, 7)] == dist.min(axis=1))
    want = (best + up) | (np.signbit(x).astype(np.int64) << 3)
    assert np.array_equal(encode_e2m1(x), want.astype(np.uint8))


# ---- the in-memory weight
def _random_fp8(rng, n, k, block) -> QuantizedWeight:
    codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale = rng.uniform(1e-3, 1, (-(-n // block[0]), -(-k // block[1]))).astype(np.float32)
    return QuantizedWeight("fp8", (n, k), codes, scale, block)


def _fp8_reference(codes, scale, block):
    n, k = codes.shape
    return E4M3[codes] * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:n, :k]


def _nvfp4_reference(packed, scale_codes, g):
    n = packed.shape[0]
    elems = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1)
    return (E2M1[elems] * np.repeat(E4M3[scale_codes], 16, axis=1)) * np.float32(g)


def test_dequantize_fp8_off_the_block_grid():
    rng = np.random.default_rng(2)
    for n, k, block in [(200, 130, (128, 128)), (7, 300, (128, 128)), (33, 20, (16, 8)), (5, 9, (1, 9))]:
        w = _random_fp8(rng, n, k, block)
        want = _fp8_reference(w.data, w.scale, block)
        assert np.array_equal(dequantize(w), want) and np.array_equal(dequantize_reference(w), want)


def test_concat_rows_keeps_each_parts_scales():
    rng = np.random.default_rng(3)
    parts = [_random_fp8(rng, n, 200, (128, 128)) for n in (200, 72, 72)]  # qkv with rows off the grid
    fused = concat_rows(parts, ["q", "k", "v"])
    assert fused.scale_rows is not None and fused.scale.shape == (4, 2) and fused.shape == (344, 200)
    assert np.array_equal(dequantize(fused), np.concatenate([dequantize(p) for p in parts]))
    aligned = concat_rows([_random_fp8(rng, 256, 64, (128, 128)), _random_fp8(rng, 40, 64, (128, 128))], ["a", "b"])
    assert aligned.scale_rows is None and aligned.block == (128, 128)  # the grids meet end to end: no row map
    tensor = [QuantizedWeight("fp8", (n, 16), rng.integers(0, 100, (n, 16)).astype(np.uint8),
                              np.array([[s]], np.float32), (n, 16)) for n, s in ((8, 0.5), (4, 0.25))]
    fused = concat_rows(tensor, ["q", "k"])  # per-tensor scales of different parts: one scale row each
    assert fused.scale_rows.tolist() == [0] * 8 + [1] * 4
    assert np.array_equal(dequantize(fused), np.concatenate([dequantize(p) for p in tensor]))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_rows([parts[0], _random_fp8(rng, 8, 200, (64, 64))], ["q", "k"])


def test_nvfp4_dequantize_and_concat_with_different_global_scales():
    rng = np.random.default_rng(4)
    parts = []
    for n, g in ((6, 0.5), (3, 0.125)):
        packed = rng.integers(0, 256, (n, 16)).astype(np.uint8)  # K = 32
        scales = rng.integers(0, 0x7E, (n, 2)).astype(np.uint8)
        parts.append(QuantizedWeight("nvfp4", (n, 32), packed, scales, (1, 16), np.array([g], np.float32)))
        assert np.array_equal(dequantize(parts[-1]), _nvfp4_reference(packed, scales, g))
        assert np.array_equal(dequantize_reference(parts[-1]), dequantize(parts[-1]))
    fused = concat_rows(parts, ["gate", "up"])
    assert fused.global_scale.shape == (9,) and fused.scale_rows is None
    assert np.array_equal(dequantize(fused), np.concatenate([dequantize(p) for p in parts]))


def test_quantize_fp8_block_is_amax_over_448_and_nearest_even():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((150, 260)).astype(np.float32)
    w[128:, 256:] = 0  # a zero block (the corner block 1 x 2 covers rows 128.., cols 256..)
    q = quantize_fp8_block(w)
    assert q.scale.shape == (2, 3) and q.data.shape == (150, 260)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = np.abs(blk).max()
            assert q.scale[i, j] == (np.float32(amax) / np.float32(448) if amax else 1.0)
            codes = q.data[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert np.array_equal(codes, encode_e4m3(blk / q.scale[i, j]))
    assert np.abs(E4M3[q.data]).max() == 448  # every nonzero block reaches the top code
    err = np.abs(dequantize(q) - w) / np.maximum(np.abs(w), 1e-30)
    assert err[np.abs(w) > 0.1].max() <= 2.0**-4  # half a step of a 3-bit mantissa


# ---- released layouts through the real loader
def _target(tmp_path: Path, shape: TinyShape, seed: int = 0):
    tensors = target_tensors(shape, np.random.default_rng(seed))
    return tensors, target_config(shape)


def _write(tmp_path: Path, name: str, fmt: str, shape: TinyShape, shards: int = 1, **kw):
    tensors, config = _target(tmp_path, shape)
    extra = None
    if fmt == "qwen_fp8":
        out, config["quantization_config"] = qwen_fp8(tensors, **kw)
    elif fmt == "compressed_fp8":
        out, config["quantization_config"] = compressed_fp8(tensors, **kw)
    elif fmt == "compressed_nvfp4":
        out, config["quantization_config"] = compressed_nvfp4(tensors, **kw)
    elif fmt == "autofp8":
        out, config["quantization_config"] = autofp8(tensors, **kw)
    else:
        out, hf, qc = (modelopt_fp8 if fmt == "modelopt_fp8" else modelopt_nvfp4)(tensors)
        if kw.get("lower"):  # exports may spell quant_algo in lower case
            hf["quantization"]["quant_algo"] = hf["quantization"]["quant_algo"].lower()
        extra = {"hf_quant_config.json": hf}
        if kw.get("in_config"):
            config["quantization_config"] = qc
    return write_tagged_model(tmp_path / name, config, out, shards, extra), out


def _reference_at(out: dict, name: str, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """The float32 value of a stored weight, from the raw stored arrays and this file's own tables (`block`: the
    checkpoint's weight_block_size)."""
    module = name[: -len("weight")]
    if name not in out and name + "_packed" in out:  # compressed-tensors NVFP4: global scale = 1 / the divisor
        g = (np.float32(1) / out[module + "weight_global_scale"][1]).astype(np.float32)
        return _nvfp4_reference(out[name + "_packed"][1], out[module + "weight_scale"][1], g)
    tag, arr = out[name]
    if tag == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    as_f32 = lambda t: (t[1].astype(np.uint32) << 16).view(np.float32) if t[0] == "BF16" else t[1]  # noqa: E731
    if tag == "U8":
        return _nvfp4_reference(arr, out[module + "weight_scale"][1], out[module + "weight_scale_2"][1])
    if module + "weight_scale_inv" in out:
        return _fp8_reference(arr, as_f32(out[module + "weight_scale_inv"]), block)
    scale = as_f32(out[module + "weight_scale"])
    return E4M3[arr] * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(1, 1))


def _check_loaded(model_dir: Path, out: dict, block: tuple[int, int] = (128, 128)):
    llm = LLM(model_dir, backend="cpu", kv_block_size=8)
    t = llm.runner.target
    _reference = lambda o, n: _reference_at(o, n, block)  # noqa: E731
    for i, layer in enumerate(t.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = np.concatenate([_reference(out, a + f"{x}_proj.weight") for x in "qkv"])
        assert np.array_equal(layer.qkv, qkv)
        assert np.array_equal(layer.o_proj, _reference(out, a + "o_proj.weight"))
        gate_up = np.concatenate([_reference(out, m + "gate_proj.weight"), _reference(out, m + "up_proj.weight")])
        assert np.array_equal(layer.gate_up, gate_up)
        assert np.array_equal(layer.down, _reference(out, m + "down_proj.weight"))
        assert np.array_equal(layer.input_norm, _reference(out, f"model.layers.{i}.input_layernorm.weight"))
    assert np.array_equal(t.embed_tokens, _reference(out, "model.embed_tokens.weight"))
    assert np.array_equal(t.lm_head, _reference(out, "lm_head.weight"))
    return llm


ODD = TinyShape(hidden_size=80, num_heads=5, num_kv_heads=1, head_dim=16, intermediate_size=208, num_layers=2,
                target_layer_ids=[0, 1])


@pytest.mark.parametrize("fmt,kw", [("qwen_fp8", {}), ("qwen_fp8", {"scale_dtype": "BF16"}),
                                    ("qwen_fp8", {"block": (32, 32)}),
                                    ("compressed_fp8", {}), ("compressed_fp8", {"strategy": "tensor"}),
                                    ("compressed_fp8", {"static_input": True, "scale_dtype": "F32"}),
                                    ("compressed_fp8", {"legacy": "frozen"}), ("compressed_fp8", {"legacy": "nested"}),
                                    ("autofp8", {}), ("autofp8", {"static": True}),
                                    ("modelopt_nvfp4", {"in_config": True, "lower": True}),
                                    ("modelopt_fp8", {"lower": True}),
                                    ("modelopt_nvfp4", {}), ("modelopt_nvfp4", {"in_config": True}),
                                    ("modelopt_fp8", {}), ("modelopt_fp8", {"in_config": True}),
                                    ("compressed_nvfp4", {}), ("compressed_nvfp4", {"w4a4": True})])
@pytest.mark.parametrize("shards", [1, 3])
def test_released_layouts_load_exactly(tmp_path, fmt, kw, shards):
    d, out = _write(tmp_path, "t", fmt, ODD, shards=shards, **kw)
    llm = _check_loaded(d, out, kw.get("block", (128, 128)))
    mem = llm.runner.weight_memory["target"]
    fmt_name = "nvfp4" if fmt.endswith("nvfp4") else "fp8"
    assert set(mem.stored) == {fmt_name, "bf16"}
    packed = sum(v.nbytes for n, (tag, v) in out.items() if tag != "BF16" and not n.endswith("input_scale"))
    assert mem.stored[fmt_name] >= packed - sum(v.nbytes for n, (_, v) in out.items() if "scale" in n)
    codes = [n.removesuffix("_packed") for n, (tag, _) in out.items()
             if tag in ("F8_E4M3", "U8") and n.endswith((".weight", ".weight_packed"))]
    assert codes and mem.device[fmt_name] == 4 * sum(np.prod(_reference_at(out, n).shape) for n in codes)


def test_compressed_tensors_nvfp4_global_scale_divides(tmp_path):
    """compressed-tensors stores NVFP4's global scale as a divisor (w = code * scale / global): the loaded weight is
    that within float32's rounding of 1 / global, and a zero divisor is refused by name."""
    d, out = _write(tmp_path, "t", "compressed_nvfp4", ODD)
    llm = LLM(d, backend="cpu", kv_block_size=8)
    name = "model.layers.0.self_attn.o_proj.weight"
    module = name[: -len("weight")]
    divided = _nvfp4_reference(out[name + "_packed"][1], out[module + "weight_scale"][1], np.float32(1)) / \
        out[module + "weight_global_scale"][1].astype(np.float64)
    got = llm.runner.target.layers[0].o_proj
    assert np.all(np.abs(got - divided) <= 2.0 ** -22 * np.abs(divided)) and not np.array_equal(got, 0 * got)
    out[module + "weight_global_scale"] = ("F32", np.zeros(1, dtype=np.float32))
    config = json.loads((d / "config.json").read_text())
    bad = write_tagged_model(tmp_path / "bad", config, out)
    with pytest.raises(CheckpointError, match=r"o_proj.weight_global_scale' is 0.0: an NVFP4 global scale divides"):
        LLM(bad, backend="cpu", kv_block_size=8)


def test_released_fp8_dims_off_the_block_grid_use_a_row_map(tmp_path):
    d, out = _write(tmp_path, "t", "qwen_fp8", ODD)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [128, 128]
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"][1].shape == (1, 1)  # 80 x 80: one partial block
    assert out["model.layers.0.mlp.down_proj.weight_scale_inv"][1].shape == (1, 2)  # 80 x 208
    _check_loaded(d, out)


@pytest.mark.parametrize("fmt", ["qwen_fp8", "compressed_fp8", "modelopt_nvfp4", "modelopt_fp8", "compressed_nvfp4",
                                 "autofp8", "at_load"])
def test_quantized_target_speculative_greedy_equals_autoregressive(tmp_path, fmt):
    shape = TinyShape(num_layers=3, target_layer_ids=[0, 2])
    tensors, config = _target(tmp_path, shape, seed=7)
    if fmt == "at_load":
        target = write_model(tmp_path / "t", config, tensors)
        out = None
    else:
        target, out = _write(tmp_path, "t", fmt, shape)
    drafter = write_model(tmp_path / "d", draft_config(shape), draft_tensors(shape, np.random.default_rng(8), tensors))
    kw = dict(backend="cpu", kv_block_size=8, quantize="fp8" if fmt == "at_load" else None)
    prompts = [[int(x) for x in np.random.default_rng(s).integers(2, 250, 10 + s)] for s in range(3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ar = LLM(target, **kw).generate(prompts, params)
    spec = LLM(target, draft=drafter, quantize_draft=fmt == "at_load", **kw).generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar] and len(ar[0].token_ids) == 20
    assert all(r.acceptance_lengths for r in spec)  # it did run speculative steps
    if out is not None:  # the quantized model is what ran: its weights are the stored codes'
        layer = LLM(target, **kw).runner.target.layers[0]
        assert np.array_equal(layer.o_proj, _reference_at(out, "model.layers.0.self_attn.o_proj.weight"))


# ---- quantize="fp8" at load
def test_quantize_fp8_at_load_converts_projections_only(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    target = write_model(tmp_path / "t", config, tensors)
    llm = LLM(target, backend="cpu", kv_block_size=8, quantize="fp8")
    t = llm.runner.target
    ckpt = Checkpoint(target)
    q = lambda n: dequantize(quantize_fp8_block(ckpt.float32(n)))  # noqa: E731
    a = "model.layers.1.self_attn."
    assert np.array_equal(t.layers[1].qkv, np.concatenate([q(a + f"{x}_proj.weight") for x in "qkv"]))
    assert np.array_equal(t.layers[1].down, q("model.layers.1.mlp.down_proj.weight"))
    assert not np.array_equal(t.layers[1].down, ckpt.float32("model.layers.1.mlp.down_proj.weight"))
    for name, got in (("model.embed_tokens.weight", t.embed_tokens), ("lm_head.weight", t.lm_head),
                      ("model.norm.weight", t.norm), (a + "q_norm.weight", t.layers[1].q_norm)):
        assert np.array_equal(got, ckpt.float32(name)), name
    mem = llm.runner.weight_memory["target"]
    n_proj = sum(v.size for n, v in tensors.items() if n.endswith("_proj.weight"))
    # Per layer, float32 scales: q, k, v, o one block each, gate and up 2 x 1, down 1 x 2; and the fused qkv's row
    # map (int32 per row: 80 + 16 + 16 rows, off the 128-row grid).
    per_layer = 4 * (4 + 2 + 2 + 2) + 4 * 112
    assert mem.stored["fp8"] == n_proj + 2 * per_layer and mem.device["fp8"] == 4 * n_proj


def test_quantize_choices_are_checked(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    target = write_model(tmp_path / "t", config, tensors)
    with pytest.raises(ConfigError, match="quantize must be one of 'fp8', 'nvfp4'"):
        LLM(target, backend="cpu", quantize="int4")
    with pytest.raises(ConfigError, match="quantize_draft needs quantize"):
        LLM(target, backend="cpu", quantize_draft=True)
    with pytest.raises(ConfigError, match="quantize_lm_head must be true or false"):
        LLM(target, backend="cpu", quantize_lm_head="yes")
    with pytest.raises(ConfigError, match="quantize_lm_head with random weights"):
        LLM(target, backend="cpu", random_weights=True, quantize_lm_head=True)
    with pytest.raises(ConfigError, match="quantize_lm_head with tensor parallelism"):
        LLM(target, backend="cpu", quantize_lm_head=True, tensor_parallel_size=2)
    nvfp4, _ = _write(tmp_path, "n", "modelopt_nvfp4", ODD)
    with pytest.raises(ConfigError, match="already quantized as nvfp4.*requantizing"):
        LLM(nvfp4, backend="cpu", quantize="fp8")
    channel, _ = _write(tmp_path, "c", "compressed_fp8", ODD)
    with pytest.raises(ConfigError, match="already quantized as compressed-tensors"):
        LLM(channel, backend="cpu", quantize="fp8")
    fp8, out = _write(tmp_path, "f", "qwen_fp8", ODD)  # the same layout: accepted, and nothing changes
    same = LLM(fp8, backend="cpu", kv_block_size=8, quantize="fp8").runner.target
    assert np.array_equal(same.layers[0].qkv, LLM(fp8, backend="cpu", kv_block_size=8).runner.target.layers[0].qkv)
    with pytest.raises(ConfigError, match="already quantized as fp8.*requantizing"):
        LLM(fp8, backend="cpu", quantize="nvfp4")
    same = LLM(nvfp4, backend="cpu", kv_block_size=8, quantize="nvfp4").runner.target  # NVFP4 already: as stored
    assert np.array_equal(same.layers[0].qkv, LLM(nvfp4, backend="cpu", kv_block_size=8).runner.target.layers[0].qkv)


def test_quantize_nvfp4_at_load_is_the_modelopt_recipe(tmp_path):
    """quantize="nvfp4": every projection holds the exact values of quant.quantize_nvfp4 of its stored weights
    (within each 16 columns the largest magnitude maps to the scale's 6, up to E4M3 rounding); the embedding, norms
    and head stay as stored; a matrix whose K is not a multiple of 16 stays as stored too."""
    from cudflash.quant import quantize_nvfp4

    tensors, config = _target(tmp_path, ODD)
    target = write_model(tmp_path / "t", config, tensors)
    llm = LLM(target, backend="cpu", kv_block_size=8, quantize="nvfp4")
    ckpt = Checkpoint(target)
    layer = llm.runner.target.layers[0]
    want = dequantize(quantize_nvfp4(ckpt.float32("model.layers.0.mlp.down_proj.weight")))
    assert np.array_equal(layer.down, want)
    assert not np.array_equal(layer.down, ckpt.float32("model.layers.0.mlp.down_proj.weight"))
    assert np.array_equal(llm.runner.target.embed_tokens, ckpt.float32("model.embed_tokens.weight"))
    assert set(llm.runner.weight_memory["target"].stored) == {"nvfp4", "bf16"}
    w = np.linspace(-3, 3, 5 * 24, dtype=np.float32).reshape(5, 24)
    from cudflash.quant import quantize_weight
    assert quantize_weight(w, "nvfp4") is None and quantize_weight(w[:, :16], "nvfp4").format == "nvfp4"
    with_head = LLM(target, backend="cpu", kv_block_size=8, quantize="nvfp4", quantize_lm_head=True)
    assert set(with_head.runner.weight_memory["target"].stored) == {"nvfp4", "fp8", "bf16"}  # the head in FP8
    assert np.array_equal(with_head.runner.target.layers[0].down, want)
    zeros = quantize_nvfp4(np.zeros((2, 32), np.float32))
    assert not np.any(dequantize(zeros)) and zeros.global_scale[0] == 1
    assert np.isnan(dequantize(quantize_nvfp4(np.full((2, 16), np.inf, np.float32)))).all()


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head_converts_the_head_alone(tmp_path, tied):
    """quantize_lm_head: the head becomes the exact values of its 128x128 block-scaled FP8 form; a tied head is an
    FP8 copy beside the embedding, which keeps the stored rows; nothing else changes. Speculative greedy still
    equals autoregressive greedy of that model (the drafter borrows the quantized head)."""
    shape = TinyShape(num_layers=3, target_layer_ids=[0, 2], tie_word_embeddings=tied)
    tensors, config = _target(tmp_path, shape, seed=5)
    target = write_model(tmp_path / "t", config, tensors)
    drafter = write_model(tmp_path / "d", draft_config(shape), draft_tensors(shape, np.random.default_rng(6), tensors))
    ckpt = Checkpoint(target)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert ("lm_head.weight" in ckpt) != tied
    kw = dict(backend="cpu", kv_block_size=8, quantize_lm_head=True)
    llm = LLM(target, draft=drafter, **kw)
    t, plain = llm.runner.target, LLM(target, backend="cpu", kv_block_size=8).runner.target
    assert np.array_equal(t.lm_head, dequantize(quantize_fp8_block(ckpt.float32(head))))
    assert not np.array_equal(t.lm_head, plain.lm_head)
    assert np.array_equal(t.embed_tokens, plain.embed_tokens) and t.lm_head is not t.embed_tokens
    assert np.array_equal(t.layers[1].qkv, plain.layers[1].qkv) and np.array_equal(t.norm, plain.norm)
    mem = llm.runner.weight_memory["target"]
    assert mem.device["fp8"] == 4 * shape.vocab_size * shape.hidden_size  # float32 values on the numpy backend
    prompts = [[int(x) for x in np.random.default_rng(s).integers(2, 250, 9 + s)] for s in range(3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = llm.generate(prompts, params)
    ar = LLM(target, **kw).generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar] and all(r.acceptance_lengths for r in spec)


# ---- refusals
def _config_with(tmp_path: Path, qc: dict | None, hf: dict | None = None) -> Path:
    tensors, config = _target(tmp_path, ODD)
    if qc is not None:
        config["quantization_config"] = qc
    d = write_model(tmp_path / "r", config, tensors)
    if hf is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf))
    return d


CT_GROUP = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method' is 'gptq': not supported"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "mxfp4"}, "'mxfp4'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"bits": 4}, "quant_method' is missing"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme' is 'static'"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "activation_scheme' is 'per-token': expected"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt' is 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size' should be"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": CT_GROUP},
     "format' is 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": CT_GROUP},
     "'float' with 8 bits: nvfp4-pack-quantized needs 4-bit float weights"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                          "group_size": 32}}}}, "NVFP4 is tensor_group with groups of 16"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}},
     "strategy 'group'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"format": "float-quantized", "weights": {"num_bits": 4, "type": "float"}}}},
     "mixed formats are not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "initialized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                          "group_size": 16}}}}, "quantization_status' is 'initialized'"),
    ({"quant_method": "compressed-tensors", "quantization_config": {"format": "float-quantized",
                                                                   "quantization_status": "calibration",
                                                                   "config_groups": CT_GROUP}},
     "quantization_status' is 'calibration'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": CT_GROUP,
      "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}}, "transform_config' is set"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": CT_GROUP}, "'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group"}}}},
     "config_groups.g.weights' is 'float' with 4 bits"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
     "strategy' is 'group'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": CT_GROUP,
      "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config' has format 'sparse-24-bitmask'"),
    ({"quant_method": "compressed-tensors", "quantization_config": {"format": "float-quantized",
                                                                   "config_groups": CT_GROUP},
      "sparsity_config": {"format": "sparse-bitmask"}}, "sparsity_config' has format 'sparse-bitmask'"),
    ({"quant_method": "modelopt", "quant_algo": "nvfp4_awq"}, "quant_algo' is 'NVFP4_AWQ'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, "quant_algo' is 'FP8_PB_WO': not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}, "'NVFP4_AWQ'"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "'MIXED_PRECISION'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size' is 32"),
])
def test_unsupported_formats_are_refused_by_name(tmp_path, qc, message):
    d = _config_with(tmp_path, qc)
    with pytest.raises(ConfigError, match=message) as err:
        LLM(d, backend="cpu")
    assert str(d / "config.json") in str(err.value)


def test_modelopt_hf_quant_config_is_read_and_checked(tmp_path):
    hf = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A8_AWQ", "group_size": 128}}
    d = _config_with(tmp_path, None, hf)
    with pytest.raises(ConfigError, match=r"hf_quant_config.json: field 'quantization.quant_algo' is 'W4A8_AWQ'"):
        read_quant_scheme(d)
    d = _config_with(tmp_path / "b", {"quant_method": "fp8", "weight_block_size": [128, 128]},
                     {"quantization": {"quant_algo": "NVFP4"}})
    with pytest.raises(ConfigError, match="beside quant_method 'fp8'"):
        read_quant_scheme(d)
    d = _config_with(tmp_path / "c", {"quant_method": "modelopt", "quant_algo": "FP8"},
                     {"quantization": {"quant_algo": "NVFP4"}})
    with pytest.raises(ConfigError, match="quant_algo' is 'FP8' but"):
        read_quant_scheme(d)


def test_corrupt_quantized_checkpoints_name_the_tensor(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    out, qc = qwen_fp8(tensors)
    name = "model.layers.0.self_attn.k_proj.weight"

    def load(variant: dict, cfg_qc=qc, sub="x"):
        d = write_tagged_model(tmp_path / sub, {**config, "quantization_config": cfg_qc} if cfg_qc else config,
                               variant)
        LLM(d, backend="cpu")

    missing = {n: v for n, v in out.items() if n != name + "_scale_inv"}
    with pytest.raises(CheckpointError, match=r"k_proj.weight' is FP8 but its scale .*weight_scale_inv' is missing"):
        load(missing, sub="a")
    bad = {**out, name + "_scale_inv": ("F32", np.ones((2, 1), np.float32))}
    with pytest.raises(CheckpointError, match=r"weight_scale_inv' \(FP8 weight scale\) has shape \[2, 1\], "
                                              r"expected \[1, 1\]"):
        load(bad, sub="b")
    with pytest.raises(CheckpointError, match=r"has dtype F8_E4M3 .*declares no quantization_config"):
        load(out, cfg_qc=None, sub="c")
    mixed = {**out, name: ("BF16", np.zeros((16, 80), np.uint16))}  # a bf16 part fused with FP8 ones: read, checked
    del mixed[name + "_scale_inv"]
    with pytest.raises(CheckpointError, match=r"k_proj.weight' is all zeros"):
        load(mixed, sub="d")
    u8 = {**out, name: ("U8", out[name][1])}
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has dtype U8, expected F8_E4M3"):
        load(u8, sub="e")


def test_nan_codes_are_caught_by_the_weight_check(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    out, qc = qwen_fp8(tensors)
    name = "model.layers.1.mlp.down_proj.weight"
    codes = out[name][1].copy()
    codes[3, 5] = 0xFF
    d = write_tagged_model(tmp_path / "n", {**config, "quantization_config": qc}, {**out, name: ("F8_E4M3", codes)})
    with pytest.raises(CheckpointError, match="down_proj.weight' holds NaN or Inf"):
        LLM(d, backend="cpu")


def test_quantized_drafter_checkpoints_are_refused(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    target = write_model(tmp_path / "t", config, tensors)
    shape = ODD
    dcfg = {**draft_config(shape), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    drafter = write_model(tmp_path / "d", dcfg, draft_tensors(shape, np.random.default_rng(1), tensors))
    with pytest.raises(ConfigError, match="a quantized drafter checkpoint is not supported"):
        LLM(target, draft=drafter, backend="cpu")


def test_random_weights_refuse_quantize(tmp_path):
    tensors, config = _target(tmp_path, ODD)
    target = write_model(tmp_path / "t", config, tensors)
    with pytest.raises(ConfigError, match="random weights"):
        LLM(target, backend="cpu", random_weights=True, quantize="fp8")


def test_cli_quantize_reaches_the_engine_for_generate_serve_and_bench():
    from cudflash.cli import build_parser, engine_kwargs

    parser = build_parser()
    for command in ("generate", "serve"):
        args = parser.parse_args([command, "--target", "t", "--quantize", "fp8", "--quantize-draft"])
        kw = engine_kwargs(args)
        assert kw["quantize"] == "fp8" and kw["quantize_draft"] is True
        assert engine_kwargs(parser.parse_args([command, "--target", "t"]))["quantize"] is None
    assert engine_kwargs(parser.parse_args(["serve", "--target", "t", "--quantize-lm-head"]))["quantize_lm_head"]
    assert engine_kwargs(parser.parse_args(["generate", "--target", "t"]))["quantize_lm_head"] is False
    bench = parser.parse_args(["bench", "--target", "t", "--quantize", "fp8"])
    assert bench.quantize == "fp8" and bench.quantize_draft is False and bench.quantize_lm_head is False
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--target", "t", "--quantize", "int4"])


def test_generate_command_with_quantize(tmp_path, capsys):
    from cudflash.cli import main
    from cudflash.tiny import write_random_pair

    target, drafter = write_random_pair(tmp_path, TinyShape(num_layers=3, target_layer_ids=[0, 2]), seed=2)
    out = tmp_path / "out.jsonl"
    main(["generate", "--target", str(target), "--draft", str(drafter), "--backend", "cpu", "--quantize", "fp8",
          "--prompts", str(_prompt_file(tmp_path)), "--max-new-tokens", "4", "--output", str(out)])
    line = json.loads(out.read_text().splitlines()[0])
    assert len(line["token_ids"]) == 4
    assert "target weights: fp8 " in capsys.readouterr().err


def _prompt_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt_ids": [5, 6, 7, 8]}) + "\n")
    return f


# ---- the trained tiny pair, quantized
PAIR_PROMPTS, PAIR_TOKENS = 6, 64  # of its 32 dev prompts: scripts/quant_tau.py measures all of them, 128 tokens each


@pytest.mark.parametrize("variant", ["fp8 at load", "fp8 at load with the head", "nvfp4 on disk", "nvfp4 at load"])
def test_tiny_pair_quantized_speculative_greedy_equals_autoregressive(tiny_pair, tmp_path, variant):
    from tests.quant_checkpoints import copy_side_files, write_quantized

    prompts = json.loads((tiny_pair / "prompts_dev.json").read_text())["prompts"][:PAIR_PROMPTS]
    target, kw = tiny_pair / "target", {"quantize": variant[:variant.index(" ")],
                                        "quantize_lm_head": variant.endswith("head")}
    if variant == "nvfp4 on disk":
        ckpt = Checkpoint(target)
        config = json.loads((target / "config.json").read_text())
        target = write_quantized(tmp_path / "nvfp4", config, {n: ckpt.float32(n) for n in ckpt.names},
                                 "modelopt_nvfp4", shards=2)
        copy_side_files(tiny_pair / "target", target)
        kw = {}
    params = SamplingParams(max_tokens=PAIR_TOKENS, ignore_eos=True)
    llm = LLM(target, draft=tiny_pair / "drafter", backend="cpu", **kw)
    assert set(llm.runner.weight_memory["target"].stored) == {variant[:variant.index(" ")], "bf16"}
    spec = llm.generate(prompts, params)
    ar = LLM(target, backend="cpu", **kw).generate(prompts, params)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    # A real drafter still drafts for the quantized target (bf16: tau 2.2 over these 64 tokens).
    assert statistics.mean(statistics.mean(s.acceptance_lengths) for s in spec) > 1.5


# ---- memory: FP8 stays FP8 on the GPU where its bf16 form would not fit (quant/memory.py)
@pytest.mark.parametrize("fmt", ["qwen_fp8", "compressed_fp8", "modelopt_nvfp4", "compressed_nvfp4"])
def test_dequantized_bytes_count_each_weight_at_bf16(tmp_path, fmt):
    d, out = _write(tmp_path, "q", fmt, ODD)
    want = 0
    for name, (tag, arr) in out.items():
        if name.rsplit(".", 1)[-1] in ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale",
                                       "weight_global_scale", "input_global_scale"):
            continue
        codes = name.endswith((".weight", ".weight_packed")) and tag in ("F8_E4M3", "U8")
        want += arr.size * 2 * (2 if tag == "U8" else 1) if codes else arr.nbytes
    assert dequantized_bytes(Checkpoint(d), 2) == want
    bf16 = sum(a.nbytes if t == "BF16" else 0 for t, a in out.values())
    assert want > bf16  # the codes count at two bytes each


class _Tight(NumpyBackend):
    """A numpy backend that carries a CUDA tuning and a fixed budget: the runner's choice is host arithmetic."""

    def __init__(self, budget: int):
        super().__init__()
        self.tuning, self.budget = CudaTuning(), budget

    def memory_budget(self, utilization: float) -> int:
        return self.budget


@pytest.mark.parametrize("fmt,flag", [("qwen_fp8", "fp8_on_device"), ("modelopt_nvfp4", "nvfp4_on_device")])
@pytest.mark.parametrize("fits", [True, False])
def test_quantized_weights_stay_on_the_device_only_where_bf16_would_not_fit(tmp_path, fits, fmt, flag):
    d, _ = _write(tmp_path, "q", fmt, ODD)
    cfg = load_target_config(d)
    weights = dequantized_bytes(Checkpoint(d), 4)  # the numpy backend's itemsize
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 64  # one sequence of max_model_len 64
    backend = _Tight(weights + kv + (1 if fits else -1))
    ModelRunner(cfg, None, backend, max_block_size=1, max_num_seqs=1, max_model_len=64,
                target_quant=read_quant_scheme(d), num_kv_blocks=8)
    assert getattr(backend.tuning, flag) is (not fits)
    other = {"fp8_on_device", "nvfp4_on_device"} - {flag}
    assert getattr(backend.tuning, other.pop()) is False
    assert keep_quantized(10, 5, 15) is False and keep_quantized(10, 6, 15) is True


def test_a_hybrid_fp8_checkpoint_with_bf16_gates_equals_its_dequantized_values(tmp_path):
    """A Qwen3.5 FP8 release quantizes the GDN layers' wide projections (in_proj_qkv, in_proj_z, out_proj) and the
    attention and MLP, and may leave the narrow in_proj_a / in_proj_b (fused with them into one in_proj) in bf16: the
    model loads, and computes exactly what the same model holds as float32 dequantized values."""
    from cudflash.tiny_hybrid import HybridShape, write_hybrid_target
    from tests.quant_checkpoints import QUANTIZED

    base = write_hybrid_target(tmp_path / "bf16", HybridShape(), seed=3)
    ck = Checkpoint(base)
    tensors = {n: ck.float32(n) for n in ck.names}
    wide = ("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight")
    out, qc = qwen_fp8(tensors, quantized=QUANTIZED + wide)
    assert out[next(n for n in out if n.endswith("in_proj_qkv.weight"))][0] == "F8_E4M3"
    assert out[next(n for n in out if n.endswith("in_proj_b.weight"))][0] == "BF16"
    config = json.loads((base / "config.json").read_text())
    fp8 = write_tagged_model(tmp_path / "fp8", {**config, "quantization_config": qc}, out, shards=2)
    exact = {}
    for n, (tag, arr) in out.items():
        if n.endswith("weight_scale_inv"):
            continue
        if tag == "F8_E4M3":
            exact[n] = ("F32", _reference_at(out, n))
        else:
            exact[n] = (tag, arr)
    ref = write_tagged_model(tmp_path / "ref", config, exact)
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a, b = LLM(fp8, backend="cpu"), LLM(ref, backend="cpu")
    assert a.generate(prompt, params)[0].token_ids == b.generate(prompt, params)[0].token_ids
    assert "fp8" in a.runner.weight_memory["target"].stored


def test_a_hybrid_keeps_fp8_on_the_device_where_bf16_would_not_fit(tmp_path):
    """A hybrid target loads with FP8 on the device as a dense one does (its attention layers' q_proj row split and
    fused qkvg are row operations on the quantized weight: CudaBackend.take_rows / cat), and is switched to it where
    bf16 would not fit."""
    from cudflash.tiny_hybrid import HybridShape, write_hybrid_target

    d = write_hybrid_target(tmp_path / "h", HybridShape(), seed=1)
    cfg = load_target_config(d)
    backend = _Tight(2**40)
    backend.tuning = CudaTuning(fp8_on_device=True)
    ModelRunner(cfg, None, backend, max_block_size=1, max_num_seqs=1, max_model_len=64, quantize="fp8",
                num_kv_blocks=8)
    assert backend.tuning.fp8_on_device is True
    tight = _Tight(1)
    ModelRunner(cfg, None, tight, max_block_size=1, max_num_seqs=1, max_model_len=64, quantize="fp8",
                num_kv_blocks=8)
    assert tight.tuning.fp8_on_device is True


def test_only_prefill_and_drafter_rows_are_named_inexact(tiny_pair, monkeypatch):
    """ModelRunner names the rows a backend may round unlike a decode (Backend.inexact_rows; the CUDA backend runs
    their FP8 products W8A8): a target forward's prefill-chunk rows, which lead its rows, and every row of a drafter
    forward; never a verify's or a decode's row. Prefill is chunked here (64 tokens a step) so that steps mix chunks
    with verifies."""
    from contextlib import contextmanager

    from cudflash.models.dflash import DFlashDraftModel
    from cudflash.models.target import TargetModel

    named, forwards = [], []

    @contextmanager
    def inexact_rows(self, rows):
        named.append(rows)
        yield

    def spy(kind, real):
        def forward(self, batch, *a, **kw):
            cu = batch.meta.cu_seqlens_q
            forwards.append((kind, named[-1], int(cu[-1]), int(cu[getattr(batch, "chunked_seqs", 0)])))
            return real(self, batch, *a, **kw)
        return forward

    monkeypatch.setattr(NumpyBackend, "inexact_rows", inexact_rows)
    monkeypatch.setattr(TargetModel, "forward", spy("target", TargetModel.forward))
    monkeypatch.setattr(DFlashDraftModel, "forward", spy("draft", DFlashDraftModel.forward))
    prompts = json.loads((tiny_pair / "prompts_dev.json").read_text())["prompts"][:3]
    llm = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cpu", max_num_seqs=3,
              max_num_batched_tokens=64)
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    targets = [f for f in forwards if f[0] == "target"]
    for kind, inexact, rows, prefill_rows in forwards:
        assert inexact == (prefill_rows if kind == "target" else rows), (kind, inexact, rows, prefill_rows)
    assert any(0 < f[3] < f[2] for f in targets)  # a step mixing prefill chunks and verifies
    assert any(f[3] == 0 for f in targets) and any(f[0] == "draft" for f in forwards)
