"""Whether FP8 / NVFP4 weights stay quantized on the GPU. By default the CUDA backend dequantizes them to bf16 at load
(the step's many-row GEMMs are faster on bf16: docs/quantization.md); a target whose bf16 form would not leave room
for the KV cache of one sequence of max_model_len tokens keeps its codes instead, so that it runs at all."""
from __future__ import annotations

import math

from cudflash.checkpoint import Checkpoint
from cudflash.quant.reader import PACKED_DTYPES

_SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale", "weight_global_scale",
           "input_global_scale")


def dequantized_bytes(ckpt: Checkpoint, itemsize: int) -> int:
    """Device bytes of the checkpoint's tensors with every quantized weight dequantized to `itemsize` bytes per
    element (an NVFP4 byte holds two codes) and its scales gone; every other tensor as stored (tensors the model
    skips, such as a vision tower, count too: an upper bound)."""
    total = 0
    for name in ckpt.names:
        info = ckpt.info(name)
        if name.rsplit(".", 1)[-1] in _SCALES:
            continue
        elements = math.prod(info.shape)
        if name.endswith((".weight", ".weight_packed")) and info.dtype in PACKED_DTYPES:
            total += elements * itemsize * (2 if info.dtype == "U8" else 1)
        else:
            total += info.nbytes
    return total


def keep_quantized(bf16_weight_bytes: int, min_kv_bytes: int, budget: int) -> bool:
    """True when weights of `bf16_weight_bytes` (dequantized) and the least KV cache the engine starts with do not
    fit in `budget` (the device memory the weights and the KV cache may take)."""
    return bf16_weight_bytes + min_kv_bytes > budget
