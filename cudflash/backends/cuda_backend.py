"""The CUDA backend: the op set of `base.Backend` on CuPy arrays, bf16 storage, float32 arithmetic in kernels.

Every op launches on CuPy's current stream, and GEMMs go through cudflash's own cuBLAS handle bound to that
same stream (or, for a few rows times a large weight, through the weight-streaming kernel of stream_gemm.py),
so a caller can run a whole forward inside `with stream:` and capture it into a CUDA graph.
Ops allocate their outputs from CuPy's pool; nothing here copies to or from the host except `asarray`,
`load`, `to_numpy` and `prepare_meta`, and nothing synchronises except `synchronize`.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import cupy
import numpy as np

from cudflash.backends import (cublaslt, cuda_gdn, cuda_gdn_chunk, fp4_weight, fp8_weight, kernel_loader, stream_gemm,
                               w8a8)
from cudflash.backends.base import AttentionMeta, DeferredNorm, gdn_mixer_in_steps
from cudflash.backends.cublas import Cublas
from cudflash.backends.cublaslt import CublasLt
from cudflash.backends.cuda_attention import attention as _attention
from cudflash.backends.cuda_attention import DeviceMeta, upload_meta
from cudflash.backends.fp4_weight import Fp4Weight
from cudflash.backends.fp8_weight import Fp8Weight
from cudflash.backends.cuda_util import (
    THREADS,
    act_dtype,
    as_rows,
    bf16_bits_to_f32,
    bits,
    cdiv,
    device_i32,
    f32,
    f32_to_bf16_bits,
    i32,
    i64,
    interleave_groups_of_8,
    rows_any,
    vec_rows,
)
from cudflash.backends.tuning import CudaTuning, as_tuning
from cudflash.errors import BackendError
from cudflash.quant.weight import QuantizedWeight, dequantize

_NORM_VPT = (1, 2, 4, 8, 16)
# Whole-tensor tests of bf16 bits, each one fused reduction without a temporary: NaN / Inf have every exponent
# bit set; +-0 has every bit but the sign clear.
_TYPES = ("bf16", "float")
_NORM_NAMES = tuple(f"rms_norm<{v}, {a}, {x}, {r}>" for v in _NORM_VPT for a in ("false", "true")
                    for x in _TYPES for r in _TYPES)
_ADD_NAMES = tuple(f"add<{a}, {b}>" for a in _TYPES for b in _TYPES)
_BIAS_NAMES = ("bias_add<bf16>", "bias_add<float>")
_SWIGLU_NAMES = ("swiglu<bf16>", "swiglu<float>")


def _ctype(x: cupy.ndarray) -> str:
    return "float" if x.dtype == cupy.float32 else "bf16"
_ARGMAX_NAMES = tuple(f"argmax_partial<{t}, {v}>" for t in ("bf16", "float") for v in ("false", "true"))
_ARGMAX_CHUNK = 8192  # ARGMAX_CHUNK in argmax.cu
_MAX_GRID_Y = 65535


_DRAFT_NAMES = (tuple(f"block_conv<{x}, {c}, {b}>" for x in _TYPES for c in _TYPES for b in _TYPES)
                + tuple(f"topk_level<{t}, {v}>" for t in _TYPES for v in ("false", "true"))
                + ("topk_level<unsigned long long, false>", "topk_write<bf16>", "topk_write<float>",
                   "pair_scores<bf16>", "pair_scores<float>"))
_TOPK_CHUNK = 4096  # TOPK_CHUNK in draft_heads.cu
_TOPK_MAX_K = 128  # TOPK_MAX_K
_PS_TILE = 64  # PS_TILE


def _rope_names(d: int) -> tuple[str, ...]:
    return tuple(f"rope_store<{d}, {n}, {x}>" for n in ("false", "true") for x in _TYPES)


@functools.cache
def engine_stream() -> cupy.cuda.Stream:
    return cupy.cuda.Stream(non_blocking=True)


def _format_module(w: Fp8Weight | Fp4Weight):
    """The module of a quantized weight's format (fp8_weight or fp4_weight): its concat, take_rows, dequantize_bf16."""
    return fp8_weight if isinstance(w, Fp8Weight) else fp4_weight


