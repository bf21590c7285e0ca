"""The CUDA backend: the op set of `base.Backend` on CuPy arrays, bf16 storage, float32 arithmetic in kernels.

Every op launches on CuPy's current stream, and GEMMs go through cudflash's own cuBLAS handle bound to that
same stream, so a caller can run a whole forward inside `with stream:` and capture it into a CUDA graph.
Ops allocate their outputs from CuPy's pool; nothing here copies to or from the host except `asarray`,
`load`, `to_numpy` and `prepare_meta`, and nothing synchronises except `synchronize`.
"""
from __future__ import annotations

import functools
from typing import Any

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.base import AttentionMeta
from cudflash.backends.cublas import Cublas
from cudflash.backends.cuda_attention import attention as _attention
from cudflash.backends.cuda_attention import upload_meta
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
    rows_any,
    vec_rows,
)
from cudflash.errors import BackendError

_NORM_VPT = (1, 2, 4, 8, 16)
_TYPES = ("bf16", "float")
_NORM_NAMES = tuple(f"rms_norm<{v}, {a}, {x}, {r}>" for v in _NORM_VPT for a in ("false", "true")
                    for x in _TYPES for r in _TYPES)
_ADD_NAMES = tuple(f"add<{a}, {b}>" for a in _TYPES for b in _TYPES)
_BIAS_NAMES = ("bias_add<bf16>", "bias_add<float>")
_SILU_NAMES = ("silu_mul<bf16>", "silu_mul<float>")
_STORE_NAMES = ("store_kv<bf16>", "store_kv<float>")


def _ctype(x: cupy.ndarray) -> str:
    return "float" if x.dtype == cupy.float32 else "bf16"
_ARGMAX_NAMES = tuple(f"argmax_partial<{t}, {v}>" for t in ("bf16", "float") for v in ("false", "true"))
_ARGMAX_CHUNK = 8192  # ARGMAX_CHUNK in argmax.cu
_MAX_GRID_Y = 65535


def _rope_names(d: int) -> tuple[str, ...]:
    return tuple(f"head_norm_rope<{d}, {n}, {x}>" for n in ("false", "true") for x in _TYPES)


@functools.cache
def engine_stream() -> cupy.cuda.Stream:
    return cupy.cuda.Stream(non_blocking=True)


