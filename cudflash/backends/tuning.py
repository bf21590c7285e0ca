"""The CUDA backend's tuning: one frozen value handed to `CudaBackend(tuning=...)` and read from there by every
user (the kernel loader, the stream GEMM, attention, the graph runner), so two backends in one process may be tuned
differently and nothing can be flipped after a kernel is compiled or a plan cached. Users: `LLM(..., tuning=...)`
(a CudaTuning or a dict) and `cudflash bench --tune NAME=VALUE`.

Only choices still worth an A/B on the hardware are fields; the defaults are the measured best (BENCHMARKS.md).
Facts of a kernel (tile sizes mirrored from a .cu file) and settled choices are constants of their module.
"""
from __future__ import annotations

import functools
import os
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from cudflash.errors import ConfigError


@dataclass(frozen=True)
class CudaTuning:
    # Kernels inside a captured CUDA graph are launched with programmatic dependent launch (pdl.py) and may start
    # while the kernel in front drains. Off: plain launches, to compare tokens and to see what the boundaries cost.
    pdl: bool = True
    # Plain decoding queues step k + 1 before it waits for step k's tokens (the graph runner).
    run_ahead: bool = True
    # Weight ring stages a stream GEMM CTA requests before griddepcontrol.wait; the rest follow the wait. No bit
    # depends on it (kernels/stream_gemm.cu).
    stream_gemm_prefill_stages: int = 2
    # Shared memory (KiB) of a stream GEMM whose caller says the kernels in front leave HBM idle (prefetch_all: the
    # GEMM after attention or the GDN mixer): its ring fills it and every stage is requested before the wait, so
    # most of the weight arrives while those kernels run. 0 (the default): such GEMMs are planned like the others.
    # It must leave room for the CTA in front on the SM (an attention CTA), or the GEMM's CTAs cannot start early.
    # An A/B switch: on its own no faster (BENCHMARKS.md, session 33), since the GEMM's CTAs on the SMs of the
    # attention combine start only when it ends.
    stream_gemm_prefetch_all_kib: int = 0
    # A stream GEMM over an FP8 / NVFP4 weight deepens its ring to at least this many stages where the shared memory
    # allows (the same blocks and grid: no bit changes): within what it requests anyway with x resident (decode
    # rows), within WIDE_SMEM_BUDGET with x in boxes (a verify's); 0 keeps the plan's. A quantized stage is small
    # (NVFP4's gate_up: 18 KB resident, 34 KB boxed), so 2 or 3 of them hold too little in flight. On an H100 at the
    # 8B, 4 took the AR step 2.56 -> 2.47 ms (NVFP4) and 3.34 -> 3.29 (FP8), and the verify 3.10 -> 3.03 (NVFP4) and
    # 3.92 -> 3.87 (FP8); a full ring slowed the GEMMs it took past 4 stages, 8 was slower on the 4B, and bf16, whose
    # stages are twice as large, was even or slower, so bf16 keeps its plans (BENCHMARKS.md, sessions 35-36). The
    # stages before the wait stay stream_gemm_prefill_stages.
    stream_gemm_quantized_stages: int = 4
    # Every kernel's preferred shared-memory carveout (percent of the SM's unified L1 / shared memory; -1: the
    # driver's choice). An SM configured for a kernel of little shared memory cannot take a stream GEMM CTA until
    # it drains, so a GEMM launched early under PDL finds no room on the SMs of a small kernel in front of it.
    # An A/B switch: 100 lets those CTAs start early, but costs the L1 of the kernels that use it (session 33).
    shared_memory_carveout: int = -1
    # The kernels shared_memory_carveout applies to: those whose name (a template's with its arguments) starts with
    # one of these, e.g. attn_combine, the kernel in front of o_proj; empty: every kernel.
    shared_memory_carveout_kernels: tuple[str, ...] = ()
    # Weights of at least this many bytes take the stream GEMM at 1..16 rows, smaller ones cuBLAS. Larger than
    # every weight: cuBLAS throughout.
    stream_gemm_min_bytes: int = 8 << 20
    # Decode and verify attention keep the row-invariant launch shape (a verify row has the bits of its decode, so
    # greedy speculation reproduces greedy decoding exactly) while the context bucket is at most this many keys;
    # longer contexts take the faster shape and agree up to bf16 rounding (cuda_attention.py). At most
    # INVARIANT_CONTEXT_LIMIT.
    invariant_max_context: int = 512
    # FP8 checkpoints (and quantize="fp8") keep their E4M3 codes on the device, at half the weight memory, and the
    # linear ops read them (fp8_weight.py). Off: dequantized to bf16 at load. Off by default while the FP8 path is
    # slower where it counts: a verify of more than quantized_stream_max_rows rows streams the codes once per 16 rows
    # to keep its decodes' bits (batch 8: 24.4 ms against bf16's 6.2, BENCHMARKS.md session 20).
    fp8_on_device: bool = False
    # NVFP4 checkpoints keep their 4-bit codes on the device (fp4_weight.py, 0.56 bytes per weight) and the linear
    # ops read them. Off: dequantized to bf16 at load. Off by default for the reason FP8 is: a large verify streams
    # the codes once per 16 rows.
    nvfp4_on_device: bool = False
    # A weight whose whole-block plan leaves many SMs idle over a long K (Qwen3-4B's down_proj) streams split over
    # every SM (stream-K, stream_gemm.plan_for). Part of the plan: the summation order depends on it, never on the rows. Off: whole
    # blocks only, for an A/B.
    stream_gemm_split: bool = True
    # Compute warps of the streaming GEMM over an FP8 weight: 4 (one per scheduler) or 8 (two). Part of the plan: the
    # summation order depends on it, never on the rows (kernels/stream_gemm.cu).
    stream_gemm_w8_warps: int = 8
    # FP8 / NVFP4 products of more than 16 rows and up to this many stream the codes, in launches of
    # quantized_launch_rows rows, each reading the whole weight (the rows keep the bits they have alone). Of a product
    # of more rows, the rows that need no decode's rounding (Backend.inexact_rows: prefill chunks, a drafter's rows)
    # take the faster many-row path (fp8_w8a8, or the weight dequantized to bf16 for cuBLAS); the others still
    # stream, so a large verify's rows round as their decodes do. 16: no launch beyond one.
    quantized_stream_max_rows: int = 64
    # Rows per launch of a streamed FP8 / NVFP4 product of more than 16 rows: 16, or a wide launch of 32 or 64 (x in
    # boxes of that many rows, the weight read once for all of them; NVFP4 at most 32). No bit depends on it.
    quantized_launch_rows: int = 64
    # The many-row path of an FP8 product's inexact rows: W8A8 on the FP8 tensor cores (backends/w8a8.py: x quantized
    # per row and 128 columns, cuBLASLt's block-scaled FP8 GEMM), instead of the dequantized weight and cuBLAS's bf16
    # GEMM: 1.45x the prefill of 2048 tokens (BENCHMARKS.md, session 20). It rounds x to FP8, which only rows
    # compared with no decode may do.
    fp8_w8a8: bool = True
    # A GDN layer's token-by-token mixer (decode, verify, commit) as one kernel (gdn.cu's gdn_mixer: conv, delta rule
    # and gated norm, the same bits) instead of the three. Off: the three kernels, for an A/B.
    gdn_fused_mixer: bool = True
    # A folder to compile the CUDA sources from instead of the package's: an A/B of kernel code in one checkout.
    kernel_dir: str | None = None
    # Extra NVRTC options for every module, e.g. -lineinfo, or the step timeline's -DCF_TRACE
    # (scripts/step_timeline.py).
    nvrtc_options: tuple[str, ...] = ()

    def carveout(self, kernel: str) -> int:
        """The preferred shared-memory carveout of `kernel` (its name as compiled): -1, the driver's choice, unless
        shared_memory_carveout sets one for it."""
        names = self.shared_memory_carveout_kernels
        return self.shared_memory_carveout if not names or kernel.startswith(names) else -1

    def __post_init__(self) -> None:
        if isinstance(self.kernel_dir, os.PathLike):
            object.__setattr__(self, "kernel_dir", os.fspath(self.kernel_dir))
        for f, kind in _field_types().items():
            value = getattr(self, f)
            ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
                  str: value is None or isinstance(value, str),
                  tuple: isinstance(value, tuple) and all(isinstance(v, str) for v in value)}[kind]
            if not ok:
                raise ConfigError(f"tuning.{f}: expected {_DESCRIBE[kind]}, got {value!r}")
        for f in ("stream_gemm_prefill_stages", "stream_gemm_prefetch_all_kib", "stream_gemm_min_bytes",
                  "invariant_max_context", "quantized_stream_max_rows"):
            if getattr(self, f) < 0:
                raise ConfigError(f"tuning.{f}: expected a non-negative integer, got {getattr(self, f)}")
        if self.stream_gemm_prefetch_all_kib > 227:
            raise ConfigError(f"tuning.stream_gemm_prefetch_all_kib: at most 227 (Hopper's shared memory per CTA), got "
                              f"{self.stream_gemm_prefetch_all_kib}")
        if not -1 <= self.shared_memory_carveout <= 100:
            raise ConfigError(f"tuning.shared_memory_carveout: a percentage 0..100, or -1 (the driver's choice), got "
                              f"{self.shared_memory_carveout}")
        if self.quantized_launch_rows not in (16, 32, 64):
            raise ConfigError(f"tuning.quantized_launch_rows: 16, 32 or 64, got {self.quantized_launch_rows}")
        if self.stream_gemm_w8_warps not in (4, 8):
            raise ConfigError(f"tuning.stream_gemm_w8_warps: 4 or 8, got {self.stream_gemm_w8_warps}")
        if not 0 <= self.stream_gemm_quantized_stages <= 16:
            raise ConfigError(f"tuning.stream_gemm_quantized_stages: 0 to 16 (MAX_STAGES), got "
                              f"{self.stream_gemm_quantized_stages}")
        if self.invariant_max_context > INVARIANT_CONTEXT_LIMIT:
            raise ConfigError(f"tuning.invariant_max_context: at most {INVARIANT_CONTEXT_LIMIT} keys, got "
                              f"{self.invariant_max_context}")
        if self.kernel_dir is not None and not Path(self.kernel_dir).is_dir():
            raise ConfigError(f"tuning.kernel_dir: {self.kernel_dir} is not a folder")

    def changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults."""
        default = asdict(CudaTuning())
        return {k: v for k, v in asdict(self).items() if v != default[k]}


# The row-invariant attention shape splits the keys into one 64-key tile per CTA, and the split merge takes at most 64
# splits (cuda_attention.BN, MAX_SPLITS).
INVARIANT_CONTEXT_LIMIT = 64 * 64
_DESCRIBE = {bool: "true or false", int: "an integer", str: "a path or none", tuple: "NVRTC options"}


@functools.cache
def _field_types() -> dict[str, type]:
    """Each field's kind: bool, int, str (an optional path) or tuple (of strings)."""
    hints = typing.get_type_hints(CudaTuning)
    kinds = {}
    for f in fields(CudaTuning):
        hint = hints[f.name]
        kinds[f.name] = hint if hint in (bool, int) else tuple if typing.get_origin(hint) is tuple else str
    return kinds


