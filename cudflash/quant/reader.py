"""Quantized tensors read from a checkpoint as the release stores them, into QuantizedWeight (quant/weight.py).

A module `<m>` is quantized when `<m>.weight` holds packed codes (F8_E4M3, or U8 for NVFP4); its scales sit beside
it under the names of its format:
- fp8 (Qwen -FP8): `<m>.weight` F8_E4M3 [N, K], `<m>.weight_scale_inv` F32 or BF16 [cdiv(N, rows), cdiv(K, cols)];
- compressed-tensors: `<m>.weight` F8_E4M3 [N, K], `<m>.weight_scale` float [N, 1] (channel), [1] or [] (tensor)
  or [cdiv(N, rows), cdiv(K, cols)] (block); optional `<m>.input_scale`;
- ModelOpt FP8 and AutoFP8 (`quant_method: fp8` without blocks): `<m>.weight` F8_E4M3 [N, K], `<m>.weight_scale`
  F32 [] or [1] (per tensor), `<m>.input_scale`;
- ModelOpt NVFP4: `<m>.weight` U8 [N, K / 2], `<m>.weight_scale` F8_E4M3 [N, K / 16], `<m>.weight_scale_2` F32
  [] or [1], optional `<m>.input_scale` F32;
- compressed-tensors NVFP4 (nvfp4-pack-quantized): `<m>.weight_packed` U8 [N, K / 2] (the same nibble order),
  `<m>.weight_scale` F8_E4M3 [N, K / 16], `<m>.weight_global_scale` F32 [1], optional `<m>.input_global_scale`.
Scales multiply (w = code * scale) in all of them; only the name differs (`_inv`: the inverse of the quantizer's
scale), except compressed-tensors' NVFP4 global scale, a divisor (w = code * scale / global): it is read as
1 / global rounded once to float32 (what vLLM does too), a relative 2^-24 from the division at most.
"""
from __future__ import annotations

import numpy as np

from cudflash.checkpoint import FLOAT_DTYPES, Checkpoint, bf16_bits_to_float32
from cudflash.errors import CheckpointError
from cudflash.model_files import shown
from cudflash.quant.scheme import QuantScheme
from cudflash.quant.weight import NVFP4_GROUP, QuantizedWeight, cdiv

PACKED_DTYPES = ("F8_E4M3", "U8")


def stored_name(ckpt: Checkpoint, name: str) -> str:
    """The checkpoint's name for the tensor `name`: compressed-tensors' packed formats store a module's codes as
    `<m>.weight_packed` where every other format (and the models) say `<m>.weight`."""
    if name not in ckpt and name.endswith(".weight") and name + "_packed" in ckpt:
        return name + "_packed"
    return name


def is_quantized(ckpt: Checkpoint, name: str) -> bool:
    name = stored_name(ckpt, name)
    return name in ckpt and ckpt.info(name).dtype in PACKED_DTYPES


def _float32(ckpt: Checkpoint, name: str, shapes: list[tuple[int, ...]], what: str) -> np.ndarray:
    info = ckpt.info(name)  # names the missing tensor
    if info.shape not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(f"{info.file}: tensor {shown(name)} ({what}) has shape {list(info.shape)}, expected "
                              f"{want}")
    dtype, raw = ckpt.typed(name, FLOAT_DTYPES, None, what)
    return bf16_bits_to_float32(raw) if dtype == "BF16" else np.array(raw, dtype=np.float32)