class CudaBackend:
    name = "cuda"
    act_itemsize = 2  # bf16
    activation_reserve = 2 * 2**30  # bytes kept free for activations and cuBLAS workspaces beside the KV cache

    def __init__(self) -> None:
        # Everything runs on one non-blocking stream (CUDA graphs cannot capture the legacy stream), the same for
        # every backend object of the process: a stream per object left CuPy's current stream pointing at a
        # destroyed one once an LLM was garbage-collected.
        self.stream = engine_stream()
        self.stream.use()
        self.act = act_dtype()
        self.num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.blas = Cublas()

    # ------------------------------------------------------------------ memory
    def memory_budget(self, utilization: float) -> int:
        """Bytes the KV cache may take: `utilization` of the device's memory, less what is already in use
        (weights included) and an activation reserve; never more than what is free now."""
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        free += pool.free_bytes()  # cached by CuPy's pool: ours to reuse
        used = total - free
        return max(0, min(int(total * utilization) - used, free) - self.activation_reserve)

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
            kernel_loader.function("memory", name)((blocks,), (THREADS,), (src, out, i64(src.size)))
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
        if xs and xs[0].dtype == self.act:
            return cupy.concatenate([bits(x) for x in xs], axis=axis).view(self.act)
        return cupy.concatenate(xs, axis=axis)

    def take_rows(self, x: cupy.ndarray, rows: Any) -> cupy.ndarray:
        rows = device_i32(rows)
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
        kernel_loader.function("memory", "gather_rows")(
            (t, cdiv(width_vec, threads)), (threads,), (table, i64(stride_vec), rows, out, i32(width_vec)))
        return out

    def prepare_meta(self, meta: AttentionMeta) -> AttentionMeta:
        meta.device = upload_meta(meta)
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
            kernel_loader.function("norm", name, _NORM_NAMES)(
                (rows,), (threads,), (x, i64(sx), res, i64(sr), weight, out, res_out if res_out is not None else
                                      out, i32(h), f32(eps)))
        if res_out is None:
            return out.reshape(shape), None
        return out.reshape(shape), res_out.reshape(shape)

    def linear(self, x: cupy.ndarray, weight: cupy.ndarray, bias: cupy.ndarray | None = None,
               out_f32: bool = False) -> cupy.ndarray:
        x = as_rows(x)
        if x.dtype != self.act or weight.dtype != self.act:
            raise BackendError(f"cuda linear: operands must be bf16, got {x.dtype} and {weight.dtype}")
        if x.strides[1] != x.itemsize or (x.shape[0] > 1 and x.strides[0] < x.shape[1] * x.itemsize):
            x = cupy.ascontiguousarray(bits(x)).view(self.act)
        if not weight.flags.c_contiguous:
            weight = cupy.ascontiguousarray(bits(weight)).view(self.act)
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k:
            raise BackendError(f"cuda linear: x is [{m}, {k}] but weight is {list(weight.shape)}")
        y = cupy.empty((m, n), dtype=cupy.float32 if out_f32 else self.act)
        if m == 0:
            return y
        self.blas.gemm_bf16(x, weight, y)
        if bias is not None:
            if n % 8 or bias.shape != (n,):
                raise BackendError(f"cuda linear: bias shape {bias.shape} for {n} outputs (n % 8 == 0 needed)")
            kernel_loader.function("elementwise", f"bias_add<{_ctype(y)}>", _BIAS_NAMES)(
                (cdiv(m * n // 8, THREADS),), (THREADS,), (y, bias, i32(m), i32(n)))
        return y

    def silu_mul(self, gate_up: cupy.ndarray) -> cupy.ndarray:
        gate_up, sg = rows_any(as_rows(gate_up), "silu_mul input")
        t, width = gate_up.shape
        inter = width // 2
        if inter % 8:
            raise BackendError(f"cuda silu_mul: intermediate size {inter} is not a multiple of 8")
        out = cupy.empty((t, inter), dtype=self.act)
        if t:
            kernel_loader.function("elementwise", f"silu_mul<{_ctype(gate_up)}>", _SILU_NAMES)(
                (cdiv(t * inter // 8, THREADS),), (THREADS,), (gate_up, i64(sg), out, i32(t), i32(inter)))
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
            kernel_loader.function("elementwise", f"add<{_ctype(a)}, {_ctype(b)}>", _ADD_NAMES)(
                (cdiv(t * width // 8, THREADS),), (THREADS,), (a, i64(sa), b, i64(sb), out, i32(t), i32(width)))
        return out.reshape(shape)

    def head_norm_rope(self, x: cupy.ndarray, head_dim: int, positions: Any, cos: cupy.ndarray,
                       sin: cupy.ndarray, weight: cupy.ndarray | None, eps: float) -> cupy.ndarray:
        if head_dim % 16 or 32 % (head_dim // 16):
            raise BackendError(f"cuda head_norm_rope: head_dim {head_dim} unsupported (16, 32, 64, 128, 256, 512)")
        x, sx = rows_any(x, "head_norm_rope x")
        t, width = x.shape
        heads = width // head_dim
        if heads * head_dim != width:
            raise BackendError(f"cuda head_norm_rope: width {width} is not a multiple of head_dim {head_dim}")
        if cos.dtype != np.float32 or cos.shape[1] != head_dim // 2 or sin.shape != cos.shape:
            raise BackendError(f"cuda head_norm_rope: cos/sin must be float32 [max_pos, {head_dim // 2}]")
        cos, sin = cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin)
        positions = device_i32(positions)
        out = cupy.empty((t, width), dtype=self.act)
        if t == 0:
            return out
        norm = weight is not None
        if norm and weight.shape != (head_dim,):
            raise BackendError(f"cuda head_norm_rope: weight shape {weight.shape}, expected ({head_dim},)")
        name = f"head_norm_rope<{head_dim}, {'true' if norm else 'false'}, {_ctype(x)}>"
        total = t * heads * (head_dim // 16)
        kernel_loader.function("rope", name, _rope_names(head_dim))(
            (cdiv(total, 128),), (128,),
            (x, i64(sx), positions, cos, sin, weight if norm else x, out, i32(t), i32(heads), f32(eps)))
        return out

    def store_kv(self, k: cupy.ndarray, v: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                 slots: Any) -> None:
        k, sk = vec_rows(k, "store_kv k")
        v, sv = rows_any(v, "store_kv v")
        t, width = k.shape
        _, _, kv_heads, head_dim = k_cache.shape
        if v.shape != k.shape or width != kv_heads * head_dim:
            raise BackendError(f"cuda store_kv: k {k.shape} / v {v.shape} do not match cache rows of "
                               f"{kv_heads} x {head_dim}")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise BackendError("cuda store_kv: caches must be contiguous")
        if t:
            kernel_loader.function("store_kv", f"store_kv<{_ctype(v)}>", _STORE_NAMES)(
                (cdiv(t * width // 8, THREADS),), (THREADS,),
                (k, i64(sk), v, i64(sv), device_i32(slots), k_cache, v_cache, i32(t), i32(width)))

    def attention(self, q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, meta: AttentionMeta,
                  scale: float, causal: bool, window: int = 0) -> cupy.ndarray:
        return _attention(q, k_cache, v_cache, meta, scale, causal, window, self.num_sms)

    def argmax(self, x: cupy.ndarray) -> cupy.ndarray:
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
        partial = kernel_loader.function("argmax", f"argmax_partial<{tname}, {'true' if vec else 'false'}>",
                                         _ARGMAX_NAMES)
        for r0 in range(0, rows, _MAX_GRID_Y):
            r1 = min(rows, r0 + _MAX_GRID_Y)
            partial((cdiv(vocab, _ARGMAX_CHUNK), r1 - r0), (256,), (x[r0:r1], i64(sx), i32(vocab), keys[r0:r1]))
        kernel_loader.function("argmax", "argmax_finish", _ARGMAX_NAMES)(
            (cdiv(rows, 128),), (128,), (keys, out, i32(rows)))
        return out
