"""Quantized weights on the GPU: load_quantized dequantizes to the numpy backend's float32 values rounded once to
bf16, or with tuning.fp8_on_device keeps FP8 as codes and scales whose bf16 form has those bits (NVFP4 always
dequantized), for every format and a fused weight off the block grid; and the tiny pair quantized to FP8 at load:
speculative greedy equals autoregressive greedy."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash import LLM, SamplingParams
from cudflash.quant import QuantizedWeight, concat_rows, dequantize, quantize_fp8_block
from cudflash.tiny import float32_to_bf16_bits


def _bf16_bits(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(x.view(cupy.uint16))


def _weights(rng) -> list[QuantizedWeight]:
    fp8 = quantize_fp8_block(rng.standard_normal((300, 200)).astype(np.float32))
    fused = concat_rows([quantize_fp8_block(rng.standard_normal((n, 200)).astype(np.float32)) for n in (80, 16, 16)],
                        ["q", "k", "v"])
    channel = QuantizedWeight("fp8", (64, 96), rng.integers(0, 0x7E, (64, 96)).astype(np.uint8),
                              rng.uniform(1e-3, 1, (64, 1)).astype(np.float32), (1, 96))
    nvfp4 = QuantizedWeight("nvfp4", (48, 64), rng.integers(0, 256, (48, 32)).astype(np.uint8),
                            rng.integers(0, 0x7E, (48, 4)).astype(np.uint8), (1, 16), np.array([0.03], np.float32))
    return [fp8, fused, channel, nvfp4]


@pytest.mark.parametrize("fp8_on_device", [False, True])
def test_load_quantized_is_numpy_rounded_to_bf16(rng, fp8_on_device):
    """NVFP4 is dequantized at load; FP8 too by default, and with tuning.fp8_on_device it stays FP8 on the device
    (Fp8Weight), whose bf16 form for the many-row GEMMs has the same bits."""
    from cudflash.backends.cuda_backend import CudaBackend
    from cudflash.backends.fp8_weight import Fp8Weight, dequantize_bf16

    cb = CudaBackend(tuning={"fp8_on_device": fp8_on_device})
    for w in _weights(rng):
        want = float32_to_bf16_bits(dequantize(w))
        got = cb.load_quantized(w)
        assert isinstance(got, Fp8Weight) == (fp8_on_device and w.format == "fp8")
        if isinstance(got, Fp8Weight):
            got = dequantize_bf16(got, cb.act, cb.tuning)
        assert np.array_equal(_bf16_bits(got), want), w.format


@pytest.mark.parametrize("fp8_on_device", [False, True])
def test_tiny_pair_fp8_at_load_on_the_gpu(tiny_pair, fp8_on_device):
    import json

    prompts = json.loads((tiny_pair / "prompts_dev.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    tuning = {"fp8_on_device": fp8_on_device}
    gpu = LLM(tiny_pair / "target", draft=tiny_pair / "drafter", backend="cuda", quantize="fp8", tuning=tuning)
    spec = gpu.generate(prompts, params)
    ar = LLM(tiny_pair / "target", backend="cuda", quantize="fp8", tuning=tuning).generate(prompts, params)
    same = sum(s.token_ids == a.token_ids for s, a in zip(spec, ar))
    assert same >= int(np.ceil(0.95 * len(prompts))), f"spec == AR on {same} of {len(prompts)} prompts"
