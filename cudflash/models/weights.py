"""Where weights come from: a checkpoint, tensor by tensor with shape checks, or random values made on the
backend itself (synthetic benchmarks: per-step time does not depend on the weights' values).

A quantized tensor (a released FP8 / NVFP4 checkpoint, or quantize="fp8" at load) is read as a QuantizedWeight
(cudflash/quant) and handed to `Backend.load_quantized`, which returns the backend's linear weight: the models take
it where they take a bf16 weight and never ask which it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint, bf16_bits_to_float32
from cudflash.model_files import shown
from cudflash.errors import CheckpointError
from cudflash.quant import QuantizedWeight, QuantScheme, concat_rows, dequantize, quantize_weight, read_quantized
from cudflash.quant.reader import is_quantized, stored_name


# Tensors no real model holds as all zeros: the embedding, the LM head and every projection matrix (a zero bias,
# a neutral DFlash2 selector or an identity-initialised conv kernel projection are legitimate and not listed).
NONZERO_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                    "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "fc.weight")


# The linear weights quantize="fp8" converts: every projection of the attention and the MLP. The embedding, the LM
# head and the norms stay as the checkpoint has them (as in the Qwen -FP8 releases); so do the drafter's fc and
# head tensors when the drafter is quantized too.
QUANTIZE_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                     "up_proj.weight", "down_proj.weight")


@dataclass
class WeightMemory:
    """Bytes of the loaded weights per format ("bf16", "f32", "fp8", "nvfp4", ...): as the checkpoint stores them
    (for quantize="fp8": as quantized at load) and as the backend holds them."""

    stored: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)

    def add(self, fmt: str, stored: int, device: int) -> None:
        self.stored[fmt] = self.stored.get(fmt, 0) + stored
        self.device[fmt] = self.device.get(fmt, 0) + device

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    def describe(self) -> str:
        """e.g. 'fp8 8.19 GB (on the device 16.38 GB), bf16 1.24 GB (on the device 1.24 GB)'."""
        return ", ".join(f"{fmt} {_size(self.stored[fmt])} (on the device {_size(self.device[fmt])})"
                         for fmt in sorted(self.stored, key=lambda f: -self.stored[f]))


def _size(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


class WeightLoader:
    """Tensors of a checkpoint onto the backend, each checked against the shape the model expects and, unless
    the checkpoint is trusted (check_weights=False), refused when it holds NaN / Inf or, for the tensors in
    NONZERO_SUFFIXES, nothing but zeros: one reduction per tensor on the backend, after its conversion.

    `quant`: the checkpoint's declared quantization (quant.read_quant_scheme); its quantized tensors load through
    Backend.load_quantized, every other tensor as it is stored. `quantize`: "fp8" / "nvfp4" turns the bf16 / f16 /
    f32 tensors in QUANTIZE_SUFFIXES into 128x128 block-scaled FP8 / NVFP4 as they are read (quant.quantize_weight;
    NVFP4 leaves a matrix whose K is not a multiple of 16 as stored). `quantize_lm_head`: the LM head (`lm_head.weight`,
    or the tied head: `tied_head`) into block-scaled FP8, whatever `quantize` says."""

    def __init__(self, ckpt: Checkpoint, backend: Backend, prefix: str = "",
                 progress: Callable[[int], None] | None = None, check_weights: bool = True,
                 quant: QuantScheme | None = None, quantize: str | None = None, quantize_lm_head: bool = False):
        self.ckpt, self.backend, self.prefix = ckpt, backend, prefix
        self.progress = progress  # called with the bytes of each tensor loaded
        self.check_weights = check_weights
        self.quant, self.quantize, self.quantize_lm_head = quant, quantize, quantize_lm_head
        self.memory = WeightMemory()

    def has(self, name: str) -> bool:
        return stored_name(self.ckpt, self.prefix + name) in self.ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        return self._upload(self.prefix + name, self.read(name, shape))

    def tied_head(self, embed_name: str, embedding: Any, shape: tuple[int, int]) -> Any:
        """The LM head of tied embeddings: the embedding itself, or with quantize_lm_head an FP8 copy of it (the
        lookup keeps the stored rows)."""
        if not self.quantize_lm_head:
            return embedding
        return self._upload(self.prefix + embed_name, self.read(embed_name, shape, quantize=True))

    def _quantizes(self, name: str) -> str | None:
        """The format `name`, read as stored in bf16 / f16 / f32, is quantized to at load (None: kept as stored)."""
        if self.quantize_lm_head and name == "lm_head.weight":
            return "fp8"
        return self.quantize if self.quantize is not None and name.endswith(QUANTIZE_SUFFIXES) else None

    def get_slices(self, name: str, shape: tuple[int, ...], axis: int, ranges: list[range]) -> Any:
        """The tensor's indices `ranges` along `axis`, concatenated (a tensor-parallel rank's shard): checked
        against the whole `shape`, sliced on the host before the upload, so a rank holds only its part."""
        w = self.read(name, shape)
        if isinstance(w, QuantizedWeight):
            raise CheckpointError(f"{shown(self.prefix + name)}: tensor parallelism over quantized weights is not "
                                  f"there yet (their scales would be sliced with the codes)")
        dtype, raw = w
        part = np.concatenate([np.take(raw, np.arange(r.start, r.stop), axis=axis) for r in ranges], axis=axis)
        return self._upload(self.prefix + name, (dtype, part))

    def read(self, name: str, shape: tuple[int, ...], quantize: bool | None = None
             ) -> QuantizedWeight | tuple[str, np.ndarray]:
        """The tensor as the backend will get it, checked against `shape` (logical: [N, K] for a packed weight):
        a QuantizedWeight, or (safetensors dtype, read-only storage view). quantize: turn a stored bf16 / f16 / f32
        matrix into block-scaled FP8 (default: as `quantize` says for its name)."""
        fmt = self._quantizes(name) if quantize is None else "fp8" if quantize else None
        full = self.prefix + name
        if self.quant is not None or is_quantized(self.ckpt, full):
            qw = read_quantized(self.ckpt, full, shape, self.quant)
            if qw is not None:
                self._progress(qw.nbytes + (qw.input_scale.nbytes if qw.input_scale is not None else 0))
                return qw
        dtype, raw = self.ckpt.raw(full, shape)
        self._progress(raw.nbytes)
        if len(shape) == 2 and fmt is not None:
            w = bf16_bits_to_float32(raw) if dtype == "BF16" else raw.astype(np.float32)
            qw = quantize_weight(w, fmt, source=f"{self.ckpt.info(full).file.name}: {full}, quantized at load")
            if qw is not None:
                return qw
        return dtype, raw

    def _progress(self, nbytes: int) -> None:
        if self.progress:
            self.progress(nbytes)

    def _upload(self, full: str, w: QuantizedWeight | tuple[str, np.ndarray]) -> Any:
        if isinstance(w, QuantizedWeight):
            x = self.backend.load_quantized(w)
            fmt, stored = w.format, w.nbytes
        else:
            dtype, raw = w
            x = self.backend.load(dtype, raw)
            fmt, stored = dtype.lower(), raw.nbytes
        if self.check_weights:
            self._check_values(full, x)
        self.memory.add(fmt, stored, int(x.nbytes))
        return x

    def _upload_dense(self, full: str, w: QuantizedWeight) -> Any:
        """A quantized weight as a plain array of the backend's activation dtype: its exact float32 values (what
        every backend's load_quantized rounds from), for a row concatenation with unquantized parts."""
        x = self.backend.load("F32", dequantize(w))
        if self.check_weights:
            self._check_values(full, x)
        self.memory.add(w.format, w.nbytes, int(x.nbytes))
        return x

    def _check_values(self, name: str, x: Any) -> None:
        stored = stored_name(self.ckpt, name)
        where = f"{self.ckpt.info(stored).file}: tensor {shown(stored)}"
        if not self.backend.all_finite(x):
            raise CheckpointError(f"{where} holds NaN or Inf values (a corrupt or diverged checkpoint)")
        if name.endswith(NONZERO_SUFFIXES) and not self.backend.any_nonzero(x):
            raise CheckpointError(f"{where} is all zeros, which no trained model has (an uninitialised or "
                                  f"corrupt checkpoint)")

    def fused(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
        """Concatenate along the output dimension (rows), e.g. q/k/v -> qkv. Parts all quantized are concatenated as
        codes and scales, each part's scales kept (quant.concat_rows); where only some are, the quantized ones are
        dequantized (their exact float32 values, as the backend's activation dtype) and the rows concatenated."""
        names = [self.prefix + n for n, _ in names_and_shapes]
        parts = [self.read(n, s) for n, s in names_and_shapes]
        packed = [isinstance(p, QuantizedWeight) for p in parts]
        if not any(packed):
            return self.backend.cat([self._upload(n, p) for n, p in zip(names, parts)], axis=0)
        if not all(packed):  # e.g. a hybrid's in_proj: qkv and z quantized, the narrow a and b left in bf16
            return self.backend.cat([self._upload_dense(n, p) if isinstance(p, QuantizedWeight) else self._upload(n, p)
                                     for n, p in zip(names, parts)], axis=0)
        try:
            return self._upload(names[0], concat_rows(parts, names))
        except ValueError as e:
            raise CheckpointError(f"{self.ckpt.dir}: {e}") from None

    def gate_up(self, gate: str, up: str, shape: tuple[int, int]) -> Any:
        """The MLP's gate and up projections [I, H] as the backend's fused gate_up weight (Backend.swiglu)."""
        return self.backend.gate_up_weight(self.get(gate, shape), self.get(up, shape))


def lm_head(loader: WeightLoader | RandomWeights, tied: bool, embed_name: str, embedding: Any,
            shape: tuple[int, int]) -> Any:
    """A target's LM head [V, H]: `lm_head.weight` unless the embeddings are tied and the checkpoint has none, then
    the embedding itself (or its FP8 copy: quantize_lm_head, the loader's tied_head)."""
    if tied and not loader.has("lm_head.weight"):
        return loader.tied_head(embed_name, embedding, shape)
    return loader.get("lm_head.weight", shape)


class RandomWeights:
    """The WeightLoader interface over random values: matrices ~ N(0, std^2), vectors (norms, biases) ~ 1."""

    def __init__(self, backend: Backend, seed: int = 0, std: float = 0.02, untied: bool = True):
        self.backend, self.seed, self.std, self.untied = backend, seed, std, untied
        self.count = 0

    def has(self, name: str) -> bool:
        return name == "lm_head.weight" and self.untied

    def tied_head(self, embed_name: str, embedding: Any, shape: tuple[int, int]) -> Any:
        return embedding

    def get(self, name: str, shape: tuple[int, ...]) -> Any:
        self.count += 1
        if len(shape) == 1:
            return self.backend.load("F32", np.ones(shape, dtype=np.float32))
        return self.backend.random(shape, self.std, self.seed + self.count)

    def fused(self, names_and_shapes: list[tuple[str, tuple[int, ...]]]) -> Any:
        rows = sum(s[0] for _, s in names_and_shapes)
        return self.get(names_and_shapes[0][0], (rows,) + tuple(names_and_shapes[0][1][1:]))

    def gate_up(self, gate: str, up: str, shape: tuple[int, int]) -> Any:
        return self.get(gate, (2 * shape[0], shape[1]))  # random either way: the row order does not matter
