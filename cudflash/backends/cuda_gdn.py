"""The Gated DeltaNet ops of the CUDA backend (issue 22): layout checks and launches of kernels/gdn.cu.

Dtypes follow what models/hybrid.py feeds: the in_proj GEMM's output is float32 (its column slices are the conv's
input x, the gates a, b and z), the conv's output and the delta rule's o are float32 (as numpy's), and the two ops
whose outputs feed a GEMM (gated_rms_norm, sigmoid_gate) return bf16. bf16 inputs are accepted where a kernel is
templated on them (conv x / weight, norm x / z, gate x / gate) and converted to float32 for the delta rule. The state
pools (conv_states [S, C, K-1], states [S, Hv, dk, dv]) must be contiguous float32: they are updated in place.
Every op allocates its outputs from CuPy's pool and launches on the current stream; nothing synchronises.
"""
from __future__ import annotations

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.base import AttentionMeta
from cudflash.backends.cuda_util import act_dtype, bits, cdiv, device_i32, f32, i32, i64
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError

CONV_ROWS = 16  # CONV_ROWS in gdn.cu
CONV_THREADS = 128
GDN_TILE = 32  # GDN_TILE: state columns per CTA
GDN_THREADS = 128  # GDN_WARPS x 32
CONV_TAPS = (2, 3, 4)  # conv kernel sizes compiled
KEY_DIMS = (16, 32, 48, 64, 128, 256)  # dk compiled (multiples of 16: gdn_recurrent reads a lane group's rows as float4)
MIX_THREADS = 512  # MIX_WARPS x 32: gdn_mixer's CTA, one value head of at most 128 columns and 512 conv channels
MIX_KEY_DIMS = (16, 32, 48, 64, 128)  # dk of gdn_mixer (a lane's 256 / 4 state rows would not fit 512 threads' registers)
MAX_CLUSTER = 8  # value heads per key head gdn_mixer takes in one cluster (the portable cluster size)
_TYPES = ("bf16", "float")
NAMES = (tuple(f"causal_conv1d<{k}, {x}, {w}>" for k in CONV_TAPS for x in _TYPES for w in _TYPES)
         + tuple(f"gdn_recurrent<{d}>" for d in KEY_DIMS)
         + tuple(f"gdn_mixer<{k}, {d}, {w}>" for k in CONV_TAPS for d in MIX_KEY_DIMS for w in _TYPES)
         + tuple(f"gated_rms_norm<{x}, {z}>" for x in _TYPES for z in _TYPES)
         + tuple(f"sigmoid_gate<{x}, {g}>" for x in _TYPES for g in _TYPES))


def _kernel(name: str, tuning: CudaTuning) -> kernel_loader.Kernel:
    return kernel_loader.function("gdn", name, NAMES, tuning=tuning)


def _ctype(x: cupy.ndarray) -> str:
    return "float" if x.dtype == cupy.float32 else "bf16"


def _f32_bits(x: cupy.ndarray) -> cupy.ndarray:
    """A bf16 array as float32 (exact), without CuPy's own bf16 kernels."""
    return (bits(x).astype(cupy.uint32) << cupy.uint32(16)).view(cupy.float32)


