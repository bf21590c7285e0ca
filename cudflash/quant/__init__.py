"""Quantized weights: the released formats read as they are on disk (FP8 block / channel / tensor scales, NVFP4),
quantization to block-scaled FP8 or NVFP4 at load, and their exact float32 values (docs/quantization.md)."""
from cudflash.quant.reader import read_quantized
from cudflash.quant.scheme import QuantScheme, read_quant_scheme
from cudflash.quant.weight import (QuantizedWeight, concat_rows, dequantize, quantize_fp8_block, quantize_nvfp4,
                                   quantize_weight)

__all__ = ["QuantScheme", "QuantizedWeight", "concat_rows", "dequantize", "quantize_fp8_block", "quantize_nvfp4",
           "quantize_weight", "read_quant_scheme", "read_quantized"]