def read_quantized(ckpt: Checkpoint, name: str, shape: tuple[int, ...], scheme: QuantScheme | None
                   ) -> QuantizedWeight | None:
    """The tensor `name` (a `.weight` of logical shape [N, K]) as a QuantizedWeight, or None when the checkpoint
    stores it unquantized. CheckpointError when its codes or scales do not match the declared format."""
    stored = stored_name(ckpt, name)
    info = ckpt.info(stored)
    if info.dtype not in PACKED_DTYPES:
        return None
    where = f"{info.file}: tensor {shown(stored)}"
    if scheme is None:
        raise CheckpointError(f"{where} has dtype {info.dtype} (quantized) but {ckpt.dir / 'config.json'} declares "
                              f"no quantization_config")
    if len(shape) != 2 or not name.endswith(".weight"):
        raise CheckpointError(f"{where} has dtype {info.dtype}, but only linear weights [N, K] can be quantized here "
                              f"(expected shape {list(shape)} as a float tensor)")
    module = name[: -len("weight")]
    n, k = shape
    if scheme.format == "nvfp4":
        return _nvfp4(ckpt, stored, module, n, k, where)
    if info.dtype != "F8_E4M3":
        raise CheckpointError(f"{where} has dtype {info.dtype}, expected F8_E4M3 ({scheme.method} FP8, declared in "
                              f"{scheme.source})")
    _, data = ckpt.typed(name, ("F8_E4M3",), (n, k))
    scale_name = module + scheme.scale_name
    if scale_name not in ckpt:
        raise CheckpointError(f"{where} is FP8 but its scale {shown(scale_name)} is missing")
    input_scale = (_float32(ckpt, module + "input_scale", [(), (1,)], "activation scale")
                   if module + "input_scale" in ckpt else None)
    shapes: dict[tuple[int, ...], tuple[int, int]] = {}  # scale shape -> the block it implies
    if scheme.method == "fp8" or "block" in scheme.strategies:
        bn, bk = scheme.block
        shapes[(cdiv(n, bn), cdiv(k, bk))] = (bn, bk)
    if scheme.method in ("compressed-tensors", "modelopt-fp8", "fp8-tensor"):
        if "channel" in scheme.strategies:
            shapes[(n, 1)] = (1, k)
        if "tensor" in scheme.strategies:
            shapes.update({(): (n, k), (1,): (n, k), (1, 1): (n, k)})
    scale = _float32(ckpt, scale_name, list(shapes), "FP8 weight scale")
    block = shapes[scale.shape]
    scale = scale.reshape(cdiv(n, block[0]), cdiv(k, block[1]))  # [S, cdiv(K, cols)]: a scalar becomes [1, 1]
    return QuantizedWeight("fp8", (n, k), np.ascontiguousarray(data), scale, block, input_scale=input_scale,
                           source=f"{info.file.name}: {name}")


def _nvfp4(ckpt: Checkpoint, name: str, module: str, n: int, k: int, where: str) -> QuantizedWeight:
    if k % NVFP4_GROUP:
        raise CheckpointError(f"{where}: NVFP4 needs K = {k} to be a multiple of {NVFP4_GROUP}")
    _, data = ckpt.typed(name, ("U8",), (n, k // 2), "NVFP4 packed weight")
    packed = name.endswith("_packed")  # compressed-tensors: a divisor global scale, other names
    scale_name = module + "weight_scale"
    global_name = module + ("weight_global_scale" if packed else "weight_scale_2")
    for needed in (scale_name, global_name):
        if needed not in ckpt:
            raise CheckpointError(f"{where} is NVFP4 but {shown(needed)} is missing")
    _, scale = ckpt.typed(scale_name, ("F8_E4M3",), (n, k // NVFP4_GROUP), "NVFP4 block scale")
    global_scale = _float32(ckpt, global_name, [(), (1,)], "NVFP4 global scale").reshape(1)
    if packed:
        if not (np.isfinite(global_scale).all() and (global_scale != 0).all()):
            raise CheckpointError(f"{ckpt.info(global_name).file}: tensor {shown(global_name)} is "
                                  f"{float(global_scale[0])}: an NVFP4 global scale divides the weight, so it must be "
                                  f"finite and nonzero (a corrupt checkpoint)")
        global_scale = (np.float32(1) / global_scale).astype(np.float32)
    act_name = module + ("input_global_scale" if packed else "input_scale")
    input_scale = _float32(ckpt, act_name, [(), (1,)], "activation scale") if act_name in ckpt else None
    return QuantizedWeight("nvfp4", (n, k), np.ascontiguousarray(data), np.ascontiguousarray(scale),
                           (1, NVFP4_GROUP), global_scale, input_scale=input_scale,
                           source=f"{ckpt.info(name).file.name}: {name}")
