"""The chunked gated delta rule of the CUDA backend (base.Backend.gdn_chunked, prefill): launches of
kernels/gdn_chunk.cu, which computes what gdn_recurrent computes (cuda_gdn.py) from the same inputs, 64 rows at a time
on tensor cores.

Two launches per call: gdn_chunk_prepare (every chunk of every sequence in parallel: the state-independent part of
the WY form) writes a scratch of about 1.4 KiB per row and value head (w, qg, kd, intra in bf16, u in float32),
which gdn_chunk_scan then reads chunk by chunk while it carries the state. Inputs, outputs and the state pool are as
cuda_gdn.gated_delta_rule takes them (and checked the same way); the scratch comes from CuPy's pool.
"""
from __future__ import annotations

import cupy
import numpy as np

from cudflash.backends import kernel_loader
from cudflash.backends.base import AttentionMeta
from cudflash.backends.cuda_gdn import _output, _pool, _rows, _sequences
from cudflash.backends.cuda_util import cdiv, f32, i32, i64
from cudflash.backends.tuning import CudaTuning
from cudflash.errors import BackendError

CHUNK = 64  # GC_CHUNK in gdn_chunk.cu
THREADS = 128  # GC_THREADS
PAD = 8  # GC_PAD: bf16 elements of padding per shared-memory row
HEAD_DIMS = (16, 32, 64, 128)  # dk = dv compiled (other shapes take the recurrent kernel)
BLOCK_DV = (16, 32, 64)  # state columns per scan CTA compiled (those <= dk)
# The longest sequence of a call from which the chunked kernels are used; below it the recurrent kernel, which is
# faster for a few rows (tests/gpu/test_gdn_chunk.py times both; BENCHMARKS.md).
MIN_ROWS = 40  # 9B shapes: recurrent 23.9 / 45.2 us at 32 / 64 rows, chunked 27.2 / 28.0 us (BENCHMARKS.md)
NAMES = (tuple(f"gdn_chunk_prepare<{d}, {d}>" for d in HEAD_DIMS)
         + tuple(f"gdn_chunk_scan<{d}, {bv}>" for d in HEAD_DIMS for bv in BLOCK_DV if bv <= d))


def _kernel(name: str, tuning: CudaTuning) -> kernel_loader.Kernel:
    return kernel_loader.function("gdn_chunk", name, NAMES, tuning=tuning)


def supports(dk: int, dv: int) -> bool:
    """Whether the chunked kernels are compiled for these head dims."""
    return dk == dv and dk in HEAD_DIMS


def use_chunked(states, meta: AttentionMeta) -> bool:
    """Whether a gdn_chunked call takes these kernels: head dims compiled and a sequence long enough to gain."""
    shape = getattr(states, "shape", ())
    return len(shape) == 4 and supports(shape[2], shape[3]) and int(meta.max_q_len) >= MIN_ROWS


def prepare_smem(dk: int, dv: int) -> int:
    """Dynamic shared memory of gdn_chunk_prepare<dk, dv> (bytes): q and k in bf16, later overwritten by A (float32)
    and T (bf16), whichever is larger; beta k e^G and beta v in bf16; g and beta in float32."""
    region0 = max(2 * CHUNK * (dk + PAD) * 2, CHUNK * (CHUNK + 4) * 4 + CHUNK * (CHUNK + PAD) * 2)
    return region0 + 2 * CHUNK * ((dk + PAD) + (dv + PAD)) + 4 * 2 * CHUNK


def scan_smem(dk: int, block_dv: int) -> int:
    """Dynamic shared memory of gdn_chunk_scan<dk, block_dv> (bytes): two chunk buffers (w, qg, kd, intra), the
    state's columns and v', all bf16."""
    buffer = 3 * CHUNK * (dk + PAD) + CHUNK * (CHUNK + PAD)
    return 2 * (2 * buffer + (dk + CHUNK) * (block_dv + PAD))


def default_block_dv(dv: int) -> int:
    """The scan's columns per CTA: 32 (at Qwen3.5-9B, batch 1, 4 x 32 heads = 128 CTAs for 132 SMs; each CTA reads
    the chunk's w, qg, kd, intra, so fewer columns per CTA means more re-reads), less for a narrower dv."""
    for bv in (32, 16):
        if dv % bv == 0:
            return bv
    raise BackendError(f"cuda gdn_chunked: value head dim {dv} is not a multiple of 16")