def _rows(x: cupy.ndarray, what: str, float_only: bool = False) -> tuple[cupy.ndarray, int]:
    """(x as 2-D bf16 or float32 rows with unit column stride, its row stride in elements): a column slice of a GEMM
    output is read in place, anything else is copied. float_only: bf16 becomes float32."""
    if not isinstance(x, cupy.ndarray) or x.ndim != 2:
        raise BackendError(f"cuda {what}: expected a 2-D device array, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (cupy.float32, act_dtype(), np.dtype(np.uint16)):
        x = x.astype(cupy.float32)
    if x.dtype != cupy.float32 and float_only:
        x = _f32_bits(x)
    if x.strides[1] != x.itemsize or x.strides[0] < 0 or x.strides[0] % x.itemsize \
            or (x.shape[0] > 1 and x.strides[0] < x.shape[1] * x.itemsize):
        x = cupy.ascontiguousarray(x) if x.dtype == cupy.float32 else cupy.ascontiguousarray(bits(x)).view(x.dtype)
    return x, (x.strides[0] // x.itemsize if x.shape[0] > 1 else x.shape[1])


def _pool(x: cupy.ndarray, ndim: int, what: str) -> None:
    if not isinstance(x, cupy.ndarray) or x.dtype != cupy.float32 or x.ndim != ndim or not x.flags.c_contiguous:
        raise BackendError(f"cuda {what}: the state pool must be a contiguous float32 {ndim}-D device array, got "
                           f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")


def _sequences(slots, meta: AttentionMeta) -> tuple[cupy.ndarray, cupy.ndarray, int, int, int]:
    """(slots int32 [n], cu_seqlens int32 [n + 1] on the device, n, the longest sequence's rows, the rows the
    sequences cover). A meta that was not prepared (one a caller built on the host alone) has its row offsets
    uploaded here; the engine's metas are all prepared (a CUDA graph may record these ops)."""
    cu_host = np.asarray(meta.cu_seqlens_q)
    n = len(cu_host) - 1
    cu = meta.device.cu_seqlens if meta.device is not None else cupy.asarray(cu_host.astype(np.int32))
    slots = device_i32(slots)
    if slots.shape != (n,):
        raise BackendError(f"cuda gdn: {slots.shape[0]} state slots for {n} sequences")
    return slots, cu, n, int(meta.max_q_len), int(cu_host[-1])


def _span(span, slots: cupy.ndarray, n: int) -> tuple[cupy.ndarray, np.int32]:
    """(the span array as the kernels take it, the `spanned` flag): span int32 [2, n] on the device (rows skipped |
    rows run per sequence, gdn.cu's header), or None: every row, and the slots stand in for the pointer, unread."""
    if span is None:
        return slots, i32(0)
    if not isinstance(span, cupy.ndarray) or span.dtype != cupy.int32 or span.shape != (2, n) \
            or not span.flags.c_contiguous:
        raise BackendError(f"cuda gdn: span must be a contiguous int32 [2, {n}] device array, got "
                           f"{getattr(span, 'dtype', type(span))} {getattr(span, 'shape', '')}")
    return span, i32(1)


def _output(shape: tuple[int, int], covered: int) -> cupy.ndarray:
    """The float32 output: the kernels write every row of every sequence (zeros for a padding one), so it is cleared
    only where rows lie past the last sequence (numpy leaves those 0)."""
    if covered > shape[0]:
        raise BackendError(f"cuda gdn: the sequences cover {covered} rows of an input of {shape[0]}")
    return cupy.empty(shape, dtype=cupy.float32) if covered == shape[0] else cupy.zeros(shape, dtype=cupy.float32)


def causal_conv1d(x: cupy.ndarray, weight: cupy.ndarray, conv_states: cupy.ndarray, slots, meta: AttentionMeta,
                  commit: bool, tuning: CudaTuning, span: cupy.ndarray | None = None) -> cupy.ndarray:
    """See base.Backend.causal_conv1d: x [T, C] bf16 / float32, weight [C, K]; returns float32 [T, C]."""
    x, sx = _rows(x, "causal_conv1d x")
    t, c = x.shape
    _pool(conv_states, 3, "causal_conv1d")
    if weight.ndim != 2 or weight.shape[0] != c or conv_states.shape[1:] != (c, weight.shape[1] - 1):
        raise BackendError(f"cuda causal_conv1d: weight {weight.shape} and conv states {conv_states.shape} for x "
                           f"{x.shape} (expected [C, K] and [S, C, K-1])")
    taps = weight.shape[1]
    if taps not in CONV_TAPS:
        raise BackendError(f"cuda causal_conv1d: conv kernel {taps} unsupported (compiled: {CONV_TAPS})")
    weight, _ = _rows(weight, "causal_conv1d weight")
    if not weight.flags.c_contiguous:
        weight = cupy.ascontiguousarray(weight)
    slots, cu, n, max_rows, covered = _sequences(slots, meta)
    span, spanned = _span(span, slots, n)
    out = _output((t, c), covered)
    if t and n and c:
        grid = (cdiv(c, CONV_THREADS), max(1, cdiv(max_rows, CONV_ROWS)), n)
        _kernel(f"causal_conv1d<{taps}, {_ctype(x)}, {_ctype(weight)}>", tuning)(
            grid, (CONV_THREADS,), (x, i64(sx), weight, conv_states, slots, cu, span, spanned, out, i32(c),
                                    i32(int(commit))))
    return out


def gated_delta_rule(qkv: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray, A_log: cupy.ndarray,
                     dt_bias: cupy.ndarray, states: cupy.ndarray, slots, meta: AttentionMeta, commit: bool,
                     tuning: CudaTuning, span: cupy.ndarray | None = None) -> cupy.ndarray:
    """base.Backend.gdn_recurrent (and, for now, gdn_chunked: the same kernel, token by token over each sequence);
    returns o float32 [T, Hv * dv]. span: see causal_conv1d (gdn.cu's header)."""
    _pool(states, 4, "gdn")
    _, hv, dk, dv = states.shape
    qkv, sq = _rows(qkv, "gdn qkv", float_only=True)
    a, sa = _rows(a, "gdn a", float_only=True)
    b, sb = _rows(b, "gdn b", float_only=True)
    t = qkv.shape[0]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk) if dk else 0
    if hk <= 0 or qkv.shape[1] != 2 * hk * dk + hv * dv or hv % hk or a.shape != (t, hv) or b.shape != (t, hv):
        raise BackendError(f"cuda gdn: qkv {qkv.shape}, a {a.shape}, b {b.shape} do not fit states {states.shape} "
                           "(qkv width 2 Hk dk + Hv dv, Hv a multiple of Hk; a, b [T, Hv])")
    if dk not in KEY_DIMS:
        raise BackendError(f"cuda gdn: key head dim {dk} unsupported (compiled: {KEY_DIMS})")
    A_log = cupy.ascontiguousarray(A_log, dtype=cupy.float32)
    dt_bias = cupy.ascontiguousarray(dt_bias, dtype=cupy.float32)
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise BackendError(f"cuda gdn: A_log {A_log.shape} / dt_bias {dt_bias.shape}, expected ({hv},)")
    slots, cu, n, _, covered = _sequences(slots, meta)
    span, spanned = _span(span, slots, n)
    out = _output((t, hv * dv), covered)
    if t and n:
        _kernel(f"gdn_recurrent<{dk}>", tuning)(
            (n, hv, cdiv(dv, GDN_TILE)), (GDN_THREADS,),
            (qkv, i64(sq), a, i64(sa), b, i64(sb), A_log, dt_bias, states, slots, cu, span, spanned, out, i32(hk),
             i32(hv), i32(dv), f32(float(np.float32(dk ** -0.5))), i32(int(commit))))
    return out


def mixer_fits(proj: cupy.ndarray, conv_weight: cupy.ndarray, states: cupy.ndarray) -> bool:
    """Whether gdn_mixer takes these shapes: float32 in_proj rows, the compiled conv taps and key dims, a value head
    of at most 128 columns, its channels (2 dk + dv) within the CTA's threads, at most MAX_CLUSTER value heads per
    key head. Other shapes run the three kernels it fuses."""
    if states.ndim != 4 or conv_weight.ndim != 2 or proj.ndim != 2 or proj.dtype != cupy.float32:
        return False
    _, hv, dk, dv = states.shape
    c = conv_weight.shape[0]
    hk = (c - hv * dv) // (2 * dk) if dk else 0
    return (conv_weight.shape[1] in CONV_TAPS and dk in MIX_KEY_DIMS and 0 < dv <= 128
            and 2 * dk + dv <= MIX_THREADS and hk > 0 and c == 2 * hk * dk + hv * dv and hv % hk == 0
            and hv // hk <= MAX_CLUSTER and proj.shape[1] == c + hv * dv + 2 * hv)


def gdn_mixer(proj: cupy.ndarray, conv_weight: cupy.ndarray, conv_states: cupy.ndarray, A_log: cupy.ndarray,
              dt_bias: cupy.ndarray, states: cupy.ndarray, norm_weight: cupy.ndarray, eps: float, slots,
              meta: AttentionMeta, commit: bool, normed: bool, tuning: CudaTuning,
              span: cupy.ndarray | None = None, independent: bool = False) -> cupy.ndarray | None:
    """base.Backend.gdn_recurrent_mixer in one kernel (mixer_fits says where): proj [T, C + Hv dv + 2 Hv] float32;
    returns the gated norm bf16 [T, Hv dv] (None if not `normed`), the same bits as causal_conv1d, gated_delta_rule
    and gated_rms_norm in turn. independent (base.Backend.gdn_recurrent_mixer's): the kernel skips
    griddepcontrol.wait, so under PDL consecutive such launches (a commit's layers) overlap instead of each waiting
    for the one in front."""
    _pool(states, 4, "gdn mixer")
    _pool(conv_states, 3, "gdn mixer conv")
    _, hv, dk, dv = states.shape
    c, taps = conv_weight.shape
    hk = (c - hv * dv) // (2 * dk)
    if conv_states.shape[1:] != (c, taps - 1):
        raise BackendError(f"cuda gdn mixer: conv states {conv_states.shape} for a conv weight {conv_weight.shape}")
    proj, sp = _rows(proj, "gdn mixer proj", float_only=True)
    conv_weight, _ = _rows(conv_weight, "gdn mixer conv weight")
    if not conv_weight.flags.c_contiguous:
        conv_weight = cupy.ascontiguousarray(conv_weight)
    A_log = cupy.ascontiguousarray(A_log, dtype=cupy.float32)
    dt_bias = cupy.ascontiguousarray(dt_bias, dtype=cupy.float32)
    norm_weight = cupy.ascontiguousarray(norm_weight if norm_weight.dtype == cupy.float32 else _f32_bits(norm_weight))
    if A_log.shape != (hv,) or dt_bias.shape != (hv,) or norm_weight.shape != (dv,):
        raise BackendError(f"cuda gdn mixer: A_log {A_log.shape}, dt_bias {dt_bias.shape}, norm {norm_weight.shape} "
                           f"for {hv} value heads of {dv}")
    slots, cu, n, _, covered = _sequences(slots, meta)
    span, spanned = _span(span, slots, n)
    t = proj.shape[0]
    if covered > t:
        raise BackendError(f"cuda gdn mixer: the sequences cover {covered} rows of an input of {t}")
    # Every sequence's rows are written; rows past the last sequence are zeros (numpy's norm of o = 0 there).
    shape = (t, hv * dv) if normed else (1, 1)  # (a placeholder the kernel does not write)
    out = cupy.empty(shape, dtype=act_dtype()) if covered == t or not normed else cupy.zeros(shape, act_dtype())
    if t and n:
        r = hv // hk
        _kernel(f"gdn_mixer<{taps}, {dk}, {_ctype(conv_weight)}>", tuning)(
            (r, hk, n), (MIX_THREADS,),
            (proj, i64(sp), conv_weight, conv_states, A_log, dt_bias, states, norm_weight, f32(eps), slots, cu, span,
             spanned, out, i32(int(normed)), i32(hk), i32(hv), i32(dv), f32(float(np.float32(dk ** -0.5))),
             i32(int(commit)), i32(int(independent))),
            cluster=(r, 1, 1) if r > 1 else None)
    return out if normed else None


def gated_rms_norm(x: cupy.ndarray, z: cupy.ndarray, weight: cupy.ndarray, eps: float, head_dim: int,
                   tuning: CudaTuning) -> cupy.ndarray:
    """See base.Backend.gated_rms_norm; returns bf16 [T, heads * head_dim] (out_proj's input)."""
    x, sx = _rows(x, "gated_rms_norm x")
    z, sz = _rows(z, "gated_rms_norm z")
    t, width = x.shape
    if z.shape != x.shape or head_dim <= 0 or width % head_dim:
        raise BackendError(f"cuda gated_rms_norm: x {x.shape}, z {z.shape}, head_dim {head_dim}")
    weight = cupy.ascontiguousarray(weight if weight.dtype == cupy.float32 else _f32_bits(weight))
    if weight.shape != (head_dim,):
        raise BackendError(f"cuda gated_rms_norm: weight {weight.shape}, expected ({head_dim},)")
    heads = width // head_dim
    out = cupy.empty((t, width), dtype=act_dtype())
    if t * heads:
        warps = GDN_THREADS // 32
        _kernel(f"gated_rms_norm<{_ctype(x)}, {_ctype(z)}>", tuning)(
            (cdiv(t * heads, warps),), (GDN_THREADS,),
            (x, i64(sx), z, i64(sz), weight, out, i32(t), i32(heads), i32(head_dim), f32(eps)))
    return out


def sigmoid_gate(x: cupy.ndarray, gate: cupy.ndarray, tuning: CudaTuning) -> cupy.ndarray:
    """x * sigmoid(gate), both [T, W] (bf16 or float32, row-strided views read in place); returns bf16 [T, W]."""
    x, sx = _rows(x, "sigmoid_gate x")
    gate, sg = _rows(gate, "sigmoid_gate gate")
    if gate.shape != x.shape:
        raise BackendError(f"cuda sigmoid_gate: x {x.shape} and gate {gate.shape} differ")
    t, width = x.shape
    out = cupy.empty((t, width), dtype=act_dtype())
    if t * width:
        _kernel(f"sigmoid_gate<{_ctype(x)}, {_ctype(gate)}>", tuning)(
            (cdiv(t * width, 256),), (256,), (x, i64(sx), gate, i64(sg), out, i32(t), i32(width)))
    return out
