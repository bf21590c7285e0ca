"""The user's quantization choices (`LLM(quantize=..., quantize_draft=...)`, `--quantize`, `--quantize-draft`) checked
against what the checkpoints already are, before anything loads.

- quantize=None: every checkpoint loads as stored (quantized releases included).
- quantize="fp8": the target's bf16 / f16 / f32 projection weights become 128x128 block-scaled FP8 at load. On a
  checkpoint that is already block-scaled FP8 with 128x128 blocks (the Qwen -FP8 layout) it is a no-op: the
  release's codes, scales and unquantized modules are kept as they are. On any other quantized checkpoint it is
  refused: that would be dequantize-then-requantize, which changes a released model.
- quantize="nvfp4": the same into NVFP4 (the ModelOpt weight recipe, quant.quantize_nvfp4: weight-only, no
  calibration); a no-op on an NVFP4 checkpoint, refused on any other quantized one.
- quantize_lm_head: the target's LM head (or, for tied embeddings, a copy of the embedding as the head, the embedding
  itself staying as stored) becomes 128x128 block-scaled FP8 at load, on any target: every decode, verify and
  propose step reads it (the drafter borrows it), 1.24 GB of bf16 at Qwen3-8B. Off by default: the releases keep
  their heads in bf16, and the logits move by FP8 rounding (the tau change is measured in docs/quantization.md).
- quantize_draft: the drafter gets the same conversion (default off: the drafter stays bf16; which is faster for the
  whole step is measured on the GPU, docs/quantization.md). Quantized drafter checkpoints are refused: none is
  released, and their layout would be a guess.
"""
from __future__ import annotations

from pathlib import Path

from cudflash.errors import ConfigError
from cudflash.quant.scheme import QuantScheme, read_quant_scheme
from cudflash.quant.weight import FP8_BLOCK

QUANTIZE_CHOICES = ("fp8", "nvfp4")


def check_quantize(target: str | Path, draft: str | Path | None, quantize: object, quantize_draft: object,
                   random_weights: bool, quantize_lm_head: object = False,
                   tensor_parallel_size: int = 1) -> QuantScheme | None:
    """The target's own quantization (None: unquantized), after refusing choices that cannot be honoured."""
    if not isinstance(quantize_lm_head, bool):
        raise ConfigError(f"quantize_lm_head must be true or false, got {quantize_lm_head!r}")
    if quantize_lm_head and random_weights:
        raise ConfigError("quantize_lm_head with random weights is not supported: bench --synthetic --weights fp8 "
                          "--quantize-lm-head makes an FP8 head on the device")
    if quantize_lm_head and tensor_parallel_size != 1:
        raise ConfigError("quantize_lm_head with tensor parallelism is not supported yet (a rank's vocabulary "
                          "slice of the head would need its own scales)")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"quantize must be one of {', '.join(map(repr, QUANTIZE_CHOICES))} or None, got "
                          f"{quantize!r}")
    if not isinstance(quantize_draft, bool):
        raise ConfigError(f"quantize_draft must be true or false, got {quantize_draft!r}")
    if quantize_draft and quantize is None:
        raise ConfigError("quantize_draft needs quantize (e.g. quantize='fp8' / --quantize fp8)")
    if draft is not None and read_quant_scheme(draft) is not None:
        raise ConfigError(f"{Path(draft) / 'config.json'}: a quantized drafter checkpoint is not supported; give the "
                          f"bf16 drafter (quantize_draft=True / --quantize-draft quantizes it at load)")
    if random_weights:
        if quantize is not None:
            raise ConfigError("quantize with random weights is not supported: bench --synthetic makes its FP8 "
                              "weights on the device with --weights fp8")
        return None
    scheme = read_quant_scheme(target)
    same = scheme is not None and ((quantize == "fp8" and scheme.method == "fp8" and scheme.block == FP8_BLOCK) or
                                   (quantize == "nvfp4" and scheme.format == "nvfp4"))
    if quantize is not None and scheme is not None and not same:
        raise ConfigError(f"{scheme.source}: quantize={quantize!r} on a checkpoint already quantized as "
                          f"{scheme.method}{'' if scheme.block is None else ' ' + str(list(scheme.block))}: "
                          f"requantizing a released model is refused; load it without quantize")
    return scheme