def gated_delta_rule(qkv: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray, A_log: cupy.ndarray,
                     dt_bias: cupy.ndarray, states: cupy.ndarray, slots, meta: AttentionMeta, commit: bool,
                     tuning: CudaTuning, block_dv: int | None = None) -> cupy.ndarray:
    """base.Backend.gdn_chunked on tensor cores; returns o float32 [T, Hv * dv]. block_dv: the scan's columns per
    CTA (default_block_dv when None; the timing tries the others)."""
    _pool(states, 4, "gdn_chunked")
    _, hv, dk, dv = states.shape
    if not supports(dk, dv):
        raise BackendError(f"cuda gdn_chunked: head dims dk {dk}, dv {dv} unsupported (compiled: dk = dv in "
                           f"{HEAD_DIMS})")
    qkv, sq = _rows(qkv, "gdn qkv", float_only=True)
    a, sa = _rows(a, "gdn a", float_only=True)
    b, sb = _rows(b, "gdn b", float_only=True)
    t = qkv.shape[0]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    if hk <= 0 or qkv.shape[1] != 2 * hk * dk + hv * dv or hv % hk or a.shape != (t, hv) or b.shape != (t, hv):
        raise BackendError(f"cuda gdn_chunked: qkv {qkv.shape}, a {a.shape}, b {b.shape} do not fit states "
                           f"{states.shape} (qkv width 2 Hk dk + Hv dv, Hv a multiple of Hk; a, b [T, Hv])")
    A_log = cupy.ascontiguousarray(A_log, dtype=cupy.float32)
    dt_bias = cupy.ascontiguousarray(dt_bias, dtype=cupy.float32)
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise BackendError(f"cuda gdn_chunked: A_log {A_log.shape} / dt_bias {dt_bias.shape}, expected ({hv},)")
    bv = default_block_dv(dv) if block_dv is None else block_dv
    if bv not in BLOCK_DV or bv > dk or dv % bv:
        raise BackendError(f"cuda gdn_chunked: block_dv {bv} (compiled {BLOCK_DV}, at most dk, dividing dv {dv})")
    slots, cu, n, max_rows, covered = _sequences(slots, meta)
    out = _output((t, hv * dv), covered)
    # Scratch blocks: every sequence's chunks, padding ones included (gc_chunk_base counts them the same way).
    lens = np.diff(np.asarray(meta.cu_seqlens_q, dtype=np.int64))
    chunks = int(((lens + CHUNK - 1) // CHUNK).sum())
    if not (t and n and chunks and max_rows):
        return out
    rows = chunks * hv * CHUNK
    w = cupy.empty((rows, dk), dtype=cupy.uint16)  # bf16 bits
    qg = cupy.empty((rows, dk), dtype=cupy.uint16)
    kd = cupy.empty((rows, dk), dtype=cupy.uint16)
    u = cupy.empty((rows, dv), dtype=cupy.float32)
    intra = cupy.empty((rows, CHUNK), dtype=cupy.uint16)
    decay = cupy.empty((chunks * hv,), dtype=cupy.float32)

    prepare = _kernel(f"gdn_chunk_prepare<{dk}, {dv}>", tuning)
    smem = prepare_smem(dk, dv)
    prepare.reserve_shared(smem)
    prepare((cdiv(max_rows, CHUNK), hv, n), (THREADS,),
            (qkv, i64(sq), a, i64(sa), b, i64(sb), A_log, dt_bias, slots, cu, w, u, qg, kd, intra, decay, i32(hk),
             i32(hv), f32(float(np.float32(dk ** -0.5)))), shared_mem=smem)
    scan = _kernel(f"gdn_chunk_scan<{dk}, {bv}>", tuning)
    smem = scan_smem(dk, bv)
    scan.reserve_shared(smem)
    scan((dv // bv, hv, n), (THREADS,),
         (w, u, qg, kd, intra, decay, states, slots, cu, out, i32(hv), i32(dv), i32(int(commit))), shared_mem=smem)
    return out