class CudaBackend:
    name = "cuda"
    act_itemsize = 2  # bf16
    activation_reserve = 2 * 2**30  # bytes kept free for activations and cuBLAS workspaces beside the KV cache
    graph_reserve = 2 * 2**30  # bytes kept free for captured CUDA graph steps (their LRU cache's bound)

    def __init__(self, tuning: CudaTuning | dict | None = None) -> None:
        self.tuning = as_tuning(tuning)  # read by every kernel launch, the stream GEMM, attention and the graph runner
        self._inexact_rows = 0  # leading rows of the products that need no decode's rounding (inexact_rows)
        # Everything runs on one non-blocking stream (CUDA graphs cannot capture the legacy stream), the same for
        # every backend object of the process: a stream per object left CuPy's current stream pointing at a
        # destroyed one once an LLM was garbage-collected.
        self.stream = engine_stream()
        self.stream.use()
        self.act = act_dtype()
        self.num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.blas = Cublas()
        if stream_gemm.available():  # allocated here, never inside a capture
            stream_gemm.split_workspace(self.num_sms)

    def _kernel(self, module: str, kernel: str, name_expressions: tuple[str, ...] = ()) -> kernel_loader.Kernel:
        return kernel_loader.function(module, kernel, name_expressions, tuning=self.tuning)

    # ------------------------------------------------------------------ memory
    def memory_budget(self, utilization: float) -> int:
        """Bytes the KV cache may take: `utilization` of the device's memory, less what is already in use
        (weights included) and the activation and CUDA graph reserves; never more than what is free now."""
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        free += pool.free_bytes()  # cached by CuPy's pool: ours to reuse
        used = total - free
        return max(0, min(int(total * utilization) - used, free) - self.activation_reserve - self.graph_reserve)

    def asarray(self, x: Any, dtype: str) -> cupy.ndarray:
        if dtype == "i32":
            return cupy.asarray(x, dtype=cupy.int32) if isinstance(x, cupy.ndarray) else cupy.asarray(
                np.ascontiguousarray(x, dtype=np.int32))
        if dtype == "f32":
            return cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.float32))
        if dtype != "act":
            raise BackendError(f"cuda backend: unknown dtype '{dtype}' (expected act, f32 or i32)")
        if isinstance(x, cupy.ndarray):
            return self._to_act(cupy.ascontiguousarray(x, dtype=cupy.float32))
        return cupy.asarray(f32_to_bf16_bits(np.asarray(x))).view(self.act)

    def load(self, dtype: str, raw: np.ndarray) -> cupy.ndarray:
        """A checkpoint tensor (a memory-mapped storage view) on the device as bf16; converted on the device."""
        if dtype == "BF16":
            return cupy.asarray(raw.view(np.uint16)).view(self.act)
        if dtype in ("F16", "F32"):
            return self._to_act(cupy.asarray(raw.view(np.float16 if dtype == "F16" else np.float32)))
        raise BackendError(f"cuda backend: cannot load dtype {dtype} (expected BF16, F16 or F32)")

    def load_quantized(self, w: QuantizedWeight) -> cupy.ndarray | Fp8Weight | Fp4Weight:
        """With tuning.fp8_on_device, an FP8 weight whose scales cover whole 128-column blocks (every released FP8
        layout: 128x128 blocks, per channel, per tensor) stays FP8 on the device (fp8_weight.Fp8Weight); with
        tuning.nvfp4_on_device an NVFP4 weight stays 4-bit (fp4_weight.Fp4Weight). The linear ops stream their codes
        (stream_gemm.py, W8 / W4) or, for many rows, dequantize them to bf16 for cuBLAS. Any other quantized weight
        (the default; FP8 with narrower blocks) is dequantized at load, on the device, to the numpy backend's float32
        values rounded once to bf16, and the step reads bf16."""
        if self.tuning.fp8_on_device and fp8_weight.fits(w):
            return fp8_weight.upload(w)
        if self.tuning.nvfp4_on_device and fp4_weight.fits(w):
            return fp4_weight.upload(w)
        return self._to_act(dequantize(w, cupy))

    def all_finite(self, x: cupy.ndarray | Fp8Weight | Fp4Weight) -> bool:
        """No NaN / Inf in a loaded tensor (bf16; FP8: no NaN code, finite scales; NVFP4: its upload refused NaN
        scales, so its global scales); synchronises."""
        if isinstance(x, Fp8Weight):
            return not bool(cupy.any((x.data & 0x7F) == 0x7F)) and bool(cupy.all(cupy.isfinite(x.scale)))
        if isinstance(x, Fp4Weight):
            return bool(cupy.all(cupy.isfinite(x.gscale)))
        return not self._bf16_flags(x)[0]

    def any_nonzero(self, x: cupy.ndarray | Fp8Weight | Fp4Weight) -> bool:
        if isinstance(x, Fp8Weight):
            return bool(cupy.any((x.data & 0x7F) != 0)) and bool(cupy.any(x.scale != 0))
        if isinstance(x, Fp4Weight):
            return x.any_nonzero()
        return self._bf16_flags(x)[1]

    def _bf16_flags(self, x: cupy.ndarray) -> tuple[bool, bool]:
        """(some element is NaN or +-Inf, some element is nonzero) of a bf16 tensor: one pass (memory.cu)."""
        flat = cupy.ascontiguousarray(bits(x)).reshape(-1)
        flags = cupy.zeros(2, dtype=cupy.int32)
        if flat.size:
            blocks = min(cdiv(flat.size, THREADS), 65535 * 8)
            self._kernel("memory", "bf16_flags")((blocks,), (THREADS,), (flat, i64(flat.size), flags))
        nonfinite, nonzero = flags.get().tolist()
        return bool(nonfinite), bool(nonzero)

    def random(self, shape: tuple[int, ...], std: float, seed: int) -> cupy.ndarray:
        """N(0, std^2) bf16 made on the device (synthetic weights), in float32 chunks of at most 64M values so a
        large table never needs a full float32 twin."""
        out = cupy.empty(shape, dtype=self.act)
        flat = out.reshape(-1)
        gen = cupy.random.RandomState(seed)
        chunk = 1 << 26
        for lo in range(0, flat.size, chunk):
            piece = gen.standard_normal(min(chunk, flat.size - lo), dtype=cupy.float32)
            piece *= cupy.float32(std)
            self._to_act(piece, flat[lo:lo + piece.size])
        return out

    def event(self) -> cupy.cuda.Event:
        ev = cupy.cuda.Event()
        ev.record(cupy.cuda.get_current_stream())
        return ev

    def elapsed_ms(self, start: cupy.cuda.Event, end: cupy.cuda.Event) -> float:
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, end))

    def _to_act(self, src: cupy.ndarray, out: cupy.ndarray | None = None) -> cupy.ndarray:
        src = cupy.ascontiguousarray(src)
        if out is None:
            out = cupy.empty(src.shape, dtype=self.act)  # else: a contiguous bf16 destination of src's size
        if src.size:
            name = "f16_to_bf16" if src.dtype == np.float16 else "f32_to_bf16"
            if src.dtype not in (np.float16, np.float32):
                src, name = src.astype(cupy.float32), "f32_to_bf16"
            blocks = min(cdiv(src.size, THREADS), 65535 * 8)
            self._kernel("memory", name)((blocks,), (THREADS,), (src, out, i64(src.size)))
        return out

    def to_numpy(self, x: Any) -> np.ndarray:
        if not isinstance(x, cupy.ndarray):
            return np.asarray(x)
        if x.dtype == self.act:
            return bf16_bits_to_f32(bits(x).get())
        host = x.get()
        return host.astype(np.float32) if host.dtype.kind == "f" and host.dtype != np.float32 else host

    def zeros(self, shape: tuple[int, ...], dtype: str) -> cupy.ndarray:
        if dtype == "act":
            return cupy.zeros(shape, dtype=cupy.uint16).view(self.act)
        return cupy.zeros(shape, dtype=cupy.int32 if dtype == "i32" else cupy.float32)

    def cat(self, xs: list[cupy.ndarray], axis: int = 0) -> cupy.ndarray:
        """One copy per piece into the output: cupy.concatenate of many pieces uploads a table of their addresses
        from the host, which a stream capturing a CUDA graph refuses (the drafter heads' walk, cuda_graph.py).
        Quantized weights of one format concatenate along the rows at load (a hybrid's fused qkvg)."""
        quantized = [isinstance(x, (Fp8Weight, Fp4Weight)) for x in xs]
        if any(quantized):
            if not all(quantized) or axis != 0 or len({type(x) for x in xs}) != 1:
                raise BackendError("cuda cat: quantized weights concatenate along the rows, all of one format")
            return _format_module(xs[0]).concat(xs)
        act = bool(xs) and xs[0].dtype == self.act
        xs = [bits(x) for x in xs] if act else list(xs)
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        out = cupy.empty(shape, dtype=xs[0].dtype)
        at = [slice(None)] * len(shape)
        start = 0
        for x in xs:
            at[axis] = slice(start, start + x.shape[axis])
            out[tuple(at)] = x
            start += x.shape[axis]
        return out.view(self.act) if act else out

    def take_rows(self, x: cupy.ndarray, rows: Any) -> cupy.ndarray:
        rows = device_i32(rows)
        if isinstance(x, (Fp8Weight, Fp4Weight)):  # a quantized weight's rows at load (a hybrid's q_proj split)
            return _format_module(x).take_rows(x, rows)
        row_bytes = x.shape[1] * x.itemsize if x.ndim == 2 else 0
        if x.ndim == 2 and x.strides[1] == x.itemsize and row_bytes % 16 == 0 and x.data.ptr % 16 == 0 \
                and (x.shape[0] <= 1 or x.strides[0] % 16 == 0):
            return self._gather(x, rows)
        if x.dtype == self.act:
            return cupy.take(bits(x), rows, axis=0).view(self.act)
        return cupy.take(x, rows, axis=0)

    def _gather(self, table: cupy.ndarray, rows: cupy.ndarray) -> cupy.ndarray:
        """out[t] = table[rows[t]] with 16-byte vectors; table rows must be 16-byte multiples and aligned."""
        t, width_vec = rows.shape[0], table.shape[1] * table.itemsize // 16
        out = cupy.empty((t, table.shape[1]), dtype=table.dtype)
        if t == 0 or width_vec == 0:
            return out
        stride_vec = table.strides[0] // 16 if table.shape[0] > 1 else width_vec
        threads = min(128, width_vec)
        self._kernel("memory", "gather_rows")(
            (t, cdiv(width_vec, threads)), (threads,), (table, i64(stride_vec), rows, out, i32(width_vec)))
        return out

    def prepare_meta(self, meta: AttentionMeta, on_device: tuple | None = None) -> AttentionMeta:
        meta.device = DeviceMeta(*on_device) if on_device is not None else upload_meta(meta)
        return meta

    def synchronize(self) -> None:
        cupy.cuda.Device().synchronize()

    # ------------------------------------------------------------------ ops
    def embedding(self, ids: Any, table: cupy.ndarray) -> cupy.ndarray:
        if table.dtype != self.act or table.shape[1] % 8:
            raise BackendError(f"cuda embedding: table must be bf16 with width % 8 == 0, got {table.dtype} "
                               f"{table.shape}")
        return self._gather(table, device_i32(ids))

    def rms_norm(self, x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
        return self._norm(x, None, weight, eps)[0]

    def add_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, weight: cupy.ndarray, eps: float):
        return self._norm(x, residual, weight, eps)

    def _norm(self, x: cupy.ndarray, res: cupy.ndarray | None, weight: cupy.ndarray, eps: float):
        """(norm(x + res), x + res): the residual stream comes back in float32 (see norm.cu)."""
        shape = x.shape
        x, sx = rows_any(as_rows(x), "rms_norm x")
        rows, h = x.shape
        if weight.shape != (h,):
            raise BackendError(f"cuda rms_norm: weight shape {weight.shape}, expected ({h},)")
        out = cupy.empty((rows, h), dtype=self.act)
        res_out = cupy.empty((rows, h), dtype=cupy.float32) if res is not None else None
        res, sr = rows_any(as_rows(res), "rms_norm residual") if res is not None else (x, sx)
        if rows:
            nvec = h // 8
            threads = min(256, -(-nvec // 32) * 32)
            vpt = next((v for v in _NORM_VPT if v * threads >= nvec), None)
            if vpt is None:
                raise BackendError(f"cuda rms_norm: width {h} too large (max {8 * 256 * _NORM_VPT[-1]})")
            threads = -(-cdiv(nvec, vpt) // 32) * 32
            name = f"rms_norm<{vpt}, {'true' if res_out is not None else 'false'}, {_ctype(x)}, {_ctype(res)}>"
            self._kernel("norm", name, _NORM_NAMES)(
                (rows,), (threads,), (x, i64(sx), res, i64(sr), weight, out, res_out if res_out is not None else
                                      out, i32(h), f32(eps)))
        if res_out is None:
            return out.reshape(shape), None
        return out.reshape(shape), res_out.reshape(shape)

    def linear_add_rms_norm(self, x: cupy.ndarray, weight: cupy.ndarray, bias: cupy.ndarray | None,
                            residual: cupy.ndarray, norm_weight: cupy.ndarray, eps: float, prefetch_all: bool = False):
        """See base.Backend.linear_add_rms_norm. Where the weight streams (stream_gemm.usable), one launch: the
        GEMM's epilogue adds the residual and leaves a DeferredNorm with its partial form for the next GEMM, so no
        RMSNorm kernel (and no wait on one) sits between the two; else the GEMM and the fused add + RMSNorm kernel."""
        rows = as_rows(x)
        (m, k), n = rows.shape, weight.shape[0]
        if isinstance(weight, (Fp8Weight, Fp4Weight)):
            fusable = weight.shape[1] == k and stream_gemm.fusable_quantized(
                m, n, k, stream_gemm.weight_bits(weight), self.num_sms, self.tuning)
        else:
            fusable = weight.flags.c_contiguous and stream_gemm.fusable(m, n, k, weight.nbytes, self.num_sms,
                                                                        self.tuning)
        if bias is None and x.dtype == self.act and residual.dtype == cupy.float32 and residual.flags.c_contiguous \
                and residual.shape == (m, n) and norm_weight.shape == (n,) and fusable:
            return stream_gemm.add_norm(self._gemm_rows(rows, True), weight, residual, norm_weight, eps, self.num_sms,
                                        self.tuning, prefetch_all)
        return self.add_rms_norm(self.linear(x, weight, bias, out_f32=True), residual, norm_weight, eps)

    def _gemm_rows(self, x: cupy.ndarray, streamed: bool) -> cupy.ndarray:
        """x [M, K] as a GEMM reads it: unit column stride, rows apart by at least K; for the streamed kernel also
        16-byte aligned rows (it copies them by TMA). A copy where x is not."""
        m, k = x.shape
        if x.strides[1] != x.itemsize or (m > 1 and x.strides[0] < k * x.itemsize) or (
                streamed and (x.data.ptr % 16 or (m > 1 and x.strides[0] % 16))):
            x = cupy.ascontiguousarray(bits(x)).view(self.act)
        return x

    def linear(self, x: cupy.ndarray | DeferredNorm, weight: cupy.ndarray,
               bias: cupy.ndarray | None = None, out_f32: bool = False) -> cupy.ndarray:
        return self._add_bias(self._gemm(x, weight, cupy.float32 if out_f32 else self.act, swiglu=False), bias)

    def _gemm(self, x: cupy.ndarray | DeferredNorm, weight: stream_gemm.Weight, out_dtype: np.dtype,
              swiglu: bool) -> cupy.ndarray:
        """x @ weight.T as a new [M, N] array of out_dtype; swiglu: weight is gate_up_weight's [2I, H] and the result
        the bf16 [M, I] of silu(gate) * up (in the streamed GEMM's epilogue, else by the swiglu kernel)."""
        n = weight.shape[0]

        def streamed_out(m: int) -> cupy.ndarray:  # what the streamed GEMM writes
            return cupy.empty((m, n // 2) if swiglu else (m, n), dtype=self.act if swiglu else out_dtype)

        if isinstance(weight, (Fp8Weight, Fp4Weight)):
            return self._gemm_quantized(x, weight, out_dtype, swiglu, streamed_out)

        if isinstance(x, DeferredNorm):
            m, k = x.shape
            if x.partial is not None and weight.dtype == self.act and weight.shape[1] == k \
                    and weight.flags.c_contiguous and stream_gemm.usable(m, n, k, weight.nbytes, self.tuning):
                y = streamed_out(m)
                stream_gemm.row_scaled(x, weight, y, self.num_sms, self.tuning, swiglu)
                return y
            x = self._normed(x)
        x = as_rows(x)
        if x.dtype != self.act or weight.dtype != self.act:
            raise BackendError(f"cuda linear: operands must be bf16, got {x.dtype} and {weight.dtype}")
        m, k = x.shape
        if weight.shape[1] != k:
            raise BackendError(f"cuda linear: x is [{m}, {k}] but weight is {list(weight.shape)}")
        streamed = stream_gemm.usable(m, n, k, weight.nbytes, self.tuning)
        x = self._gemm_rows(x, streamed)
        if not weight.flags.c_contiguous:
            weight = cupy.ascontiguousarray(bits(weight)).view(self.act)
        if streamed and m:
            y = streamed_out(m)
            stream_gemm.stream_gemm(x, weight, y, self.num_sms, self.tuning, swiglu)
            return y
        y = cupy.empty((m, n), dtype=cupy.float32 if swiglu else out_dtype)
        if m:
            self.blas.gemm_bf16(x, weight, y)
        return self._swiglu_rows(y) if swiglu else y

    def _normed(self, x: DeferredNorm) -> cupy.ndarray:
        """A deferred norm's rows normalised, once per DeferredNorm: for a GEMM that cannot take it row-scaled."""
        if x.plain is None:
            x.plain = self.rms_norm(x.residual, x.weight, x.eps)
        return x.plain

    def _gemm_quantized(self, x: cupy.ndarray | DeferredNorm, weight: Fp8Weight | Fp4Weight, out_dtype: np.dtype,
                        swiglu: bool, streamed_out) -> cupy.ndarray:
        """_gemm for an FP8 or NVFP4 weight. Up to 16 rows (stream_gemm.usable_quantized): the streaming GEMM reads
        the codes, with the epilogues as for bf16; up to tuning.quantized_stream_max_rows rows it does so in wide
        launches (stream_gemm.streams_quantized: a verify of a few sequences). Beyond: the rows `inexact_rows`
        names (prefill chunks, a drafter's) the faster way (_gemm_inexact); every other row (a large verify's) still
        streams, in wide launches whatever their number, so that it keeps the bits of its decode: a verify's
        rows over the weight rounded to bf16, as the dequantized path has it, made the tiny pair's speculative output
        differ from its autoregressive one on every prompt. K off the stage's columns: dequantized (a decode too)."""
        n, k = weight.shape
        bits = stream_gemm.weight_bits(weight)
        if isinstance(x, DeferredNorm):
            m = x.shape[0]
            if x.partial is not None and x.shape[1] == k and stream_gemm.usable_quantized(m, n, k, bits):
                y = streamed_out(m)
                stream_gemm.row_scaled(x, weight, y, self.num_sms, self.tuning, swiglu)
                return y
            x = self._normed(x)
        x = as_rows(x)
        if x.dtype != self.act:
            raise BackendError(f"cuda linear: x must be bf16, got {x.dtype}")
        m = x.shape[0]
        if x.shape[1] != k:
            raise BackendError(f"cuda linear: x is [{m}, {x.shape[1]}] but the {'fp8' if bits == 8 else 'nvfp4'} "
                               f"weight is {list(weight.shape)}")
        if not m or stream_gemm.streams_quantized(m, n, k, bits, self.tuning):
            return self._gemm_streamed(x, weight, out_dtype, swiglu, streamed_out)
        p = min(self._inexact_rows, m)
        if p == m:
            return self._gemm_inexact(x, weight, out_dtype, swiglu, streamed_out)
        exact = self._gemm_streamed if stream_gemm.usable_quantized(1, n, k, bits) else self._gemm_dequantized
        if not p:
            return exact(x, weight, out_dtype, swiglu, streamed_out)
        return cupy.concatenate([self._gemm_inexact(x[:p], weight, out_dtype, swiglu, streamed_out),
                                 exact(x[p:], weight, out_dtype, swiglu, streamed_out)])

    def _gemm_streamed(self, x: cupy.ndarray, weight: Fp8Weight | Fp4Weight, out_dtype: np.dtype, swiglu: bool,
                       streamed_out) -> cupy.ndarray:
        """The codes streamed, beyond 16 rows in launches of tuning.quantized_launch_rows (stream_gemm.stream_chunks):
        each row has the bits it has alone."""
        y, x = streamed_out(x.shape[0]), self._gemm_rows(x, True)
        per = stream_gemm.launch_rows(stream_gemm.weight_bits(weight), self.tuning)
        for rows in stream_gemm.stream_chunks(x.shape[0], per):
            stream_gemm.stream_gemm(x[rows], weight, y[rows], self.num_sms, self.tuning, swiglu)
        return y

    def _gemm_dequantized(self, x: cupy.ndarray, weight: Fp8Weight | Fp4Weight, out_dtype: np.dtype, swiglu: bool,
                          streamed_out) -> cupy.ndarray:
        """Over the weight dequantized into a bf16 scratch array (the exact values rounded once, fp8_dequant.cu /
        fp4_dequant.cu) for cuBLAS: one more pass over the weight (1 or 0.56 bytes read, 2 written)."""
        y = cupy.empty((x.shape[0], weight.shape[0]), dtype=cupy.float32 if swiglu else out_dtype)
        dense = _format_module(weight).dequantize_bf16(weight, self.act, self.tuning)
        self.blas.gemm_bf16(self._gemm_rows(x, False), dense, y)
        return self._swiglu_rows(y) if swiglu else y

    def _gemm_inexact(self, x: cupy.ndarray, weight: Fp8Weight | Fp4Weight, out_dtype: np.dtype, swiglu: bool,
                      streamed_out) -> cupy.ndarray:
        """Many rows that need no decode's rounding: with tuning.fp8_w8a8 an FP8 product on the FP8 tensor cores, x
        quantized per row and 128 columns (w8a8.py), else over the dequantized weight."""
        m, (n, k) = x.shape[0], weight.shape
        if not (isinstance(weight, Fp8Weight) and self._w8a8 and w8a8.usable(m, n, k)):
            return self._gemm_dequantized(x, weight, out_dtype, swiglu, streamed_out)
        try:
            y = w8a8.gemm(self._blas_lt, self._gemm_rows(x, True), weight, cupy.float32 if swiglu else out_dtype,
                          self.tuning)
        except BackendError as err:  # cuBLASLt has no algorithm for it here: the rows are the same either way
            self._w8a8 = False
            print(f"cudflash: W8A8 is off from here on ({err}); FP8 prefill runs over the dequantized weight",
                  file=sys.stderr, flush=True)
            return self._gemm_dequantized(x, weight, out_dtype, swiglu, streamed_out)
        return self._swiglu_rows(y) if swiglu else y

    @functools.cached_property
    def _w8a8(self) -> bool:
        """Whether inexact FP8 rows run W8A8 here: tuning.fp8_w8a8, a Hopper GPU (cuBLASLt's 128-column FP8 scale
        modes are Hopper's; Blackwell has other ones) and cuBLASLt 12.9 or later."""
        if not self.tuning.fp8_w8a8 or int(cupy.cuda.Device().compute_capability) // 10 != 9:
            return False
        try:
            return cublaslt.library_version() >= 120900
        except (BackendError, OSError, AttributeError):
            return False

    @contextlib.contextmanager
    def inexact_rows(self, rows: int) -> Iterator[None]:
        outer, self._inexact_rows = self._inexact_rows, rows
        try:
            yield
        finally:
            self._inexact_rows = outer

    @functools.cached_property
    def _blas_lt(self) -> CublasLt:
        """The cuBLASLt handle of the W8A8 GEMMs (tuning.fp8_w8a8), made at its first use."""
        return CublasLt()

    def _add_bias(self, y: cupy.ndarray, bias: cupy.ndarray | None) -> cupy.ndarray:
        m, n = y.shape
        if bias is not None:
            if n % 8 or bias.shape != (n,):
                raise BackendError(f"cuda linear: bias shape {bias.shape} for {n} outputs (n % 8 == 0 needed)")
            self._kernel("elementwise", f"bias_add<{_ctype(y)}>", _BIAS_NAMES)(
                (cdiv(m * n // 8, THREADS),), (THREADS,), (y, bias, i32(m), i32(n)))
        return y

    def gate_up_weight(self, gate: stream_gemm.Weight, up: stream_gemm.Weight) -> stream_gemm.Weight:
        """[I, H] each -> [2I, H] with gate and up rows interleaved in groups of 8 (rows 16 j .. 16 j + 7: gate
        features 8 j .. 8 j + 7, the next eight their up features), so that one MMA tile of the GEMM holds both halves
        of its features and its epilogue can write silu(gate) * up (stream_gemm.cu, SG_SWIGLU). FP8 parts: the same
        interleave of codes, each row keeping its scale row (fp8_weight.interleave_gate_up); NVFP4 parts likewise
        with their scales (fp4_weight.interleave_gate_up)."""
        if isinstance(gate, Fp8Weight) and isinstance(up, Fp8Weight):
            return fp8_weight.interleave_gate_up(gate, up)
        if isinstance(gate, Fp4Weight) and isinstance(up, Fp4Weight):
            return fp4_weight.interleave_gate_up(gate, up)
        if type(gate) is not type(up):
            raise BackendError("cuda gate_up: gate and up must have one format (both bf16, FP8 or NVFP4)")
        inter = gate.shape[0]
        if up.shape != gate.shape or inter % 8:
            raise BackendError(f"cuda gate_up: gate {gate.shape} and up {up.shape} must match, rows a multiple of 8")
        return interleave_groups_of_8(bits(gate), bits(up)).view(self.act)

    def swiglu(self, x: cupy.ndarray | DeferredNorm, gate_up: cupy.ndarray) -> cupy.ndarray:
        if gate_up.shape[0] % 16:
            raise BackendError(f"cuda swiglu: gate_up has {gate_up.shape[0]} rows, expected 2 I with I % 8 == 0")
        return self._gemm(x, gate_up, self.act, swiglu=True)

    def _swiglu_rows(self, y: cupy.ndarray) -> cupy.ndarray:
        """The swiglu kernel on a GEMM output y [T, 2I] (interleaved features) -> [T, I] bf16."""
        y, sy = rows_any(y, "swiglu input")
        t, width = y.shape
        out = cupy.empty((t, width // 2), dtype=self.act)
        if t:
            self._kernel("elementwise", f"swiglu<{_ctype(y)}>", _SWIGLU_NAMES)(
                (cdiv(t * width // 16, THREADS),), (THREADS,), (y, i64(sy), out, i32(t), i32(width // 2)))
        return out

    def add(self, a: cupy.ndarray, b: cupy.ndarray) -> cupy.ndarray:
        """a + b -> bf16; either operand bf16 or float32 (a GEMM output, the residual stream)."""
        shape = a.shape
        if b.shape != shape:
            raise BackendError(f"cuda add: shapes {a.shape} and {b.shape} differ")
        a, sa = rows_any(as_rows(a), "add a")
        b, sb = rows_any(as_rows(b), "add b")
        t, width = a.shape
        out = cupy.empty((t, width), dtype=self.act)
        if t:
            self._kernel("elementwise", f"add<{_ctype(a)}, {_ctype(b)}>", _ADD_NAMES)(
                (cdiv(t * width // 8, THREADS),), (THREADS,), (a, i64(sa), b, i64(sb), out, i32(t), i32(width)))
        return out.reshape(shape)

    def head_norm_rope(self, x: cupy.ndarray, head_dim: int, positions: Any, cos: cupy.ndarray,
                       sin: cupy.ndarray, weight: cupy.ndarray | None, eps: float) -> cupy.ndarray:
        """rope_store with no K/V heads: every head of x is normed (if weight), rotated and returned as bf16."""
        x, sx = rows_any(x, "head_norm_rope x")
        t, width = x.shape
        if head_dim <= 0 or width % head_dim:
            raise BackendError(f"cuda head_norm_rope: width {width} is not a multiple of head_dim {head_dim}")
        out = cupy.empty((t, width), dtype=self.act)
        self._rope(x, sx, head_dim, positions, cos, sin, (weight, weight), eps, out, None)
        return out

    def rope_store(self, x: cupy.ndarray, q_heads: int, positions: Any, cos: cupy.ndarray, sin: cupy.ndarray,
                   q_norm: cupy.ndarray | None, k_norm: cupy.ndarray | None, eps: float, slots: Any,
                   k_cache: cupy.ndarray, v_cache: cupy.ndarray) -> cupy.ndarray | None:
        """See base.Backend.rope_store: one launch for q's RoPE, k's RoPE and the K/V store of a layer."""
        if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
            raise BackendError(f"cuda rope_store: caches {k_cache.shape} / {v_cache.shape}, expected two "
                               "[num_blocks, block_size, kv_heads, head_dim]")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous) or k_cache.dtype != self.act \
                or v_cache.dtype != self.act:
            raise BackendError("cuda rope_store: caches must be contiguous bf16")
        _, _, kv_heads, head_dim = k_cache.shape
        x, sx = rows_any(x, "rope_store x")
        t, width = x.shape
        if width != (q_heads + 2 * kv_heads) * head_dim:
            raise BackendError(f"cuda rope_store: x width {width}, expected ({q_heads} + 2 x {kv_heads}) heads of "
                               f"{head_dim}")
        if q_heads and (q_norm is None) != (k_norm is None):
            raise BackendError("cuda rope_store: q_norm and k_norm must be both given or both None")
        q = cupy.empty((t, q_heads * head_dim), dtype=self.act) if q_heads else None
        norms = (q_norm if q_heads else k_norm, k_norm)
        self._rope(x, sx, head_dim, positions, cos, sin, norms, eps, q, (device_i32(slots), k_cache, v_cache))
        return q

    def _rope(self, x: cupy.ndarray, sx: int, head_dim: int, positions: Any, cos: cupy.ndarray, sin: cupy.ndarray,
              norms: tuple[cupy.ndarray | None, cupy.ndarray | None], eps: float, q_out: cupy.ndarray | None,
              kv: tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray] | None) -> None:
        """One launch of rope_store<D, NORM, X> (kernels/rope.cu) over x's rows. norms: (q weight, k weight), both
        None or both [D]; q_out [T, Hq * D] bf16 or None (Hq = 0); kv: (slots, k_cache, v_cache) or None (Hk = 0).
        Pointers of an absent part are never read or written; x stands in for them."""
        if head_dim % 16 or 32 % (head_dim // 16):
            raise BackendError(f"cuda rope: head_dim {head_dim} unsupported (16, 32, 64, 128, 256, 512)")
        if cos.dtype != np.float32 or cos.shape[1] != head_dim // 2 or sin.shape != cos.shape:
            raise BackendError(f"cuda rope: cos/sin must be float32 [max_pos, {head_dim // 2}]")
        q_w, k_w = norms
        norm = q_w is not None
        if norm and (q_w.shape != (head_dim,) or k_w.shape != (head_dim,)):
            raise BackendError(f"cuda rope: norm weights {q_w.shape} / {k_w.shape}, expected ({head_dim},)")
        t = x.shape[0]
        q_heads = q_out.shape[1] // head_dim if q_out is not None else 0
        slots, k_cache, v_cache = kv if kv is not None else (x, x, x)
        kv_heads = k_cache.shape[2] if kv is not None else 0
        total = t * (q_heads + 2 * kv_heads) * (head_dim // 16)  # D/16 threads per (row, head)
        if total == 0:
            return
        cos, sin = cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin)
        name = f"rope_store<{head_dim}, {'true' if norm else 'false'}, {_ctype(x)}>"
        self._kernel("rope", name, _rope_names(head_dim))(
            (cdiv(total, 128),), (128,),
            (x, i64(sx), device_i32(positions), cos, sin, q_w if norm else x, k_w if norm else x, slots,
             q_out if q_out is not None else x, k_cache, v_cache, i32(t), i32(q_heads), i32(kv_heads), f32(eps)))

    def attention(self, q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, meta: AttentionMeta,
                  scale: float, causal: bool, window: int = 0, gate: cupy.ndarray | None = None) -> cupy.ndarray:
        return _attention(q, k_cache, v_cache, meta, scale, causal, window, self.num_sms, self.tuning, gate)

    def argmax(self, x: cupy.ndarray, nonfinite: int = -1) -> cupy.ndarray:
        x = as_rows(x)
        if x.dtype not in (self.act, np.float32):
            x = x.astype(cupy.float32)
        if x.strides[1] != x.itemsize:
            x = cupy.ascontiguousarray(x)
        rows, vocab = x.shape
        out = cupy.empty((rows,), dtype=cupy.int32)
        if rows == 0 or vocab == 0:
            return out
        keys = cupy.zeros((rows,), dtype=cupy.uint64)  # packed (value, index) maxima, folded by atomicMax
        sx = x.strides[0] // x.itemsize if rows > 1 else vocab
        per_vec = 16 // x.itemsize
        vec = x.data.ptr % 16 == 0 and (sx * x.itemsize) % 16 == 0 and vocab % per_vec == 0
        tname = "bf16" if x.dtype == self.act else "float"
        partial = self._kernel("argmax", f"argmax_partial<{tname}, {'true' if vec else 'false'}>",
                                         _ARGMAX_NAMES)
        for r0 in range(0, rows, _MAX_GRID_Y):
            r1 = min(rows, r0 + _MAX_GRID_Y)
            partial((cdiv(vocab, _ARGMAX_CHUNK), r1 - r0), (256,), (x[r0:r1], i64(sx), i32(vocab), keys[r0:r1]))
        self._kernel("argmax", "argmax_finish", _ARGMAX_NAMES)(
            (cdiv(rows, 128),), (128,), (keys, out, i32(rows), i32(nonfinite)))
        return out

    def copy_slots(self, cache: cupy.ndarray, src: Any, dst: Any) -> None:
        """See base.Backend.copy_slots: one gather into a temporary, one scatter."""
        flat = bits(cache).reshape(cache.shape[0], -1, *cache.shape[3:])
        flat[:, device_i32(dst)] = flat[:, device_i32(src)]

    def logsumexp(self, x: cupy.ndarray) -> cupy.ndarray:
        x = as_rows(x).astype(cupy.float32)
        m = cupy.max(x, axis=1, keepdims=True)
        return cupy.log(cupy.sum(cupy.exp(x - m), axis=1)) + m[:, 0]

    # ------------------------------------------------------------------ drafter heads (DFlash2)
    def block_conv(self, x: cupy.ndarray, coeff: cupy.ndarray, base: cupy.ndarray, block: int) -> cupy.ndarray:
        """Grouped dynamic depthwise conv along each block's rows (see NumpyBackend.block_conv); x bf16 or
        float32 [T, C] (C % 8 == 0), coeff [T, K G] bf16 or float32 (a row-strided column slice is read in
        place), base [K, C]. Returns x's dtype, contiguous."""
        x, sx = rows_any(x, "block_conv x")
        t, c = x.shape
        if base.ndim != 2 or base.shape[1] != c:
            raise BackendError(f"cuda block_conv: base shape {base.shape}, expected [taps, {c}]")
        taps = base.shape[0]
        base, sb = rows_any(base, "block_conv base")
        if coeff.ndim != 2 or coeff.shape[0] != t or taps == 0 or coeff.shape[1] % taps:
            raise BackendError(f"cuda block_conv: coeff shape {coeff.shape} for x {x.shape} and {taps} taps")
        groups = coeff.shape[1] // taps
        if groups == 0 or c % groups or block <= 0 or t % block:
            raise BackendError(f"cuda block_conv: {groups} groups of {c} channels, {t} rows in blocks of {block}")
        if coeff.dtype not in (self.act, np.float32):
            raise BackendError(f"cuda block_conv: coeff must be bf16 or float32, got {coeff.dtype}")
        if coeff.strides[1] != coeff.itemsize or coeff.strides[0] < 0 or coeff.strides[0] % coeff.itemsize:
            coeff = cupy.ascontiguousarray(bits(coeff)).view(coeff.dtype) if coeff.dtype == self.act \
                else cupy.ascontiguousarray(coeff)
        sc = coeff.strides[0] // coeff.itemsize if t > 1 else coeff.shape[1]
        out = cupy.empty((t, c), dtype=x.dtype)
        if t:
            name = f"block_conv<{_ctype(x)}, {_ctype(coeff)}, {_ctype(base)}>"
            self._kernel("draft_heads", name, _DRAFT_NAMES)(
                (cdiv(t * c // 8, THREADS),), (THREADS,),
                (x, i64(sx), coeff, i64(sc), base, i64(sb), out, i32(t), i32(c), i32(taps), i32(groups), i32(block)))
        return out

    def topk(self, x: cupy.ndarray, k: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        """(values float32 [T, k], ids int32 [T, k]) of the k largest entries of each row of x [T, V] (bf16 or
        float32): value descending, equal values lower index first, exactly as NumpyBackend.topk."""
        x = as_rows(x)
        if x.dtype not in (self.act, np.float32):
            x = x.astype(cupy.float32)
        if x.strides[1] != x.itemsize or x.strides[0] < 0:
            x = cupy.ascontiguousarray(bits(x)).view(self.act) if x.dtype == self.act else cupy.ascontiguousarray(x)
        rows, vocab = x.shape
        if not 1 <= k <= vocab or k > _TOPK_MAX_K:
            raise BackendError(f"cuda topk: k = {k} for rows of {vocab} (1 <= k <= min(V, {_TOPK_MAX_K}))")
        vals = cupy.empty((rows, k), dtype=cupy.float32)
        ids = cupy.empty((rows, k), dtype=cupy.int32)
        if rows == 0:
            return vals, ids
        sx = x.strides[0] // x.itemsize if rows > 1 else vocab
        per_vec = 16 // x.itemsize
        vec = x.data.ptr % 16 == 0 and (sx * x.itemsize) % 16 == 0 and vocab % per_vec == 0
        tname = _ctype(x)
        # Each level keeps the k largest keys of every TOPK_CHUNK inputs; repeat until one block per row is left.
        src, s_in, n, name = x, sx, vocab, f"topk_level<{tname}, {'true' if vec else 'false'}>"
        while True:
            chunks = cdiv(n, _TOPK_CHUNK)
            keys = cupy.empty((rows, chunks * k), dtype=cupy.uint64)
            level = self._kernel("draft_heads", name, _DRAFT_NAMES)
            for r0 in range(0, rows, _MAX_GRID_Y):
                r1 = min(rows, r0 + _MAX_GRID_Y)
                level((chunks, r1 - r0), (256,), (src[r0:r1], i64(s_in), i32(n), i32(k), keys[r0:r1]))
            if chunks == 1:
                break
            src, s_in, n, name = keys, chunks * k, chunks * k, "topk_level<unsigned long long, false>"
        self._kernel("draft_heads", f"topk_write<{tname}>", _DRAFT_NAMES)(
            (cdiv(rows * k, 128),), (128,), (keys, x, i64(sx), vals, ids, i32(rows * k), i32(k)))
        return vals, ids

    def pair_scores(self, unary: cupy.ndarray, cand: Any, pred: Any, hidden: cupy.ndarray,
                    pred_table: cupy.ndarray, succ_table: cupy.ndarray) -> cupy.ndarray:
        """DFlash2 selector lattice (see NumpyBackend.pair_scores), float32 [R, P, K]: unary float32 [R, K],
        cand int32 [R, K], pred int32 [R, P], hidden bf16 or float32 [R, r], tables bf16 [V, r] (r % 8 == 0)."""
        unary = cupy.ascontiguousarray(unary, dtype=cupy.float32)
        cand = cupy.ascontiguousarray(device_i32(cand))
        pred = cupy.ascontiguousarray(device_i32(pred))
        hidden, sh = rows_any(hidden, "pair_scores hidden")
        a, sa = vec_rows(pred_table, "pair_scores pred_table")
        b, sb = vec_rows(succ_table, "pair_scores succ_table")
        r_rows, rank = hidden.shape
        if unary.ndim != 2 or unary.shape[0] != r_rows or cand.shape != unary.shape or pred.ndim != 2 \
                or pred.shape[0] != r_rows or a.shape[1] != rank or b.shape[1] != rank:
            raise BackendError(f"cuda pair_scores: unary {unary.shape}, cand {cand.shape}, pred {pred.shape}, "
                               f"hidden {hidden.shape}, tables {a.shape} / {b.shape} do not match")
        k, p = unary.shape[1], pred.shape[1]
        out = cupy.empty((r_rows, p, k), dtype=cupy.float32)
        if r_rows and p and k:
            self._kernel("draft_heads", f"pair_scores<{_ctype(hidden)}>", _DRAFT_NAMES)(
                (r_rows, cdiv(p, _PS_TILE), cdiv(k, _PS_TILE)), (256,),
                (unary, cand, pred, hidden, i64(sh), a, i64(sa), b, i64(sb), out, i32(p), i32(k), i32(rank)))
        return out

    # ---- hybrid targets (Gated DeltaNet layers): kernels/gdn.cu through cuda_gdn.py
    def causal_conv1d(self, x: cupy.ndarray, weight: cupy.ndarray, conv_states: cupy.ndarray, slots: Any,
                      meta: AttentionMeta, commit: bool, span: cupy.ndarray | None = None) -> cupy.ndarray:
        return cuda_gdn.causal_conv1d(x, weight, conv_states, slots, meta, commit, self.tuning, span)

    def gdn_chunked(self, qkv: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray, A_log: cupy.ndarray,
                    dt_bias: cupy.ndarray, states: cupy.ndarray, slots: Any, meta: AttentionMeta,
                    commit: bool) -> cupy.ndarray:
        # The same function as gdn_recurrent (base.py): the tensor-core chunked (WY) kernels of gdn_chunk.cu where
        # a sequence is long enough for them to gain and the head dims are compiled, else the recurrent kernel.
        if cuda_gdn_chunk.use_chunked(states, meta):
            return cuda_gdn_chunk.gated_delta_rule(qkv, a, b, A_log, dt_bias, states, slots, meta, commit,
                                                   self.tuning)
        return cuda_gdn.gated_delta_rule(qkv, a, b, A_log, dt_bias, states, slots, meta, commit, self.tuning)

    def gdn_recurrent(self, qkv: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray, A_log: cupy.ndarray,
                      dt_bias: cupy.ndarray, states: cupy.ndarray, slots: Any, meta: AttentionMeta,
                      commit: bool, span: cupy.ndarray | None = None) -> cupy.ndarray:
        return cuda_gdn.gated_delta_rule(qkv, a, b, A_log, dt_bias, states, slots, meta, commit, self.tuning,
                                         span)

    def gated_rms_norm(self, x: cupy.ndarray, z: cupy.ndarray, weight: cupy.ndarray, eps: float,
                       head_dim: int) -> cupy.ndarray:
        return cuda_gdn.gated_rms_norm(x, z, weight, eps, head_dim, self.tuning)

    def gdn_recurrent_mixer(self, proj: cupy.ndarray, conv_weight: cupy.ndarray, conv_states: cupy.ndarray,
                            A_log: cupy.ndarray, dt_bias: cupy.ndarray, states: cupy.ndarray,
                            norm_weight: cupy.ndarray, eps: float, slots: Any, meta: AttentionMeta, commit: bool,
                            span: cupy.ndarray | None = None, normed: bool = True,
                            independent: bool = False) -> cupy.ndarray | None:
        args = (proj, conv_weight, conv_states, A_log, dt_bias, states, norm_weight, eps, slots, meta, commit)
        if self.tuning.gdn_fused_mixer and cuda_gdn.mixer_fits(proj, conv_weight, states):
            return cuda_gdn.gdn_mixer(*args, normed, self.tuning, span, independent)
        return gdn_mixer_in_steps(self, *args, span, normed)

    def sigmoid_gate(self, x: cupy.ndarray, gate: cupy.ndarray) -> cupy.ndarray:
        return cuda_gdn.sigmoid_gate(x, gate, self.tuning)