def as_tuning(value: CudaTuning | dict[str, Any] | None) -> CudaTuning:
    """A CudaTuning from what a caller passed: None (the defaults), a CudaTuning, or a dict of fields."""
    if value is None:
        return CudaTuning()
    if isinstance(value, CudaTuning):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"tuning: expected a CudaTuning or a dict, got {type(value).__name__}")
    kinds = _field_types()
    unknown = sorted(set(value) - set(kinds))
    if unknown:
        raise ConfigError(f"tuning: unknown field {unknown[0]!r} (expected one of {', '.join(kinds)})")
    if isinstance(value.get("nvrtc_options"), list):
        value = {**value, "nvrtc_options": tuple(value["nvrtc_options"])}
    return CudaTuning(**value)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_tuning(assignments: Iterable[str]) -> CudaTuning:
    """A CudaTuning from `NAME=VALUE` strings (`cudflash bench --tune`), each value read as its field's type:
    bool 1/0/true/false/yes/no/on/off, int in Python syntax (8388608, 0x800000), a path or `none`, NVRTC options
    separated by spaces. A later assignment of a name wins."""
    kinds = _field_types()
    values: dict[str, Any] = {}
    for text in assignments:
        name, sep, raw = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"--tune {text!r}: expected NAME=VALUE")
        if name not in kinds:
            raise ConfigError(f"--tune {text}: unknown tuning field {name!r} (expected one of {', '.join(kinds)})")
        kind, raw = kinds[name], raw.strip()
        if kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"--tune {text}: {name} expects true or false (1/0, yes/no, on/off)")
            values[name] = raw.lower() in _TRUE
        elif kind is int:
            try:
                values[name] = int(raw, 0)
            except ValueError:
                raise ConfigError(f"--tune {text}: {name} expects an integer") from None
        elif kind is tuple:
            values[name] = tuple(raw.split())
        else:
            values[name] = None if raw.lower() in ("", "none") else raw
    try:
        return CudaTuning(**values)
    except ConfigError as e:
        raise ConfigError(f"--tune: {e}") from None
